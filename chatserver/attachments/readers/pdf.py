"""PDF to pages of text with pypdfium2: what a person sees on each page.

- The page's text, then what sits on it in annotations and form fields: pages with annotations are
  flattened in memory (FPDFPage_Flatten, the appearance streams become page content, as poppler and
  a viewer draw them) and read again; a text, combo or list field's value and an annotation's
  Contents (a sticky note, a comment on a highlight) that the flattened text still lacks are added.
- A page that fails to load or read is left empty and named in the warnings; the others are read.
- Encryption with an empty user password is opened (pdfium tries it; an explicit "" is tried too).
- A file without the `%PDF-` header that poppler still reads: pdfium refuses it, so the header is
  put back in front and the file opened again (pdfium rebuilds the cross-reference table).
- Spaces that pdfium puts between every Han or kana character of widely spaced CJK text are removed
  (poppler's pdftotext keeps such runs whole; a Chinese query must find them).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from .common import Budget, Unreadable, clean, section

# A single space between two Han, kana or full-width characters: never a word break in Chinese or
# Japanese, so one pdfium inserted for a wide gap. Hangul is left alone: Korean spaces words.
_CJK = "\u2e80-\u2fdf\u3001-\u303f\u3040-\u30ff\u3190-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff01-\uff60"
_CJK_SPACE = re.compile(f"(?<=[{_CJK}]) (?=[{_CJK}])")
# Widget values a checkbox or radio button holds: states, not text a person reads.
_STATES = {"", "Off", "On", "Yes", "No", "0", "1"}
_ERRORS = {1: "an unknown error", 2: "the file could not be read", 3: "it is not a PDF or is damaged beyond repair",
           4: "it needs a password", 5: "it uses an encryption this reader does not support",
           6: "a page could not be found"}


# Three or more lines of one Han or kana character each: a line of widely tracked CJK text that
# pdfium broke at every character (its first character sometimes left at the end of the line before).
_CJK_COLUMN = re.compile(f"(?m)(?:(?<=[{_CJK}])\n)?(?:^[{_CJK}]\n){{2,}}[{_CJK}]$")


def fix_cjk_spacing(text: str) -> str:
    text = _CJK_COLUMN.sub(lambda m: m.group(0).replace("\n", ""), text)
    return _CJK_SPACE.sub("", text)


def _wide(getter, *args) -> str:
    """A UTF-16 string from one of pdfium's two-call getters (size first, then the buffer)."""
    import pypdfium2.raw as raw

    size = getter(*args, None, 0)
    if size <= 2 or size > 4 * 2**20:
        return ""
    buffer = ctypes.create_string_buffer(size)
    getter(*args, ctypes.cast(buffer, ctypes.POINTER(raw.FPDF_WCHAR)), size)
    return buffer.raw[: size - 2].decode("utf-16-le", "replace")


def _open(path: Path):
    import pypdfium2 as pdfium

    def attempt(source, password=None):
        try:
            return pdfium.PdfDocument(source, password=password), 0
        except pdfium.PdfiumError as exc:
            return None, getattr(exc, "err_code", 1) or 1

    doc, code = attempt(str(path))
    if code == pdfium.raw.FPDF_ERR_PASSWORD:
        doc, code = attempt(str(path), "")
    if code == pdfium.raw.FPDF_ERR_FORMAT:
        data = path.read_bytes()
        if not data.startswith(b"%PDF-"):
            doc, code = attempt(b"%PDF-1.7\n" + data)
    if code == pdfium.raw.FPDF_ERR_PASSWORD:
        raise Unreadable("the PDF is encrypted (password-protected); remove the password and upload it again")
    if doc is None:
        raise Unreadable(f"the PDF is damaged and could not be opened ({_ERRORS.get(code, 'an unknown error')})")
    return doc


def _annotations(doc, page, text: str) -> list[str]:
    """Field values and annotation notes on `page` that `text` (the flattened page) does not hold."""
    import pypdfium2.raw as raw

    extra = []
    form = doc.formenv.raw if getattr(doc, "formenv", None) is not None else None
    for index in range(raw.FPDFPage_GetAnnotCount(page.raw)):
        annot = raw.FPDFPage_GetAnnot(page.raw, index)
        if not annot:
            continue
        try:
            if raw.FPDFAnnot_GetSubtype(annot) == raw.FPDF_ANNOT_WIDGET:
                if form is None or raw.FPDFAnnot_GetFormFieldType(form, annot) not in (
                        raw.FPDF_FORMFIELD_TEXTFIELD, raw.FPDF_FORMFIELD_COMBOBOX, raw.FPDF_FORMFIELD_LISTBOX):
                    continue
                value = _wide(raw.FPDFAnnot_GetFormFieldValue, form, annot)
            else:
                value = _wide(raw.FPDFAnnot_GetStringValue, annot, b"Contents")
            value = clean(value).strip()
            if value not in _STATES and " ".join(value.split()) not in " ".join(text.split()):
                extra.append(value)
        finally:
            raw.FPDFPage_CloseAnnot(annot)
    return extra


def _page_text(doc, index: int) -> str:
    import pypdfium2.raw as raw

    page = doc[index]
    try:
        if raw.FPDFPage_GetAnnotCount(page.raw) > 0:
            flattened = raw.FPDFPage_Flatten(page.raw, raw.FLAT_NORMALDISPLAY) == raw.FLATTEN_SUCCESS
            if flattened:  # the flattened content is read from a fresh page object
                page.close()
                page = doc[index]
        textpage = page.get_textpage()
        try:
            text = clean(textpage.get_text_bounded())
        finally:
            textpage.close()
        notes = _annotations(doc, page, text)
    finally:
        page.close()
    text = fix_cjk_spacing(text)
    return "\n".join([text, *notes]) if notes else text


def extract_pdf(path: Path, max_pages: int, budget: Budget) -> tuple[list[dict], int, str | None, list[str]]:
    """Pages of text (at most max_pages), the page count, the title and the warnings."""
    import pypdfium2 as pdfium

    doc = _open(path)
    pages: list[dict] = []
    failed: list[int] = []
    try:
        total = len(doc)
        title = None
        try:
            title = (doc.get_metadata_dict().get("Title") or "").strip() or None
        except pdfium.PdfiumError:
            pass
        try:
            doc.init_forms()  # before any page is loaded, so widgets carry their form fields
        except pdfium.PdfiumError:
            pass
        for index in range(min(total, max_pages)):
            try:
                text = _page_text(doc, index)
            except pdfium.PdfiumError:
                text = ""
                failed.append(index + 1)
            pages.append(section(index + 1, f"p. {index + 1}", budget.add(text)))
    finally:
        doc.close()
    if total == 0:
        raise Unreadable("the PDF is damaged: it has no pages")
    if failed and len(failed) == len(pages):
        raise Unreadable("the PDF is damaged: none of its pages could be read")
    if not any(p["text"].strip() for p in pages):
        raise Unreadable("the PDF has no text layer (a scanned or image-only PDF); this server does not "
                         "read text from images")
    warnings = []
    if failed:
        listed = ", ".join(map(str, failed[:20])) + (f" and {len(failed) - 20} more" if len(failed) > 20 else "")
        warnings.append(f"{len(failed)} page{'s' if len(failed) != 1 else ''} could not be read and "
                        f"{'were' if len(failed) != 1 else 'was'} skipped: {listed}")
    return pages, total, title, warnings
