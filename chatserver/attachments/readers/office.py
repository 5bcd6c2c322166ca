"""Spreadsheets (XLSX by openpyxl), slides (PPTX by python-pptx) and OpenDocument text (ODT).

Every package is a zip checked first (common.open_zip: refused past ZIP_MAX_INFLATED). openpyxl
parses through defusedxml when it is installed (it is a dependency of this server for that), and
python-pptx and the ODT walk through lxml parsers that expand no entity, so an XML bomb is refused.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from .common import Budget, Sections, Unreadable, clean, local, near_memory_limit, open_zip, parse_xml, read_part

ROWS_PER_SECTION = 200  # and at most SECTION_CHARS of text, whichever comes first


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, datetime.datetime) and not (value.hour or value.minute or value.second):
        return value.date().isoformat()
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    return " ".join(str(value).split())


def extract_xlsx(path: Path, budget: Budget) -> list[dict]:
    """Sheet by sheet, rows as tab-separated text: 'Sheet "Q3" rows 1-40'."""
    with open_zip(path, "spreadsheet") as package:
        workbook = read_part(package, "xl/workbook.xml", "spreadsheet") or b""
        # openpyxl reads no cell of a Strict workbook and says nothing: it gets a Transitional copy.
        strict = _transitional(package) if b"purl.oclc.org/ooxml" in workbook[:4096] else None
    import openpyxl

    # A file object: openpyxl refuses a path whose name is not .xlsx (an upload's is not).
    source = strict if strict is not None else open(path, "rb")
    try:
        book = openpyxl.load_workbook(source, read_only=True, data_only=True, keep_links=False)
    except MemoryError:
        raise
    except Exception as exc:  # openpyxl, defusedxml and zipfile raise many kinds on a bad package
        if near_memory_limit():
            raise MemoryError from None
        reason = "it declares XML entities, which are refused" if "Entit" in type(exc).__name__ \
            else f"{type(exc).__name__}: {exc}"
        source.close()
        raise Unreadable(f"the spreadsheet is damaged ({reason})") from None
    out = Sections(budget)
    try:
        for sheet in book.worksheets:
            name = sheet.title.replace('"', "'")
            chunk: list[str] = []
            size, first, last = 0, 0, 0
            for number, row in enumerate(sheet.iter_rows(values_only=True), start=1):
                cells = [_cell(v) for v in row]
                while cells and not cells[-1]:
                    cells.pop()
                if not cells:
                    continue
                line = "\t".join(cells)
                if chunk and (len(chunk) >= ROWS_PER_SECTION or size + len(line) > out.limit):
                    out.add(_rows_label(name, first, last), "\n".join(chunk))
                    chunk, size = [], 0
                if not chunk:
                    first = number
                chunk.append(line[: out.limit])
                size += len(line) + 1
                last = number
            if chunk:
                out.add(_rows_label(name, first, last), "\n".join(chunk))
    except MemoryError:
        raise
    except Unreadable:
        raise
    except Exception as exc:
        if near_memory_limit():
            raise MemoryError from None
        raise Unreadable(f"the spreadsheet is damaged ({type(exc).__name__}: {exc})") from None
    finally:
        book.close()
        source.close()
    return out.out


# Strict OOXML (ISO 29500 Strict) names its namespaces and relationship types under purl.oclc.org;
# these are the Transitional names a reader of ordinary files expects for each of them.
STRICT_NAMESPACES = (
    (b"http://purl.oclc.org/ooxml/spreadsheetml/main", b"http://schemas.openxmlformats.org/spreadsheetml/2006/main"),
    (b"http://purl.oclc.org/ooxml/officeDocument/relationships",
     b"http://schemas.openxmlformats.org/officeDocument/2006/relationships"),
    (b"http://purl.oclc.org/ooxml/drawingml/main", b"http://schemas.openxmlformats.org/drawingml/2006/main"),
    (b"http://purl.oclc.org/ooxml/officeDocument/", b"http://schemas.openxmlformats.org/officeDocument/2006/"),
)


def _transitional(package):  # -> io.BytesIO
    """A Transitional copy of a Strict package, in memory (its size is bounded by open_zip's check)."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as copy:
        for info in package.infolist():
            data = read_part(package, info.filename, "spreadsheet") or b""
            if info.filename.endswith((".xml", ".rels")):
                for strict, transitional in STRICT_NAMESPACES:
                    data = data.replace(strict, transitional)
            copy.writestr(info.filename, data)
    out.seek(0)
    return out


def _rows_label(sheet: str, first: int, last: int) -> str:
    return f'Sheet "{sheet}" ' + (f"row {first}" if first == last else f"rows {first}-{last}")


def _shape_texts(shapes) -> list[str]:
    texts = []
    for shape in shapes:
        if shape.shape_type is not None and int(shape.shape_type) == 6:  # a group: its shapes in order
            texts.extend(_shape_texts(shape.shapes))
        elif getattr(shape, "has_table", False) and shape.has_table:
            for row in shape.table.rows:
                cells = [" ".join(c.text.split()) for c in row.cells]
                if any(cells):
                    texts.append(" | ".join(cells))
        elif getattr(shape, "has_text_frame", False) and shape.has_text_frame:
            texts.append(shape.text_frame.text)
    return [t for t in texts if t.strip()]


def _notes_texts(notes_slide) -> list[str]:
    """The notes, then what else the printed notes page shows: its header, footer, date and number."""
    from pptx.enum.shapes import PP_PLACEHOLDER

    shown = {PP_PLACEHOLDER.HEADER: "header", PP_PLACEHOLDER.FOOTER: "footer", PP_PLACEHOLDER.DATE: "date",
             PP_PLACEHOLDER.SLIDE_NUMBER: "number"}
    texts = []
    notes = notes_slide.notes_text_frame
    if notes is not None and notes.text.strip():
        texts.append("Notes: " + notes.text)
    for shape in notes_slide.placeholders:
        name = shown.get(shape.placeholder_format.type)
        if name and shape.text_frame.text.strip():
            texts.append(f"Notes page {name}: {shape.text_frame.text}")
    return texts


def extract_pptx(path: Path, budget: Budget) -> list[dict]:
    """Slide by slide, the slide's text and then its notes: "slide 7"."""
    open_zip(path, "presentation").close()
    import pptx

    try:
        deck = pptx.Presentation(str(path))
    except MemoryError:
        raise
    except Exception as exc:
        if near_memory_limit():
            raise MemoryError from None
        raise Unreadable(f"the presentation is damaged ({type(exc).__name__})") from None
    out = Sections(budget)
    try:
        for number, slide in enumerate(deck.slides, start=1):
            texts = _shape_texts(slide.shapes)
            if slide.has_notes_slide:
                texts.extend(_notes_texts(slide.notes_slide))
            out.add(f"slide {number}", "\n".join(texts))
    except MemoryError:
        raise
    except Exception as exc:
        if near_memory_limit():
            raise MemoryError from None
        raise Unreadable(f"the presentation is damaged ({type(exc).__name__}: {exc})") from None
    return out.out


_ODT_SKIP = {"tracked-changes", "annotation-end", "bookmark", "bookmark-start", "bookmark-end", "sequence-decls"}


def extract_odt(path: Path, budget: Budget) -> list[dict]:
    """OpenDocument text: the body's headings ("§ Heading"), paragraphs, lists and tables in order."""
    package = open_zip(path, "ODT")
    with package:
        data = read_part(package, "content.xml", "ODT")
    if data is None:
        raise Unreadable("the ODT is damaged: it has no content.xml")
    root = parse_xml(data, "ODT")
    out = Sections(budget)
    label, lines = "", []

    def text_of(element) -> str:
        parts = [element.text or ""]
        for child in element:
            name = local(child.tag)
            if name == "s":
                parts.append(" " * int(next(iter(child.attrib.values()), "1") or 1))
            elif name == "tab":
                parts.append("\t")
            elif name == "line-break":
                parts.append("\n")
            elif name not in _ODT_SKIP and name:
                parts.append(text_of(child))
            parts.append(child.tail or "")
        return "".join(parts)

    def walk(element) -> None:
        nonlocal label, lines
        for child in element:
            name = local(child.tag)
            if name == "h":
                out.add(label or f"section {len(out.out) + 1}", "\n".join(lines))
                lines = []
                text = clean(text_of(child)).strip()
                label = "§ " + " ".join(text.split())[:200] if text else label
                lines.append(text)
            elif name == "p":
                lines.append(text_of(child))
            elif name == "table-row":
                lines.append(" | ".join(" / ".join(clean(text_of(p)).strip() for p in cell.iter("{*}p"))
                                        for cell in child if local(cell.tag) == "table-cell"))
            elif name not in _ODT_SKIP and name:
                walk(child)

    body = root.find("./{*}body")
    walk(body if body is not None else root)
    out.add(label or f"section {len(out.out) + 1}", "\n".join(lines))
    return out.out
