"""The document corpus (tests/fixtures/documents): real files from public test suites, each with a
reference text from a reader we trust, and how much of that reference the server's reading keeps.

References (`<file>.ref.txt`, made by `python tests/corpus.py` and stored beside each file):
- PDF: poppler's `pdftotext -enc UTF-8` (poppler-utils), the reader people compare against.
- Word (.docx .docm .dotx): LibreOffice is not available here, so every `w:t` (the text runs Word
  shows) of the body, headers, footers, footnotes, endnotes and comments parts, found by their part
  names, not by the relationships the server follows; the `mc:Fallback` copies of text boxes are left
  out (they repeat the `mc:Choice` for older readers). Deleted text (`w:delText`) and field codes
  (`w:instrText`) are not `w:t`, so they are not in it either.
- XLSX: each sheet's cell values from the sheet XML and the shared strings table, not openpyxl.
- PPTX: every `a:t` of the slides and their notes pages, not python-pptx.
- ODT: all text of content.xml's office:body.
- HTML: trafilatura's html2txt (all visible text), not the server's walk.
- Markdown, CSV, JSON and source code: the file itself.

Coverage is the share of the reference's tokens (the search index's tokens: words, and character
bigrams for CJK, so a Chinese text split by spurious spaces loses its bigrams) that the reading has,
each counted at most as often as the reading has it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "fixtures" / "documents"
MANIFEST = ROOT / "corpus.json"


def documents() -> dict[str, dict]:
    """file name -> {"repo", "path", "commit", "licence", "threshold", ...} from corpus.json."""
    return json.loads(MANIFEST.read_text())


def reference_path(name: str) -> Path:
    return ROOT / f"{name}.ref.txt"


def tokens(text: str) -> Counter:
    from chatserver.attachments.store import tokenize

    return Counter(tokenize(text))


def coverage(reference: str, text: str) -> float:
    """The share of the reference's tokens that `text` holds (1.0 for an empty reference)."""
    want = tokens(reference)
    if not want:
        return 1.0
    have = tokens(text)
    return sum(min(n, have[t]) for t, n in want.items()) / sum(want.values())


def _xml(data: bytes):
    from lxml import etree

    return etree.fromstring(data, etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False))


def _word(path: Path) -> str:
    keep = re.compile(r"word/(document\d*|header\d*|footer\d*|footnotes|endnotes|comments)\.xml")
    out = []
    with zipfile.ZipFile(path) as package:
        for name in package.namelist():
            if not keep.fullmatch(name):
                continue
            root = _xml(package.read(name))
            for p in root.iter("{*}p"):
                if any(a.tag.endswith("}Fallback") for a in p.iterancestors()):
                    continue
                if any(a.tag.endswith("}p") for a in p.iterancestors()):
                    continue  # a text box's paragraph inside another: counted with its own p below
                runs = [t.text or "" for t in p.iter("{*}t") if t.tag.split("}")[0].endswith("main")
                        and not any(a.tag.endswith("}Fallback") for a in t.iterancestors())]
                out.append("".join(runs))
    return "\n".join(out)


def _xlsx(path: Path) -> str:
    out = []
    with zipfile.ZipFile(path) as package:
        shared = []
        if "xl/sharedStrings.xml" in package.namelist():
            for si in _xml(package.read("xl/sharedStrings.xml")):
                shared.append("".join(t.text or "" for t in si.iter("{*}t")
                                      if not any(a.tag.endswith("}rPh") for a in t.iterancestors())))
        for name in sorted(n for n in package.namelist() if re.fullmatch(r"xl/worksheets/sheet\d+\.xml", n)):
            for c in _xml(package.read(name)).iter("{*}c"):
                kind = c.get("t")
                v = c.find("{*}v")
                if kind == "s" and v is not None and v.text and int(v.text) < len(shared):
                    out.append(shared[int(v.text)])
                elif kind == "inlineStr":
                    out.append("".join(t.text or "" for t in c.iter("{*}t")))
                elif v is not None and v.text and kind not in ("b", "e"):
                    out.append(v.text)
    return "\n".join(out)


def _pptx(path: Path) -> str:
    out = []
    with zipfile.ZipFile(path) as package:
        names = [n for n in package.namelist()
                 if re.fullmatch(r"ppt/(slides/slide|notesSlides/notesSlide)\d+\.xml", n)]
        for name in sorted(names):
            out.extend(t.text or "" for t in _xml(package.read(name)).iter("{*}t")
                       if t.tag.startswith("{http://schemas.openxmlformats.org/drawingml"))
    return "\n".join(out)


def _odt(path: Path) -> str:
    with zipfile.ZipFile(path) as package:
        root = _xml(package.read("content.xml"))
    body = root.find("{*}body")
    return "\n".join(p.xpath("string()") for p in body.iter("{*}p", "{*}h")
                     if not any(a.tag.endswith(("}p", "}h")) for a in p.iterancestors()))


def reference(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        return subprocess.run(["pdftotext", "-enc", "UTF-8", "-q", str(path), "-"], capture_output=True,
                              check=False).stdout.decode("utf-8", "replace")
    if suffix in (".docx", ".docm", ".dotx"):
        return _word(path)
    if suffix == ".xlsx":
        return _xlsx(path)
    if suffix == ".pptx":
        return _pptx(path)
    if suffix == ".odt":
        return _odt(path)
    if suffix in (".html", ".htm"):
        import trafilatura

        page = path.read_text("utf-8")
        # html2txt answers "" for a fragment (no <html> or <body>, as github/markup's outputs are).
        return trafilatura.html2txt(page) or trafilatura.html2txt(f"<html><body>{page}</body></html>") or ""
    return path.read_text("utf-8")


if __name__ == "__main__":  # remake the references: python tests/corpus.py [names...]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    for name in sys.argv[1:] or sorted(documents()):
        reference_path(name).write_text(reference(ROOT / name))
        print(name, len(reference_path(name).read_text()))
