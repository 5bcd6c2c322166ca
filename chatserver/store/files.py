"""Persistence: one JSON file per conversation, `memory.md`, `models.json`, all under DATA_DIR.

Every write goes to a temporary file (never ending in `.json`), is fsynced and renamed over the
old one, so a crash mid-write leaves the previous version or the new one, never a torn file.
A file that does not parse is reported, skipped and never overwritten.

A long conversation is not rewritten whole every turn: once its file holds SEAL_AFTER messages,
the oldest SEGMENT_MESSAGES are sealed into a file of their own under `<id>.earlier/`, written
once and never again, and the conversation file lists those files in `earlier_messages` (the
whole history is their messages, in order, then `messages`). The `archive` of folded messages,
which also only grows at its end, is sealed the same way into `earlier_archive`. A change that
reaches into sealed messages (a compression, a cut) writes them back and seals afresh.
Segments are written before the conversation file that names them, so a crash leaves at worst
an unreferenced segment, never a reference to a missing one.

Reads are served from memory when the file has not changed on disk, so a long conversation is
not re-parsed every turn. Callers mutate conversations only inside `update()`, whose change
runs without awaiting and is therefore atomic within the event loop. Conversation writes then
run in a worker thread (a long history is megabytes to fsync, and the event loop is serving
every other stream meanwhile), one conversation's writes landing in the order they were made.

The store is a protocol (`Store`, and `OwnerStore`, one person's view of it) so that the
pipeline and the routes never see files: `FileStore` is the embedded implementation for one
process. Every conversation belongs to an owner; an owner's view answers NotFound for another
owner's id exactly as for an unknown one. Turn locks live here too, so that "a turn is running on
this conversation" is a fact of the store, not of one process's memory.

A streaming reply's checkpoints go beside the conversation file: the reply alone (a comparison's
replies together), written every second or so without fsync, so a checkpoint costs the size of
the reply, never of the conversation. They are written in place, by turns into two slots (`<id>.checkpoint` and
`<id>.checkpoint-b`), each framed with its sequence number, length and CRC: a write cut by a
crash spoils only the slot it was writing, and the other still holds the checkpoint before it.
Reading a conversation takes the newest whole checkpoint in; the next whole write takes it into
the conversation file and removes both slots.

A reply a turn left `status: "streaming"` (its checkpoint) while no turn holds the
conversation's lock belongs to a process that died: every store reads it as `interrupted`
(`recover_interrupted`), so nothing shows as streaming forever and a new turn can start at once.

This module knows files and ids, not turns or wire formats.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tempfile
import threading
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Protocol, Sequence

import anyio
import orjson

from chatserver.conversations.document import (
    LOCAL_OWNER,
    check_shape,
    new_id,
    now_iso,
    place_checkpoint,
    recover_interrupted,
    starts_with,
    summary_of,
    upgrade,
    valid_id,
)
from chatserver.upstream.failures import redact_json

log = logging.getLogger("chat.storage")

OWNER_PATTERN = re.compile(r"[a-z0-9_.-]{1,64}")
SEGMENT_MESSAGES = 500
SEAL_AFTER = 2 * SEGMENT_MESSAGES
CHECKPOINT_GATHER_SECONDS = 0.05
WHOLE_WRITE_THREADS = 8
WHOLE_WRITE_BATCH = 4
SEGMENT_NAME = re.compile(r"[A-Za-z0-9_-]{8,64}\.json")
# The lists that grow at their end, each with the field that names its sealed segments.
SEALED_LISTS = {"messages": "earlier_messages", "archive": "earlier_archive"}
# One small JSON document of each kind per person, beside their memory (see OwnerStore.read_document).
OWNER_DOCUMENTS = ("presets", "projects", "shares")
# A shared snapshot's id: URL-safe, never a path (no dot, no slash), long enough not to be guessed.
SHARE_ID = re.compile(r"[A-Za-z0-9_-]{32,64}")


class NotFound(Exception):
    """No conversation with that id (or the id is not one the server could have made)."""


class Damaged(Exception):
    """The conversation file exists but cannot be used; it is left untouched."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path.name}: {reason}")
        self.path = path
        self.reason = reason


class TurnBusy(Exception):
    """A turn already holds this conversation's lock."""


class StoreUnavailable(Exception):
    """The store cannot be reached now (Redis down); nothing acknowledged is lost, try again later."""


class LockLost(Exception):
    """A write came from a turn whose lock is no longer the conversation's current one."""


def write_synced(fd: int, data: bytes) -> None:
    """All of `data` to the descriptor `fd`, then fsync: a plain descriptor's writes may be partial."""
    rest = memoryview(data)
    while rest:
        rest = rest[os.write(fd, rest):]
    os.fsync(fd)


