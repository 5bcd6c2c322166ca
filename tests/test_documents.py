"""Documents read whole (issue 24): real files from public test suites (tests/fixtures/documents,
sources in its README) read through the extraction child, measured against a trusted reader's text,
and each new format and fix shown on a real file."""

from __future__ import annotations

import asyncio
import io
import json
import re
import zipfile
from pathlib import Path

import pytest

import corpus
from chatserver.attachments import store as att
from chatserver.attachments.extraction import Extractor, Unreadable
from chatserver.attachments.store import Attachments, Limits, attachment_context, read_attachment
from test_attachments import store, upload
from test_extraction import pdf_of

DOCS = corpus.ROOT


async def read(name: str, data: bytes | None = None, tmp: Path | None = None) -> dict:
    """The child's answer for a corpus file (or `data` under that name)."""
    path = DOCS / name
    if data is not None:
        assert tmp is not None
        path = tmp / "upload-1.part"  # as the server names an upload: never the file's own name
        path.write_bytes(data)
    return await Extractor(timeout=30).run(path, name, max_pages=1000, max_chars=10_000_000)


def text_of(answer: dict) -> str:
    return "\n".join(p["text"] for p in answer["pages"])


@pytest.fixture(scope="module")
def readings() -> dict[str, dict | str]:
    """Every corpus file read once by the child, two at a time."""
    async def all_files() -> dict[str, dict | str]:
        extractor = Extractor(timeout=30, workers=2)
        names = sorted(corpus.documents())
        slots = asyncio.Semaphore(2)

        async def one(name: str) -> dict | str:
            async with slots:
                try:
                    return await extractor.run(DOCS / name, name, max_pages=1000, max_chars=10_000_000)
                except Unreadable as exc:
                    return str(exc)

        return dict(zip(names, await asyncio.gather(*(one(n) for n in names))))

    return asyncio.run(all_files())


def test_the_corpus_is_documented_and_each_file_has_its_reference():
    listed = corpus.documents()
    readme = (DOCS / "README.md").read_text()
    on_disk = {p.name for p in DOCS.iterdir() if p.name not in ("README.md", "corpus.json")
               and not p.name.endswith(".ref.txt")}
    assert on_disk == set(listed)
    for name, source in listed.items():
        assert corpus.reference_path(name).exists(), name
        assert f"`{name}`" in readme and source["path"] in readme, name
        assert source["licence"] and 0 < source["threshold"] <= 1
    assert sum((DOCS / n).stat().st_size for n in listed) < 4 * 2**20


def test_every_file_is_read_and_keeps_its_references_words(readings):
    """Per file, the share of the reference's words (CJK bigrams) the server's text holds is at least
    the file's threshold (corpus.json; most are 0.98 or more, a few lower with the reason noted)."""
    low = {}
    for name, source in corpus.documents().items():
        answer = readings[name]
        assert isinstance(answer, dict), f"{name} was refused: {answer}"
        score = corpus.coverage(corpus.reference_path(name).read_text(), text_of(answer))
        if score < source["threshold"]:
            low[name] = (round(score, 3), source["threshold"])
    assert not low, low


def test_sections_are_bounded_and_labelled_where_they_came_from(readings):
    for name, answer in readings.items():
        assert isinstance(answer, dict)
        for section in answer["pages"]:
            if answer["kind"] != "pdf":
                assert len(section["text"]) <= 4000, (name, section["label"])
            assert section["label"], name
        assert [s["page"] for s in answer["pages"]] == list(range(1, len(answer["pages"]) + 1)), name
    labels = {name: [s["label"] for s in answer["pages"]] for name, answer in readings.items()}
    assert labels["poi-headerFooter.docx"] == ["header", "footer"]
    assert labels["poi-footnotes.docx"][-1] == "footnotes" and labels["poi-endnotes.docx"][-1] == "endnotes"
    assert labels["poi-comment.docx"] == ["comments"]
    assert "§ Experience" in labels["poi-60316.dotx"]
    assert any(re.fullmatch(r'Sheet "[^"]+" rows? \d+(-\d+)?', label) for label in labels["poi-SampleSS.xlsx"])
    assert labels["poi-with_japanese.pptx"][0] == "slide 1"
    assert "§ Installation" in labels["markup-README.long.rst.html"]
    assert any(label.startswith("§ ") for label in labels["pdfjs-README.md"])
    assert any(label.startswith("§ ") for label in labels["odfpy-Electra.odt"])
    assert labels["pandas-test1.csv"] == ["lines 1-8"]
    assert labels["pydocx-document.py"][0].startswith("lines 1-")


