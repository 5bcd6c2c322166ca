"""Full-text search over conversation titles and message text: one SQLite FTS5 file per data directory.

The index lives in `DATA_DIR/search.sqlite3` (WAL). Text is split by FTS5's trigram tokenizer, so
any script matches as a substring (Korean, Chinese, words inside words). Trigrams need three
characters; a query word of two (common in Korean: "서울") becomes the set of indexed trigrams
that start with it, read from the index's vocabulary (each text is indexed with a space at both
ends, so every occurrence has one). A one-character word, or a two-character one so common
that its set is huge, is checked by scanning the candidates, newest first, bounded.

Results are ranked by bm25; when even the rarest trigram of the query is in thousands of
messages, ranking all of them would take longer than it helps, and the newest come first.

Every write goes through one connection in one worker thread, in the order the calls were made;
searches use their own read connections in other threads. The event loop never waits on SQLite.
The index is a cache of the store: `reconcile` brings it back in line after a crash lost its
last writes, `rebuild` builds it from scratch.

Snippets are HTML: the message text in them is escaped and only `<mark>`…`</mark>` is markup.

This module knows owners, conversation ids, titles and message dicts (`id`, `role`, `content`);
it does not know how conversations are stored or who an owner is.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import os
import re
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from chatserver.store.files import settle

log = logging.getLogger("chat.search")

INDEX_VERSION = "1"
INDEXED_ROLES = ("user", "assistant")
# A pasted book should not make the index ten times its size; its start is what people recall.
MAX_INDEXED_CHARS = 100_000
MAX_TERMS = 8
SNIPPET_BEFORE = 60
SNIPPET_AFTER = 120
# A query of only short words scans text; it stops after this many of the owner's rows.
SHORT_SCAN_ROWS = 200_000
# A two-character word starting more distinct trigrams than this is scanned for instead.
MAX_EXPANSION = 300
# Above this many candidate messages, bm25 ranking costs more than it helps: newest first.
RANK_AT_MOST = 3_000
TITLE = ""  # the message_id of a conversation's title row
# How long a turn's save waits for others to share its transaction: at a hundred turns a second a
# transaction (and a wake-up of the writer thread, which contends for the GIL) per save cost the
# loop more than the writes. A search does not wait for it: it hurries the pending writes.
GATHER_SECONDS = 0.2

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS convs (
    owner TEXT NOT NULL, conv_id TEXT NOT NULL, title TEXT NOT NULL, updated_at TEXT NOT NULL,
    PRIMARY KEY (owner, conv_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS docs (
    id INTEGER PRIMARY KEY, owner TEXT NOT NULL, conv_id TEXT NOT NULL, message_id TEXT NOT NULL,
    text TEXT NOT NULL, UNIQUE (owner, conv_id, message_id));
CREATE INDEX IF NOT EXISTS docs_owner ON docs (owner, id);
CREATE VIRTUAL TABLE IF NOT EXISTS fts USING fts5(
    text, content='docs', content_rowid='id', tokenize='trigram');
CREATE VIRTUAL TABLE IF NOT EXISTS fts_vocab USING fts5vocab(fts, 'row');
CREATE TRIGGER IF NOT EXISTS docs_ai AFTER INSERT ON docs BEGIN
    INSERT INTO fts (rowid, text) VALUES (new.id, ' ' || new.text || ' '); END;
CREATE TRIGGER IF NOT EXISTS docs_ad AFTER DELETE ON docs BEGIN
    INSERT INTO fts (fts, rowid, text) VALUES ('delete', old.id, ' ' || old.text || ' '); END;
CREATE TRIGGER IF NOT EXISTS docs_au AFTER UPDATE OF text ON docs BEGIN
    INSERT INTO fts (fts, rowid, text) VALUES ('delete', old.id, ' ' || old.text || ' ');
    INSERT INTO fts (rowid, text) VALUES (new.id, ' ' || new.text || ' '); END;
"""