def atomic_write(path: Path, data: bytes, synced_later: set[Path] | None = None) -> os.stat_result:
    """Write `data` to `path` so that readers see the old or the new content, never a mix, even
    after a power cut: the data and the directory are fsynced before it returns, or the directory
    is added to `synced_later` for the caller to fsync (once for a batch of writes). Returns the
    new file's stat.

    Plain descriptor calls, no file object: these writes run in worker threads, and each system
    call there lets go of the GIL and takes it back, a hand-off with the event loop each time.
    """
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            write_synced(fd, data)
            stat = os.fstat(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if synced_later is not None:
        synced_later.add(path.parent)
    else:
        fsync_directory(path.parent)
    return stat


def fsync_directory(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


_SMALL_FILES: dict[Path, tuple[tuple[int, int, int], bytes]] = {}


def read_small_file(path: Path) -> bytes:
    """A small settings file's bytes (models, presets), read again only once it changed on disk.

    Every turn consults them, so this saves a turn the reads, not the freshness: a changed size or
    modification time is seen at once. FileNotFoundError and OSError come through as from read_bytes.
    """
    stat = path.stat()
    # The inode too: atomic_write replaces a file by renaming a new one over it, even within one mtime tick.
    stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    known = _SMALL_FILES.get(path)
    if known is not None and known[0] == stamp:
        return known[1]
    data = path.read_bytes()
    _SMALL_FILES[path] = (stamp, data)
    return data


CHECKPOINT_FRAME = re.compile(rb"checkpoint (\d{1,19}) (\d{1,12}) ([0-9a-f]{8})\n")


def _checkpoint_frame(seq: int, data: bytes) -> bytes:
    """The line in front of a checkpoint's bytes: what tells a whole checkpoint from a torn one."""
    return b"checkpoint %d %d %08x\n" % (seq, len(data), zlib.crc32(data))


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What one checkpoint slot holds: the replies streaming when it was written."""

    seq: int
    message: dict | None  # the reply on the path (None: a comparison whose first reply has no output yet)
    off_path: list[dict]  # a comparison's other replies, stored off the path as its siblings

    def data(self) -> bytes:
        return _dumps({"message": self.message, "off_path": self.off_path})


def _streaming_reply(value: object) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("id"), str) and value.get("role") == "assistant"
            and value.get("status") == "streaming" and isinstance(value.get("content"), str))


def _checkpoint_in(raw: bytes) -> Checkpoint | None:
    """A checkpoint slot's replies, or None when it holds no whole checkpoint (a torn or damaged
    slot is advisory: never fatal). Bytes past the framed length are an older, longer
    checkpoint's leftovers. A slot written before comparisons kept checkpoints holds one reply."""
    frame = CHECKPOINT_FRAME.match(raw)
    if frame is None:
        return None
    start, length = frame.end(), int(frame[2])
    data = raw[start:start + length]
    if len(data) != length or f"{zlib.crc32(data):08x}".encode() != frame[3]:
        return None
    try:
        held = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if _streaming_reply(held):
        return Checkpoint(int(frame[1]), held, [])
    if not isinstance(held, dict) or not isinstance(held.get("off_path"), list):
        return None
    message, off_path = held.get("message"), held["off_path"]
    if (message is None or _streaming_reply(message)) and all(map(_streaming_reply, off_path)) \
            and (message is not None or off_path):
        return Checkpoint(int(frame[1]), message, off_path)
    return None


def checkpoints_beside(path: Path) -> list[Checkpoint]:
    """The whole checkpoints kept beside the conversation file `path`, newest first."""
    found = []
    for slot in _checkpoint_paths(path):
        try:
            raw = slot.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("ignoring unreadable checkpoint %s: %s", slot.name, exc)
            continue
        if (checkpoint := _checkpoint_in(raw)) is None:
            log.warning("ignoring a damaged or torn checkpoint %s", slot.name)
            continue
        found.append(checkpoint)
    return sorted(found, key=lambda c: c.seq, reverse=True)


def place_replies(conv: dict, message: dict | None, off_path: Iterable[dict]) -> tuple[dict | None, list[dict]]:
    """`place_checkpoint` of each streaming reply: the ones that changed `conv` (a settled reply is left)."""
    kept = message if message is not None and place_checkpoint(conv, message) else None
    return kept, [reply for reply in off_path if place_checkpoint(conv, reply, off_path=True)]


def _write_snapshot(path: Path, earlier: Path, snapshot: Snapshot,
                    before_write: Callable[[Path, bytes], None] | None = None,
                    synced_later: set[Path] | None = None) -> tuple[int, int] | None:
    """Put one snapshot on disk; the conversation file's new stamp (None: it was left as it was).
    `synced_later`: the conversation file's directory is left there for the caller to fsync."""
    if snapshot.checkpoint:
        slot = _checkpoint_paths(path)[snapshot.checkpoint % 2]
        if before_write is not None:
            before_write(slot, snapshot.data)
        _overwrite_unsynced(slot, [_checkpoint_frame(snapshot.checkpoint, snapshot.data), snapshot.data])
        return None
    for name, data in snapshot.segments:
        if before_write is not None:
            before_write(earlier / name, data)
        atomic_write(earlier / name, data)
    if before_write is not None:
        before_write(path, snapshot.data)
    # Segments above were synced with their directory: a crash never leaves the file naming a lost one.
    stat = atomic_write(path, snapshot.data, synced_later)
    stamp = stat.st_mtime_ns, stat.st_size
    # The file now holds everything memory held, the reply's latest checkpoint included.
    for slot in _checkpoint_paths(path):
        slot.unlink(missing_ok=True)
    if snapshot.keep is not None and earlier.is_dir():
        for stale in earlier.glob("*.json"):
            if stale.name not in snapshot.keep:
                stale.unlink(missing_ok=True)
    return stamp


def _checkpoint_paths(path: Path) -> tuple[Path, Path]:
    """The two checkpoint slots beside `<id>.json`: not `.json` names, so nothing lists them as conversations."""
    return path.with_suffix(".checkpoint"), path.with_suffix(".checkpoint-b")


def _overwrite_unsynced(path: Path, chunks: list[bytes]) -> None:
    """Write `chunks` over the start of `path`, in place and without fsync: for checkpoint slots only.

    Replacing the file instead (a new file renamed over the old, whose blocks are then freed) cost
    ext4 about 600 µs of CPU per checkpoint, four hundred times a second with four hundred replies
    streaming; writing over the same blocks costs a few µs. The frame's length tells where the
    checkpoint ends, its CRC whether a crash cut the write short.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)  # a reply's text: private, like the conversation
    try:
        written = os.pwritev(fd, chunks, 0)
    finally:
        os.close(fd)
    if written != sum(map(len, chunks)):
        raise OSError(f"checkpoint {path.name} was written short ({written} bytes)")


class SnapshotWriter:
    """A few threads that write snapshots, each taking whatever has gathered at a time.

    Through the shared thread pool each write cost the event loop a task, a pool hand-off and a
    wake-up, and the thread's work contended for the GIL with the loop's: a hundred turns a
    second made two whole writes each, and four hundred streaming replies a checkpoint each a
    second. Here a write costs a list append; a thread writes the batch, fsyncs the directory
    once for all the whole writes in it (each file is fsynced on its own), and settles the batch
    with one wake-up. While every thread is busy (an fsync takes a while) another starts, up to
    `threads`, each taking at most `batch` writes, so a burst of turns does not queue behind one
    disk flush at a time. Threads leave
    when they have been idle a while, so an idle store holds none.
    """

    IDLE_SECONDS = 5.0

    def __init__(self, name: str, gather: float = 0.0, threads: int = 1, batch: int = 10_000) -> None:
        self.name = name
        self.batch = batch
        # Waking a sleeping thread is the dear part (a futex wake, a context switch, GIL hand-offs:
        # about a tenth of the loop's time at 200 streams when each write woke it), so the writes of
        # one pass of the loop, or of `gather` seconds, wake it once.
        self.gather = gather
        self.threads = threads
        self._jobs: list[tuple] = []
        self._ready = threading.Condition()
        self._running = 0  # threads alive
        self._idle = 0  # of them, waiting for work
        self._waking = False

    def submit(self, path: Path, earlier: Path, snapshot: Snapshot,
               before_write: Callable[[Path, bytes], None] | None, skip: Callable[[], bool]) -> asyncio.Future:
        """Queue one snapshot write; the future settles on the submitting loop once it is on disk."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._ready:
            self._jobs.append((loop, future, path, earlier, snapshot, before_write, skip))
        if not self._waking:
            self._waking = True
            if self.gather:
                loop.call_later(self.gather, self._wake)
            else:
                loop.call_soon(self._wake)
        return future

    def _wake(self) -> None:
        self._waking = False
        with self._ready:
            self._more_hands()

    def _more_hands(self) -> None:
        """With the lock held: get a thread onto the waiting jobs, a sleeping one or a new one."""
        if not self._jobs:
            return
        if self._idle:
            self._ready.notify()
        elif self._running < self.threads:
            self._running += 1
            threading.Thread(target=self._run, name=self.name, daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._ready:
                if not self._jobs:
                    self._idle += 1
                    self._ready.wait(self.IDLE_SECONDS)
                    self._idle -= 1
                if not self._jobs:
                    self._running -= 1
                    return
                # A thread's batch is written one file after another: a few at a time, the rest to
                # other threads, whose fsyncs the filesystem's journal commits together.
                batch, self._jobs = self._jobs[:self.batch], self._jobs[self.batch:]
                self._more_hands()
            outcomes: list[object] = []
            directories: set[Path] = set()
            for loop, future, path, earlier, snapshot, before_write, skip in batch:
                outcome: object
                try:
                    outcome = None if skip() else _write_snapshot(path, earlier, snapshot, before_write, directories)
                except BaseException as exc:  # handed to the awaiting side, like the pool would
                    outcome = exc
                outcomes.append(outcome)
            for directory in directories:
                try:
                    fsync_directory(directory)
                except OSError as exc:  # the renames into it may not survive a power cut: not written
                    outcomes = [exc if not job[4].checkpoint else outcome for job, outcome in zip(batch, outcomes)]
            settled: dict[asyncio.AbstractEventLoop, list] = {}
            for (loop, future, *_), outcome in zip(batch, outcomes):
                settled.setdefault(loop, []).append((future, outcome))
            for loop, results in settled.items():
                try:
                    loop.call_soon_threadsafe(settle, results)
                except RuntimeError:
                    pass  # that loop has closed: nobody is waiting any more


def settle(results: list[tuple[asyncio.Future, object]]) -> None:
    """Give each future its outcome (an exception or a result), on the loop: what worker threads hand back."""
    for future, outcome in results:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


@dataclass(slots=True)
class Sealed:
    """A list's sealed prefix: its segment files and the very message dicts they hold."""

    segments: list[dict] = field(default_factory=list)  # [{"file", "count"}], oldest first
    messages: list[dict] = field(default_factory=list)

    def is_prefix_of(self, messages: list[dict]) -> bool:
        return starts_with(messages, self.messages)


@dataclass(slots=True)
class Snapshot:
    """What one write puts on disk: new segment files first, then the conversation file."""

    data: bytes
    segments: list[tuple[str, bytes]]
    keep: set[str] | None  # after a reseal, the only segment files still referenced
    # Non-zero: `data` is one streaming reply, and this its checkpoint's sequence number (from 1;
    # its parity picks the slot). Not fsynced (a power cut may lose a checkpoint, never the
    # conversation) and written by the checkpoint SnapshotWriter.
    checkpoint: int = 0


def _dumps(obj: object) -> bytes:
    """The stored bytes: never holding a kept secret (the gateway key), whatever echoed it."""
    # The newline from orjson, not `+ b"\n"`: concatenating copies a long conversation's megabytes again.
    return redact_json(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))


Change = Callable[[dict], object]


@dataclass(frozen=True, slots=True)
class TurnLock:
    """A running turn's claim on one conversation; `token` tells this claim from any later one."""

    owner: str
    conv_id: str
    token: str = field(default_factory=new_id)


class OwnerStore(Protocol):
    """One owner's conversations, memory and turn locks; another owner's ids are NotFound."""

    owner: str

    async def create(self, conv: dict) -> dict: ...

    async def get(self, conv_id: str) -> dict:
        """The stored conversation; do not mutate it outside `update()`."""

    async def update(self, conv_id: str, change: Change, *, lock: TurnLock | None = None) -> dict:
        """Apply `change` to the latest version and store it; `lock`: refuse (LockLost) unless it is current."""

    async def update_soon(self, conv_id: str, change: Change, *,
                          lock: TurnLock | None = None) -> tuple[dict, Awaitable[None]]:
        """`update` that answers once the change is visible to every reader, with its write still running."""

    async def checkpoint(self, conv_id: str, message: dict | None, *, lock: TurnLock,
                         off_path: Sequence[dict] = ()) -> None:
        """Store a streaming reply as it is so far (`place_checkpoint`), with a comparison's other
        replies `off_path`; it need not survive a power cut. LockLost once the turn has let the
        conversation go."""

    async def list(self) -> list[dict]:
        """Every readable conversation's list entry (`summary_of`)."""

    async def delete(self, conv_id: str) -> None: ...

    async def read_memory(self) -> str: ...

    async def write_memory(self, text: str) -> None: ...

    async def forget_memory(self) -> None:
        """Remove the memory altogether (the person is being removed)."""

    async def read_presets(self) -> bytes | None:
        """The stored document of the person's own presets (`conversations/presets.py` reads it), or None."""

    async def update_presets(self, change: Callable[[bytes | None], bytes]) -> None:
        """Replace the presets document with `change(current)`, as one step against other processes'
        changes; an exception from `change` stores nothing."""

    async def forget_presets(self) -> None: ...

    async def read_document(self, kind: str) -> bytes | None:
        """The person's document of one of OWNER_DOCUMENTS (presets, projects, shares), or None."""

    async def update_document(self, kind: str, change: Callable[[bytes | None], bytes]) -> None:
        """`update_presets` for any of OWNER_DOCUMENTS."""

    async def forget_document(self, kind: str) -> None: ...

    async def lock_turn(self, conv_id: str) -> TurnLock:
        """Claim the conversation for one turn; TurnBusy when a turn holds it already."""

    @property
    def lock_renew_seconds(self) -> float | None:
        """How often a running turn must renew its lock (`renew_turn`, also its heartbeat); None: locks never expire."""

    async def renew_turn(self, lock: TurnLock) -> bool:
        """Keep a claim alive; False when it is no longer current (it expired and another took it)."""

    async def unlock_turn(self, lock: TurnLock) -> None:
        """Release a claim (a no-op when it is no longer current)."""

    async def turn_locked(self, conv_id: str) -> bool:
        """Whether a turn holds the conversation; NotFound for another owner's id or an unknown one."""


class Store(Protocol):
    """Where everything lives; routes and turns see it only through `for_owner`."""

    def for_owner(self, owner: str) -> OwnerStore: ...

    async def read_custom_models(self) -> list[dict]: ...

    async def write_custom_models(self, models: list[dict]) -> None: ...

    async def read_mcp_servers(self) -> list[dict]:
        """The MCP servers admins added in the page (tools/mcp.py checks each entry)."""
        ...

    async def write_mcp_servers(self, servers: list[dict]) -> None: ...

    async def flush(self) -> None:
        """Wait until every acknowledged change is durable (at shutdown)."""

    async def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers (a readiness check at startup)."""

    async def close(self) -> None:
        """Let go of connections and workers; after `flush`, at shutdown."""

    def every_conversation(self) -> AsyncIterator[dict]:
        """Every readable conversation, whoever owns it (for tools such as the migration, not requests)."""
        ...

    async def owners(self) -> set[str]:
        """Everyone who may have conversations or a memory here."""

    async def read_share(self, share_id: str) -> bytes | None:
        """A shared snapshot (`conversations/sharing.py` writes it), whoever made it; None when there is none."""

    async def write_share(self, share_id: str, data: bytes) -> None: ...

    async def delete_share(self, share_id: str) -> None: ...

    def every_share(self) -> AsyncIterator[tuple[str, bytes]]:
        """Every shared snapshot (for the migration)."""
        ...

    async def changes(self) -> AsyncGenerator[StoreChange, None]:
        """Every change from now on, made by any process that shares the store, in order; the
        feed is subscribed by the time this returns (so a catch-up read after it misses nothing)."""
        ...


@dataclass(frozen=True, slots=True)
class StoreChange:
    """A conversation stored or deleted. `conv` is the stored document when the store has it at
    hand (else read it: it may have changed again since); `streaming`: a checkpoint of a reply
    still being written."""

    owner: str
    conv_id: str
    deleted: bool = False
    streaming: bool = False
    conv: dict | None = None


def is_checkpoint(conv: dict) -> bool:
    messages = conv.get("messages") or []
    return bool(messages) and messages[-1].get("status") == "streaming"


class _Feed:
    """One `changes()` follower of the file store: told on the event loop, read in order."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[StoreChange] = asyncio.Queue()

    def changed(self, owner: str, conv: dict) -> None:
        self.queue.put_nowait(StoreChange(owner, conv["id"], streaming=is_checkpoint(conv), conv=conv))

    def removed(self, owner: str, conv_id: str) -> None:
        self.queue.put_nowait(StoreChange(owner, conv_id, deleted=True))


class StoreObserver(Protocol):
    def changed(self, owner: str, conv: dict) -> None: ...

    def removed(self, owner: str, conv_id: str) -> None: ...


def check_document(kind: str) -> str:
    if kind not in OWNER_DOCUMENTS:
        raise ValueError(f"not a person's document: {kind!r}")
    return kind


def check_share_id(share_id: str) -> str:
    """The id when it is one the server could have made; NotFound otherwise (it never reaches a path)."""
    if not isinstance(share_id, str) or not SHARE_ID.fullmatch(share_id):
        raise NotFound(share_id)
    return share_id


def _check_owner(owner: str) -> str:
    if not isinstance(owner, str) or not OWNER_PATTERN.fullmatch(owner):
        raise ValueError(f"not an owner id: {owner!r}")
    return owner


class FileStore:
    """Conversations as JSON files under one data directory, for one process.

    `before_write`, when set, is called (in the worker thread) with the path and bytes of every
    file a conversation write is about to replace: tests inject slow or failing disks through it.
    """

    def __init__(self, data_dir: Path, before_write: Callable[[Path, bytes], None] | None = None) -> None:
        self.root = Path(data_dir)
        self.conversations_dir = self.root / "conversations"
        self.models_path = self.root / "models.json"
        self.mcp_path = self.root / "mcp_servers.json"
        self.conversations_dir.mkdir(parents=True, exist_ok=True)
        self.before_write = before_write
        self._cache: dict[str, tuple[tuple[int, int], dict]] = {}
        # Writes queued or running per conversation; while any is, memory is ahead of the file.
        self._pending: Counter[str] = Counter()
        # The last queued write per conversation: the next one waits for it, so writes land in
        # the order their changes were made.
        self._tail: dict[str, asyncio.Future] = {}
        # Ids are random and never reused, so a deleted one stays deleted for queued writes too.
        self._deleted: set[str] = set()
        self._sealed: dict[str, dict[str, Sealed]] = {}  # conv id -> list name -> its sealed prefix
        self._turn_locks: dict[str, TurnLock] = {}
        # Nobody waits for a checkpoint: they may gather a while. A whole write is waited for.
        self._checkpoints = SnapshotWriter("checkpoint-writer", gather=CHECKPOINT_GATHER_SECONDS)
        self._whole_writes = SnapshotWriter("conversation-writer", threads=WHOLE_WRITE_THREADS,
                                            batch=WHOLE_WRITE_BATCH)
        # Conversations read with a reply from a checkpoint slot that no whole write has taken in.
        self._unabsorbed: set[str] = set()
        # The last checkpoint's sequence number per conversation. It only grows, so a slot that a
        # failed whole write left behind is never taken for a newer checkpoint.
        self._checkpoint_seq: dict[str, int] = {}
        # Told of every change as it is made (e.g. the search index): `changed(owner, conv)`,
        # `removed(owner, conv_id)`; called without awaiting, so they must only queue work.
        self.observers: list[StoreObserver] = []
        self._documents_lock = asyncio.Lock()

    def for_owner(self, owner: str) -> FileOwnerStore:
        return FileOwnerStore(self, _check_owner(owner))

    def memory_path(self, owner: str) -> Path:
        """The local person's memory stays where it always was; each account has its own folder."""
        if owner == LOCAL_OWNER:
            return self.root / "memory.md"
        return self.root / "users" / _check_owner(owner) / "memory.md"

    def presets_path(self, owner: str) -> Path:
        return self.document_path(owner, "presets")

    def document_path(self, owner: str, kind: str) -> Path:
        """Like the memory: the local person's in DATA_DIR itself, each account's in its own folder."""
        name = f"{check_document(kind)}.json"
        if owner == LOCAL_OWNER:
            return self.root / name
        return self.root / "users" / _check_owner(owner) / name

    def share_path(self, share_id: str) -> Path:
        return self.root / "shares" / f"{check_share_id(share_id)}.json"

    async def read_share(self, share_id: str) -> bytes | None:
        try:
            return self.share_path(share_id).read_bytes()
        except (FileNotFoundError, NotFound):
            return None

    async def write_share(self, share_id: str, data: bytes) -> None:
        atomic_write(self.share_path(share_id), data)

    async def delete_share(self, share_id: str) -> None:
        self.share_path(share_id).unlink(missing_ok=True)

    async def every_share(self) -> AsyncIterator[tuple[str, bytes]]:
        folder = self.root / "shares"
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            if SHARE_ID.fullmatch(path.stem):
                yield path.stem, path.read_bytes()

    def _path(self, conv_id: str) -> Path:
        if not valid_id(conv_id):
            raise NotFound(conv_id)
        return self.conversations_dir / f"{conv_id}.json"

    def _earlier_dir(self, conv_id: str) -> Path:
        return self.conversations_dir / f"{conv_id}.earlier"

    async def create(self, conv: dict) -> dict:
        conv = upgrade(dict(conv))
        self._cache[conv["id"]] = ((0, 0), conv)
        write = self._queue_write(conv["id"], self._snapshot(conv["id"], conv))
        self._tell_changed(conv)
        await asyncio.shield(write)
        return conv

    def _tell_changed(self, conv: dict) -> None:
        for observer in self.observers:
            observer.changed(conv["owner"], conv)

    def load(self, conv_id: str) -> dict:
        """The stored conversation, whoever owns it (NotFound, Damaged)."""
        path = self._path(conv_id)
        if conv_id in self._deleted:
            raise NotFound(conv_id)
        cached = self._cache.get(conv_id)
        if cached and self._pending[conv_id]:
            return cached[1]  # the file lags behind memory until the queued write lands
        try:
            stat = path.stat()
        except FileNotFoundError:
            self._forget(conv_id)
            raise NotFound(conv_id) from None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if cached and cached[0] == stamp:
            return cached[1]
        try:
            conv = orjson.loads(path.read_bytes())
        except IsADirectoryError:
            raise Damaged(path, "a directory, not a conversation file") from None
        except OSError as exc:
            raise Damaged(path, f"cannot be read ({exc.strerror or type(exc).__name__})") from None
        except orjson.JSONDecodeError as exc:
            raise Damaged(path, f"damaged JSON ({exc})") from None
        try:
            if not isinstance(conv, dict):
                raise ValueError("not a conversation (a JSON object is expected)")
            if conv.get("id") != conv_id:
                raise ValueError("not a conversation of this server (its id differs from its file name)")
            conv = upgrade(conv)
            sealed = {name: self._read_earlier(conv_id, conv, name) for name in SEALED_LISTS}
            check_shape(conv)
        except (ValueError, TypeError, AttributeError) as exc:
            raise Damaged(path, str(exc) or type(exc).__name__) from None
        self._take_checkpoint(conv_id, path, conv)
        if conv_id not in self._turn_locks and recover_interrupted(conv):
            # Read as recovered at once; the file catches up with the conversation's next write.
            log.warning("conversation %s: a reply left streaming by a stopped process is now interrupted", conv_id)
        self._cache[conv_id] = (stamp, conv)
        self._sealed[conv_id] = sealed
        return conv

    def _take_checkpoint(self, conv_id: str, path: Path, conv: dict) -> None:
        """A reply checkpointed after the file's last write joins the conversation read from it.

        The newest whole checkpoint that still fits goes in: one of a reply the file already holds
        settled (a crash between a whole write and its removal of the slots) is left out.
        """
        for checkpoint in checkpoints_beside(path):
            if place_replies(conv, checkpoint.message, checkpoint.off_path) != (None, []):
                self._unabsorbed.add(conv_id)
                return

    def _read_earlier(self, conv_id: str, conv: dict, name: str) -> Sealed:
        """Put a list's sealed items back in front of it; ValueError says which segment is unusable."""
        segments = conv.pop(SEALED_LISTS[name], [])
        if not isinstance(segments, list):
            raise ValueError(f"{SEALED_LISTS[name]} is not a list")
        sealed = Sealed()
        for entry in segments:
            file = entry.get("file") if isinstance(entry, dict) else None
            if not isinstance(file, str) or not SEGMENT_NAME.fullmatch(file) or not isinstance(entry.get("count"), int):
                raise ValueError(f"{SEALED_LISTS[name]} holds an entry without a file name and a count")
            try:
                messages = orjson.loads((self._earlier_dir(conv_id) / file).read_bytes())
            except (OSError, orjson.JSONDecodeError) as exc:
                raise ValueError(f"its earlier {name} in {file} cannot be read ({exc})") from None
            if not isinstance(messages, list) or len(messages) != entry["count"]:
                raise ValueError(f"its earlier {name} in {file} are not the {entry['count']} it names")
            sealed.segments.append({"file": file, "count": entry["count"]})
            sealed.messages.extend(messages)
        if sealed.messages:
            rest = conv.get(name, [])
            if not isinstance(rest, list):
                raise ValueError(f"{name} is not a list")
            conv[name] = sealed.messages + rest
        return sealed

    def _snapshot(self, conv_id: str, conv: dict) -> Snapshot:
        """The bytes of the next write; seals the oldest items of a list once enough have gathered."""
        self._unabsorbed.discard(conv_id)  # a whole write takes in whatever the checkpoint slots held
        before = self._sealed.get(conv_id, {})
        head = {key: value for key, value in conv.items() if key not in SEALED_LISTS}
        new_segments: list[tuple[str, bytes]] = []
        resealed = False
        state = {}
        for name, field_name in SEALED_LISTS.items():
            items = conv.get(name)
            sealed = before.get(name) or Sealed()
            if not isinstance(items, list) or not sealed.is_prefix_of(items):
                resealed = resealed or bool(sealed.segments)
                sealed = Sealed()
            if isinstance(items, list):
                while len(items) - len(sealed.messages) >= SEAL_AFTER:
                    chunk = items[len(sealed.messages): len(sealed.messages) + SEGMENT_MESSAGES]
                    file = f"{new_id()}.json"
                    new_segments.append((file, _dumps(chunk)))
                    sealed.segments.append({"file": file, "count": len(chunk)})
                    sealed.messages.extend(chunk)
                if sealed.segments:
                    head[field_name] = sealed.segments
                head[name] = items[len(sealed.messages):] if sealed.messages else items
            elif name in conv:
                head[name] = items
            state[name] = sealed
        self._sealed[conv_id] = state
        keep = {e["file"] for sealed in state.values() for e in sealed.segments} if resealed else None
        return Snapshot(_dumps(head), new_segments, keep)

    def apply(self, conv_id: str, conv: dict, change: Change) -> asyncio.Future:
        """Apply `change` to `conv` now (no await: atomic within the loop) and queue its write."""
        try:
            change(conv)
            conv["updated_at"] = now_iso()
            snapshot = self._snapshot(conv_id, conv)
        except BaseException:
            self._forget(conv_id)
            raise
        write = self._queue_write(conv_id, snapshot)
        self._tell_changed(conv)
        return write

    def checkpoint(self, conv_id: str, conv: dict, message: dict | None,
                   off_path: Sequence[dict] = ()) -> asyncio.Future | None:
        """Put streaming replies in `conv` and queue writing them alone to a checkpoint slot.

        The conversation file is left as it is, so a checkpoint costs the size of the replies, not
        of the conversation; the next whole write takes them in and removes the checkpoint slots.
        A comparison writes all its replies in each checkpoint: a slot is the newest state of every
        one of them. None when the replies have settled meanwhile (nothing to write).
        """
        if conv_id in self._unabsorbed:
            # Memory holds a reply read from a checkpoint slot (a crash's): the file takes it in
            # first, or this checkpoint would replace the only copy of it.
            return self.apply(conv_id, conv, lambda c: place_replies(c, message, off_path))
        kept, siblings = place_replies(conv, message, off_path)
        if kept is None and not siblings:
            return None
        conv["updated_at"] = now_iso()
        seq = self._checkpoint_seq[conv_id] = self._checkpoint_seq.get(conv_id, 0) + 1
        snapshot = Snapshot(Checkpoint(seq, kept, siblings).data(), [], None, checkpoint=seq)
        write = self._queue_write(conv_id, snapshot)
        self._tell_changed(conv)
        return write

    def _forget(self, conv_id: str) -> None:
        """Memory is ahead of a file that will not catch up: read the file again next time."""
        self._cache.pop(conv_id, None)
        self._sealed.pop(conv_id, None)

    def _queue_write(self, conv_id: str, snapshot: Snapshot) -> asyncio.Future:
        """Write one snapshot in a worker thread, after the conversation's earlier writes."""
        path = self._path(conv_id)
        previous = self._tail.get(conv_id)
        self._pending[conv_id] += 1
        if previous is None and snapshot.checkpoint:
            # A checkpoint leaves the conversation file as it was, so there is no new stamp to remember.
            write = self._checkpoints.submit(path, self._earlier_dir(conv_id), snapshot, self.before_write,
                                             lambda: conv_id in self._deleted)
        else:
            write = asyncio.ensure_future(self._write_after(previous, conv_id, path, snapshot))
        self._tail[conv_id] = write
        write.add_done_callback(lambda done: self._written(conv_id, done))
        return write

    async def _write_after(self, previous: asyncio.Future | None, conv_id: str, path: Path,
                           snapshot: Snapshot) -> None:
        if previous is not None:
            await asyncio.wait([previous])
            if previous.cancelled() or previous.exception() is not None:
                # This snapshot may name segments that write never put on disk.
                raise OSError(f"an earlier write of conversation {conv_id} failed, so this one was not made")
        if conv_id in self._deleted:
            return
        stamp = await self._whole_writes.submit(path, self._earlier_dir(conv_id), snapshot, self.before_write,
                                                lambda: conv_id in self._deleted)
        if stamp is not None and conv_id in self._cache:
            # The file now holds what memory holds: reads may trust the cache while it keeps this stamp.
            self._cache[conv_id] = (stamp, self._cache[conv_id][1])

    def _written(self, conv_id: str, write: asyncio.Future) -> None:
        if write.cancelled() or write.exception() is not None:
            self._forget(conv_id)
            log.error("writing conversation %s failed: %s", conv_id,
                      "cancelled" if write.cancelled() else write.exception())
        self._pending[conv_id] -= 1
        if not self._pending[conv_id]:
            del self._pending[conv_id]
        if self._tail.get(conv_id) is write:
            del self._tail[conv_id]

    async def flush(self) -> None:
        """Wait until every queued write has landed (at shutdown, so none is cut off)."""
        while self._tail:
            await asyncio.wait(list(self._tail.values()))

    async def remove(self, conv_id: str, owner: str) -> None:
        """Remove a conversation; a damaged file is refused (Damaged) like any other write."""
        path = self._path(conv_id)
        for observer in self.observers:
            observer.removed(owner, conv_id)
        self._deleted.add(conv_id)
        self._forget(conv_id)
        self._turn_locks.pop(conv_id, None)
        self._checkpoint_seq.pop(conv_id, None)
        with anyio.CancelScope(shield=True):
            if (tail := self._tail.get(conv_id)) is not None:
                await asyncio.wait([tail])  # a write already running lands first, then the file goes
            path.unlink(missing_ok=True)
            for slot in _checkpoint_paths(path):
                slot.unlink(missing_ok=True)
            shutil.rmtree(self._earlier_dir(conv_id), ignore_errors=True)

    async def expire(self, days: float, now: datetime | None = None) -> list[str]:
        """CONVERSATION_TTL_DAYS: delete the conversations nobody touched for `days`; their ids."""
        cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=days)
        removed = []
        for conv in self.load_all():
            try:
                updated = datetime.fromisoformat(conv["updated_at"])
            except ValueError:
                continue  # an unreadable date is not a reason to delete anything
            if updated.tzinfo is None:
                updated = updated.replace(tzinfo=timezone.utc)
            if updated < cutoff and conv["id"] not in self._turn_locks:
                await self.remove(conv["id"], conv["owner"])
                removed.append(conv["id"])
        return removed

    async def ping(self) -> None:
        """The data directory is there (made at start): nothing to wait for."""

    async def close(self) -> None:
        """Nothing is held open beyond what `flush` settles."""

    async def every_conversation(self) -> AsyncIterator[dict]:
        for conv in await asyncio.to_thread(self.load_all):
            yield conv

    async def changes(self) -> AsyncGenerator[StoreChange, None]:
        feed = _Feed()
        self.observers.append(feed)

        async def follow() -> AsyncGenerator[StoreChange, None]:
            try:
                while True:
                    yield await feed.queue.get()
            finally:
                self.observers.remove(feed)

        return follow()

    async def owners(self) -> set[str]:
        users = self.root / "users"
        found = {p.name for p in users.iterdir() if p.is_dir() and OWNER_PATTERN.fullmatch(p.name)} \
            if users.is_dir() else set()
        return found | {LOCAL_OWNER}

    def load_all(self) -> list[dict]:
        """Every readable conversation, whoever owns it; damaged or foreign files are logged and skipped."""
        out = []
        for path in self.conversations_dir.glob("*.json"):
            conv_id = path.stem
            if not valid_id(conv_id):
                log.warning("skipping %s: not a conversation file name", path.name)
                continue
            try:
                out.append(self.load(conv_id))
            except Damaged as exc:
                log.warning("skipping damaged conversation file %s: %s", path.name, exc.reason)
            except NotFound:
                continue
        return out

    def _read_list(self, path: Path) -> list[dict]:
        """The objects of a small JSON list file; none when it is missing or damaged (logged)."""
        try:
            data = orjson.loads(read_small_file(path))
        except FileNotFoundError:
            return []
        except (OSError, orjson.JSONDecodeError) as exc:
            log.warning("ignoring damaged %s: %s", path.name, exc)
            return []
        if not isinstance(data, list):
            log.warning("ignoring damaged %s: not a JSON list", path.name)
            return []
        return [item for item in data if isinstance(item, dict)]

    async def read_custom_models(self) -> list[dict]:
        return [m for m in self._read_list(self.models_path) if isinstance(m.get("id"), str)
                and m.get("tier", "balanced") in ("fast", "balanced", "frontier")]

    async def write_custom_models(self, models: list[dict]) -> None:
        atomic_write(self.models_path, _dumps(models))

    async def read_mcp_servers(self) -> list[dict]:
        return self._read_list(self.mcp_path)

    async def write_mcp_servers(self, servers: list[dict]) -> None:
        # Not _dumps: the header values admins gave are what reaches the servers, so the one place
        # they are kept is not redacted (they are kept secret everywhere else, mcp.py).
        atomic_write(self.mcp_path, orjson.dumps(servers, option=orjson.OPT_INDENT_2))


