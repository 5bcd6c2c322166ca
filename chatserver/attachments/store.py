"""Attachments: files a person gives a conversation (or their library), read to text once, kept in
the stores, and searched by the model through two tools that take only what the model means.

Promises:
- A file is recognised by its content (magic bytes) and its extension, never by the type the
  client claims. PDF, Word, XLSX, PPTX, ODT, HTML, Markdown and UTF-8 text-like files are
  recognised and read by `extraction.py` (its `readers/`) in a child process under a memory and
  time limit, one per person at a time, so no file can exhaust the server or hold up other people's
  uploads. Text is kept per page (PDF) or per bounded section (headings, tables, slides, sheets'
  rows, lines of text files), each with its position, so an answer can cite "report.pdf p. 12";
  what could not be read of an accepted file is in its meta's `warnings`.
- Any failure raises an `AttachmentError` carrying its HTTP status and a sentence saying what was
  wrong; nothing is stored then. A stored attachment is its metadata and pages in a metadata
  store (`meta.py`: files under DATA_DIR/attachments/<scope>/<id>/, or Redis) and its original in
  a blob store (`blobs.py`: `original` beside them, or S3). The original is stored first and the
  metadata last, so a listed file always has its bytes and text; deleting goes the other way.
- Listings are read from the metadata store when asked (no cache another server could make
  stale); the passage index is this process's own, filled from the stored pages on a scope's first
  search, and shows only files the store still lists.
- File names are untrusted text: sanitised for display, never part of a path.
- Whose files the tools see comes from the `attachment_scope` ContextVar, which a turn sets with
  `attachment_context(...)` and which is reset in `finally` however the turn ends.

It knows scopes and ids, not conversations' contents, turns or wire formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import sqlite3
import tempfile
import threading
import time
import unicodedata
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from chatserver.attachments.blobs import (  # noqa: F401
    THUMBNAIL,
    Blob,
    BlobMissing,
    Blobs,
    BlobsUnavailable,
    FileBlobs,
)
from chatserver.attachments.extraction import (  # noqa: F401  (the errors are this module's too)
    ACCEPTED,
    MEDIA_TYPES,
    TEXT_TYPES,
    AttachmentError,
    Busy,
    Extractor,
    TooLarge,
    Unreadable,
    Unsupported,
    extension,
)
from chatserver.attachments.meta import AttachmentMeta, FileMeta
from chatserver.conversations import pii
from chatserver.conversations.document import new_id, now_iso, valid_id
from chatserver.sizes import admin_setting, size_words

log = logging.getLogger("chat.attachments")

# Measured on a generated 300-page PDF (400 words a page, equal text from both after whitespace
# normalisation): pypdfium2 1,885 pages/s, pypdf 622 pages/s. pypdf also returned NUL-padded
# text for a CJK CID font that pypdfium2 read correctly. Hence pypdfium2 (in extraction.py).
MEDIA_PDF = "application/pdf"
MEDIA_DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"

NAME_MAX = 255
PASSAGE_CHARS = 1000  # what one search hit shows
SEARCH_HITS = 5
INDEX_FILE = "passages.sqlite3"  # in SEARCH_INDEX_DIR
READ_MAX_CHARS = 20_000  # one read_attachment answer (~5k tokens)
# Owner names become one directory level under library/, so they are held to this.
_OWNER = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")

NO_CONTEXT = ("There are no attachments in this context: this tool only works inside a conversation "
              "turn, and sees the files attached to that conversation (and the library when enabled).")


class AttachmentNotFound(AttachmentError):
    status = 404


IMAGE = "image"  # the stored meta's `kind` of an image (issue 25)
# WebP quality of an image scaled down for a model: 85 keeps small text legible at 1568 px.
UPSTREAM_QUALITY = 85


def is_image(meta: dict) -> bool:
    return meta.get("kind") == IMAGE


@dataclass(frozen=True, slots=True)
class StoredImage:
    """One stored image as a turn or a tool sends it on: already clean (no metadata, upright)."""

    id: str
    name: str
    media_type: str  # image/png, image/jpeg, image/webp or image/gif
    width: int
    height: int
    data: bytes
    source: str  # "conversation" | "library"


@dataclass(frozen=True, slots=True)
class Scope:
    """One owner of attachments: a directory under DATA_DIR/attachments and where hits come from."""

    key: str
    source: str  # "conversation" | "library" | "project"


def conversation_scope(conversation_id: str) -> Scope:
    # "library" and "project" (7 characters) can never be a conversation id (8-64), so they never collide.
    if not valid_id(conversation_id):
        raise AttachmentNotFound("conversation not found")
    return Scope(conversation_id, "conversation")


def library_scope(owner: str) -> Scope:
    if not _OWNER.fullmatch(owner):
        raise ValueError(f"owner {owner!r} is not usable as a library name")
    return Scope(f"library/{owner}", "library")


def project_scope(project_id: str) -> Scope:
    """A project's files: whoever reaches them has passed the project's owner check (`conversations/projects.py`)."""
    if not valid_id(project_id):
        raise AttachmentNotFound("project not found")
    return Scope(f"project/{project_id}", "project")


def scope_of_key(key: str) -> Scope:
    """The scope a stored key names (`<conversation id>`, `library/<owner>` or `project/<id>`), checked as when made."""
    if key.startswith("project/"):
        return project_scope(key.removeprefix("project/"))
    owner = key.removeprefix("library/")
    return library_scope(owner) if owner != key else conversation_scope(key)


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
        # `source` says which route shows it (the conversation's files or the library).
        return {"attachment_id": self.attachment_id, "name": self.name, "page": self.page, "label": self.cited_as,
                "source": self.source}


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


def media_type(kind: str, name: str) -> str:
    return MEDIA_TYPES.get(kind) or TEXT_TYPES.get(extension(name), "text/plain")


def cited_as(meta: dict, section: dict) -> str:
    """Where a passage is, as a person reads it on a citation chip: "p. 3" (PDF), "lines 40-80"
    (text), "§ Budget" or "section 2" (DOCX, Markdown, HTML), "slide 7", 'Sheet "Q3" rows 1-40',
    "footnotes". The reader writes the label so; a DOCX stored before issue 24 kept its bare heading."""
    label = section["label"]
    if meta.get("media_type") == MEDIA_DOCX and "warnings" not in meta and label != f"section {section['page']}":
        return f"§ {label}"
    return label


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


PASSAGES_SCHEMA = """
CREATE TABLE IF NOT EXISTS indexed (scope TEXT NOT NULL, attachment_id TEXT NOT NULL,
    PRIMARY KEY (scope, attachment_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS passages (
    id INTEGER PRIMARY KEY, scope TEXT NOT NULL, attachment_id TEXT NOT NULL, name TEXT NOT NULL,
    page INTEGER NOT NULL, label TEXT NOT NULL, cited_as TEXT NOT NULL, text TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS passages_attachment ON passages (scope, attachment_id);
CREATE VIRTUAL TABLE IF NOT EXISTS fts USING fts5(tokens, tokenize="unicode61 remove_diacritics 0 tokenchars '_'");
"""
INDEX_BATCH = 2000  # passages written per transaction while a scope's older files are indexed


class SearchIndex:
    """BM25 over every scope's passages, on disk in one SQLite FTS5 file, so memory stays the same
    however large a library grows.

    The FTS5 table holds `tokenize`'s tokens joined by spaces (so Hangul/CJK bigrams and word
    tokens are what FTS5 sees), ranked by FTS5's bm25(). `indexed` names the attachments whose
    passages are in; files stored before this index existed are added on their scope's first search.
    Writes go through one connection under a lock; calls come from worker threads.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            _make_private(self.path)
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=5000")
            conn.executescript(PASSAGES_SCHEMA)
            self._conn = conn
        return self._conn

    def add(self, scope: Scope, meta: dict, pages: Iterable[dict]) -> None:
        """Index one attachment's passages, in batches of INDEX_BATCH rows per transaction."""
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM fts WHERE rowid IN (SELECT id FROM passages WHERE scope = ? "
                           "AND attachment_id = ?)", (scope.key, meta["id"]))
                db.execute("DELETE FROM passages WHERE scope = ? AND attachment_id = ?", (scope.key, meta["id"]))
                written = 0
                for page in pages:
                    for text in split_passages(page["text"]):
                        row = db.execute(
                            "INSERT INTO passages (scope, attachment_id, name, page, label, cited_as, text) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (scope.key, meta["id"], meta["name"], page["page"], page["label"],
                             cited_as(meta, page), text)).lastrowid
                        db.execute("INSERT INTO fts (rowid, tokens) VALUES (?, ?)", (row, " ".join(tokenize(text))))
                        written += 1
                        if written % INDEX_BATCH == 0:
                            db.execute("COMMIT")
                            db.execute("BEGIN IMMEDIATE")
                db.execute("INSERT OR IGNORE INTO indexed (scope, attachment_id) VALUES (?, ?)",
                           (scope.key, meta["id"]))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def remove(self, scope: Scope, attachment_id: str | None = None) -> None:
        """Drop one attachment's passages, or the whole scope's when `attachment_id` is None."""
        where, args = ("scope = ?", (scope.key,)) if attachment_id is None else \
            ("scope = ? AND attachment_id = ?", (scope.key, attachment_id))
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(f"DELETE FROM fts WHERE rowid IN (SELECT id FROM passages WHERE {where})", args)
                db.execute(f"DELETE FROM passages WHERE {where}", args)
                db.execute(f"DELETE FROM indexed WHERE {where}", args)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def missing(self, scope: Scope, ids: Iterable[str]) -> list[str]:
        with self._lock:
            have = {r[0] for r in self._db().execute(
                "SELECT attachment_id FROM indexed WHERE scope = ?", (scope.key,))}
        return [i for i in ids if i not in have]

    def search(self, scopes: dict[str, Scope], live: set[str], query: str,
               k: int = SEARCH_HITS) -> list[Passage]:
        """The best `k` passages of these scopes (keyed by scope key) from attachments in `live`."""
        tokens = list(dict.fromkeys(tokenize(query)))
        if not tokens or not scopes:
            return []
        match = " OR ".join('"' + t.replace('"', '""') + '"' for t in tokens)
        marks = ",".join("?" * len(scopes))
        with self._lock:
            rows = self._db().execute(
                "SELECT p.attachment_id, p.name, p.page, p.label, p.text, p.scope, p.cited_as "
                f"FROM fts JOIN passages p ON p.id = fts.rowid WHERE fts MATCH ? AND p.scope IN ({marks}) "
                "ORDER BY bm25(fts) LIMIT ?", (match, *scopes, 4 * k)).fetchall()
        # Rows of a file another process deleted may linger until its next write: skipped here.
        hits = [Passage(a, n, page, label, text, scopes[s].source, c)
                for a, n, page, label, text, s, c in rows if a in live]
        return hits[:k]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _make_private(path: Path) -> None:
    """The index holds the files' text: 0600 like the files (SQLite gives its -wal and -shm files the
    database's own mode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)


# -- the store ---------------------------------------------------------------------------------

def _masked_pages(pages: list[dict]) -> list[dict]:
    return [{**page, "text": pii.mask(page["text"])[0]} for page in pages]


def file_too_large(limit: int) -> TooLarge:
    """A file past MAX_ATTACHMENT_BYTES (`limit`), in the words the page shows."""
    return TooLarge(f"the file is larger than {size_words(limit)}, the most one file may be here "
                    f"({admin_setting('MAX_ATTACHMENT_BYTES')})")


@dataclass(frozen=True, slots=True)
class Limits:
    max_bytes: int = 20 * 1024 * 1024
    max_pages: int = 1000
    timeout: float = 30.0  # EXTRACT_TIMEOUT
    max_mb: int = 512  # EXTRACT_MAX_MB
    workers: int = 2  # EXTRACT_WORKERS
    queue: int = 8  # EXTRACT_QUEUE
    quota_bytes: int = 2**30  # QUOTA_FILE_BYTES, per person: conversations' files and library together
    mask_pii: bool = False  # PII_MASKING=on: the text kept (and read to the model) is masked
    max_image_pixels: int = 50_000_000  # MAX_IMAGE_PIXELS: a larger image is refused before it is decoded

    @property
    def max_chars(self) -> int:
        # A text file's characters are at most its bytes; PDF and DOCX text rarely outgrows the
        # file twice over. Past this the text the server would hold is refused.
        return 2 * self.max_bytes


# Called with an upload's size inside its person's turn; raises when the file does not fit.
RoomCheck = Callable[[int], Awaitable[None]]


class Attachments:
    """Attachments: metadata and pages in `meta`, originals in `blobs`, passages in this process's
    own search index under `index_dir`. Both stores default to files under `root`
    (DATA_DIR/attachments); the app picks others (Redis, S3) in one place. `root` also holds the
    uploads being received (`.incoming`), which never leave this process.
    """

    def __init__(self, root: Path, index_dir: Path, limits: Limits = Limits(), *,
                 meta: AttachmentMeta | None = None, blobs: Blobs | None = None) -> None:
        self.root = root
        self.limits = limits
        self.incoming = root / ".incoming"
        self.meta: AttachmentMeta = meta if meta is not None else FileMeta(root)
        self.blobs: Blobs = blobs if blobs is not None else FileBlobs(root)
        self.extractor = Extractor(limits.max_mb, limits.timeout, limits.workers, limits.queue)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="attachments")
        self.search_index = SearchIndex(index_dir / INDEX_FILE)
        self._indexing: dict[str, asyncio.Future] = {}
        from chatserver.attachments.viewer import CACHE_DIR, PageImages  # it builds on this module

        self.page_images = PageImages(index_dir / CACHE_DIR, self.extractor)

    async def start(self) -> None:
        """Make the blob store ready (S3: its bucket, created when missing)."""
        await self.blobs.start()

    def sweep(self, older_than: float = 3600.0) -> None:
        """Remove what a crash left behind: partial uploads and copies, staging and half-deleted
        directories, and attachment directories left with neither `meta.json` nor `original`. (An
        original whose metadata was never stored is left: only the metadata store could tell it
        from one whose metadata lives in Redis.)

        Only leftovers older than `older_than` seconds go, so an upload under way in another
        process sharing the directory is never touched.
        """
        cutoff = time.time() - older_than
        leftovers = [*self.incoming.glob("upload-*.part"), *self.root.glob("*/.staging-*"),
                     *self.root.glob(".deleting-*"), *self.root.glob("*/.deleting-*"),
                     *self.root.glob("*/*/.original-*.part")]
        for folder in ("library", "project"):  # two levels: library/<owner>, project/<id>
            leftovers += [*self.root.glob(f"{folder}/*/.staging-*"), *self.root.glob(f"{folder}/*/.deleting-*"),
                          *self.root.glob(f"{folder}/*/*/.original-*.part")]
        scopes = [d for d in self.root.glob("*") if valid_id(d.name)] + list(self.root.glob("library/*")) + \
            list(self.root.glob("project/*"))
        leftovers += [a for d in scopes if d.is_dir() for a in d.iterdir()
                      if valid_id(a.name) and a.is_dir() and not (a / "meta.json").exists()
                      and not (a / "original").exists()]
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

    async def ingest(self, scope: Scope, name: str, upload: Path, person: str,
                     fits: RoomCheck | None = None) -> dict:
        """Read `upload` (a temporary file this call consumes) and store it; AttachmentError otherwise.

        `person`'s uploads are read one at a time; `fits`, checked in that turn, refuses one that
        would pass the person's quota. An image is stored as the child cleaned it (no metadata,
        upright), never as it arrived.
        """
        display = sanitize_name(name)
        fd, cleaned = self.incoming_file()  # where the child writes an image's clean copy
        os.close(fd)
        try:
            size = upload.stat().st_size
            if size > self.limits.max_bytes:
                raise file_too_large(self.limits.max_bytes)
            if size == 0:
                raise Unreadable("the file is empty")
            async with self.extractor.turn(person):
                if fits is not None:
                    await fits(size)
                read = await self.extractor.run(upload, display, max_pages=self.limits.max_pages,
                                                max_chars=self.limits.max_chars, image_out=cleaned,
                                                max_image_pixels=self.limits.max_image_pixels)
                kind, pages, total = read["kind"], read["pages"], read["total"]
                if kind == "image":
                    meta = await self._image_meta(display, read["image"], size, cleaned, fits)
                    await self._commit(scope, meta, [], cleaned)
                    return public(meta)
                if self.limits.mask_pii:
                    pages = await asyncio.get_running_loop().run_in_executor(self._executor, _masked_pages, pages)
                meta = {
                    "id": new_id(), "name": display, "media_type": media_type(kind, display), "bytes": size,
                    "pages": total if kind == "pdf" else None, "chars": sum(len(p["text"]) for p in pages),
                    "created_at": now_iso(), "kind": kind, "sections": len(pages),
                    "warnings": read.get("warnings", []),
                }
                if kind == "pdf" and total > len(pages):
                    meta["pages_read"] = len(pages)
                await self._commit(scope, meta, pages, upload)
        finally:
            upload.unlink(missing_ok=True)
            cleaned.unlink(missing_ok=True)
        return public(meta)

    async def _image_meta(self, display: str, image: dict, size: int, cleaned: Path,
                          fits: RoomCheck | None) -> dict:
        stored = cleaned.stat().st_size
        if stored > size and fits is not None:
            await fits(stored)  # the clean copy is what counts against the quota
        return {
            "id": new_id(), "name": display, "media_type": image["media_type"], "bytes": stored,
            "pages": None, "chars": 0, "created_at": now_iso(), "kind": IMAGE, "sections": 0, "warnings": [],
            "width": image["width"], "height": image["height"], "format": image["format"],
        }

    async def _commit(self, scope: Scope, meta: dict, pages: list[dict], upload: Path) -> None:
        """The original first, then the metadata and pages, whose storing is the file appearing:
        a listing never names a file without its bytes. A failure takes the original back."""
        await self.blobs.put(scope.key, meta["id"], upload, consume=True)
        try:
            await self.meta.put(scope.key, meta, pages)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.blobs.delete(scope.key, meta["id"]))
            raise
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.search_index.add, scope, meta, pages)
        except sqlite3.Error as exc:  # the file is stored; its scope's next search indexes it
            log.error("could not index attachment %s/%s: %s", scope.key, meta["id"], exc)

    async def used_bytes(self, scopes: Iterable[Scope]) -> int:
        """The bytes of the files stored in these scopes."""
        listed = await self.meta.list_many(s.key for s in scopes)
        return sum(m.get("bytes", 0) for metas in listed.values() for m in metas)

    async def list(self, scope: Scope) -> list[dict]:
        """The scope's attachments (stored meta, oldest first), as the store holds them now."""
        return (await self.meta.list_many([scope.key]))[scope.key]

    async def list_many(self, scopes: Iterable[Scope]) -> dict[str, list[dict]]:
        """Each scope's attachments by scope key, in one read."""
        return await self.meta.list_many(s.key for s in scopes)

    async def get(self, scope: Scope, attachment_id: str) -> dict:
        for meta in await self.list(scope):
            if meta["id"] == attachment_id:
                return meta
        raise AttachmentNotFound("attachment not found")

    async def original(self, scope: Scope, attachment_id: str) -> tuple[dict, Blob]:
        """The attachment's meta and its original's bytes (to be read or closed); AttachmentNotFound otherwise."""
        meta = await self.get(scope, attachment_id)
        return meta, await self.blobs.open(scope.key, meta["id"])

    async def image(self, scope: Scope, attachment_id: str) -> StoredImage:
        """The image `attachment_id` of `scope`, its bytes read whole (at most MAX_ATTACHMENT_BYTES);
        AttachmentNotFound when the scope has no such image (a document's id included)."""
        meta = await self.get(scope, attachment_id)
        if not is_image(meta):
            raise AttachmentNotFound("image not found")
        blob = await self.blobs.open(scope.key, meta["id"])
        try:
            data = b"".join([chunk async for chunk in blob.chunks])
        finally:
            await blob.aclose()
        return StoredImage(meta["id"], meta["name"], meta["media_type"], meta["width"], meta["height"], data,
                           scope.source)

    async def thumbnail(self, scope: Scope, attachment_id: str, person: str) -> tuple[dict, Blob]:
        """The image's thumbnail (WebP, at most 320 pixels a side), drawn from the stored
        image in the limited child the first time it is asked for and kept in the blob store beside
        the original; AttachmentNotFound for a file that is not an image of `scope`."""
        meta = await self.get(scope, attachment_id)
        if not is_image(meta):
            raise AttachmentNotFound("this file is not an image")
        with contextlib.suppress(BlobMissing):
            return meta, await self.blobs.open(scope.key, meta["id"], THUMBNAIL)
        async with self.extractor.turn(person):
            with contextlib.suppress(BlobMissing):  # drawn while this request waited
                return meta, await self.blobs.open(scope.key, meta["id"], THUMBNAIL)
            await self._draw_thumbnail(scope, meta)
        return meta, await self.blobs.open(scope.key, meta["id"], THUMBNAIL)

    async def scaled(self, data: bytes, edge: int, person: str, quality: int = UPSTREAM_QUALITY) -> tuple[bytes, dict]:
        """An image's bytes (an image as `image` gives it) at most `edge` pixels on its longer side,
        drawn in the limited child like a thumbnail, in `person`'s turn: (WebP bytes, {"media_type",
        "width", "height"}). What a model is sent of an image larger than IMAGE_MAX_EDGE."""
        fd, source = self.incoming_file()
        out_fd, out_name = self.incoming_file()
        os.close(out_fd)
        out = Path(out_name)
        try:
            await asyncio.to_thread(write_closing, fd, data)
            async with self.extractor.turn(person):
                # The fastest WebP effort: a turn's first token waits for this image.
                info = await self.extractor.thumbnail(Path(source), out, self.limits.max_image_pixels,
                                                      edge=edge, quality=quality, method=0)
            return await asyncio.to_thread(out.read_bytes), info
        finally:
            Path(source).unlink(missing_ok=True)
            out.unlink(missing_ok=True)

    async def _draw_thumbnail(self, scope: Scope, meta: dict) -> None:
        _, blob = await self.original(scope, meta["id"])
        fd, name = self.incoming_file()
        os.close(fd)
        out, copy = Path(name), None
        try:
            if blob.path is not None:
                source = blob.path
            else:  # from S3: the child reads a file, so the original is spooled to one first
                fd, copy_name = self.incoming_file()
                copy = Path(copy_name)
                with os.fdopen(fd, "wb") as f:
                    async for chunk in blob.chunks:
                        await asyncio.to_thread(f.write, chunk)
                source = copy
            await blob.aclose()
            await self.extractor.thumbnail(source, out, self.limits.max_image_pixels)
            await self.blobs.put(scope.key, meta["id"], out, consume=True, part=THUMBNAIL)
        finally:
            await blob.aclose()
            out.unlink(missing_ok=True)
            if copy is not None:
                copy.unlink(missing_ok=True)
        try:
            await self.get(scope, meta["id"])
        except AttachmentNotFound:  # deleted while it was drawn: its thumbnail goes too
            await self.blobs.delete(scope.key, meta["id"])
            raise

    async def pages(self, scope: Scope, attachment_id: str) -> list[dict]:
        meta = await self.get(scope, attachment_id)
        pages = await self.meta.pages(scope.key, meta["id"])
        if pages is None:
            raise AttachmentNotFound("attachment not found")  # deleted meanwhile
        return pages

    async def delete(self, scope: Scope, attachment_id: str) -> None:
        if not valid_id(attachment_id) or not await self.meta.delete(scope.key, attachment_id):
            raise AttachmentNotFound("attachment not found")
        await asyncio.get_running_loop().run_in_executor(self._executor, self.search_index.remove, scope, attachment_id)
        await asyncio.to_thread(self.page_images.forget, scope.key, attachment_id)
        await self.blobs.delete(scope.key, attachment_id)

    async def delete_scope(self, scope: Scope) -> None:
        """Remove every attachment of a scope (a deleted conversation's files), originals included."""
        await self.meta.delete_scope(scope.key)
        await asyncio.get_running_loop().run_in_executor(self._executor, self.search_index.remove, scope)
        await asyncio.to_thread(self.page_images.forget, scope.key)
        await self.blobs.delete_scope(scope.key)

    async def check_ids(self, scope: Scope, ids: list[str]) -> list[str]:
        """`ids` when each names an attachment of `scope`; AttachmentNotFound otherwise."""
        have = {m["id"] for m in await self.list(scope)}
        if any(i not in have for i in ids):
            raise AttachmentNotFound("attachment not found")
        return list(ids)

    async def search(self, scopes: tuple[Scope, ...], query: str, k: int = SEARCH_HITS) -> list[Passage]:
        """The best passages of these scopes for `query`; files not yet in this server's index are
        added first (from the store's pages), and files gone from the store are never shown."""
        loop = asyncio.get_running_loop()
        listed = await self.list_many(scopes)
        live: set[str] = set()
        for scope in scopes:
            metas = listed[scope.key]
            live.update(m["id"] for m in metas)
            # One catch-up per scope at a time; later searches wait for it rather than repeat it.
            pending = self._indexing.get(scope.key)
            if pending is None:
                pending = asyncio.ensure_future(self._catch_up(scope, metas))
                self._indexing[scope.key] = pending
                pending.add_done_callback(lambda _, key=scope.key: self._indexing.pop(key, None))
            await asyncio.shield(pending)
        return await loop.run_in_executor(self._executor, self.search_index.search,
                                          {s.key: s for s in scopes}, live, query, k)

    async def _catch_up(self, scope: Scope, metas: list[dict]) -> None:
        """Index the scope's files stored before this index had them (another server's uploads
        included), one file at a time."""
        loop = asyncio.get_running_loop()
        missing = await loop.run_in_executor(self._executor, self.search_index.missing, scope,
                                             [m["id"] for m in metas])
        for attachment_id in missing:
            meta = next(m for m in metas if m["id"] == attachment_id)
            pages = await self.meta.pages(scope.key, attachment_id)
            if pages is None:
                continue  # deleted meanwhile
            await loop.run_in_executor(self._executor, self.search_index.add, scope, meta, pages)

    async def close(self) -> None:
        await self.blobs.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.search_index.close()


