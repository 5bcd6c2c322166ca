"""What a person sees behind a citation chip: the passages the model was given and, for a PDF,
the page itself as an image.

Promises:
- `passages` are the stored page texts cut exactly as the search index cuts them
  (`split_passages`), labelled as citations label them (`cited_as`): the same text
  `search_attachments` and `read_attachment` hand the model (PII-masked when it was). `marks`
  finds the words of a query in a passage the way the search matches them (`tokenize`: words,
  Hangul/CJK bigrams), as code-point offsets into the passage's own text.
- A page image is drawn by `pagerender.py` in a child process under the extraction limits
  (EXTRACT_MAX_MB, EXTRACT_TIMEOUT) and admitted through the same `Extractor.turn` (one per person,
  EXTRACT_WORKERS at once, EXTRACT_QUEUE waiting), never in the server. It is cached on this
  server's local disk, `<index dir>/page-images/<scope key>/<attachment id>/<page>-w<width>.png`
  (ids only, mode 0600): like the passage index it is derived from what the stores hold, cheap to
  draw again and never shared, so it lives beside the index rather than in the blob store. Every
  request passes the owner check and the metadata lookup before the cache is read, so a deleted
  file's image is never served; this server removes a file's images when it deletes the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import sys
import tempfile
import unicodedata
from pathlib import Path

import orjson

from chatserver.attachments.extraction import Extractor, Unreadable
from chatserver.attachments.store import (
    _TOKEN,
    MEDIA_PDF,
    AttachmentNotFound,
    Attachments,
    Scope,
    cited_as,
    split_passages,
    tokenize,
)

log = logging.getLogger("chat.attachments")

CHILD = Path(__file__).resolve().with_name("pagerender.py")
PAGE_WIDTH = 1000  # pixels across at most
PAGE_PIXELS = 2_000_000  # pixels in all at most (an A4 page at 1000 px is 1.4 million)
CACHE_DIR = "page-images"
CPU_GRACE_SECONDS = 2


# -- passages ----------------------------------------------------------------------------------

def passages(meta: dict, pages: list[dict], label: str | None = None, page: int | None = None) -> list[dict]:
    """The file's passages as the model was given them, those with `label` (as cited) and/or `page`."""
    out = []
    for section in pages:
        where = cited_as(meta, section)
        if (label is not None and where != label) or (page is not None and section["page"] != page):
            continue
        for part, text in enumerate(split_passages(section["text"]), start=1):
            out.append({"page": section["page"], "label": where, "part": part, "text": text})
    return out


def marks(text: str, query: str) -> list[list[int]]:
    """[start, end) code-point ranges of `text` holding the query's search tokens, merged and in order."""
    wanted = set(tokenize(query))
    if not wanted:
        return []
    spans: list[list[int]] = []
    for match in _TOKEN.finditer(text):  # the runs `tokenize` walks, on the text as stored
        run = match.group(1)
        if run is None:
            if unicodedata.normalize("NFKC", match.group(0)).lower() in wanted:
                spans.append([match.start(), match.end()])
            continue
        folded = [unicodedata.normalize("NFKC", c).lower() for c in run]
        if len(run) == 1:
            if folded[0] in wanted:
                spans.append([match.start(), match.end()])
            continue
        for i in range(len(run) - 1):
            if folded[i] + folded[i + 1] in wanted:
                spans.append([match.start() + i, match.start() + i + 2])
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


# -- page images -------------------------------------------------------------------------------