# -- PDF ---------------------------------------------------------------------------------------

def test_pdf_form_values_and_annotation_text_are_read(readings):
    assert {"Alice", "Bob"} <= set(text_of(readings["pypdf-libreoffice-form.pdf"]).split())
    assert "Bar" in text_of(readings["pypdf-form_acrobatReader.pdf"]).split()
    assert "FreeText content" in text_of(readings["pdfjs-annotation-freetext.pdf"])
    assert "Lorem ipsum dolor sit amet" in text_of(readings["pdfjs-annotation-text-widget.pdf"])


def test_empty_password_and_owner_only_encryption_open(readings):
    for name in ("pypdf-r2-empty-password.pdf", "pypdf-r6-empty-password.pdf", "pypdf-r4-owner-password.pdf"):
        assert "pdf encryption test" in text_of(readings[name]), name


def test_a_pdf_without_its_header_is_read_when_poppler_reads_it(readings):
    assert not (DOCS / "pdfjs-bug1606566.pdf").read_bytes().startswith(b"%PDF-")
    assert "Bug 1606566" in text_of(readings["pdfjs-bug1606566.pdf"])
    assert "junk before magic header" in text_of(readings["pdfjs-issue6069.pdf"])


def test_widely_spaced_cjk_text_is_whole_as_pdftotext_reads_it(readings):
    """issue6387.pdf sets one Japanese line at several trackings: pdfium split the widest with a
    space or a line break after every character; poppler reads it whole, and so does the server."""
    line = "あのイーハトーヴォのすきとおった風"
    text = text_of(readings["pdfjs-issue6387.pdf"])
    assert text.count(line) == corpus.reference_path("pdfjs-issue6387.pdf").read_text().count(line) == 9
    assert "あ の" not in text and "あ\nの" not in text
    chinese = text_of(readings["pdfjs-issue12823.pdf"])
    assert "描述团队的共同目标" in chinese


def pdf_with_a_bad_page() -> bytes:
    """Three pages, the second of which is not a page object: pdfium fails to load it."""
    content = b"BT /F1 12 Tf 72 700 Td (The survey covers every harbour) Tj ET"
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>"
    return pdf_of([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R 6 0 R 7 0 R] /Count 3 >>",
                   page, b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content),
                   b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>", b"(not a page)", page])


async def test_a_page_that_fails_is_skipped_and_listed_in_warnings(api, client):
    conv = await api.new()
    stored = await upload(client, conv["id"], "survey.pdf", pdf_with_a_bad_page())
    assert stored.status_code == 201, stored.text
    assert stored.json()["pages"] == 3
    assert stored.json()["warnings"] == ["1 page could not be read and was skipped: 2"]
    listed = (await client.get(f"/api/conversations/{conv['id']}/attachments")).json()
    assert listed[0]["warnings"] == stored.json()["warnings"]
    plain = await upload(client, conv["id"], "crazyones.pdf", (DOCS / "pypdf-crazyones.pdf").read_bytes())
    assert plain.json()["warnings"] == []


# -- Word --------------------------------------------------------------------------------------

def test_word_body_in_order_with_nested_tables_boxes_controls_and_insertions(readings):
    nested = text_of(readings["poi-60329.docx"])  # four tables inside table cells, 4,566 characters
    assert corpus.coverage(corpus.reference_path("poi-60329.docx").read_text(), nested) > 0.99
    checkboxes = text_of(readings["poi-checkboxes.docx"])  # content controls (w:sdt)
    assert "In Sequence" in checkboxes
    insertions = text_of(readings["poi-delins.docx"])  # w:ins kept, w:del left out
    assert "A Nepalese name for Tilaka" in insertions
    deleted = zipfile.ZipFile(DOCS / "poi-delins.docx").read("word/document.xml")
    gone = re.findall(rb"<w:delText[^>]*>([^<]{12,})</w:delText>", deleted)
    assert gone and not any(g.decode() in insertions for g in gone)
    boxes = text_of(readings["poi-bib-chernigovka.netdo.ru_download_docs_17459.docx"])  # text boxes, once each
    box_text = corpus.reference_path("poi-bib-chernigovka.netdo.ru_download_docs_17459.docx").read_text()
    assert corpus.coverage(box_text, boxes) > 0.99


