"""Reading untrusted files to text in a child process that cannot take the server down.

Promises:
- A file is recognised (magic bytes first, extension second) and read (PDF by pypdfium2, DOCX by
  python-docx, UTF-8 text) by a fresh child process, `python extraction.py`, never in the server.
  The child caps its own address space at EXTRACT_MAX_MB (RLIMIT_AS) and its CPU time near
  EXTRACT_TIMEOUT (RLIMIT_CPU) before it imports a reader, and the server kills it once
  EXTRACT_TIMEOUT seconds of wall time pass. Whatever a file does to a reader (a page inflating
  to gigabytes, millions of empty paragraphs, a parse that never ends), it ends with the child,
  and the child's memory goes with it.
- Every failure is an `AttachmentError` whose sentence says what was wrong and never names a path
  on the server: the child's own refusals (415, 422), memory exhausted, a crash, too slow (422).
- `Extractor.turn` admits at most EXTRACT_WORKERS reads at once and one per person at a time;
  when EXTRACT_QUEUE reads are already waiting, another is refused at once with `Busy` (429).
  `Extractor.run`, inside a turn, starts the child.
- The text handed back is bounded (`max_chars`), so what the server holds after a read is too.

It knows files, kinds and text; not scopes, storage, people's data or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import signal
import sys
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path, PurePosixPath

import orjson

log = logging.getLogger("chat.extraction")

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

SECTION_CHARS = 4000  # a DOCX section or a text-file chunk
# A DOCX is a zip: refuse one that would inflate past this before python-docx parses it.
DOCX_MAX_INFLATED = 256 * 1024 * 1024
# The child's CPU limit is a backstop for a server that died mid-read: the wall-clock kill comes first.
CPU_GRACE_SECONDS = 2
CHILD = Path(__file__).resolve()


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


# -- in the child ------------------------------------------------------------------------------

def extension(name: str) -> str:
    # Pure string work: the name is never handed to the filesystem.
    return PurePosixPath(name.replace("\\", "/")).suffix.lower()


def detect(path: Path, name: str) -> str:
    """"pdf", "docx" or "text", from the content first and the extension second; Unsupported otherwise."""
    with open(path, "rb") as f:
        head = f.read(1024)
    ext = extension(name)
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


# Control characters but tab and newline, and lone surrogates.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _clean(text: str) -> str:
    return _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def _lines_label(first: int, last: int) -> str:
    return f"line {first}" if first == last else f"lines {first}-{last}"


def _section(page: int, label: str, text: str) -> dict:
    return {"page": page, "label": label, "text": text}


class _Text:
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


def extract_pdf(path: Path, max_pages: int, budget: _Text) -> tuple[list[dict], int, str | None]:
    """Pages of text (at most max_pages), the document's page count and its title."""
    import pypdfium2 as pdfium

    try:
        doc = pdfium.PdfDocument(str(path))
    except pdfium.PdfiumError as exc:
        if getattr(exc, "err_code", None) == pdfium.raw.FPDF_ERR_PASSWORD:
            raise Unreadable("the PDF is encrypted (password-protected); remove the password and "
                             "upload it again") from None
        raise Unreadable(f"the PDF is damaged and could not be opened ({exc})") from None
    pages: list[dict] = []
    try:
        total = len(doc)
        title = (doc.get_metadata_dict().get("Title") or "").strip() or None
        for index in range(min(total, max_pages)):
            page = doc[index]
            textpage = page.get_textpage()
            try:
                text = budget.add(_clean(textpage.get_text_bounded()))
                pages.append(_section(index + 1, f"p. {index + 1}", text))
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
    return pages, total, title