def write_closing(fd: int, data: bytes) -> None:
    """Write `data` to the open file `fd` (from `incoming_file`) and close it."""
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def public(meta: dict) -> dict:
    """The API's Attachment: the stored meta without bookkeeping fields."""
    out = {k: meta.get(k) for k in ("id", "name", "media_type", "bytes", "pages", "chars", "created_at")}
    if "pages_read" in meta:
        out["pages_read"] = meta["pages_read"]
    out["warnings"] = meta.get("warnings", [])
    out["kind"] = IMAGE if is_image(meta) else "document"
    if is_image(meta):
        out["width"], out["height"] = meta["width"], meta["height"]
    return out


# -- the turn's context and the tools ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AttachmentScope:
    """Whose files the attachment tools see during one turn."""

    attachments: Attachments
    scopes: tuple[Scope, ...]


attachment_scope: ContextVar[AttachmentScope | None] = ContextVar("attachment_scope", default=None)


@contextlib.contextmanager
def attachment_context(attachments: Attachments, conversation_id: str, owner: str,
                       library: bool = False, project_id: str | None = None) -> Iterator[AttachmentScope]:
    """Let the attachment tools see this conversation's files (its project's, and the owner's library
    when asked) inside the block. `project_id` must be one the owner's store answered for this conversation."""
    scopes = [conversation_scope(conversation_id)]
    if project_id:
        scopes.append(project_scope(project_id))
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
    if is_image(meta):
        return image_words(meta)
    if meta.get("pages") is not None:
        read = meta.get("pages_read")
        return f"{meta['pages']} pages" + (f", first {read} read" if read else "")
    count = meta.get("sections", 1)
    return f"{count} section{'s' if count != 1 else ''}"


