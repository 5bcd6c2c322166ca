"""Attachments: files a person gives a conversation (or their library), read to text once, kept on
disk, and searched by the model through two tools that take only what the model means.

Promises:
- A file is recognised by its content (magic bytes) and its extension, never by the type the
  client claims. PDF (pypdfium2), DOCX (python-docx) and UTF-8 text-like files are read in a
  worker thread with a page cap and a time limit, so the event loop keeps serving every other
  stream while a long PDF is read. Text is kept per page (PDF) or per section (DOCX headings,
  bounded chunks of text files), each with its position, so an answer can cite "report.pdf p. 12".
- Any failure raises an `AttachmentError` carrying its HTTP status and a sentence saying what was
  wrong; nothing is stored then. A stored attachment is a directory
  `DATA_DIR/attachments/<scope>/<id>/` holding `meta.json`, `pages.json` and `original`, which
  appears whole (renamed from a staging directory) or not at all.
- File names are untrusted text: sanitised for display, never part of a path.
- Whose files the tools see comes from the `attachment_scope` ContextVar, which a turn sets with
  `attachment_context(...)` and which is reset in `finally` however the turn ends.

It knows directories and ids, not conversations' contents, turns or wire formats.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import unicodedata
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import orjson

import pii
from storage import atomic_write, new_id, now_iso, valid_id

log = logging.getLogger("chat.attachments")

# Measured on a generated 300-page PDF (400 words a page, equal text from both after whitespace
# normalisation): pypdfium2 1,885 pages/s, pypdf 622 pages/s. pypdf also returned NUL-padded
# text for a CJK CID font that pypdfium2 read correctly. Hence pypdfium2.
MEDIA_PDF = "application/pdf"
MEDIA_DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
# Text-like files by extension. Markup that a browser would render (html, xml, svg) is served as
# plain text: a download must never become a page of this origin.
TEXT_TYPES = {
    ".txt": "text/plain", ".md": "text/markdown", ".markdown": "text/markdown", ".csv": "text/csv",
    ".tsv": "text/tab-separated-values", ".json": "application/json", ".jsonl": "application/json",
    **dict.fromkeys((
        ".rst", ".log", ".py", ".pyi", ".js", ".mjs", ".cjs", ".jsx", ".ts", ".tsx", ".go", ".rs",
        ".java", ".kt", ".kts", ".scala", ".swift", ".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp",
        ".cs", ".rb", ".php", ".pl", ".lua", ".r", ".m", ".dart", ".html", ".htm", ".css", ".scss",
        ".xml", ".svg", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".conf", ".env", ".properties",
        ".sh", ".bash", ".zsh", ".fish", ".ps1", ".bat", ".sql", ".graphql", ".proto", ".tex",
        ".bib", ".vue", ".svelte", ".tf", ".gradle", ".cmake", ".mk", ".diff", ".patch", ".srt",
        ".vtt", ".org", ".adoc",
    ), "text/plain"),
}
# Extensionless names that are text by convention.
TEXT_NAMES = {"makefile", "dockerfile", "readme", "license", "changelog", "gemfile", "procfile"}
OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # old Office files, and encrypted new ones
# Content that is certainly not something we read, whatever its name says.
BINARY_MAGIC = (
    b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"7z\xbc\xaf",
    b"Rar!", OLE_MAGIC, b"\x7fELF", b"MZ", b"II*\x00", b"MM\x00*", b"OggS", b"fLaC", b"ID3",
)
ACCEPTED = "PDF, DOCX, or a UTF-8 text file (.txt .md .csv .json, source code, ...)"

NAME_MAX = 255
SECTION_CHARS = 4000  # a DOCX section or a text-file chunk
PASSAGE_CHARS = 1000  # what one search hit shows
SEARCH_HITS = 5
READ_MAX_CHARS = 20_000  # one read_attachment answer (~5k tokens)
EXTRACT_TIMEOUT = 60.0
# A DOCX is a zip: refuse one that would inflate past this before python-docx parses it.
DOCX_MAX_INFLATED = 256 * 1024 * 1024
INDEX_CACHE = 16
# pdfium is not thread-safe: calls from two threads at once corrupt its state.
_PDFIUM = threading.Lock()
# Owner names become one directory level under library/, so they are held to this.
_OWNER = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")

NO_CONTEXT = ("There are no attachments in this context: this tool only works inside a conversation "
              "turn, and sees the files attached to that conversation (and the library when enabled).")


class AttachmentError(Exception):
    """A file refused or missing; `status` is the HTTP answer and the message says why."""

    status = 422


class TooLarge(AttachmentError):
    status = 413


class Unsupported(AttachmentError):
    status = 415


class Unreadable(AttachmentError):
    """Encrypted, damaged, image-only, empty or too slow to read."""

    status = 422


class AttachmentNotFound(AttachmentError):
    status = 404


class _Cancelled(Exception):
    """The time limit passed; the worker thread stops at its next page."""


@dataclass(frozen=True, slots=True)
class Scope:
    """One owner of attachments: a directory under DATA_DIR/attachments and where hits come from."""

    key: str
    source: str  # "conversation" | "library"


def conversation_scope(conversation_id: str) -> Scope:
    # "library" (7 characters) can never be a conversation id (8-64), so the two never collide.
    if not valid_id(conversation_id):
        raise AttachmentNotFound("conversation not found")
    return Scope(conversation_id, "conversation")


def library_scope(owner: str) -> Scope:
    if not _OWNER.fullmatch(owner):
        raise ValueError(f"owner {owner!r} is not usable as a library name")
    return Scope(f"library/{owner}", "library")


@dataclass(frozen=True, slots=True)
class Passage:
    attachment_id: str
    name: str
    page: int
    label: str
    text: str
    source: str
    cited_as: str

    def citation(self) -> dict:
        return {"attachment_id": self.attachment_id, "name": self.name, "page": self.page, "label": self.cited_as}


@dataclass(slots=True)
class AttachmentToolResult:
    """What a tool answers: `text` for the model, `citations` and `passages` for the reply and the page."""

    text: str
    summary: str
    citations: list[dict] = field(default_factory=list)
    passages: list[dict] = field(default_factory=list)


# -- names and types ---------------------------------------------------------------------------

# Bidirectional overrides and isolates let "invoice\u202efdp.exe" display as "invoiceexe.pdf".
_BIDI = dict.fromkeys([*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C])


def sanitize_name(name: str) -> str:
    """A file name fit for display: no control, surrogate or bidi characters, at most NAME_MAX long."""
    name = unicodedata.normalize("NFC", name).translate(_BIDI)
    name = "".join(c for c in name if unicodedata.category(c) not in ("Cc", "Cs", "Co", "Cn")).strip()
    if len(name) > NAME_MAX:
        suffix = PurePosixPath(name).suffix
        suffix = suffix if len(suffix) <= 16 else ""
        name = name[: NAME_MAX - len(suffix)].rstrip() + suffix
    return name or "unnamed"


def _extension(name: str) -> str:
    # Pure string work: the name is never handed to the filesystem.
    return PurePosixPath(name.replace("\\", "/")).suffix.lower()


def detect(path: Path, name: str) -> str:
    """"pdf", "docx" or "text", from the content first and the extension second; Unsupported otherwise."""
    with open(path, "rb") as f:
        head = f.read(1024)
    ext = _extension(name)
    # Readers accept a PDF header after a little junk, but a script that merely mentions "%PDF-"
    # is not a PDF: only a .pdf gets that leeway.
    if head.startswith(b"%PDF-") or (ext == ".pdf" and b"%PDF-" in head):
        return "pdf"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        if ext == ".docx":
            return "docx"
        try:
            with zipfile.ZipFile(path) as z:
                if "word/document.xml" in z.namelist():
                    return "docx"
        except zipfile.BadZipFile:
            pass
        raise Unsupported(f"this is a zip archive, not a file type this server reads; send {ACCEPTED}")
    if ext == ".docx" and head.startswith(OLE_MAGIC):
        # Word keeps a password-protected DOCX inside an OLE container, not a zip.
        raise Unreadable("the DOCX is encrypted (password-protected); remove the password and upload it again")
    if ext == ".docx":
        raise Unreadable("the DOCX file is damaged: it is not a zip archive as every DOCX is")
    if ext == ".pdf":
        raise Unreadable("the PDF file is damaged: it has no PDF header")
    if head.startswith(BINARY_MAGIC):
        raise Unsupported(f"this kind of file is not supported; send {ACCEPTED}")
    bare = PurePosixPath(name.replace("\\", "/")).name.lower()
    if ext in TEXT_TYPES or (not ext and (bare in TEXT_NAMES or "." not in bare)):
        return "text"
    raise Unsupported(f"{ext or 'this'} files are not supported; send {ACCEPTED}")


def media_type(kind: str, name: str) -> str:
    if kind == "pdf":
        return MEDIA_PDF
    if kind == "docx":
        return MEDIA_DOCX
    return TEXT_TYPES.get(_extension(name), "text/plain")


# -- extraction (runs in a worker thread) ------------------------------------------------------

# Control characters but tab and newline, and lone surrogates. A regex, not a loop over characters:
# the worker thread holds the GIL while it runs, and the event loop waits for the GIL meanwhile.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _clean(text: str) -> str:
    return _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def _section(page: int, label: str, text: str) -> dict:
    return {"page": page, "label": label, "text": text}


def cited_as(meta: dict, section: dict) -> str:
    """Where a passage is, as a person reads it on a citation chip: "p. 3" (PDF), "lines 40-80"
    (text), "§ Budget" or "section 2" (DOCX, by its heading when it has one)."""
    label = section["label"]
    if meta.get("media_type") == MEDIA_DOCX and label != f"section {section['page']}":
        return f"§ {label}"
    return label


def extract_pdf(path: Path, max_pages: int, cancelled: threading.Event) -> tuple[list[dict], int]:
    """Pages of text (at most max_pages) and the document's page count."""
    import pypdfium2 as pdfium

    with _PDFIUM:
        try:
            doc = pdfium.PdfDocument(str(path))
        except pdfium.PdfiumError as exc:
            if getattr(exc, "err_code", None) == pdfium.raw.FPDF_ERR_PASSWORD:
                raise Unreadable("the PDF is encrypted (password-protected); remove the password and "
                                 "upload it again") from None
            raise Unreadable(f"the PDF is damaged and could not be opened ({exc})") from None
        try:
            total = len(doc)
            pages = []
            for index in range(min(total, max_pages)):
                if cancelled.is_set():
                    raise _Cancelled
                page = doc[index]
                textpage = page.get_textpage()
                try:
                    pages.append(_section(index + 1, f"p. {index + 1}", _clean(textpage.get_text_bounded())))
                finally:
                    textpage.close()
                    page.close()
        except pdfium.PdfiumError as exc:
            raise Unreadable(f"the PDF is damaged: reading page {len(pages) + 1} failed ({exc})") from None
        finally:
            doc.close()
    if total == 0:
        raise Unreadable("the PDF is damaged: it has no pages")
    if not any(p["text"].strip() for p in pages):
        raise Unreadable("the PDF has no text layer (a scanned or image-only PDF); this server does not "
                         "read text from images")
    return pages, total