def extract_docx(path: Path, budget: _Text) -> list[dict]:
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
    except ValueError as exc:
        # python-docx names the file (a server path) and the package's content type.
        if "is not a Word file" in str(exc):
            kind = str(exc).rpartition("content type is ")[2].strip("'\" ")
            raise Unsupported(f"this is not a Word document but {kind or 'another Office file'} "
                              "(a macro-enabled .docm or a template?); save it as .docx and upload "
                              "it again") from None
        raise Unreadable(f"the DOCX is damaged ({type(exc).__name__})") from None
    except MemoryError:
        raise
    except Exception as exc:  # python-docx and lxml raise many kinds on a malformed package
        if _near_memory_limit():  # lxml reports a failed allocation as "unknown error"
            raise MemoryError from None
        raise Unreadable(f"the DOCX is damaged ({type(exc).__name__}: {exc})") from None
    sections: list[dict] = []
    heading, lines, size = "", [], 0

    def close() -> None:
        nonlocal lines, size
        text = "\n".join(lines).strip()
        if text:
            number = len(sections) + 1
            sections.append(_section(number, heading or f"section {number}", budget.add(text)))
        lines, size = [], 0

    for block in document.iter_inner_content():
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


def extract_text(path: Path, budget: _Text) -> list[dict]:
    """Chunks of at most SECTION_CHARS, cut at line ends, labelled with their line numbers."""
    data = path.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        encoding = "utf-16"
    else:
        encoding = "utf-8-sig"
    try:
        text = budget.add(data.decode(encoding))
    except UnicodeDecodeError as exc:
        raise Unreadable(f"the file is not UTF-8 text (invalid byte at offset {exc.start}); save it as "
                         "UTF-8 and upload it again") from None
    if "\x00" in text:
        raise Unreadable("the file is binary, not text (it contains NUL bytes)")
    sections: list[dict] = []
    chunk, size, first = [], 0, 1
    for number, line in enumerate(_clean(text).split("\n"), start=1):
        if size + len(line) > SECTION_CHARS and chunk:
            sections.append(_section(len(sections) + 1, _lines_label(first, number - 1), "\n".join(chunk)))
            chunk, size, first = [], 0, number
        chunk.append(line[: SECTION_CHARS * 4])  # one enormous line (minified code) stays bounded
        size += len(line) + 1
    if chunk:
        sections.append(_section(len(sections) + 1, _lines_label(first, number), "\n".join(chunk)))
    if not any(s["text"].strip() for s in sections):
        raise Unreadable("the file is empty")
    return sections


def read_file(request: dict) -> dict:
    """What the child answers for one request: the kind and text, or the status and reason of a refusal."""
    path, name = Path(request["path"]), request["name"]
    budget = _Text(request["max_chars"])
    try:
        kind = detect(path, name)
        if kind == "pdf":
            pages, total, title = extract_pdf(path, request["max_pages"], budget)
            return {"kind": kind, "pages": pages, "total": total, "title": title}
        pages = extract_docx(path, budget) if kind == "docx" else extract_text(path, budget)
        return {"kind": kind, "pages": pages, "total": len(pages), "title": None}
    except AttachmentError as exc:
        return {"status": exc.status, "error": str(exc).replace(str(path), "the file")}
    except MemoryError:
        return {"status": 422, "error": _too_big(request["max_mb"])}


def _too_big(max_mb: int) -> str:
    return (f"reading the file needed more than the {max_mb} MB this server allows one file "
            "(EXTRACT_MAX_MB); it is built to inflate far beyond its size, or it is simply too big")


_memory_limit_kb = 0


def _near_memory_limit() -> bool:
    """Whether this child's peak resident memory came within a quarter of its limit."""
    import resource

    return bool(_memory_limit_kb) and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > _memory_limit_kb * 3 // 4