def image_words(meta: dict) -> str:
    """How a prompt or a tool names an image: "image, 1024 × 768 JPEG"."""
    return f"image, {meta['width']} × {meta['height']} {meta.get('format') or meta['media_type']}"


def _no_text(meta: dict) -> str:
    return f"{meta['name']} is an image ({image_words(meta).removeprefix('image, ')}): it has no text to read."


async def turn_image(image_id: str) -> StoredImage:
    """The image `image_id` among the files the running turn can see (`attachment_scope`: this
    conversation's, and the library's when the conversation enables it), bytes included.

    AttachmentNotFound ("image not found") for anything else: an id of another conversation or
    person, a document's id, a deleted file, or no turn running. The one owner check for images a
    tool is asked about: the scope comes from the turn, never from the model.
    """
    scope = attachment_scope.get()
    if scope is None or not valid_id(image_id):
        raise AttachmentNotFound("image not found")
    listed = await scope.attachments.list_many(scope.scopes)
    for s in scope.scopes:
        if any(m["id"] == image_id and is_image(m) for m in listed[s.key]):
            return await scope.attachments.image(s, image_id)
    raise AttachmentNotFound("image not found")


async def message_image_metas(attachments: Attachments, conversation_id: str,
                              attachment_ids: Iterable[str]) -> list[dict]:
    """The stored meta of the images among a user message's `attachment_ids`, in the message's
    order; documents and files deleted since are left out. No bytes are read."""
    scope = conversation_scope(conversation_id)
    by_id = {m["id"]: m for m in await attachments.list(scope)}
    return [by_id[i] for i in attachment_ids if i in by_id and is_image(by_id[i])]


