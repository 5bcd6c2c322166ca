"""Text files: plain text, source code, CSV and JSON by lines ("lines 10-42"), Markdown by its
headings ("§ Heading"), HTML as the text a browser shows, by its headings."""

from __future__ import annotations

import re
from pathlib import Path

from .common import Budget, Sections, Unreadable, clean, lines_label, section

HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
# Never shown as text on a page.
HIDDEN = {"script", "style", "noscript", "template", "head", "title", "meta", "link", "svg", "math", "iframe",
          "object", "embed", "canvas", "select", "button"}
BLOCKS = {"p", "div", "section", "article", "header", "footer", "main", "aside", "nav", "ul", "ol", "li",
          "table", "tr", "blockquote", "pre", "figure", "figcaption", "dl", "dt", "dd", "form", "fieldset",
          "address", "details", "summary", "hr", "br", "caption", "thead", "tbody", "tfoot"}
CELLS = {"td", "th"}


def decode(path: Path, budget: Budget) -> str:
    data = path.read_bytes()
    encoding = "utf-16" if data.startswith((b"\xff\xfe", b"\xfe\xff")) else "utf-8-sig"
    try:
        text = budget.add(data.decode(encoding))
    except UnicodeDecodeError as exc:
        raise Unreadable(f"the file is not UTF-8 text (invalid byte at offset {exc.start}); save it as "
                         "UTF-8 and upload it again") from None
    if "\x00" in text:
        raise Unreadable("the file is binary, not text (it contains NUL bytes)")
    return text


def extract_text(path: Path, budget: Budget, limit: int) -> list[dict]:
    """Chunks of at most `limit` characters, cut at line ends, labelled with their line numbers."""
    text = decode(path, budget)
    sections: list[dict] = []
    chunk: list[str] = []
    size, first, number = 0, 1, 0
    lines = clean(text).split("\n")
    ended = len(lines) > 1 and lines[-1] == ""
    if ended:
        lines.pop()  # the newline that ends the last line starts no line of its own
    for number, line in enumerate(lines, start=1):
        while len(line) > limit:  # one enormous line (minified code) becomes several sections
            if chunk:
                sections.append(section(len(sections) + 1, lines_label(first, number - 1), "\n".join(chunk)))
                chunk, size = [], 0
            sections.append(section(len(sections) + 1, lines_label(number, number), line[:limit]))
            line, first = line[limit:], number
        if size + len(line) > limit and chunk:
            sections.append(section(len(sections) + 1, lines_label(first, number - 1), "\n".join(chunk)))
            chunk, size, first = [], 0, number
        if not chunk:
            first = number
        chunk.append(line)
        size += len(line) + 1
    if chunk:
        sections.append(section(len(sections) + 1, lines_label(first, number), "\n".join(chunk)))
    if sections and ended:
        sections[-1]["text"] += "\n"  # the file's text kept whole, its last newline included
    sections = [s for s in sections if s["text"].strip()]
    for number, s in enumerate(sections, start=1):
        s["page"] = number
    if not sections:
        raise Unreadable("the file is empty")
    return sections


_ATX = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def extract_markdown(path: Path, budget: Budget) -> list[dict]:
    """Sections under each heading ("§ Heading"), the Markdown kept as written."""
    text = clean(decode(path, budget))
    out = Sections(Budget(budget.max_chars))  # its characters were counted once, by decode
    label, lines, fence = "", [], ""
    for line in text.split("\n"):
        opened = _FENCE.match(line)
        if opened and (not fence or opened.group(1)[0] == fence[0]):
            fence = "" if fence else opened.group(1)
        heading = None if fence else _ATX.match(line)
        if heading:
            out.add(label or f"section {len(out.out) + 1}", "\n".join(lines))
            lines = []
            title = heading.group(2)
            label = "§ " + " ".join(title.split())[:200] if title.strip() else label
        lines.append(line)
    out.add(label or f"section {len(out.out) + 1}", "\n".join(lines))
    if not out.out:
        raise Unreadable("the file is empty")
    return out.out


def extract_html(path: Path, budget: Budget) -> list[dict]:
    """The text a browser shows (no scripts, styles or markup), in sections under each heading."""
    import lxml.html
    from lxml import etree

    data = path.read_bytes()
    parser = lxml.html.HTMLParser(no_network=True, remove_comments=True, remove_pis=True, huge_tree=False,
                                  default_doctype=False)
    try:
        root = lxml.html.document_fromstring(data, parser=parser)
    except (etree.ParserError, ValueError) as exc:
        raise Unreadable(f"the HTML page could not be read ({exc})") from None
    out = Sections(budget)
    label, parts = "", []

    def flush() -> None:
        nonlocal parts
        text = "\n".join(" ".join(line.split()) for line in "".join(parts).split("\n"))
        out.add(label or f"section {len(out.out) + 1}", re.sub(r"\n{2,}", "\n", text))
        parts = []

    def walk(element) -> None:
        nonlocal label
        name = element.tag if isinstance(element.tag, str) else ""
        if name in HIDDEN or not name:
            return
        if name in HEADINGS:
            flush()
            title = " ".join(element.text_content().split())
            label = "§ " + title[:200] if title else label
            parts.append(title + "\n")
            return
        if name in BLOCKS:
            parts.append("\n")
        parts.append(element.text or "")
        for child in element:
            walk(child)
            if child.tail:
                parts.append(child.tail)
        if name in CELLS:
            parts.append(" | ")
        elif name in BLOCKS:
            parts.append("\n")

    body = root.find("body")
    walk(body if body is not None else root)
    flush()
    if not out.out:
        raise Unreadable("the HTML page has no text")
    return out.out