class FileOwnerStore:
    """One owner's view of a FileStore: every read and write checks the owner first."""

    lock_renew_seconds = None  # one process: a lock lives exactly as long as its turn

    def __init__(self, files: FileStore, owner: str) -> None:
        self.files = files
        self.owner = owner

    def _mine(self, conv_id: str) -> dict:
        conv = self.files.load(conv_id)
        if conv["owner"] != self.owner:
            raise NotFound(conv_id)  # indistinguishable from an id that does not exist
        return conv

    async def create(self, conv: dict) -> dict:
        return await self.files.create({**conv, "owner": self.owner})

    async def get(self, conv_id: str) -> dict:
        return self._mine(conv_id)

    def _check_lock(self, conv_id: str, lock: TurnLock | None) -> None:
        if lock is not None and self.files._turn_locks.get(conv_id) is not lock:
            raise LockLost(conv_id)

    async def update_soon(self, conv_id: str, change: Change, *,
                          lock: TurnLock | None = None) -> tuple[dict, asyncio.Future]:
        conv = self._mine(conv_id)
        self._check_lock(conv_id, lock)
        return conv, self.files.apply(conv_id, conv, change)

    async def update(self, conv_id: str, change: Change, *, lock: TurnLock | None = None) -> dict:
        # A caller cancelled meanwhile (Stop) does not cancel the write: it still lands, in order.
        conv, written = await self.update_soon(conv_id, change, lock=lock)
        await asyncio.shield(written)
        return conv

    async def checkpoint(self, conv_id: str, message: dict | None, *, lock: TurnLock,
                         off_path: Sequence[dict] = ()) -> None:
        conv = self._mine(conv_id)
        self._check_lock(conv_id, lock)
        if (written := self.files.checkpoint(conv_id, conv, message, off_path)) is not None:
            await asyncio.shield(written)

    async def list(self) -> list[dict]:
        return [summary_of(c) for c in self.files.load_all() if c["owner"] == self.owner]

    async def delete(self, conv_id: str) -> None:
        self._mine(conv_id)
        await self.files.remove(conv_id, self.owner)

    async def read_memory(self) -> str:
        """The memory file; bytes that are not UTF-8 are shown replaced (and logged), never fatal."""
        path = self.files.memory_path(self.owner)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return ""
        except OSError as exc:
            log.warning("ignoring unreadable %s: %s", path.name, exc)
            return ""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            log.warning("%s is not valid UTF-8 (%s); showing it with replacement characters", path.name, exc)
            return raw.decode("utf-8", "replace")

    async def write_memory(self, text: str) -> None:
        atomic_write(self.files.memory_path(self.owner), text.encode("utf-8"))

    async def forget_memory(self) -> None:
        self.files.memory_path(self.owner).unlink(missing_ok=True)

    async def read_presets(self) -> bytes | None:
        return await self.read_document("presets")

    async def update_presets(self, change: Callable[[bytes | None], bytes]) -> None:
        await self.update_document("presets", change)

    async def forget_presets(self) -> None:
        await self.forget_document("presets")

    async def read_document(self, kind: str) -> bytes | None:
        try:
            return read_small_file(self.files.document_path(self.owner, kind))
        except FileNotFoundError:
            return None

    async def update_document(self, kind: str, change: Callable[[bytes | None], bytes]) -> None:
        async with self.files._documents_lock:  # one process owns the file store
            atomic_write(self.files.document_path(self.owner, kind), change(await self.read_document(kind)))

    async def forget_document(self, kind: str) -> None:
        self.files.document_path(self.owner, kind).unlink(missing_ok=True)

    async def lock_turn(self, conv_id: str) -> TurnLock:
        self._mine(conv_id)
        if conv_id in self.files._turn_locks:
            raise TurnBusy(conv_id)
        lock = TurnLock(self.owner, conv_id)
        self.files._turn_locks[conv_id] = lock
        return lock

    async def renew_turn(self, lock: TurnLock) -> bool:
        return self.files._turn_locks.get(lock.conv_id) is lock

    async def unlock_turn(self, lock: TurnLock) -> None:
        if self.files._turn_locks.get(lock.conv_id) is lock:
            del self.files._turn_locks[lock.conv_id]
            # A reply its turn could not save (its final write failed) must not read as streaming.
            if (cached := self.files._cache.get(lock.conv_id)) is not None:
                recover_interrupted(cached[1])

    async def turn_locked(self, conv_id: str) -> bool:
        self._mine(conv_id)
        return conv_id in self.files._turn_locks