def extract_docx(path: Path, cancelled: threading.Event) -> list[dict]:
    """Sections split at headings and at SECTION_CHARS, numbered from 1."""
    import docx
    from docx.table import Table

    try:
        with zipfile.ZipFile(path) as z:
            if sum(i.file_size for i in z.infolist()) > DOCX_MAX_INFLATED:
                raise Unreadable("the DOCX inflates to more than "
                                 f"{DOCX_MAX_INFLATED // 2**20} MiB; it was not read")
            if "word/document.xml" not in z.namelist():
                raise Unreadable("the DOCX is damaged: it has no word/document.xml")
        document = docx.Document(str(path))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise Unreadable(f"the DOCX is damaged or truncated ({exc})") from None
    except Unreadable:
        raise
    except Exception as exc:  # python-docx and lxml raise many kinds on a malformed package
        raise Unreadable(f"the DOCX is damaged ({type(exc).__name__}: {exc})") from None
    sections: list[dict] = []
    heading, lines, size = "", [], 0

    def close() -> None:
        nonlocal lines, size
        text = "\n".join(lines).strip()
        if text:
            number = len(sections) + 1
            sections.append(_section(number, heading or f"section {number}", text))
        lines, size = [], 0

    for block in document.iter_inner_content():
        if cancelled.is_set():
            raise _Cancelled
        if isinstance(block, Table):
            text = "\n".join(" | ".join(c.text.strip() for c in row.cells) for row in block.rows)
        else:
            text = block.text
            style = (block.style.name if block.style is not None else "") or ""
            if text.strip() and (style.startswith("Heading") or style == "Title"):
                close()
                heading = _clean(text).strip()[:200]
        text = _clean(text)
        if size + len(text) > SECTION_CHARS and lines:
            close()
        lines.append(text)
        size += len(text) + 1
    close()
    if not sections:
        raise Unreadable("the DOCX has no text")
    return sections