async def message_images(attachments: Attachments, conversation_id: str,
                         attachment_ids: Iterable[str]) -> list[StoredImage]:
    """The images a user message was sent with (its `attachment_ids`), bytes included, in order;
    one deleted meanwhile is left out."""
    scope = conversation_scope(conversation_id)
    out = []
    for meta in await message_image_metas(attachments, conversation_id, attachment_ids):
        with contextlib.suppress(AttachmentNotFound, BlobMissing):
            out.append(await attachments.image(scope, meta["id"]))
    return out


def _listed_as(meta: dict) -> str:
    """A file's line in the listing; an image's carries its id, which analyze_image takes."""
    return f"{_pages_word(meta)}, id {meta['id']}" if is_image(meta) else _pages_word(meta)


async def attachment_listing(scope: AttachmentScope | None, listed: dict[str, list[dict]] | None = None) -> str:
    """The prompt block naming the files the tools can see (never their text); "" when there are none.
    `listed`: the scopes' attachments as the caller already read them (`list_many`)."""
    if scope is None:
        return ""
    blocks = []
    if listed is None:
        listed = await scope.attachments.list_many(scope.scopes)
    for s in scope.scopes:
        metas = listed[s.key]
        if not metas:
            continue
        title = {"conversation": "Files attached to this conversation:",
                 "project": "Files of the project this conversation belongs to:"}.get(
                     s.source, "Files in the person's library:")
        blocks.append("\n".join([title, *(f"- {m['name']} ({_listed_as(m)})" for m in metas)]))
    if not blocks:
        return ""
    return ("\n".join(blocks) + "\nTheir text is not shown here: use search_attachments to find passages "
            "and read_attachment to read pages, and cite them as (name p. N).")