UPSERT_DOC = """
INSERT INTO docs (owner, conv_id, message_id, text) VALUES (?, ?, ?, ?)
ON CONFLICT (owner, conv_id, message_id) DO UPDATE SET text = excluded.text WHERE text != excluded.text
"""
UPSERT_CONV = """
INSERT INTO convs (owner, conv_id, title, updated_at) VALUES (?, ?, ?, ?)
ON CONFLICT (owner, conv_id) DO UPDATE SET title = excluded.title, updated_at = excluded.updated_at
"""


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class Query:
    """A search as typed: its distinct words, each of which a result must contain."""

    terms: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Query:
        # Control characters (NUL above all, which ends an SQLite string) are never typed into a search.
        words = [w for w in _CONTROL.sub(" ", text).split() if w]
        unique = list(dict.fromkeys(words))[:MAX_TERMS]
        return cls(tuple(unique))

    def pattern(self) -> re.Pattern[str]:
        """Any of the words, longest first, case-insensitively: what the snippet marks."""
        ordered = sorted(self.terms, key=len, reverse=True)
        return re.compile("|".join(re.escape(t) for t in ordered), re.IGNORECASE)


def snippet(text: str, query: Query) -> str:
    """A window of `text` around the first match, HTML-escaped, every match wrapped in <mark>."""
    pattern = query.pattern()
    first = pattern.search(text)
    at = first.start() if first else 0
    start = max(0, at - SNIPPET_BEFORE)
    end = min(len(text), at + SNIPPET_AFTER)
    if start > 0:
        space = text.find(" ", start, at)
        start = space + 1 if space != -1 else start
    window = " ".join(text[start:end].split())  # newlines and runs of spaces read badly in one line
    out, last = [], 0
    for m in pattern.finditer(window):
        out.append(html.escape(window[last:m.start()]))
        out.append(f"<mark>{html.escape(m.group())}</mark>")
        last = m.end()
    out.append(html.escape(window[last:]))
    return ("…" if start > 0 else "") + "".join(out) + ("…" if end < len(text) else "")


@dataclass(frozen=True, slots=True)
class Plan:
    """How to run a query: an FTS5 expression (may be empty), words to scan for, a match estimate."""

    match: str
    scan: tuple[str, ...]
    estimate: int


def fts_string(text: str) -> str:
    """`text` as an FTS5 string: quotes, `*`, `-`, NEAR and parentheses inside are only text."""
    return '"' + text.replace('"', '""') + '"'


def plan_query(conn: sqlite3.Connection, query: Query) -> Plan | None:
    """The plan for `query`, or None when a word occurs nowhere, so nothing can match."""
    groups, scan, estimate = [], [], None
    for term in query.terms:
        folded = term.lower()
        if len(term) >= 3:
            count = min(_doc_count(conn, folded[i:i + 3]) for i in range(len(folded) - 2))
            groups.append(fts_string(term))
        elif len(term) == 2:
            trigrams = conn.execute(
                "SELECT term, doc FROM fts_vocab WHERE term >= ? AND term < ? LIMIT ?",
                (folded, folded + "\U0010ffff", MAX_EXPANSION + 1)).fetchall()
            if not trigrams:
                return None
            if len(trigrams) > MAX_EXPANSION:
                scan.append(folded)
                continue
            count = sum(doc for _, doc in trigrams)
            groups.append("(" + " OR ".join(fts_string(t) for t, _ in trigrams) + ")")
        else:
            scan.append(folded)
            continue
        estimate = count if estimate is None else min(estimate, count)
    return Plan(" AND ".join(groups), tuple(scan), estimate or 0)


def _doc_count(conn: sqlite3.Connection, trigram: str) -> int:
    row = conn.execute("SELECT doc FROM fts_vocab WHERE term = ?", (trigram,)).fetchone()
    return row[0] if row else 0


def searchable(message: dict) -> tuple[str, str] | None:
    """(message id, text) for a message worth finding, or None (notices, tool output, empty)."""
    if message.get("role") not in INDEXED_ROLES:
        return None
    content, message_id = message.get("content"), message.get("id")
    if not isinstance(content, str) or not isinstance(message_id, str) or not content.strip():
        return None
    return message_id, content[:MAX_INDEXED_CHARS]


def conversation_rows(conv: dict) -> list[tuple[str, str]]:
    """Every searchable message of a conversation: its current messages, its folded archive and its
    other branches (`off_path`: a hit there is opened with the branch route)."""
    rows = []
    for name in ("messages", "archive", "off_path"):
        for message in conv.get(name) or ():
            if (row := searchable(message)) is not None:
                rows.append(row)
    return rows


