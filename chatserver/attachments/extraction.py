"""Reading untrusted files to text in a child process that cannot take the server down.

Promises:
- A file is recognised (magic bytes first, extension second) and read by a fresh child process,
  `python extraction.py`, never in the server: PDF (pypdfium2), Word (DOCX/DOCM/DOTX, Strict too),
  XLSX (openpyxl), PPTX (python-pptx), ODT, HTML, Markdown and UTF-8 text, by the modules of
  `readers/` (which import nothing from the server, so the child imports them as `readers`).
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
- The text handed back is bounded (`max_chars`), so what the server holds after a read is too, and
  comes in sections of a readable size (pages, or at most SECTION_CHARS each), with `warnings`
  naming what could not be read (a PDF's failed pages) when the rest was.

It knows files, kinds and text; not scopes, storage, people's data or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import sys
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path, PurePosixPath

import orjson

if __package__:
    from .readers.common import (  # noqa: F401  (the errors are this module's too)
        SECTION_CHARS,
        AttachmentError,
        Budget,
        Busy,
        TooLarge,
        Unreadable,
        Unsupported,
        near_memory_limit,
    )
else:  # the child, run as a script from this directory
    from readers.common import (
        SECTION_CHARS,
        AttachmentError,
        Budget,
        Busy,
        TooLarge,
        Unreadable,
        Unsupported,
        near_memory_limit,
    )

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
ACCEPTED = ("PDF, Word (.docx .docm .dotx), Excel (.xlsx), PowerPoint (.pptx), OpenDocument text (.odt), "
            "an image (PNG, JPEG, WebP, GIF) or a UTF-8 text file (.txt .md .html .csv .json, source code, ...)")
# Media types of the kinds that are not text-like (those take TEXT_TYPES by extension).
MEDIA_TYPES = {
    "pdf": "application/pdf",
    "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
    "pptx": "application/vnd.openxmlformats-officedocument.presentationml.presentation",
    "odt": "application/vnd.oasis.opendocument.text",
}
# Zip packages by the part that makes them what they are.
PACKAGES = (("word/document.xml", "docx"), ("xl/workbook.xml", "xlsx"), ("ppt/presentation.xml", "pptx"))
PACKAGE_EXTENSIONS = {".docx": "docx", ".docm": "docx", ".dotx": "docx", ".dotm": "docx", ".xlsx": "xlsx",
                      ".xlsm": "xlsx", ".pptx": "pptx", ".pptm": "pptx", ".odt": "odt"}
HTML_EXTENSIONS = {".html", ".htm", ".xhtml"}
MARKDOWN_EXTENSIONS = {".md", ".markdown"}

# The child's CPU limit is a backstop for a server that died mid-read: the wall-clock kill comes first.
CPU_GRACE_SECONDS = 2
CHILD = Path(__file__).resolve()


# -- in the child ------------------------------------------------------------------------------

def extension(name: str) -> str:
    # Pure string work: the name is never handed to the filesystem.
    return PurePosixPath(name.replace("\\", "/")).suffix.lower()


def _package_kind(path: Path) -> str | None:
    """"docx", "xlsx", "pptx" or "odt" by the zip's parts, or None."""
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            for part, kind in PACKAGES:
                if part in names:
                    return kind
            if "mimetype" in names and z.getinfo("mimetype").file_size < 100 \
                    and z.read("mimetype").strip() == b"application/vnd.oasis.opendocument.text":
                return "odt"
            if "[Content_Types].xml" in names and z.getinfo("[Content_Types].xml").file_size < 2**20:
                types = z.read("[Content_Types].xml")
                for marker, kind in ((b"wordprocessingml", "docx"), (b"ms-word", "docx"),
                                     (b"spreadsheetml", "xlsx"), (b"presentationml", "pptx")):
                    if marker in types:
                        return kind
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, KeyError):
        return None
    return None


def detect(path: Path, name: str) -> str:
    """The reader for a file: "pdf", "docx", "xlsx", "pptx", "odt", "html", "markdown", "text" or
    "image", from the content first and the extension second; Unsupported otherwise."""
    with open(path, "rb") as f:
        head = f.read(1024)
    ext = extension(name)
    if _reader("image").is_image(head):
        return "image"
    # Readers accept a PDF header after a little junk, but a script that merely mentions "%PDF-"
    # is not a PDF: only a .pdf gets that leeway, and a .pdf with no header at all is tried too
    # (poppler reads such files; the PDF reader puts the header back).
    if head.startswith(b"%PDF-") or (ext == ".pdf" and not head.startswith(BINARY_MAGIC)
                                     and not head.startswith((b"PK\x03\x04", b"PK\x05\x06"))):
        return "pdf"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        kind = _package_kind(path)
        if kind is not None:
            return kind
        if ext in PACKAGE_EXTENSIONS:  # its reader says what is wrong (truncated, a part missing)
            return PACKAGE_EXTENSIONS[ext]
        raise Unsupported(f"this is a zip archive, not a file type this server reads; send {ACCEPTED}")
    if ext in PACKAGE_EXTENSIONS and head.startswith(OLE_MAGIC):
        # Office keeps a password-protected file inside an OLE container, not a zip.
        raise Unreadable(f"the {ext[1:].upper()} is encrypted (password-protected), or an old binary Office "
                         "file renamed; remove the password (or save it in the new format) and upload it again")
    if ext in PACKAGE_EXTENSIONS:
        raise Unreadable(f"the {ext[1:].upper()} file is damaged: it is not a zip archive as every such file is")
    if head.startswith(BINARY_MAGIC):
        raise Unsupported(f"this kind of file is not supported; send {ACCEPTED}")
    bare = PurePosixPath(name.replace("\\", "/")).name.lower()
    if ext in HTML_EXTENSIONS:
        return "html"
    if ext in MARKDOWN_EXTENSIONS:
        return "markdown"
    if ext in TEXT_TYPES or (not ext and (bare in TEXT_NAMES or "." not in bare)):
        return "text"
    raise Unsupported(f"{ext or 'this'} files are not supported; send {ACCEPTED}")


