"""What every reader shares: the errors, the text budget, cleaning, sections and safe XML.

A section is {"page": n, "label": str, "text": str}: `page` numbers sections from 1 in reading
order (a PDF's page number), `label` is where it is as a person reads it ("p. 3", "§ Budget",
"slide 7", 'Sheet "Q3" rows 1-40', "lines 10-42", "footnotes").

Readers import nothing from the server: they run in the child (`extraction.py`), where this
package is imported as the top-level `readers`.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

SECTION_CHARS = 4000  # a section of a document that has no pages of its own
# A zip package (DOCX, XLSX, PPTX, ODT) that would inflate past this is refused before it is parsed.
ZIP_MAX_INFLATED = 256 * 1024 * 1024
# One XML part inflating past this is refused even when the package's sum is under the limit.
PART_MAX_INFLATED = 128 * 1024 * 1024


class AttachmentError(Exception):
    """A file refused or missing; `status` is the HTTP answer and the message says why."""

    status = 422


class TooLarge(AttachmentError):
    status = 413


class Unsupported(AttachmentError):
    status = 415


class Unreadable(AttachmentError):
    """Encrypted, damaged, image-only, empty, too big to read in memory or too slow to read."""

    status = 422


class Busy(AttachmentError):
    """Too many files are being read already; the client should try again shortly."""

    status = 429


# Control characters but tab and newline, and lone surrogates.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def clean(text: str) -> str:
    return _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def lines_label(first: int, last: int) -> str:
    return f"line {first}" if first == last else f"lines {first}-{last}"


def section(page: int, label: str, text: str) -> dict:
    return {"page": page, "label": label, "text": text}


class Budget:
    """The text read so far, refused once it passes `max_chars`."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.chars = 0

    def add(self, text: str) -> str:
        self.chars += len(text)
        if self.chars > self.max_chars:
            raise Unreadable(f"the file holds more than {self.max_chars:,} characters of text; "
                             "split it into smaller files")
        return text


class Sections:
    """Sections in reading order, each at most SECTION_CHARS: text added under one label is cut at
    paragraph, line or word ends into as many sections as it needs ("§ Budget, part 2")."""

    def __init__(self, budget: Budget, limit: int = SECTION_CHARS) -> None:
        self.out: list[dict] = []
        self.budget = budget
        self.limit = limit

    def add(self, label: str, text: str) -> None:
        """Sections of `text` under `label`; "label, part 2" and on when it needs more than one."""
        text = clean(text).strip()
        pieces = []
        while text:
            piece, text = cut(text, self.limit)
            pieces.append(self.budget.add(piece))
        for number, piece in enumerate(pieces, start=1):
            named = label if len(pieces) == 1 else f"{label}, part {number}"
            self.out.append(section(len(self.out) + 1, named, piece))


def cut(text: str, limit: int) -> tuple[str, str]:
    """(the first at most `limit` characters, cut at a paragraph, line or word end; the rest)."""
    if len(text) <= limit:
        return text, ""
    at = max(text.rfind("\n\n", 0, limit), text.rfind("\n", 0, limit))
    if at < limit // 2:
        at = max(at, text.rfind(" ", 0, limit))
    if at < limit // 2:
        at = limit
    return text[:at].rstrip(), text[at:].strip()


def open_zip(path: Path, what: str) -> zipfile.ZipFile:
    """The package as a zip, refused when it is not one or would inflate past ZIP_MAX_INFLATED."""
    try:
        package = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as exc:
        raise Unreadable(f"the {what} is damaged or truncated ({exc})") from None
    if sum(i.file_size for i in package.infolist()) > ZIP_MAX_INFLATED:
        package.close()
        raise Unreadable(f"the {what} inflates to more than {ZIP_MAX_INFLATED // 2**20} MB; it was not read")
    return package


def read_part(package: zipfile.ZipFile, name: str, what: str) -> bytes | None:
    """One part's bytes (None when absent), never more than PART_MAX_INFLATED."""
    try:
        info = package.getinfo(name)
    except KeyError:
        return None
    if info.file_size > PART_MAX_INFLATED:
        raise Unreadable(f"the {what}'s part {name} inflates to more than {PART_MAX_INFLATED // 2**20} MB; "
                         "it was not read")
    try:
        with package.open(info) as member:  # zipfile stops at the declared size, whatever the stream holds
            return member.read(PART_MAX_INFLATED + 1)
    except (zipfile.BadZipFile, EOFError, OSError, NotImplementedError) as exc:
        raise Unreadable(f"the {what} is damaged: its part {name} could not be inflated ({exc})") from None


def parse_xml(data: bytes, what: str):  # -> lxml.etree._Element
    """An XML part of an untrusted package: no entity is expanded, no DTD or network is fetched,
    and libxml2's limits on depth and text size stay on (huge_tree off), so an XML bomb is refused."""
    from lxml import etree

    parser = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False,
                             remove_comments=True, remove_pis=True)
    try:
        root = etree.fromstring(data, parser)
    except etree.XMLSyntaxError as exc:
        if near_memory_limit():  # libxml2 reports a failed allocation as "unknown error", among others
            raise MemoryError from None
        raise Unreadable(f"the {what} is damaged: an XML part is not well-formed ({exc.msg})") from None
    if root is None:
        raise Unreadable(f"the {what} is damaged: an XML part is empty")
    return root


def near_memory_limit() -> bool:
    """Whether this process's peak resident memory came within a quarter of its address-space limit
    (the child's RLIMIT_AS): then a reader's odd failure was memory running out."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return False
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > limit * 3 // 4


def local(tag: object) -> str:
    """An element's name without its namespace ("" for comments and entities)."""
    if not isinstance(tag, str):
        return ""
    return tag.rpartition("}")[2]