def _where(passage: Passage) -> str:
    return f"{passage.name} {passage.label}" if passage.label.startswith("p. ") else \
        f"{passage.name} §{passage.page} ({passage.label.removeprefix('§ ')})"


async def search_attachments(query: str) -> AttachmentToolResult:
    """Search the attached files for passages about `query`: the best ones, with file name and page.

    Sees the files of this conversation and of its project, and the person's library when the
    conversation enables it.

    Args:
        query: what to look for, in words likely to appear in the file (any language).
    """
    scope = attachment_scope.get()
    if scope is None:
        return AttachmentToolResult(NO_CONTEXT, "no attachment context")
    listed = await scope.attachments.list_many(scope.scopes)
    if not any(listed.values()):
        return AttachmentToolResult("No files are attached to this conversation.", "no files")
    hits = await scope.attachments.search(scope.scopes, query)
    if not hits:
        images = [m["name"] for metas in listed.values() for m in metas if is_image(m)]
        note = (f" {', '.join(images)} {'is an image' if len(images) == 1 else 'are images'}, which "
                "search cannot read.") if images else ""
        return AttachmentToolResult(f"No passage in the attached files matches {query!r}.{note}", "no match")
    blocks = [f"[{n}] {_where(p)} ({p.source})\n{p.text}" for n, p in enumerate(hits, start=1)]
    citations = []
    for p in hits:
        if p.citation() not in citations:
            citations.append(p.citation())
    # The words searched for, so the viewer can highlight them in the passage (added after the
    # dedupe: one search cites a page once).
    citations = [{**c, "query": query} for c in citations]
    names = sorted({p.name for p in hits})
    return AttachmentToolResult(
        "\n\n".join(blocks),
        f"{len(hits)} passage{'s' if len(hits) != 1 else ''} from {', '.join(names)}",
        citations,
        [{"attachment_id": p.attachment_id, "name": p.name, "page": p.page, "text": p.text,
          "source": p.source} for p in hits],
    )