class IndexFollower:
    """Keeps the index in step with the store, told of every change as it is made.

    A turn's save appends a message or two (or replaces the last one): only those are indexed,
    so the save path stays cheap. Anything else (a compression moving messages to the archive,
    a rewind, a rename) re-indexes the whole conversation.
    """

    def __init__(self, index: SearchIndex) -> None:
        self.index = index
        self._seen: dict[str, tuple[int, str | None, int, str]] = {}

    @staticmethod
    def _mark(conv: dict) -> tuple[int, str | None, int, str]:
        messages = conv.get("messages") or []
        return len(messages), messages[-1]["id"] if messages else None, len(conv.get("archive") or []), conv["title"]

    def seen_all(self, convs: Iterable[dict]) -> None:
        """What the index holds after a rebuild or reconcile."""
        for conv in convs:
            self._seen[conv["id"]] = self._mark(conv)

    def changed(self, owner: str, conv: dict) -> None:
        messages = conv.get("messages") or []
        if messages and messages[-1].get("status") == "streaming":
            return  # a checkpoint of a reply still being written: it is indexed once, when saved
        seen, mark = self._seen.get(conv["id"]), self._mark(conv)
        if seen and seen[2:] == mark[2:] and seen[0] <= mark[0] and (
                seen[0] == 0 or messages[seen[0] - 1]["id"] == seen[1]):
            # The last message seen may have changed in place (a checkpoint grows into the reply).
            fresh = messages[max(seen[0] - 1, 0):]
            if fresh:
                self.index.index_messages(owner, conv["id"], conv["title"], fresh, conv.get("updated_at") or "")
        else:
            self.index.index_conversation(owner, conv)
        self._seen[conv["id"]] = mark

    def removed(self, owner: str, conv_id: str) -> None:
        self._seen.pop(conv_id, None)
        self.index.remove_conversation(owner, conv_id)