def _limit_self(max_mb: int, cpu_seconds: int) -> None:
    import resource

    global _memory_limit_kb
    _memory_limit_kb = max_mb * 1024
    resource.setrlimit(resource.RLIMIT_AS, (max_mb * 2**20, max_mb * 2**20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a reader that aborts leaves no core file


def child_main() -> None:
    request = orjson.loads(sys.stdin.buffer.read())
    _limit_self(request["max_mb"], request["cpu_seconds"])
    try:
        answer = read_file(request)
    except Exception as exc:  # a reader's own bug: say what kind, log the rest through stderr
        import traceback

        traceback.print_exc()
        answer = {"status": 422, "error": f"the file could not be read ({type(exc).__name__})"}
    sys.stdout.buffer.write(orjson.dumps(answer))


# -- in the server -----------------------------------------------------------------------------

class Extractor:
    """Children that read files, at most `workers` at once and one per person, `queue` waiting."""

    def __init__(self, max_mb: int = 512, timeout: float = 30.0, workers: int = 2, queue: int = 8) -> None:
        self.max_mb = max_mb
        self.timeout = timeout
        self.queue = queue
        self._slots = asyncio.Semaphore(workers)
        self._people: dict[str, asyncio.Lock] = {}
        self._entered: dict[str, int] = {}  # per person: reads running or waiting
        self.waiting = 0
        self.running = 0

    async def run(self, path: Path, name: str, *, max_pages: int, max_chars: int) -> dict:
        """{"kind", "pages", "total", "title"} for the file at `path`; AttachmentError otherwise.

        Call it inside `turn`, which decides when a child may start.
        """
        return await self._run({"path": str(path), "name": name, "max_pages": max_pages,
                                "max_chars": max_chars, "max_mb": self.max_mb,
                                "cpu_seconds": math.ceil(self.timeout) + CPU_GRACE_SECONDS})

    @asynccontextmanager
    async def turn(self, person: str) -> AsyncIterator[None]:
        """Wait for `person`'s earlier reads and for a free worker; Busy when the queue is full."""
        lock = self._people.get(person)
        if ((lock is not None and lock.locked()) or self._slots.locked()) and self.waiting >= self.queue:
            raise Busy(f"{self.waiting} files are already waiting to be read; try again in a moment")
        lock = self._people.setdefault(person, asyncio.Lock())
        self._entered[person] = self._entered.get(person, 0) + 1
        self.waiting += 1
        started = False
        try:
            async with lock:  # one read per person: a second waits behind the first
                async with self._slots:
                    self.waiting -= 1
                    started = True
                    self.running += 1
                    try:
                        yield
                    finally:
                        self.running -= 1
        finally:
            if not started:
                self.waiting -= 1
            self._entered[person] -= 1
            if not self._entered[person]:
                del self._entered[person], self._people[person]

    async def _run(self, request: dict) -> dict:
        # -E -s: no PYTHON* variables and no user site; the child gets no environment, so none of
        # the server's secrets either.
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-E", "-s", str(CHILD), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={}, cwd=CHILD.parent)
        try:
            out, err = await asyncio.wait_for(process.communicate(orjson.dumps(request)), self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise Unreadable(f"reading the file took longer than {self.timeout:g} s (EXTRACT_TIMEOUT); "
                             "it was not stored") from None
        finally:
            if process.returncode is None:
                process.kill()
                await asyncio.shield(process.wait())
        if err:
            log.warning("the file reader said: %s", err[-2000:].decode("utf-8", "replace").strip())
        if process.returncode != 0 or not out:
            raise Unreadable(self._death(process.returncode))
        answer = orjson.loads(out)
        if "error" in answer:
            error = {413: TooLarge, 415: Unsupported}.get(answer["status"], Unreadable)
            raise error(answer["error"])
        return answer

    def _death(self, returncode: int) -> str:
        if returncode == -signal.SIGXCPU or returncode == -signal.SIGKILL:
            return (f"reading the file took longer than {self.timeout:g} s (EXTRACT_TIMEOUT); "
                    "it was not stored")
        # A native reader (pdfium) aborts when an allocation fails under the memory limit.
        return _too_big(self.max_mb) + "; it was not stored"


if __name__ == "__main__":
    child_main()