def extract_text(path: Path, cancelled: threading.Event) -> list[dict]:
    """Chunks of at most SECTION_CHARS, cut at line ends, labelled with their line numbers."""
    data = path.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        encoding = "utf-16"
    else:
        encoding = "utf-8-sig"
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise Unreadable(f"the file is not UTF-8 text (invalid byte at offset {exc.start}); save it as "
                         "UTF-8 and upload it again") from None
    if "\x00" in text:
        raise Unreadable("the file is binary, not text (it contains NUL bytes)")
    sections: list[dict] = []
    chunk, size, first = [], 0, 1
    for number, line in enumerate(_clean(text).split("\n"), start=1):
        if size + len(line) > SECTION_CHARS and chunk:
            if cancelled.is_set():
                raise _Cancelled
            sections.append(_section(len(sections) + 1, f"lines {first}-{number - 1}", "\n".join(chunk)))
            chunk, size, first = [], 0, number
        chunk.append(line[: SECTION_CHARS * 4])  # one enormous line (minified code) stays bounded
        size += len(line) + 1
    if chunk:
        sections.append(_section(len(sections) + 1, f"lines {first}-{number}", "\n".join(chunk)))
    if not any(s["text"].strip() for s in sections):
        raise Unreadable("the file is empty")
    return sections