def test_word_headers_footers_notes_and_comments_are_stored(readings):
    sections = {s["label"]: s["text"] for s in readings["poi-headerFooter.docx"]["pages"]}
    assert sections == {"header": "This is a simple header…", "footer": "… and this is a simple footer."}
    assert "snoska" in {s["label"]: s["text"] for s in readings["poi-footnotes.docx"]["pages"]}["footnotes"]
    comments = readings["pydocx-comments-rich-para.docx"]["pages"]
    assert comments[-1]["label"] == "comments" and comments[-1]["text"].strip()


def test_docm_dotx_and_strict_ooxml_are_read(readings):
    assert "macro word processing document" in text_of(readings["poi-SimpleMacro.docm"])
    assert readings["poi-test.dotx"]["kind"] == "docx"
    # Strict OOXML: Word's "Strict Open XML" files, the same parts under the ISO namespaces.
    for name in ("openxmlsdk-Strict01.docx", "openxmlsdk-strict-CommentRangeStart.docx"):
        document = zipfile.ZipFile(DOCS / name).read("word/document.xml")
        assert b"purl.oclc.org/ooxml/wordprocessingml/main" in document
        assert b"schemas.openxmlformats.org/wordprocessingml/2006/main" not in document
    labels = [s["label"] for s in readings["openxmlsdk-Strict01.docx"]["pages"]]
    assert "§ This is Heading 2" in labels and "table 1" in labels
    notes = readings["openxmlsdk-strict-CommentRangeStart.docx"]["pages"]
    assert [(s["label"], s["text"]) for s in notes] == [("section 1", "This is some text."),
                                                         ("comments", "Terminal Server Users: some test comment")]


def await_(coroutine):
    return asyncio.run(coroutine)


# -- spreadsheets, slides, OpenDocument, HTML, Markdown, text ------------------------------------

def test_xlsx_sheet_by_sheet_with_row_labels(readings):
    answer = readings["poi-SampleSS.xlsx"]
    assert answer["kind"] == "xlsx"
    workbook = zipfile.ZipFile(DOCS / "poi-SampleSS.xlsx").read("xl/workbook.xml").decode()
    first_sheet = re.search(r'<sheet [^>]*name="([^"]+)"', workbook).group(1)
    assert answer["pages"][0]["label"].startswith(f'Sheet "{first_sheet}" row')


def test_a_strict_ooxml_workbook_reads_as_its_transitional_twin(readings):
    """POI's SampleSS.strict.xlsx is SampleSS.xlsx saved as Strict Open XML; openpyxl alone reads
    no cell of it (and says nothing), so the reader hands it a Transitional copy."""
    assert b"purl.oclc.org" in zipfile.ZipFile(DOCS / "poi-SampleSS.strict.xlsx").read("xl/workbook.xml")
    assert [(s["label"], s["text"]) for s in readings["poi-SampleSS.strict.xlsx"]["pages"]] == \
        [(s["label"], s["text"]) for s in readings["poi-SampleSS.xlsx"]["pages"]]


def test_pptx_slide_by_slide_with_notes(readings):
    assert readings["poi-with_japanese.pptx"]["kind"] == "pptx"
    slides = [(s["label"], s["text"]) for s in readings["pypptx-ph-inherit-props.pptx"]["pages"]]
    assert slides == [("slide 1", "Title Text\nBody Text\nNotes: Notes in inherited position and size.\n"
                                  "Notes page number: 1"),
                      ("slide 2", "Notes: Notes in modified position and size.\nNotes page number: 2")]
    printed = readings["poi-bug58144-headers-footers-2007.pptx"]["pages"][0]["text"]
    assert "Notes page header: Notes header" in printed and "Notes page footer: Notes footer" in printed


def test_odt_html_markdown_csv_json_and_code_are_read(readings):
    assert readings["odfpy-Electra.odt"]["kind"] == "odt"
    html = text_of(readings["markup-README.long.rst.html"])
    assert "Robot Framework 7.0 is a new major release" in " ".join(html.split())
    assert "<p>" not in html and "<a href" not in html
    assert readings["pdfjs-README.md"]["kind"] == "markdown"
    assert "0.980268513777" in text_of(readings["pandas-test1.csv"])
    assert '"name": "pdf.js"' in text_of(readings["pdfjs-package.json"])
    assert "class Document" in text_of(readings["pydocx-document.py"])