def read_file(request: dict) -> dict:
    """What the child answers for one request: the kind, sections, page count, title and warnings,
    or the status and reason of a refusal."""
    path, name = Path(request["path"]), request["name"]
    budget = Budget(request["max_chars"])
    try:
        kind = detect(path, name)
        warnings: list[str] = []
        title = None
        if kind == "image":  # pixels, no text: cleaned into `image_out`, which the server stores
            if not request.get("image_out"):
                raise Unsupported("this is an image, not a file with text")
            image = _reader("image").clean(path, Path(request["image_out"]), request["max_image_pixels"])
            return {"kind": kind, "pages": [], "total": 0, "title": None, "warnings": [], "image": image}
        if kind == "pdf":
            pages, total, title, warnings = _reader("pdf").extract_pdf(path, request["max_pages"], budget)
        else:
            pages = _read_other(kind, path, budget)
            total = len(pages)
        if not any(p["text"].strip() for p in pages):
            raise Unreadable("the file has no text" if kind != "docx" else "the DOCX has no text")
        return {"kind": kind, "pages": pages, "total": total, "title": title, "warnings": warnings}
    except AttachmentError as exc:
        return {"status": exc.status, "error": str(exc).replace(str(path), "the file")}
    except MemoryError:
        return {"status": 422, "error": _too_big(request["max_mb"])}
    except Exception:
        if near_memory_limit():  # lxml reports a failed allocation as "unknown error", among others
            return {"status": 422, "error": _too_big(request["max_mb"])}
        raise


def _reader(name: str):  # -> ModuleType
    """A reader module, imported where this module was: the package in the server, `readers` in the child."""
    import importlib

    return importlib.import_module(f"{__package__}.readers.{name}" if __package__ else f"readers.{name}")


def _read_other(kind: str, path: Path, budget: Budget) -> list[dict]:
    if kind == "docx":
        return _reader("docx").extract_docx(path, budget)
    if kind in ("xlsx", "pptx", "odt"):
        return getattr(_reader("office"), f"extract_{kind}")(path, budget)
    text = _reader("text")
    if kind == "html":
        return text.extract_html(path, budget)
    if kind == "markdown":
        return text.extract_markdown(path, budget)
    return text.extract_text(path, budget, SECTION_CHARS)


def _too_big(max_mb: int) -> str:
    return (f"reading the file needed more than the {max_mb} MB this server allows one file "
            "(EXTRACT_MAX_MB); it is built to inflate far beyond its size, or it is simply too big")


def _limit_self(max_mb: int, cpu_seconds: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (max_mb * 2**20, max_mb * 2**20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a reader that aborts leaves no core file


def draw_thumbnail(request: dict) -> dict:
    """A stored image's thumbnail written to `out`: {"thumbnail": {...}}, or a refusal as `read_file` gives."""
    try:
        sizing = {k: request[k] for k in ("edge", "quality", "method") if request.get(k) is not None}
        return {"thumbnail": _reader("image").thumbnail(Path(request["path"]), Path(request["out"]),
                                                        request["max_image_pixels"], **sizing)}
    except AttachmentError as exc:
        return {"status": exc.status, "error": str(exc).replace(request["path"], "the file")}
    except MemoryError:
        return {"status": 422, "error": _too_big(request["max_mb"])}


def child_main() -> None:
    request = orjson.loads(sys.stdin.buffer.read())
    _limit_self(request["max_mb"], request["cpu_seconds"])
    try:
        answer = draw_thumbnail(request) if request.get("op") == "thumbnail" else read_file(request)
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
        self.started = 0  # children started, ever

    async def run(self, path: Path, name: str, *, max_pages: int, max_chars: int, image_out: Path | None = None,
                  max_image_pixels: int = 0) -> dict:
        """{"kind", "pages", "total", "title"} for the file at `path`; AttachmentError otherwise.
        An image answers "image" ({"format", "media_type", "width", "height"}) and has been written,
        cleaned, to `image_out`; without `image_out` an image is Unsupported.

        Call it inside `turn`, which decides when a child may start.
        """
        return await self._run({"path": str(path), "name": name, "max_pages": max_pages,
                                "max_chars": max_chars, "image_out": image_out and str(image_out),
                                "max_image_pixels": max_image_pixels, **self._limits()})

    async def thumbnail(self, path: Path, out: Path, max_image_pixels: int, *, edge: int | None = None,
                        quality: int | None = None, method: int | None = None) -> dict:
        """Draw the thumbnail of the stored image at `path` into `out` (WebP; `edge`, `quality` and
        the encoder's `method` default to the thumbnail's): {"media_type", "width", "height"};
        AttachmentError otherwise. Call it inside `turn`."""
        answer = await self._run({"op": "thumbnail", "path": str(path), "out": str(out), "edge": edge,
                                  "quality": quality, "method": method, "max_image_pixels": max_image_pixels,
                                  **self._limits()})
        return answer["thumbnail"]

    def _limits(self) -> dict:
        return {"max_mb": self.max_mb, "cpu_seconds": math.ceil(self.timeout) + CPU_GRACE_SECONDS}

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
        self.started += 1
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