class SearchIndex:
    """The index file, its single writer thread and its reader threads."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search-write")
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="search-read")
        self._local = threading.local()
        self._write_conn: sqlite3.Connection | None = None
        self._closed = False
        self._last_write: asyncio.Future | None = None  # a search waits for it: it reads its writes
        # Writes waiting for the writer thread, and whether a drain of them is already on its way.
        self._queued: list[tuple[Callable, tuple, asyncio.Future]] = []
        self._queue_lock = threading.Lock()
        self._draining = False
        self._gathering: asyncio.TimerHandle | None = None

    # Connections -----------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        _make_private(self.path)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
        conn.execute("PRAGMA journal_mode=WAL")
        # The index is rebuilt from the store after a crash, so losing the last commits is fine.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        return conn

    def _writing(self) -> sqlite3.Connection:
        if self._write_conn is None:
            conn = self._connect()
            conn.executescript(SCHEMA)
            self._write_conn = conn
        return self._write_conn

    def _reading(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            conn.execute("PRAGMA query_only=1")
            self._local.conn = conn
        return conn

    def _submit(self, fn, *args, gather: bool = False) -> asyncio.Future:
        """Queue a write now (so writes keep the order of the calls); await the result or not.

        The writes that gather while the writer thread is busy, or for GATHER_SECONDS when the
        write may `gather`, go in together: one hand-off to the thread, one transaction and one
        wake-up of the loop for the lot.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        future.add_done_callback(_log_failure)
        with self._queue_lock:
            self._queued.append((fn, args, future))
            start = not self._draining
            self._draining = True
        if start and gather:
            self._gathering = loop.call_later(GATHER_SECONDS, self._hurry)
        elif start:
            self._writer.submit(self._drain, loop)
        elif not gather:
            self._hurry()
        self._last_write = future
        return future

    def _hurry(self) -> None:
        """Hand the gathered writes to the writer thread now, if they are still waiting."""
        if self._gathering is not None:
            self._gathering.cancel()
            self._gathering = None
            self._writer.submit(self._drain, asyncio.get_running_loop())

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the writer thread: run what has been queued, batch after batch, until nothing is left."""
        while True:
            with self._queue_lock:
                batch, self._queued = self._queued, []
                if not batch:
                    self._draining = False
                    return
            outcomes = self._transaction(batch)
            try:
                loop.call_soon_threadsafe(settle, outcomes)
            except RuntimeError:
                pass  # the loop has closed: nobody waits for these any more

    def _transaction(self, batch: list[tuple[Callable, tuple, asyncio.Future]]) -> list[tuple[asyncio.Future, object]]:
        """One transaction; each write in a savepoint of its own, so one that fails leaves the others in."""
        outcomes: list[tuple[asyncio.Future, object]] = []
        try:
            conn = self._writing()
            conn.execute("BEGIN IMMEDIATE")
        except Exception as exc:
            return [(future, exc) for _, _, future in batch]
        try:
            for fn, args, future in batch:
                conn.execute("SAVEPOINT write")
                try:
                    result: object = fn(conn, *args)
                except Exception as exc:
                    conn.execute("ROLLBACK TO write")
                    result = exc
                conn.execute("RELEASE write")
                outcomes.append((future, result))
            conn.execute("COMMIT")
        except Exception as exc:  # the transaction itself broke: none of the lot is in
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            return [(future, exc) for _, _, future in batch]
        return outcomes

    # Writes -----------------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the file and its tables (in the writer thread)."""
        await asyncio.get_running_loop().run_in_executor(self._writer, self._writing)

    def index_conversation(self, owner: str, conv: dict) -> asyncio.Future:
        """Upsert a whole conversation (title, messages, archive); messages it no longer has go."""
        rows = conversation_rows(conv)
        return self._submit(_put_conversation, owner, conv["id"], conv.get("title") or "",
                            conv.get("updated_at") or "", rows)

    def index_messages(self, owner: str, conv_id: str, title: str, messages: list[dict],
                       updated_at: str = "") -> asyncio.Future:
        """Add or update a few messages (a turn's save) and the title; cheap, nothing else is read."""
        rows = [row for m in messages if (row := searchable(m)) is not None]
        stamp = updated_at or max((m.get("created_at") or "" for m in messages), default="")
        return self._submit(_put_messages, owner, conv_id, title or "", stamp, rows, gather=True)

    def remove_conversation(self, owner: str, conv_id: str) -> asyncio.Future:
        return self._submit(_remove, owner, conv_id)

    def reconcile(self, owner_conversations: Iterable[tuple[str, dict]]) -> asyncio.Future:
        """Re-index what changed since the index last saw it, drop what is gone (at startup)."""
        convs = [(owner, conv["id"], conv.get("updated_at") or "", conv) for owner, conv in owner_conversations]
        return self._submit(_reconcile, convs, False)

    def rebuild(self, owner_conversations: Iterable[tuple[str, dict]]) -> asyncio.Future:
        """Throw the index away and build it from these (owner, conversation) pairs."""
        convs = [(owner, conv["id"], conv.get("updated_at") or "", conv) for owner, conv in owner_conversations]
        return self._submit(_reconcile, convs, True)

    # Reads ------------------------------------------------------------------------------------

    async def search(self, owner: str, q: str, limit: int = 20) -> list[dict]:
        """The owner's best matches for `q`: [{conversation_id, title, message_id, snippet, updated_at}]."""
        query = Query.parse(q)
        if not query.terms or limit <= 0:
            return []
        self._hurry()
        if self._last_write is not None and not self._last_write.done():
            # A change made before this search (an edit, a rename) is found by it; writes run in order.
            await asyncio.wait([self._last_write])
        return await asyncio.get_running_loop().run_in_executor(self._readers, self._search, owner, query, limit)

    def _search(self, owner: str, query: Query, limit: int) -> list[dict]:
        conn = self._reading()
        if not _has_tables(conn):
            return []
        plan = plan_query(conn, query)
        if plan is None:
            return []
        # lower() folds ASCII only, which is what instr() can compare; other scripts match as typed.
        scan_filter = "".join(" AND instr(lower(d.text), ?) > 0" for _ in plan.scan)
        columns = "d.conv_id, d.message_id, d.text, c.title, c.updated_at"
        join = "JOIN convs c ON c.owner = d.owner AND c.conv_id = d.conv_id"
        if plan.match:
            order = "fts.rank" if plan.estimate <= RANK_AT_MOST else "fts.rowid DESC"
            sql = (f"SELECT {columns} FROM fts JOIN docs d ON d.id = fts.rowid {join} "
                   f"WHERE fts MATCH ? AND d.owner = ?{scan_filter} ORDER BY {order} LIMIT ?")
            params = [plan.match, owner, *plan.scan, limit]
        else:
            sql = (f"SELECT {columns} FROM (SELECT * FROM docs WHERE owner = ? ORDER BY id DESC LIMIT ?) d "
                   f"{join} WHERE 1{scan_filter} ORDER BY d.id DESC LIMIT ?")
            params = [owner, SHORT_SCAN_ROWS, *plan.scan, limit]
        return [
            {"conversation_id": conv_id, "title": title, "message_id": message_id or None,
             "snippet": snippet(text, query), "updated_at": updated_at}
            for conv_id, message_id, text, title, updated_at in conn.execute(sql, params)
        ]

    async def stamps(self, owner: str) -> dict[str, str]:
        """The `updated_at` the index holds for each of the owner's conversations (after queued writes)."""
        self._hurry()
        if self._last_write is not None and not self._last_write.done():
            await asyncio.wait([self._last_write])

        def read() -> dict[str, str]:
            conn = self._reading()
            if not _has_tables(conn):
                return {}
            return dict(conn.execute("SELECT conv_id, updated_at FROM convs WHERE owner = ?", (owner,)))
        return await asyncio.get_running_loop().run_in_executor(self._readers, read)

    async def is_built(self) -> bool:
        """Whether a build has finished in this file (a fresh or interrupted one needs `rebuild`)."""
        def built() -> bool:
            conn = self._writing()
            row = conn.execute("SELECT value FROM meta WHERE key = 'built'").fetchone()
            return row is not None and row[0] == INDEX_VERSION
        return await asyncio.get_running_loop().run_in_executor(self._writer, built)

    async def close(self) -> None:
        """Finish queued writes, then close every connection."""
        if self._closed:
            return
        self._closed = True
        self._hurry()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._writer, self._close_writer)
        self._writer.shutdown(wait=False)
        self._readers.shutdown(wait=False, cancel_futures=True)

    def _close_writer(self) -> None:
        if self._write_conn is not None:
            self._write_conn.close()
            self._write_conn = None