def _find(candidates: list[tuple[Scope, dict]], name: str) -> tuple[Scope, dict] | None:
    """The attachment called `name` (exactly, else ignoring case, else by id); the newest wins."""
    for matches in (
        lambda m: m["name"] == name,
        lambda m: m["name"].casefold() == name.strip().casefold(),
        lambda m: m["id"] == name,
    ):
        found = [(s, m) for s, m in candidates if matches(m)]
        if found:
            return max(found, key=lambda sm: sm[1]["created_at"])
    return None


# Kept free in every read_attachment answer for the line saying where the rest is, so it is never cut.
READ_POINTER_ROOM = 400


def _cut_at(text: str, limit: int) -> int:
    """Where to cut `text` to at most `limit` characters: a paragraph, line or word end when one is near."""
    if len(text) <= limit:
        return len(text)
    at = max(text.rfind("\n", 0, limit), text.rfind(" ", 0, limit))
    return at if at > limit // 2 else max(limit, 1)


async def read_attachment(name: str, start_page: int = 1, end_page: int | None = None,
                          offset: int = 0) -> AttachmentToolResult:
    """Read pages start_page to end_page of an attached file; a long range is cut short.

    DOCX and text files have numbered sections instead of pages. An answer that had to stop says
    where the rest is (start_page, and offset when it stopped inside a page); that line is never cut.

    Args:
        name: the file's name as listed (e.g. "report.pdf").
        start_page: the first page to read, from 1.
        end_page: the last page to read; omit to read on as far as the length cap allows.
        offset: characters of start_page already read, as the continue line gives it; 0 otherwise.
    """
    scope = attachment_scope.get()
    if scope is None:
        return AttachmentToolResult(NO_CONTEXT, "no attachment context")
    listed = await scope.attachments.list_many(scope.scopes)
    candidates = [(s, m) for s in scope.scopes for m in listed[s.key]]
    found = _find(candidates, name)
    if found is None:
        known = [m["name"] for _, m in candidates]
        listing = ", ".join(known) if known else "none"
        return AttachmentToolResult(f"No attached file is called {name!r}. Attached files: {listing}.",
                                    "no such file")
    where, meta = found
    if is_image(meta):
        return AttachmentToolResult(_no_text(meta), f"{meta['name']} is an image")
    try:
        pages = await scope.attachments.pages(where, meta["id"])
    except AttachmentNotFound:
        return AttachmentToolResult(f"{meta['name']} was just deleted.", "no such file")
    last = pages[-1]["page"]
    start = max(1, start_page)
    end = min(last, end_page if end_page is not None else last)
    if start > last or end < start:
        return AttachmentToolResult(f"{meta['name']} has pages 1 to {last}; {start_page}-{end_page} is "
                                    "outside that.", "pages out of range")
    offset = max(0, min(offset, len(pages[start - 1]["text"]))) if offset else 0
    room = READ_MAX_CHARS - READ_POINTER_ROOM
    parts: list[str] = []
    shown: list[tuple[dict, str]] = []  # each page read and the text of it shown
    size, stop = 0, None  # stop: (page, offset) where the rest begins
    for page in pages[start - 1:end]:
        skip = offset if page["page"] == start else 0
        head = f"--- {meta['name']} {page['label']}" + (f" (from character {skip})" if skip else "") + " ---\n"
        body = page["text"][skip:]
        if size + len(head) + len(body) > room:
            if parts:
                stop = (page["page"], 0)
                break
            take = _cut_at(body, max(room - len(head), 1))
            parts.append(head + body[:take])
            shown.append((page, body[:take]))
            stop = (page["page"], skip + take) if take < len(body) else None
            if stop is None and page["page"] < end:
                stop = (page["page"] + 1, 0)
            break
        parts.append(head + body)
        shown.append((page, body))
        size += len(head) + len(body) + 2
    text = "\n\n".join(parts)
    if stop is not None:
        page_no, at = stop
        if at:
            label = pages[page_no - 1]["label"][:120]  # the line fits READ_POINTER_ROOM whatever the label
            text += (f"\n\n[Stopped at character {at:,} of {len(pages[page_no - 1]['text']):,} in {label} "
                     f"(page {page_no}) to stay within {READ_MAX_CHARS} characters; call read_attachment with "
                     f"start_page={page_no}, offset={at} to continue.]")
        else:
            text += (f"\n\n[Stopped after page {page_no - 1} to stay within {READ_MAX_CHARS} characters; "
                     f"call read_attachment with start_page={page_no} to continue.]")
    numbers = [p["page"] for p, _ in shown]
    span = f"{numbers[0]}" if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}"
    return AttachmentToolResult(
        text, f"read {meta['name']} {'p.' if meta.get('pages') is not None else '§'} {span}",
        [{"attachment_id": meta["id"], "name": meta["name"], "page": p["page"], "label": cited_as(meta, p),
          "source": where.source} for p, _ in shown],
        [{"attachment_id": meta["id"], "name": meta["name"], "page": p["page"], "text": part,
          "source": where.source} for p, part in shown],
    )


def content_disposition(name: str) -> str:
    """`attachment` with an ASCII fallback and the RFC 5987 UTF-8 name."""
    from urllib.parse import quote

    display = sanitize_name(name)
    fallback = "".join(c if c.isascii() and (c.isalnum() or c in " ._-()[]+,@") else "_" for c in display)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(display, safe='')}"