async def test_html_drops_scripts_and_styles(tmp_path):
    page = (b"<html><head><title>t</title><style>p{color:red}</style></head><body><h1>Budget</h1>"
            b"<p>The pilot costs 40,000 euros.</p><script>alert('steal')</script><h2>Risks</h2><p>Weather.</p></body></html>")
    answer = await read("page.html", page, tmp_path)
    assert [(s["label"], s["text"]) for s in answer["pages"]] == [
        ("§ Budget", "Budget\nThe pilot costs 40,000 euros."), ("§ Risks", "Risks\nWeather.")]


# -- hostile packages --------------------------------------------------------------------------

LAUGHS = (b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lolololololololololol">'
          + b"".join(b'<!ENTITY lol%d "%s">' % (n, (b"&lol%d;" % (n - 1) if n > 1 else b"&lol;") * 10)
                     for n in range(1, 10)) + b"]>")


def with_part(source: Path, part: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(source) as package, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for item in package.infolist():
            target.writestr(item, data if item.filename == part else package.read(item))
    return out.getvalue()


async def test_xml_bombs_in_any_office_format_are_not_expanded(tmp_path):
    """A billion-laughs DTD in the part each reader parses: refused, or read without expanding it."""
    cases = [
        ("bomb.docx", DOCS / "poi-delins.docx", "word/document.xml",
         b'<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body><w:p><w:r>'
         b"<w:t>&lol9;</w:t></w:r></w:p><w:p><w:r><w:t>plain words</w:t></w:r></w:p></w:body></w:document>"),
        ("bomb.xlsx", DOCS / "poi-SampleSS.xlsx", "xl/sharedStrings.xml",
         b'<sst xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"><si><t>&lol9;</t></si></sst>'),
        ("bomb.pptx", DOCS / "poi-with_japanese.pptx", "ppt/slides/slide1.xml", None),
        ("bomb.odt", DOCS / "odfpy-parastyles.odt", "content.xml",
         b'<office:document-content xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
         b'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0"><office:body><office:text>'
         b"<text:p>&lol9;</text:p><text:p>plain words</text:p></office:text></office:body></office:document-content>"),
    ]
    for name, source, part, body in cases:
        if body is None:
            original = zipfile.ZipFile(source).read(part)
            body = re.sub(rb"^<\?xml[^>]*\?>", b"", original).replace(b"<a:t>", b"<a:t>&lol9;", 1)
        try:
            answer = await read(name, with_part(source, part, LAUGHS + body), tmp_path)
        except Unreadable as exc:
            assert "damaged" in str(exc) or "entities" in str(exc), (name, str(exc))
            continue
        assert "lol" * 100 not in text_of(answer), name
        assert answer["pages"], name


async def test_a_zip_bomb_posing_as_a_spreadsheet_is_refused(tmp_path):
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        with z.open("xl/workbook.xml", "w", force_zip64=True) as member:
            for _ in range(300):
                member.write(bytes(2**20))
    with pytest.raises(Unreadable, match="inflates to more than"):
        await read("bomb.xlsx", out.getvalue(), tmp_path)


# -- reading passage by passage ----------------------------------------------------------------

async def test_reading_section_by_section_returns_the_whole_document(tmp_path):
    """Every section of a long Word document, read with read_attachment from 1 following each
    answer's continue line, gives back all its text, and every answer fits the cap with its line."""
    limits = Limits()
    attachments = Attachments(tmp_path / "att", tmp_path / "index", limits)
    scope = att.conversation_scope("conversation1")
    data = (DOCS / "poi-bug57031.docx").read_bytes()
    upload_path = tmp_path / "in.part"
    upload_path.write_bytes(data)
    meta = await attachments.ingest(scope, "tables.docx", upload_path, "local")
    pages = await attachments.pages(scope, meta["id"])
    token = att.attachment_scope.set(att.AttachmentScope(attachments, (scope,)))
    try:
        seen, start, offset, calls = [], 1, 0, 0
        while True:
            calls += 1
            answer = await read_attachment("tables.docx", start, None, offset)
            assert len(answer.text) <= att.READ_MAX_CHARS
            seen.extend(p["text"] for p in answer.passages)
            found = re.search(r"start_page=(\d+)(?:, offset=(\d+))?", answer.text)
            if not found:
                break
            start, offset = int(found.group(1)), int(found.group(2) or 0)
        assert "".join(seen) == "".join(p["text"] for p in pages)
    finally:
        att.attachment_scope.reset(token)
        await attachments.close()


async def test_a_page_longer_than_the_cap_is_cut_with_a_pointer_that_is_never_cut(api, client, app):
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=4)
    pdf.add_page()
    words = [f"w{n:05d}" for n in range(5000)]  # 35,000 characters on one page
    pdf.multi_cell(0, 2, " ".join(words))
    conv = await api.new()
    assert (await upload(client, conv["id"], "dense.pdf", bytes(pdf.output()))).status_code == 201
    with attachment_context(store(app), conv["id"], "local"):
        first = await read_attachment("dense.pdf")
        assert len(first.text) <= att.READ_MAX_CHARS
        pointer = re.search(r"call read_attachment with start_page=1, offset=(\d+) to continue\.\]$", first.text)
        assert pointer, first.text[-300:]
        rest = await read_attachment("dense.pdf", 1, None, int(pointer.group(1)))
        assert "to continue" not in rest.text
    read_words = re.findall(r"w\d{5}", first.text + rest.text)
    assert read_words == words