def _has_tables(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'fts'").fetchone() is not None


def _put_messages(conn: sqlite3.Connection, owner: str, conv_id: str, title: str, updated_at: str,
                  rows: list[tuple[str, str]]) -> None:
    conn.execute(UPSERT_CONV, (owner, conv_id, title, updated_at))
    conn.execute(UPSERT_DOC, (owner, conv_id, TITLE, title))
    conn.executemany(UPSERT_DOC, [(owner, conv_id, message_id, text) for message_id, text in rows])


def _put_conversation(conn: sqlite3.Connection, owner: str, conv_id: str, title: str, updated_at: str,
                      rows: list[tuple[str, str]]) -> None:
    _put_messages(conn, owner, conv_id, title, updated_at, rows)
    keep = {message_id for message_id, _ in rows} | {TITLE}
    stale = [(i,) for i, message_id in conn.execute(
        "SELECT id, message_id FROM docs WHERE owner = ? AND conv_id = ?", (owner, conv_id))
        if message_id not in keep]
    conn.executemany("DELETE FROM docs WHERE id = ?", stale)


def _remove(conn: sqlite3.Connection, owner: str, conv_id: str) -> None:
    conn.execute("DELETE FROM docs WHERE owner = ? AND conv_id = ?", (owner, conv_id))
    conn.execute("DELETE FROM convs WHERE owner = ? AND conv_id = ?", (owner, conv_id))


def _reconcile(conn: sqlite3.Connection, convs: list[tuple[str, str, str, dict]], fresh: bool) -> int:
    """Index each conversation whose updated_at differs from the index's; returns how many were."""
    if fresh:
        conn.execute("DELETE FROM meta WHERE key = 'built'")
        conn.execute("DELETE FROM docs")
        conn.execute("DELETE FROM convs")
        conn.execute("INSERT INTO fts (fts) VALUES ('delete-all')")
    known = {(o, c): u for o, c, u in conn.execute("SELECT owner, conv_id, updated_at FROM convs")}
    present = set()
    changed = 0
    for owner, conv_id, updated_at, conv in convs:
        present.add((owner, conv_id))
        if known.get((owner, conv_id)) == updated_at:
            continue
        _put_conversation(conn, owner, conv_id, conv.get("title") or "", updated_at, conversation_rows(conv))
        changed += 1
    for owner, conv_id in known.keys() - present:
        _remove(conn, owner, conv_id)
    conn.execute("INSERT INTO meta (key, value) VALUES ('built', ?) "
                 "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (INDEX_VERSION,))
    return changed


def _make_private(path: Path) -> None:
    """The index holds every message's text: 0600 like the conversations (SQLite gives its -wal and
    -shm files the database's own mode), an older index made with the umask's mode included."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
        for side in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(side, 0o600)


def _log_failure(future: asyncio.Future) -> None:
    # A save does not wait for the index; a failed write is logged here and mended by `reconcile`.
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.error("search index write failed: %s", exc)