# -- search ------------------------------------------------------------------------------------

# Hangul (syllables, jamo), kana and CJK ideographs. Korean glues particles to words ("감귤은") and
# Japanese and Chinese put no spaces at all, so such runs become overlapping character bigrams;
# other scripts become lower-cased word tokens.
_CJK = ("\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u3400-\u4dbf\u4e00-\u9fff"
        "\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f")
_TOKEN = re.compile(f"([{_CJK}]+)|[^\\W{_CJK}]+")


def tokenize(text: str) -> list[str]:
    """BM25 tokens: word tokens for most scripts, character bigrams over Hangul/CJK runs."""
    out: list[str] = []
    for match in _TOKEN.finditer(unicodedata.normalize("NFKC", text).lower()):
        run = match.group(1)
        if run is None:
            out.append(match.group(0))
        elif len(run) == 1:
            out.append(run)
        else:
            out.extend(run[i:i + 2] for i in range(len(run) - 1))
    return out


def split_passages(text: str, limit: int = PASSAGE_CHARS) -> list[str]:
    """Pieces of at most about `limit` characters, cut at paragraph, line or word boundaries."""
    text = text.strip()
    out = []
    while len(text) > limit:
        cut = max(text.rfind("\n\n", 0, limit), text.rfind("\n", 0, limit), text.rfind(" ", 0, limit))
        if cut < limit // 2:
            cut = limit
        out.append(text[:cut].strip())
        text = text[cut:].strip()
    if text:
        out.append(text)
    return out