class PageImages:
    """PDF pages drawn to PNG in a limited child, cached on this server's disk by ids."""

    def __init__(self, root: Path, extractor: Extractor) -> None:
        self.root = root
        self.extractor = extractor
        self.renders = 0  # children started: a cached page starts none

    def path(self, scope_key: str, attachment_id: str, page: int) -> Path:
        # Scope keys and ids were checked where they were made; nothing here comes from a name.
        return self.root / scope_key / attachment_id / f"{page}-w{PAGE_WIDTH}.png"

    def cached(self, scope_key: str, attachment_id: str, page: int) -> Path | None:
        path = self.path(scope_key, attachment_id, page)
        return path if path.is_file() else None

    def forget(self, scope_key: str, attachment_id: str | None = None) -> None:
        """Remove one file's images, or a whole scope's."""
        target = self.root / scope_key if attachment_id is None else self.root / scope_key / attachment_id
        shutil.rmtree(target, ignore_errors=True)

    async def image(self, attachments: Attachments, scope: Scope, meta: dict, page: int, person: str) -> Path:
        """The cached PNG of `page` of the PDF `meta`, drawn first when missing; AttachmentError otherwise."""
        if meta.get("media_type") != MEDIA_PDF or meta.get("pages") is None:
            raise AttachmentNotFound("this file has no pages to show")
        if not 1 <= page <= meta["pages"]:
            raise AttachmentNotFound("no such page")
        hit = self.cached(scope.key, meta["id"], page)
        if hit is not None:
            return hit
        async with self.extractor.turn(person):
            hit = self.cached(scope.key, meta["id"], page)  # drawn while this request waited
            if hit is not None:
                return hit
            return await self._draw(attachments, scope, meta, page)

    async def _draw(self, attachments: Attachments, scope: Scope, meta: dict, page: int) -> Path:
        _, blob = await attachments.original(scope, meta["id"])
        copy: Path | None = None
        try:
            if blob.path is not None:
                await blob.aclose()
                source = blob.path
            else:  # from S3: the child reads a file, so the original is spooled to one first
                fd, name = tempfile.mkstemp(dir=_incoming(attachments), prefix="render-", suffix=".part")
                copy = Path(name)
                with os.fdopen(fd, "wb") as f:
                    async for chunk in blob.chunks:
                        await asyncio.to_thread(f.write, chunk)
                source = copy
            data = await self._run(source, page)
        finally:
            await blob.aclose()
            if copy is not None:
                copy.unlink(missing_ok=True)
        return await asyncio.to_thread(self._store, scope.key, meta["id"], page, data)

    def _store(self, scope_key: str, attachment_id: str, page: int, data: bytes) -> Path:
        path = self.path(scope_key, attachment_id, page)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=".page-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(name, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name)
            raise
        return path

    async def _run(self, source: Path, page: int) -> bytes:
        request = {"path": str(source), "page": page, "max_width": PAGE_WIDTH, "max_pixels": PAGE_PIXELS,
                   "max_mb": self.extractor.max_mb,
                   "cpu_seconds": math.ceil(self.extractor.timeout) + CPU_GRACE_SECONDS}
        self.renders += 1
        # As for extraction: no PYTHON* variables, no user site, no environment (no secrets).
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-E", "-s", str(CHILD), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={}, cwd=CHILD.parent)
        try:
            out, err = await asyncio.wait_for(process.communicate(orjson.dumps(request)), self.extractor.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise Unreadable(f"drawing the page took longer than {self.extractor.timeout:g} s "
                             "(EXTRACT_TIMEOUT)") from None
        finally:
            if process.returncode is None:
                process.kill()
                await asyncio.shield(process.wait())
        if err:
            log.warning("the page renderer said: %s", err[-2000:].decode("utf-8", "replace").strip())
        if process.returncode != 0 or not out:
            raise Unreadable(f"drawing the page failed: it needed more than {self.extractor.max_mb} MB "
                             f"(EXTRACT_MAX_MB) or {self.extractor.timeout:g} s (EXTRACT_TIMEOUT)")
        if out.startswith(b"\x89PNG"):
            return out
        answer = orjson.loads(out)
        error = AttachmentNotFound if answer.get("status") == 404 else Unreadable
        raise error(str(answer.get("error") or "the page could not be drawn"))


def _incoming(attachments: Attachments) -> Path:
    attachments.incoming.mkdir(parents=True, exist_ok=True)
    return attachments.incoming