async def test_new_kinds_upload_with_their_media_types(api, client):
    conv = await api.new()
    for name, media in [("poi-SampleSS.xlsx", "spreadsheetml.sheet"), ("poi-with_japanese.pptx", "presentationml"),
                        ("odfpy-parastyles.odt", "opendocument.text"), ("markup-README.long.rst.html", "text/plain")]:
        stored = await upload(client, conv["id"], name, (DOCS / name).read_bytes())
        assert stored.status_code == 201, (name, stored.text)
        assert media in stored.json()["media_type"], (name, stored.json())


def test_corpus_manifest_is_valid_json():
    json.loads(corpus.MANIFEST.read_text())


async def test_a_pdf_that_will_not_open_says_why_in_words_not_pdfiums_codes(tmp_path):
    """Before issue 24 a file pdfium refused without an error code read "damaged ... (PDFium: Success)"."""
    for data in (b"%PDF-1.7\n" + bytes(range(256)) * 8, b"this is not a PDF at all\n" * 40):
        with pytest.raises(Unreadable) as refused:
            await read("broken.pdf", data, tmp_path)
        assert "PDFium" not in str(refused.value) and "Success" not in str(refused.value)
        assert str(refused.value).startswith("the PDF is damaged and could not be opened ("), str(refused.value)


@pytest.mark.skipif(not Path("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc").exists(),
                    reason="needs fonts-noto-cjk for a CJK PDF")
async def test_a_chinese_line_set_character_by_character_is_found_by_a_chinese_query(api, client, app):
    """Each character placed on its own with a gap, as spaced-out titles and justified lines are:
    pdfium (and pdftotext too, here) puts a space between every character, so the search's bigrams
    ("预算") never formed. The spaces between Han characters are removed; Latin text keeps its own."""
    from fpdf import FPDF

    from chatserver.attachments.store import search_attachments

    pdf = FPDF()
    pdf.add_font("noto", fname="/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc", collection_font_number=2)
    pdf.set_font("noto", size=12)
    pdf.add_page()
    for index, character in enumerate("试点项目的预算为四万欧元"):
        pdf.text(20 + index * 7.5, 30, character)
    pdf.text(20, 45, "Budget 2026: the pilot costs 40,000 euros.")
    conv = await api.new()
    stored = await upload(client, conv["id"], "预算.pdf", bytes(pdf.output()))
    assert stored.status_code == 201, stored.text
    with attachment_context(store(app), conv["id"], "local"):
        found = await search_attachments("预算")
        assert found.passages and "试点项目的预算为四万欧元" in found.passages[0]["text"]
        assert "Budget 2026: the pilot costs 40,000 euros." in found.passages[0]["text"]


async def test_a_long_heading_section_is_split_into_parts_that_say_so(tmp_path):
    from test_attachments import make_docx

    answer = await read("long.docx", make_docx([("Budget", "The pilot costs forty thousand euros. " * 300)]), tmp_path)
    labels = [s["label"] for s in answer["pages"]]
    assert labels == ["§ Budget, part 1", "§ Budget, part 2", "§ Budget, part 3"], labels
    assert all(len(s["text"]) <= 4000 for s in answer["pages"])