class SearchIndex:
    """BM25 over the passages of a set of scopes."""

    def __init__(self, passages: list[Passage]) -> None:
        import bm25s

        self.passages = passages
        self.bm25 = None
        if passages:
            self.bm25 = bm25s.BM25()
            self.bm25.index([tokenize(p.text) for p in passages], show_progress=False)

    def search(self, query: str, k: int = SEARCH_HITS) -> list[Passage]:
        tokens = [t for t in tokenize(query) if self.bm25 is not None and t in self.bm25.vocab_dict]
        if not tokens:
            return []
        docs, scores = self.bm25.retrieve([tokens], k=min(k, len(self.passages)), show_progress=False)
        return [self.passages[int(d)] for d, s in zip(docs[0], scores[0]) if s > 0]


# -- the store ---------------------------------------------------------------------------------

def _masked_pages(pages: list[dict]) -> list[dict]:
    return [{**page, "text": pii.mask(page["text"])[0]} for page in pages]


@dataclass(frozen=True, slots=True)
class Limits:
    max_bytes: int = 20 * 1024 * 1024
    max_pages: int = 1000
    timeout: float = EXTRACT_TIMEOUT
    mask_pii: bool = False  # PII_MASKING=on: the text kept (and read to the model) is masked


class Attachments:
    """Attachment files under `root` (DATA_DIR/attachments), with cached listings and search indexes.

    Caches are per process and invalidated by this process's uploads and deletes.
    """

    def __init__(self, root: Path, limits: Limits = Limits()) -> None:
        self.root = root
        self.limits = limits
        self.incoming = root / ".incoming"
        # Two workers: a DOCX or a text file need not wait for a long PDF (PDFs take turns anyway).
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="attachments")
        self._metas: dict[str, list[dict]] = {}
        self._generation: dict[str, int] = {}
        self._indexes: OrderedDict[tuple, asyncio.Future] = OrderedDict()

    def _dir(self, scope: Scope) -> Path:
        return self.root / scope.key

    def _changed(self, scope: Scope) -> None:
        self._metas.pop(scope.key, None)
        self._generation[scope.key] = self._generation.get(scope.key, 0) + 1

    def sweep(self, older_than: float = 3600.0) -> None:
        """Remove what a crash left behind: partial uploads, staging and half-deleted directories.

        Only leftovers older than `older_than` seconds go, so an upload under way in another
        process sharing the directory is never touched.
        """
        cutoff = time.time() - older_than
        leftovers = [*self.incoming.glob("upload-*.part"), *self.root.glob("*/.staging-*"),
                     *self.root.glob("library/*/.staging-*"), *self.root.glob(".deleting-*"),
                     *self.root.glob("*/.deleting-*"), *self.root.glob("library/*/.deleting-*")]
        for path in leftovers:
            try:
                if path.lstat().st_mtime >= cutoff:
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except OSError as exc:
                log.warning("could not remove leftover %s: %s", path.name, exc)

    def incoming_file(self) -> tuple[int, Path]:
        """A new temporary file for an upload, on the same filesystem as the attachments."""
        self.incoming.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.incoming, prefix="upload-", suffix=".part")
        return fd, Path(name)

    async def ingest(self, scope: Scope, name: str, upload: Path) -> dict:
        """Read `upload` (a temporary file this call consumes) and store it; AttachmentError otherwise."""
        display = sanitize_name(name)
        try:
            size = upload.stat().st_size
            if size > self.limits.max_bytes:
                raise TooLarge(f"the file is over {self.limits.max_bytes} bytes")
            if size == 0:
                raise Unreadable("the file is empty")
            kind = await asyncio.get_running_loop().run_in_executor(self._executor, detect, upload, display)
            pages, total = await self._extract(kind, upload)
            if self.limits.mask_pii:
                pages = await asyncio.get_running_loop().run_in_executor(self._executor, _masked_pages, pages)
            meta = {
                "id": new_id(), "name": display, "media_type": media_type(kind, display), "bytes": size,
                "pages": total if kind == "pdf" else None, "chars": sum(len(p["text"]) for p in pages),
                "created_at": now_iso(), "kind": kind, "sections": len(pages),
            }
            if kind == "pdf" and total > len(pages):
                meta["pages_read"] = len(pages)
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._commit, scope, meta, pages, upload)
        finally:
            upload.unlink(missing_ok=True)
        self._changed(scope)
        return public(meta)

    async def _extract(self, kind: str, path: Path) -> tuple[list[dict], int]:
        cancelled = threading.Event()

        def run() -> tuple[list[dict], int]:
            if kind == "pdf":
                return extract_pdf(path, self.limits.max_pages, cancelled)
            sections = extract_docx(path, cancelled) if kind == "docx" else extract_text(path, cancelled)
            return sections, len(sections)

        job = asyncio.get_running_loop().run_in_executor(self._executor, run)
        try:
            return await asyncio.wait_for(asyncio.shield(job), self.limits.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise Unreadable(f"reading the file took longer than {self.limits.timeout:g} s; it was not "
                             "stored") from None
        finally:
            cancelled.set()  # stops the worker at its next page if it is still reading
            job.add_done_callback(lambda f: f.cancelled() or f.exception())  # consumed, not logged

    def _commit(self, scope: Scope, meta: dict, pages: list[dict], upload: Path) -> None:
        """Move the upload and its text into place: the directory appears whole or not at all."""
        final = self._dir(scope) / meta["id"]
        staging = self._dir(scope) / f".staging-{meta['id']}"
        staging.mkdir(parents=True)
        try:
            with open(upload, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(upload, staging / "original")
            atomic_write(staging / "pages.json", orjson.dumps(pages))
            atomic_write(staging / "meta.json", orjson.dumps(meta))
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _fsync_dir(final.parent)

    def list(self, scope: Scope) -> list[dict]:
        """The scope's attachments (stored meta, oldest first); cached until the next change."""
        cached = self._metas.get(scope.key)
        if cached is not None:
            return cached
        metas = []
        directory = self._dir(scope)
        if directory.is_dir():
            for entry in directory.iterdir():
                if not valid_id(entry.name):
                    continue
                try:
                    metas.append(orjson.loads((entry / "meta.json").read_bytes()))
                except (OSError, orjson.JSONDecodeError) as exc:
                    log.error("skipping attachment %s/%s: %s", scope.key, entry.name, exc)
        metas.sort(key=lambda m: (m.get("created_at", ""), m.get("id", "")))
        self._metas[scope.key] = metas
        return metas

    def get(self, scope: Scope, attachment_id: str) -> dict:
        for meta in self.list(scope):
            if meta["id"] == attachment_id:
                return meta
        raise AttachmentNotFound("attachment not found")

    def original(self, scope: Scope, attachment_id: str) -> tuple[dict, Path]:
        meta = self.get(scope, attachment_id)
        return meta, self._dir(scope) / meta["id"] / "original"

    def pages(self, scope: Scope, attachment_id: str) -> list[dict]:
        meta = self.get(scope, attachment_id)
        return orjson.loads((self._dir(scope) / meta["id"] / "pages.json").read_bytes())

    async def delete(self, scope: Scope, attachment_id: str) -> None:
        meta = self.get(scope, attachment_id)
        target = self._dir(scope) / meta["id"]
        # Renamed first so a reader never meets a half-removed directory.
        doomed = self._dir(scope) / f".deleting-{meta['id']}"
        os.rename(target, doomed)
        self._changed(scope)
        await asyncio.to_thread(shutil.rmtree, doomed, True)

    async def delete_scope(self, scope: Scope) -> None:
        """Remove every attachment of a scope (a deleted conversation's files)."""
        directory = self._dir(scope)
        self._changed(scope)
        if directory.is_dir():
            doomed = directory.with_name(f".deleting-{directory.name}-{new_id()}")
            os.rename(directory, doomed)
            await asyncio.to_thread(shutil.rmtree, doomed, True)

    def check_ids(self, scope: Scope, ids: list[str]) -> list[str]:
        """`ids` when each names an attachment of `scope`; AttachmentNotFound otherwise."""
        for attachment_id in ids:
            self.get(scope, attachment_id)
        return list(ids)

    async def index(self, scopes: tuple[Scope, ...]) -> SearchIndex:
        """The BM25 index over these scopes, built once in a worker thread and cached until a change."""
        key = tuple((s.key, self._generation.get(s.key, 0)) for s in scopes)
        future = self._indexes.get(key)
        if future is None:
            gathered = [(s, self.list(s)) for s in scopes]
            future = asyncio.get_running_loop().run_in_executor(self._executor, self._build, gathered)
            self._indexes[key] = future
            while len(self._indexes) > INDEX_CACHE:
                self._indexes.popitem(last=False)
        self._indexes.move_to_end(key)
        try:
            return await asyncio.shield(future)
        except BaseException:
            if future.done():
                self._indexes.pop(key, None)
            raise

    def _build(self, gathered: list[tuple[Scope, list[dict]]]) -> SearchIndex:
        passages = []
        for scope, metas in gathered:
            for meta in metas:
                try:
                    pages = orjson.loads((self._dir(scope) / meta["id"] / "pages.json").read_bytes())
                except (OSError, orjson.JSONDecodeError):
                    continue  # deleted meanwhile
                for page in pages:
                    for text in split_passages(page["text"]):
                        passages.append(Passage(meta["id"], meta["name"], page["page"], page["label"],
                                                text, scope.source, cited_as(meta, page)))
        return SearchIndex(passages)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def public(meta: dict) -> dict:
    """The API's Attachment: the stored meta without bookkeeping fields."""
    out = {k: meta.get(k) for k in ("id", "name", "media_type", "bytes", "pages", "chars", "created_at")}
    if "pages_read" in meta:
        out["pages_read"] = meta["pages_read"]
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the turn's context and the tools ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AttachmentScope:
    """Whose files the attachment tools see during one turn."""

    attachments: Attachments
    scopes: tuple[Scope, ...]


attachment_scope: ContextVar[AttachmentScope | None] = ContextVar("attachment_scope", default=None)


@contextmanager
def attachment_context(attachments: Attachments, conversation_id: str, owner: str,
                       library: bool = False) -> Iterator[AttachmentScope]:
    """Let the attachment tools see this conversation's files (and the owner's library) inside the block."""
    scopes = [conversation_scope(conversation_id)]
    if library:
        scopes.append(library_scope(owner))
    scope = AttachmentScope(attachments, tuple(scopes))
    token = attachment_scope.set(scope)
    try:
        yield scope
    finally:
        # Reset however the turn ends: a scope left set would show these files to the next turn.
        attachment_scope.reset(token)


def _pages_word(meta: dict) -> str:
    if meta.get("pages") is not None:
        read = meta.get("pages_read")
        return f"{meta['pages']} pages" + (f", first {read} read" if read else "")
    count = meta.get("sections", 1)
    return f"{count} section{'s' if count != 1 else ''}"


def attachment_listing(scope: AttachmentScope | None) -> str:
    """The prompt block naming the files the tools can see (never their text); "" when there are none."""
    if scope is None:
        return ""
    blocks = []
    for s in scope.scopes:
        metas = scope.attachments.list(s)
        if not metas:
            continue
        title = ("Files attached to this conversation:" if s.source == "conversation"
                 else "Files in the person's library:")
        blocks.append("\n".join([title, *(f"- {m['name']} ({_pages_word(m)})" for m in metas)]))
    if not blocks:
        return ""
    return ("\n".join(blocks) + "\nTheir text is not shown here: use search_attachments to find passages "
            "and read_attachment to read pages, and cite them as (name p. N).")


def _where(passage: Passage) -> str:
    return f"{passage.name} {passage.label}" if passage.label.startswith("p. ") else \
        f"{passage.name} §{passage.page} ({passage.label})"


async def search_attachments(query: str) -> AttachmentToolResult:
    """Search the attached files for passages about `query`: the best ones, with file name and page.

    Sees the files of this conversation, and the person's library when the conversation enables it.

    Args:
        query: what to look for, in words likely to appear in the file (any language).
    """
    scope = attachment_scope.get()
    if scope is None:
        return AttachmentToolResult(NO_CONTEXT, "no attachment context")
    if not any(scope.attachments.list(s) for s in scope.scopes):
        return AttachmentToolResult("No files are attached to this conversation.", "no files")
    index = await scope.attachments.index(scope.scopes)
    hits = index.search(query)
    if not hits:
        return AttachmentToolResult(f"No passage in the attached files matches {query!r}.", "no match")
    blocks = [f"[{n}] {_where(p)} ({p.source})\n{p.text}" for n, p in enumerate(hits, start=1)]
    citations = []
    for p in hits:
        if p.citation() not in citations:
            citations.append(p.citation())
    names = sorted({p.name for p in hits})
    return AttachmentToolResult(
        "\n\n".join(blocks),
        f"{len(hits)} passage{'s' if len(hits) != 1 else ''} from {', '.join(names)}",
        citations,
        [{"attachment_id": p.attachment_id, "name": p.name, "page": p.page, "text": p.text,
          "source": p.source} for p in hits],
    )


def _find(scope: AttachmentScope, name: str) -> tuple[Scope, dict] | None:
    """The attachment called `name` (exactly, else ignoring case, else by id); the newest wins."""
    candidates = [(s, m) for s in scope.scopes for m in scope.attachments.list(s)]
    for matches in (
        lambda m: m["name"] == name,
        lambda m: m["name"].casefold() == name.strip().casefold(),
        lambda m: m["id"] == name,
    ):
        found = [(s, m) for s, m in candidates if matches(m)]
        if found:
            return max(found, key=lambda sm: sm[1]["created_at"])
    return None


async def read_attachment(name: str, start_page: int = 1,
                          end_page: int | None = None) -> AttachmentToolResult:
    """Read pages start_page to end_page of an attached file; a long range is cut short.

    DOCX and text files have numbered sections instead of pages.

    Args:
        name: the file's name as listed (e.g. "report.pdf").
        start_page: the first page to read, from 1.
        end_page: the last page to read; omit to read on as far as the length cap allows.
    """
    scope = attachment_scope.get()
    if scope is None:
        return AttachmentToolResult(NO_CONTEXT, "no attachment context")
    found = _find(scope, name)
    if found is None:
        known = [m["name"] for s in scope.scopes for m in scope.attachments.list(s)]
        listing = ", ".join(known) if known else "none"
        return AttachmentToolResult(f"No attached file is called {name!r}. Attached files: {listing}.",
                                    "no such file")
    where, meta = found
    pages = await asyncio.to_thread(scope.attachments.pages, where, meta["id"])
    last = pages[-1]["page"]
    start = max(1, start_page)
    end = min(last, end_page if end_page is not None else last)
    if start > last or end < start:
        return AttachmentToolResult(f"{meta['name']} has pages 1 to {last}; {start_page}-{end_page} is "
                                    "outside that.", "pages out of range")
    parts, size, shown = [], 0, []
    for page in pages[start - 1:end]:
        block = f"--- {meta['name']} {page['label']} ---\n{page['text']}"
        if size + len(block) > READ_MAX_CHARS and parts:
            break
        parts.append(block[:READ_MAX_CHARS])
        size += len(block)
        shown.append(page["page"])
    text = "\n\n".join(parts)
    if shown[-1] < end:
        text += (f"\n\n[Stopped after page {shown[-1]} to stay within {READ_MAX_CHARS} characters; "
                 f"call read_attachment with start_page={shown[-1] + 1} to continue.]")
    span = f"{shown[0]}" if len(shown) == 1 else f"{shown[0]}-{shown[-1]}"
    return AttachmentToolResult(
        text, f"read {meta['name']} {'p.' if meta.get('pages') is not None else '§'} {span}",
        [{"attachment_id": meta["id"], "name": meta["name"], "page": p["page"], "label": cited_as(meta, p)}
         for p in pages[start - 1:start - 1 + len(shown)]],
        [{"attachment_id": meta["id"], "name": meta["name"], "page": p["page"], "text": p["text"],
          "source": where.source} for p in pages[start - 1:start - 1 + len(shown)]],
    )


def content_disposition(name: str) -> str:
    """`attachment` with an ASCII fallback and the RFC 5987 UTF-8 name."""
    from urllib.parse import quote

    display = sanitize_name(name)
    fallback = "".join(c if c.isascii() and (c.isalnum() or c in " ._-()[]+,@") else "_" for c in display)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(display, safe='')}"

