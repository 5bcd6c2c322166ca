"""Conversations out (Markdown, this server's JSON) and in (this server's JSON, ChatGPT, Open WebUI).

Every import becomes the same neutral tree, `ImportedConversation`: nodes with fresh ids and
`parent_id` links (None for roots), roles "user" or "assistant" only, and `current`, the leaf of
the path that was on screen. System, tool and hidden messages, reasoning and empty messages are
left out as messages, and their children hang from the nearest message that was kept, so the
tree stays connected; what they said is not lost: reasoning and tool steps become the `activity`
of the reply below them, system messages the conversation's `system_prompt`. A conversation that
cannot be read is skipped with a warning; a file that cannot be read, or of which no
conversation can, raises `Unreadable` with the reasons, before anything is returned: callers
store nothing then. Uploads may be a zip archive (ChatGPT's download) and may start with a
byte-order mark.

This module knows the export formats and the shape of a stored conversation's messages
(`id`, `role`, `content`, `created_at`, `model`, optional `parent_id`); it does not know how
conversations are stored, or whose they are.
"""

from __future__ import annotations

import codecs
import html
import io
import re
import struct
import time
import unicodedata
import zipfile
import zlib
from collections import Counter
from datetime import datetime
from typing import Annotated, Any, Callable, Iterator, Literal, NotRequired, TypedDict
from urllib.parse import quote

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from chatserver.conversations import branches
from chatserver.conversations.document import new_id, now_iso

FORMAT = "chat-server-export"
VERSION = 1
ROLES = ("user", "assistant")
MAX_IMPORT_BYTES = 200 * 1024 * 1024
MAX_CONVERSATIONS = 50_000
MAX_NODES = 100_000  # per conversation
MAX_SIBLINGS = 1_000  # versions of one message: answers regenerated, questions edited
MAX_CONTENT_CHARS = 2_000_000  # per message
MAX_TITLE_CHARS = 200


class Unreadable(Exception):
    """The file cannot be imported; `reason` says why, in words for the person who chose it."""

    def __init__(self, reason: str, skipped: list[dict] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.skipped = skipped or []  # when every conversation was skipped: each one's warning


class Node(TypedDict):
    id: str
    parent_id: str | None
    role: str
    content: str
    created_at: str
    model: NotRequired[str]
    activity: NotRequired[list[dict]]  # assistant: its reasoning and tool steps, as our own replies keep them
    # ChatGPT: the images the message showed, by the export's asset ids (the import route turns
    # those found in the zip into attachments and `attachment_ids`, then drops this).
    image_refs: NotRequired[list[str]]


class ImportedConversation(TypedDict):
    title: str
    created_at: str
    updated_at: str
    model: str | None
    nodes: list[Node]
    current: str | None  # None only when no message could be kept
    # Only from this server's own export: what compression had folded (`folded`: ids of nodes, a
    # prefix of the current path; `archive`: an older export's folded messages, outside the tree)
    # and its summary.
    folded: NotRequired[list[str]]
    archive: NotRequired[list[dict]]
    summary: NotRequired[str]
    # From other tools: the system messages (or instructions) it had, as one system prompt, and
    # warnings about it (`roles_skipped`: messages of roles with no place here, left out).
    system_prompt: NotRequired[str]
    notes: NotRequired[list[dict]]


# Tree helpers -------------------------------------------------------------------------------


def current_path(nodes: list[dict], leaf: str | None) -> list[dict]:
    """The nodes from a root down to `leaf`, in order."""
    by_id = {n["id"]: n for n in nodes}
    path, seen = [], set()
    at = leaf
    while at is not None and at in by_id and at not in seen:
        seen.add(at)
        path.append(by_id[at])
        at = by_id[at].get("parent_id")
    path.reverse()
    return path


def siblings(nodes: list[dict]) -> dict[str, list[str]]:
    """{id: [ids of it and its siblings, in order]} for every node that has a sibling."""
    children: dict[str | None, list[str]] = {}
    for n in nodes:
        children.setdefault(n.get("parent_id"), []).append(n["id"])
    return {i: group for group in children.values() if len(group) > 1 for i in group}


def to_tree(conv: dict, all_messages: list[dict] | None = None) -> tuple[list[dict], str | None]:
    """A conversation as (nodes, current leaf id): every branch, folded messages included.

    Without `all_messages` the stored tree is read (`branches`: the path in `archive` +
    `messages`, the rest in `off_path`); with it, those messages are the tree. A message
    without `parent_id` follows the message before it.
    """
    if all_messages is None:
        nodes = [{**m, "parent_id": parent} for m, parent in branches.linked(branches.path_items(conv))]
        nodes += [dict(m) for m in conv.get("off_path") or []]
        return nodes, branches.last_node_id(conv)
    nodes, previous = [], None
    for m in all_messages:
        parent = m["parent_id"] if "parent_id" in m else previous
        nodes.append({**m, "parent_id": parent})
        previous = m["id"]
    path = conv.get("messages", [])
    return nodes, (path[-1]["id"] if path else None)


def from_tree(nodes: list[dict], leaf: str | None) -> tuple[list[dict], dict[str, list[str]]]:
    """(`messages`, the current path; `branches`, {message id: sibling ids}) for a stored conversation."""
    return current_path(nodes, leaf), siblings(nodes)


# Export -------------------------------------------------------------------------------------


def export_json(conversations: list[tuple[dict, list[dict] | None]]) -> bytes:
    """This server's export of (conversation, all its branches' messages or None) pairs."""
    return orjson.dumps({
        "format": FORMAT, "version": VERSION, "exported_at": now_iso(),
        "conversations": [export_entry(conv, all_messages) for conv, all_messages in conversations],
    }, option=orjson.OPT_INDENT_2)


def export_entry(conv: dict, all_messages: list[dict] | None = None) -> dict:
    nodes, current = to_tree(conv, all_messages)
    return {
        "id": conv["id"], "title": conv.get("title", ""), "model": conv.get("model"),
        "created_at": conv.get("created_at"), "updated_at": conv.get("updated_at"),
        "summary": conv.get("summary", ""), "settings": conv.get("settings", {}),
        "nodes": nodes, "current": current, "archive": conv.get("archive", []),
    }


def export_markdown(conv: dict, files: dict[str, dict] | None = None) -> str:
    """The current path as Markdown: folded messages first, in a marked section; notices as quotes.

    `files` (the conversation's attachments by id, `public` shape) lets a message link the files
    it was sent with: an image as `![name](url)`, any other file as `[name](url)`, by the
    server-relative download route."""
    files = files or {}
    title = one_line(conv.get("title") or "Conversation")
    out = [f"# {title}", ""]
    if conv.get("model"):
        out.append(f"- Model: {conv['model']}")
    out += [f"- Created: {conv.get('created_at', '')}", f"- Exported: {now_iso()}", ""]
    archive = conv.get("archive") or []
    if archive:
        out += ["## Earlier messages (folded into the summary)", "",
                "> These messages were folded by compression: the model saw them only through the summary.", ""]
        out += [line for m in archive for line in markdown_message(m, conv["id"], files)]
        out += ["## Conversation", ""]
    for m in conv.get("messages", []):
        out += markdown_message(m, conv["id"], files)
    return "\n".join(out).rstrip("\n") + "\n"


def markdown_message(m: dict, conv_id: str = "", files: dict[str, dict] | None = None) -> list[str]:
    content = m.get("content") or ""
    if m.get("role") == "notice":
        return ["> " + line if line else ">" for line in content.splitlines() or [""]] + [""]
    heading = [m.get("role", "message").capitalize()]
    if m.get("model"):
        heading.append(m["model"])
    if m.get("created_at"):
        heading.append(m["created_at"])
    lines = ["### " + " · ".join(heading), "", content, ""]
    if m.get("status") not in (None, "complete"):
        lines[3:3] = ["", f"*({m['status']})*"]
    attached = [(i, (files or {}).get(i)) for i in m.get("attachment_ids") or []]
    if attached:
        lines += [markdown_file(conv_id, i, meta) for i, meta in attached] + [""]
    sources = [c for c in m.get("citations") or [] if isinstance(c, dict) and isinstance(c.get("url"), str)]
    if sources:
        lines += ["Sources:", ""] + [f"- [{one_line(c.get('title') or c['url'])}]({c['url']})" for c in sources] + [""]
    return lines


def markdown_file(conv_id: str, attachment_id: str, meta: dict | None) -> str:
    if meta is None:
        return "- (a file since deleted)"
    # The name is untrusted text: no brackets or line breaks that would end the link early.
    name = one_line(meta["name"]).replace("[", "(").replace("]", ")")
    url = f"/api/conversations/{quote(conv_id)}/attachments/{quote(attachment_id)}"
    return f"![{name}]({url})" if meta.get("kind") == "image" else f"- [{name}]({url})"


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def safe_filename(title: str, extension: str) -> str:
    """A file name from a title: letters, digits, spaces, `-` and `_` only, never a path."""
    text = unicodedata.normalize("NFKC", title or "")
    text = "".join(ch if ch.isalnum() or ch in "-_" else " " for ch in text)
    text = " ".join(text.split()).strip(" -_")[:80].strip()
    return f"{text or 'conversation'}.{extension}"


def content_disposition(filename: str) -> str:
    """`attachment` with an ASCII fallback name and the real one in RFC 5987 form."""
    stem, _, extension = filename.rpartition(".")
    ascii_stem = stem.encode("ascii", "ignore").decode().strip(" -_.")
    ascii_name = f"{ascii_stem or 'conversation'}.{extension}"
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename, safe='')}"


# Import -------------------------------------------------------------------------------------


class ImportResult(TypedDict):
    conversations: list[ImportedConversation]
    # What the whole file's reading has to say, none naming a stored conversation: conversations
    # skipped (`conversation_skipped`, with `index` and `title`) and files left in a zip archive
    # (`images_skipped`, with `count`).
    warnings: list[dict]


def parse_import(raw: bytes, progress: Callable[[int, int], None] | None = None) -> list[ImportedConversation]:
    """Every conversation that could be read (the others skipped), or Unreadable when none could."""
    return read_import(raw, progress)["conversations"]


def read_import(raw: bytes, progress: Callable[[int, int], None] | None = None) -> ImportResult:
    """The file's conversations and what was left out of it; `progress(done, total)` after each one.

    One conversation that cannot be read is skipped and named in the warnings; Unreadable, with
    every reason, when the file itself cannot be read or not one of its conversations can."""
    data, warnings = load(raw)
    kind, items = detect(data)
    if not items:
        raise Unreadable("the file holds no conversations")
    if len(items) > MAX_CONVERSATIONS:
        raise Unreadable(f"the file holds over {MAX_CONVERSATIONS} conversations")
    convert = {"chat-server": from_own, "chatgpt": from_chatgpt, "open-webui": from_open_webui}[kind]
    conversations: list[ImportedConversation] = []
    skipped: list[dict] = []
    for i, item in enumerate(items):
        title = clean_title(item.get("title") or _chat_title(item)) if isinstance(item, dict) else ""
        where = f"conversation {i + 1}" + (f" (“{title[:60]}”)" if title and title != UNTITLED else "")
        reason = None
        if not isinstance(item, dict):
            reason = f"{where} is not an object"
        else:
            try:
                converted = convert(item)
                if not converted["nodes"]:
                    raise Unreadable("it holds no user or assistant message (only system, tool or empty ones)")
                conversations.append(converted)
            except Unreadable as exc:
                reason = f"{where}: {exc.reason}"
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                # A shape no check above foresaw is still the file's fault, not the server's.
                reason = f"{where}: an unexpected shape ({type(exc).__name__}: {str(exc)[:100]})"
        if reason is not None:
            skipped.append({"code": "conversation_skipped", "index": i + 1, "title": title, "message": reason})
        if progress is not None:
            progress(i + 1, len(items))
    if not conversations:
        reasons = [w["message"] for w in skipped]
        more = f"; and {len(reasons) - 10} more" if len(reasons) > 10 else ""
        raise Unreadable("; ".join(reasons[:10]) + more, skipped)
    return {"conversations": conversations, "warnings": warnings + skipped}


# Reading the bytes: a zip archive, byte-order marks, JSON ----------------------------------------

ZIP_MAGIC = b"PK\x03\x04"
MAX_ZIP_ENTRIES = 100_000
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".heic", ".bmp", ".svg")
IMAGE_MARK = "[image]"  # where an image was that the import could not keep
# ChatGPT's file ids ("file-4UfjdrDjmMfTpyV3T2yXHW", "file_00000000ab12..."): no "-" after the prefix.
ASSET_ID = re.compile(r"file[-_][A-Za-z0-9_]{1,100}")
MAX_MESSAGE_IMAGES = 32  # as many as a message may be sent with


def load(raw: bytes) -> tuple[object, list[dict]]:
    """The parsed JSON of an upload (from a zip's conversations.json when it is one), and the
    warnings about what was left beside it."""
    if len(raw) > MAX_IMPORT_BYTES:
        raise Unreadable(f"the file is over {MAX_IMPORT_BYTES // (1024 * 1024)} MB")
    warnings: list[dict] = []
    if raw.startswith(ZIP_MAGIC):
        raw, warnings = read_zip(raw)
    elif raw.startswith(b"PK\x05\x06"):
        raise Unreadable("the zip archive is empty")
    try:
        return orjson.loads(without_bom(raw)), warnings
    except orjson.JSONDecodeError as exc:
        raise Unreadable(f"the file is not JSON ({exc})") from None


def without_bom(raw: bytes) -> bytes:
    """UTF-8 text with no byte-order mark: a UTF-8 mark is dropped, UTF-16 and UTF-32 with a mark decoded."""
    if raw.startswith(codecs.BOM_UTF8):
        return raw[len(codecs.BOM_UTF8):]
    for mark, codec in ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
                        (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")):
        if raw.startswith(mark):
            try:
                return raw.decode(codec).encode("utf-8")
            except UnicodeDecodeError as exc:
                raise Unreadable(f"the file starts with a {codec.upper()} byte-order mark but is not {codec.upper()} "
                                 f"({exc.reason} at byte {exc.start})") from None
    return raw


def read_zip(raw: bytes) -> tuple[bytes, list[dict]]:
    """`conversations.json` of a zip archive (ChatGPT's download), read in memory within
    MAX_IMPORT_BYTES however well it compresses; nothing is written to disk and no member's name
    is used as a path. The images beside it are read by the import route (`zip_images`)."""
    zip_entry_count(raw)  # before zipfile lists the entries: a directory of millions is refused unread
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            infos = archive.infolist()
            candidates = [i for i in infos if not i.is_dir()
                          and (i.filename == "conversations.json" or i.filename.endswith("/conversations.json"))]
            if not candidates:
                raise Unreadable("the zip archive holds no conversations.json")
            member = min(candidates, key=lambda i: i.filename.count("/"))  # the top-most one
            if member.flag_bits & 0x1:
                raise Unreadable("conversations.json is encrypted in the zip archive")
            data = _read_member(archive, member, MAX_IMPORT_BYTES)
            if data is None:
                declared = f" ({member.file_size} bytes declared)" if member.file_size > MAX_IMPORT_BYTES else ""
                raise Unreadable(f"conversations.json in the zip archive is over "
                                 f"{MAX_IMPORT_BYTES // (1024 * 1024)} MB unpacked{declared}")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError, EOFError,
            OSError, zlib.error, ValueError) as exc:
        raise Unreadable(f"the zip archive cannot be read ({type(exc).__name__}: {str(exc)[:100]})") from None
    return data, []


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes | None:
    """A member's bytes read in memory, or None past `limit` bytes: declared, or as read (a declared
    size may lie), so a zip bomb stops at the limit however far it would inflate."""
    if info.file_size > limit:
        return None
    data = bytearray()
    with archive.open(info) as stream:
        while chunk := stream.read(1 << 20):
            data += chunk
            if len(data) > limit:
                return None
    return bytes(data)


def zip_images(raw: bytes) -> tuple[dict[str, zipfile.ZipInfo], set[str]]:
    """The image files of a zip archive (ChatGPT's download) by the asset id their name starts
    with ("file-AbC-photo.png" and "file-AbC.png" are "file-AbC"), and the names of all its image
    files; nothing when `raw` is no zip. Names are only matched, never used as paths."""
    if not raw.startswith(ZIP_MAGIC):
        return {}, set()
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError):
        return {}, set()
    by_asset: dict[str, zipfile.ZipInfo] = {}
    names = set()
    for info in infos:
        base = info.filename.rsplit("/", 1)[-1]
        if info.is_dir() or not base.lower().endswith(IMAGE_SUFFIXES):
            continue
        names.add(info.filename)
        found = ASSET_ID.match(base)
        # "file-AbC-photo.png": the id ends where the original name begins.
        if found and base[found.end():found.end() + 1] in ("-", "."):
            by_asset.setdefault(found.group(0), info)
    return by_asset, names


def zip_member(raw: bytes, info: zipfile.ZipInfo, limit: int) -> bytes:
    """One member's bytes, read in memory and refused (Unreadable) past `limit` bytes whatever its
    header declares, or when it is encrypted or damaged."""
    if info.flag_bits & 0x1:
        raise Unreadable("it is encrypted in the zip archive")
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            data = _read_member(archive, info, limit)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError, EOFError,
            OSError, zlib.error, ValueError) as exc:
        raise Unreadable(f"it cannot be read from the zip archive ({type(exc).__name__})") from None
    if data is None:
        raise Unreadable(f"it is over {limit} bytes unpacked")
    return data


def zip_entry_count(raw: bytes) -> int:
    """How many entries the archive's central directory holds, counted by walking it (its stated
    count may lie); Unreadable past MAX_ZIP_ENTRIES or when the directory cannot be found."""
    end = raw.rfind(b"PK\x05\x06", max(0, len(raw) - 22 - 0xFFFF))
    if end < 0 or len(raw) < end + 22:
        raise Unreadable("the zip archive has no central directory (is the download complete?)")
    stated, size, _offset = struct.unpack_from("<HII", raw, end + 10)
    directory_end = end
    if stated == 0xFFFF or size == 0xFFFFFFFF:  # zip64: the real figures are in its own record
        locator = end - 20
        if locator < 0 or raw[locator:locator + 4] != b"PK\x06\x07":
            raise Unreadable("the zip archive's zip64 directory cannot be found")
        record = struct.unpack_from("<Q", raw, locator + 8)[0]
        if raw[record:record + 4] != b"PK\x06\x06":
            raise Unreadable("the zip archive's zip64 directory cannot be found")
        size = struct.unpack_from("<Q", raw, record + 40)[0]
        directory_end = record
    at, count = directory_end - size, 0
    if at < 0:
        raise Unreadable("the zip archive's central directory is damaged")
    while at < directory_end:
        if raw[at:at + 4] != b"PK\x01\x02" or at + 46 > directory_end:
            raise Unreadable("the zip archive's central directory is damaged")
        name, extra, comment = struct.unpack_from("<HHH", raw, at + 28)
        at += 46 + name + extra + comment
        count += 1
        if count > MAX_ZIP_ENTRIES:
            raise Unreadable(f"the zip archive holds over {MAX_ZIP_ENTRIES} files")
    return count


def detect(data: object) -> tuple[str, list]:
    """Which format the parsed file is in, and its list of conversations."""
    if isinstance(data, dict):
        if data.get("format") == FORMAT:
            if data.get("version") != VERSION:
                raise Unreadable(f"this server's export version {data.get('version')!r} is not one it reads")
            if not isinstance(data.get("conversations"), list):
                raise Unreadable("the export has no list of conversations")
            return "chat-server", data["conversations"]
        data = [data]  # one conversation on its own, as some exporters write it
    if not isinstance(data, list):
        raise Unreadable("the file is not a list of conversations or an export of this server")
    # The first conversation whose shape is known names the format; the others are read as that.
    for item in data:
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("mapping"), dict):
            return "chatgpt", data
        if isinstance(item.get("chat"), dict) or is_bare_chat(item):
            return "open-webui", data
    if not any(isinstance(item, dict) for item in data):
        return "chatgpt", data  # every entry is skipped as not an object
    raise Unreadable("not a ChatGPT, Open WebUI or chat-server export "
                     "(no `mapping`, `chat` or message `history` in its conversations)")


def is_bare_chat(item: dict) -> bool:
    """An Open WebUI `chat` object on its own, not wrapped as `{"chat": ...}` (its per-chat download)."""
    history = item.get("history")
    return (isinstance(history, dict) and isinstance(history.get("messages"), dict)) or (
        isinstance(item.get("messages"), list) and ("models" in item or "history" in item or "params" in item))


def _chat_title(item: dict) -> object:
    chat = item.get("chat")
    return chat.get("title") if isinstance(chat, dict) else None


# The neutral tree ------------------------------------------------------------------------------

MAX_STEPS = 200  # activity steps kept per reply
MAX_STEP_TEXT = 100_000  # characters of one thought or tool result summary
SUMMARY_CHARS = 300  # a tool step's summary: the start of its result


class Raw(TypedDict):
    parent: str | None
    role: str | None  # None: left out, its children hang from its parent
    content: str
    created_at: str
    model: str | None
    # Activity steps (thinking, tool, fetch) of this node: a kept assistant reply carries its own
    # and those of the left-out nodes between it and the message above it. Optional.
    steps: NotRequired[list[dict]]
    images: NotRequired[list[str]]  # asset ids of the images it showed (ChatGPT)


class _Pending:
    """Steps waiting for the next kept reply below, as a chain shared by the branches under it."""

    __slots__ = ("count", "steps", "up")

    def __init__(self, count: int, steps: tuple[dict, ...], up: _Pending | None) -> None:
        self.count, self.steps, self.up = count, steps, up


def _add_steps(pending: _Pending | None, steps: list[dict] | None) -> _Pending | None:
    for step in steps or ():
        if pending is not None and pending.count >= MAX_STEPS:
            break
        if step.get("merge") is True and pending is not None and pending.steps:
            # A tool's result ends the call just before it (the call's name is the one it was sent to:
            # "browser", "web.run", "python"; the result's author may be named otherwise).
            last = pending.steps[-1]
            if last.get("kind") == "tool" and "summary" not in last:
                ended = {**last, **{k: v for k, v in step.items() if k not in ("merge", "call_id", "name", "arguments", "at")}}
                pending = _Pending(pending.count, pending.steps[:-1] + (ended,), pending.up)
                continue
        if step.get("merge") == "duration" and pending is not None and pending.steps:
            last = pending.steps[-1]
            if last.get("kind") == "thinking":  # a reasoning recap: how long the thought above took
                ended = {**last, "ended_at": last["started_at"] + step["seconds"]}
                pending = _Pending(pending.count, pending.steps[:-1] + (ended,), pending.up)
                continue
        clean = {k: v for k, v in step.items() if k not in ("merge", "seconds")}
        if clean.get("kind") == "thinking" and step.get("merge") == "duration":
            clean["started_at"] = clean["ended_at"] - step["seconds"]
        pending = _Pending((pending.count if pending else 0) + 1, (clean,), pending)
    return pending


def _materialize(pending: _Pending | None) -> list[dict]:
    """The steps waiting, oldest first, each a copy (a step above a fork belongs to every reply under it)."""
    chunks = []
    while pending is not None:
        chunks.append(pending.steps)
        pending = pending.up
    return [{**step, "arguments": dict(step["arguments"])} if isinstance(step.get("arguments"), dict) else dict(step)
            for chunk in reversed(chunks) for step in chunk]


def build_tree(raw: dict[str, Raw], order: dict[str, list[str]], current: str | None,
               fresh: dict[str, str] | None = None) -> tuple[list[Node], str | None]:
    """Kept nodes with fresh ids, parents first; `order` lists children as the source did.

    `fresh`, when given, is filled with {source id: new id}."""
    if len(raw) > MAX_NODES:
        raise Unreadable(f"over {MAX_NODES} messages")
    check_acyclic(raw)
    fresh = {} if fresh is None else fresh
    fresh.update({old: new_id() for old, node in raw.items() if node["role"] is not None})
    children: dict[str | None, list[str]] = {}
    for old in _ordered(raw, order):
        children.setdefault(raw[old]["parent"], []).append(old)
    # The nearest kept message at or above each node, filled parents first: one step per node,
    # where walking up from each node made long chains of left-out nodes quadratic. Steps of
    # left-out nodes wait the same way, in `pending`, for the reply they belong to.
    kept_at: dict[str | None, str | None] = {None: None}
    pending: dict[str | None, _Pending | None] = {None: None}
    kept_children: Counter[str | None] = Counter()
    nodes: list[Node] = []
    copied = 0
    stack = list(reversed(children.get(None, [])))
    while stack:
        old = stack.pop()
        node = raw[old]
        above = kept_at[node["parent"]]
        waiting = _add_steps(pending[node["parent"]], node.get("steps"))
        if node["role"] is None:
            kept_at[old] = above
            pending[old] = waiting
        else:
            kept_at[old] = old
            pending[old] = None
            kept_children[above] += 1
            if kept_children[above] > MAX_SIBLINGS:
                raise Unreadable(f"a message has over {MAX_SIBLINGS} versions side by side "
                                 "(answers or edits of the same point)")
            out: Node = {"id": fresh[old], "parent_id": fresh.get(above),
                         "role": node["role"], "content": node["content"], "created_at": node["created_at"]}
            if node["model"]:
                out["model"] = node["model"]
            if node.get("images"):
                out["image_refs"] = node["images"]
            if node["role"] == "assistant" and waiting is not None:
                out["activity"] = _materialize(waiting)
                copied += len(out["activity"])
                if copied > MAX_NODES:  # steps above many forks are copied to each reply under them
                    raise Unreadable(f"its replies hold over {MAX_NODES} activity steps in all")
            nodes.append(out)
        stack.extend(reversed(children.get(old, [])))
    leaf = kept_at.get(current)
    if leaf is not None:
        return nodes, fresh[leaf]
    return nodes, (_last_leaf(nodes) if nodes else None)


def _ordered(raw: dict[str, Raw], order: dict[str, list[str]]) -> list[str]:
    """Node ids with each parent's children in the source's order, the rest by time."""
    position = {child: i for kids in order.values() for i, child in enumerate(kids)}
    return sorted(raw, key=lambda old: (position.get(old, len(raw)), raw[old]["created_at"]))


def _last_leaf(nodes: list[Node]) -> str:
    """No usable current node: follow the newest child down from the newest root."""
    children: dict[str | None, list[Node]] = {}
    for n in nodes:
        children.setdefault(n["parent_id"], []).append(n)
    at = max(children[None], key=lambda n: n["created_at"])
    while children.get(at["id"]):
        at = max(children[at["id"]], key=lambda n: n["created_at"])
    return at["id"]


def check_acyclic(raw: dict[str, Raw]) -> None:
    """Every parent exists and following parents always reaches a root."""
    rooted: set[str] = set()
    for start in raw:
        walk, at = [], start
        seen: set[str] = set()
        while at is not None and at not in rooted:
            if at in seen:
                raise Unreadable("its message tree has a cycle")
            if at not in raw:
                raise Unreadable(f"a message names a parent ({str(at)[:40]}) that is not in the file")
            seen.add(at)
            walk.append(at)
            at = raw[at]["parent"]
        rooted.update(walk)


def epoch_seconds(value: object) -> float | None:
    """Seconds (or milliseconds, or nanoseconds) since 1970 as seconds; None when it is not a time."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        return None
    seconds = float(value)
    while seconds > 1e11:  # milliseconds, microseconds or nanoseconds
        seconds /= 1000
    return seconds


def iso_from_epoch(value: object, fallback: str) -> str:
    """Seconds (or milliseconds, or nanoseconds) since 1970 as this server's time format."""
    seconds = epoch_seconds(value)
    if seconds is None:
        return fallback
    try:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):
        return fallback
    return stamp + f".{int(seconds % 1 * 1000):03d}Z"


def checked_content(text: str) -> str:
    if len(text) > MAX_CONTENT_CHARS:
        raise Unreadable(f"a message is over {MAX_CONTENT_CHARS} characters")
    return text


UNTITLED = "Imported conversation"


def clean_title(value: object) -> str:
    return one_line(value)[:MAX_TITLE_CHARS] if isinstance(value, str) and value.strip() else UNTITLED


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _short(text: str, limit: int = SUMMARY_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _arguments(text: str, key: str) -> dict:
    """A call's input as the object the trail shows: its JSON when it is an object, else {key: text}."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {key: text[:MAX_STEP_TEXT]}


def system_prompt_of(texts: list[str]) -> str | None:
    """One system prompt from the system messages a conversation had (each once, in order)."""
    kept = list(dict.fromkeys(t.strip() for t in texts if t.strip()))
    return checked_content("\n\n".join(kept)) if kept else None


def roles_note(roles: Counter[str]) -> dict | None:
    """The warning for messages of roles this server has no place for, left out."""
    if not roles:
        return None
    named = ", ".join(f"{n} “{one_line(r)[:40]}”" for r, n in roles.most_common(5))
    return {"code": "roles_skipped",
            "message": f"Messages left out, their role has no place here: {named}. This server keeps user and assistant "
                       "messages (tool results go into the reply's activity, system messages into the system prompt)."}


def _finish(conv: ImportedConversation, system: list[str], roles: Counter[str]) -> ImportedConversation:
    prompt = system_prompt_of(system)
    if prompt:
        conv["system_prompt"] = prompt
    note = roles_note(roles)
    if note:
        conv["notes"] = [note]
    return conv


# ChatGPT ----------------------------------------------------------------------------------------


def from_chatgpt(item: dict) -> ImportedConversation:
    mapping = item.get("mapping")
    if not isinstance(mapping, dict):
        raise Unreadable("it has no `mapping` of messages")
    created = iso_from_epoch(item.get("create_time"), now_iso())
    created_epoch = epoch_seconds(item.get("create_time")) or time.time()
    raw: dict[str, Raw] = {}
    order: dict[str, list[str]] = {}
    system: list[str] = []
    roles: Counter[str] = Counter()
    for key, node in mapping.items():
        if not isinstance(node, dict):
            raise Unreadable(f"message {str(key)[:40]} is not an object")
        parent = node.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise Unreadable(f"message {str(key)[:40]} has a parent that is not an id")
        kids = node.get("children") or []
        if not isinstance(kids, list):
            raise Unreadable(f"message {str(key)[:40]} has children that are not a list")
        order[key] = [k for k in kids if isinstance(k, str)]
        raw[key] = chatgpt_node(node.get("message"), parent, created, created_epoch, system, roles)
    nodes, current = build_tree(raw, order, _str(item.get("current_node")))
    models = [n["model"] for n in current_path(nodes, current) if n.get("model")]
    return _finish({
        "title": clean_title(item.get("title")), "created_at": created,
        "updated_at": iso_from_epoch(item.get("update_time"), created),
        "model": _str(item.get("default_model_slug")) or (models[-1] if models else None),
        "nodes": nodes, "current": current,
    }, system, roles)


def chatgpt_node(message: object, parent: str | None, fallback_time: str, fallback_epoch: float,
                 system: list[str], roles: Counter[str]) -> Raw:
    """One mapping node: a kept user or assistant message, or a left-out one that may carry
    activity steps (reasoning, a tool call or its result) for the reply below it, or a system
    prompt (added to `system`); roles with no place here are counted in `roles`."""
    out: Raw = {"parent": parent, "role": None, "content": "", "created_at": fallback_time, "model": None}
    if not isinstance(message, dict):
        return out
    author = message.get("author") if isinstance(message.get("author"), dict) else {}
    metadata = message.get("metadata") if isinstance(message.get("metadata"), dict) else {}
    content = message.get("content") if isinstance(message.get("content"), dict) else {}
    out["created_at"] = iso_from_epoch(message.get("create_time"), fallback_time)
    at = epoch_seconds(message.get("create_time")) or fallback_epoch
    role, kind = author.get("role"), content.get("content_type")
    if kind == "user_editable_context" or metadata.get("is_user_system_message"):
        # Custom instructions: what ChatGPT sent as the system's context for this conversation.
        system += [t for t in (content.get("user_profile"), content.get("user_instructions")) if isinstance(t, str)]
        return out
    if role == "system":
        if not metadata.get("is_visually_hidden_from_conversation"):
            system.append(chatgpt_text(content))
        return out
    if metadata.get("is_visually_hidden_from_conversation"):
        return out
    if role == "tool":
        out["steps"] = chatgpt_tool_result(content, _str(author.get("name")) or "tool", at, message.get("status"))
        return out
    if role not in ROLES:
        if isinstance(role, str) and role:
            roles[role] += 1
        return out
    if role == "assistant":
        recipient = message.get("recipient")
        if recipient not in (None, "all"):
            # An assistant message to a tool ("browser", "python", "web.run"...) is a call, not a reply.
            text = content.get("text") if isinstance(content.get("text"), str) else chatgpt_text(content)
            out["steps"] = [{"kind": "tool", "call_id": _str(message.get("id")) or "", "name": str(recipient)[:100],
                             "arguments": _arguments(text, "code" if kind == "code" else "input"),
                             "status": "done", "at": at}]
            return out
        if kind in ("thoughts", "reasoning_recap"):
            out["steps"] = chatgpt_reasoning(content, metadata, at)
            return out
    text = chatgpt_text(content)
    if not text.strip():
        return out
    out["role"], out["content"] = role, checked_content(text)
    images = chatgpt_images(content)
    if images:
        out["images"] = images
    out["model"] = _str(metadata.get("model_slug")) if role == "assistant" else None
    return out


def chatgpt_reasoning(content: dict, metadata: dict, at: float) -> list[dict]:
    """A `thoughts` message as a thinking step; a `reasoning_recap` as the duration of the one above it."""
    if content.get("content_type") == "reasoning_recap":
        seconds = metadata.get("finished_duration_sec")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 86_400:
            return []
        return [{"kind": "thinking", "text": "", "started_at": at, "ended_at": at, "merge": "duration",
                 "seconds": float(seconds)}]
    thoughts = content.get("thoughts") if isinstance(content.get("thoughts"), list) else []
    parts = []
    for thought in thoughts:
        if not isinstance(thought, dict):
            continue
        summary, body = _str(thought.get("summary")), _str(thought.get("content"))
        parts.append("\n".join(p for p in (summary, body) if p))
    text = "\n\n".join(p for p in parts if p)
    return [{"kind": "thinking", "text": text[:MAX_STEP_TEXT], "started_at": at, "ended_at": at}] if text else []


def chatgpt_tool_result(content: dict, name: str, at: float, status: object) -> list[dict]:
    """A tool's message: a page it quoted as a fetch step, anything else as the result of the call above."""
    kind = content.get("content_type")
    if kind == "tether_quote" and isinstance(content.get("url"), str):
        return [{"kind": "fetch", "url": content["url"][:2000], "title": _str(content.get("title")), "ok": True, "at": at}]
    if kind == "tether_browsing_display":
        text = content.get("result") if isinstance(content.get("result"), str) else ""
    elif kind == "system_error":
        text = str(content.get("text") or content.get("name") or "error")
    else:
        text = content.get("text") if isinstance(content.get("text"), str) else chatgpt_text(content)
    failed = kind == "system_error" or status not in (None, "finished_successfully")
    step: dict = {"kind": "tool", "call_id": "", "name": name[:100], "arguments": {},
                  "status": "error" if failed else "done", "summary": _short(text) if text.strip() else "", "at": at,
                  "merge": True}
    if failed:
        step["error"] = _short(text) or "failed"
    return [step]


def chatgpt_text(content: object) -> str:
    """The readable text of a message's content; reasoning and tool output give ''."""
    if not isinstance(content, dict):
        return ""
    kind = content.get("content_type")
    if kind in ("text", "multimodal_text"):
        parts = content.get("parts") if isinstance(content.get("parts"), list) else []
        pieces = []
        for part in parts:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, dict):
                # Images and files are not in the export's JSON; say one was there.
                pieces.append(IMAGE_MARK if "image" in str(part.get("content_type", "")) else "[attachment]")
        return "\n\n".join(p for p in pieces if p)
    if kind == "code" and isinstance(content.get("text"), str):
        return f"```{content.get('language') or ''}\n{content['text']}\n```"
    if kind in ("thoughts", "reasoning_recap", "execution_output", "tether_browsing_display",
                "tether_quote", "system_error", "user_editable_context"):
        return ""
    return content.get("text") if isinstance(content.get("text"), str) else ""


def chatgpt_images(content: dict) -> list[str]:
    """The asset ids of the images a message's parts point to, in order ("file-service://file-AbC"
    gives "file-AbC"; "sediment://file_00ab" gives "file_00ab"): the names of the image files
    beside conversations.json in the export's zip start with them."""
    parts = content.get("parts") if isinstance(content.get("parts"), list) else []
    out = []
    for part in parts:
        if isinstance(part, dict) and "image" in str(part.get("content_type", "")):
            pointer = part.get("asset_pointer")
            if isinstance(pointer, str):
                asset = pointer.rsplit("://", 1)[-1].rsplit("/", 1)[-1]
                if ASSET_ID.fullmatch(asset):
                    out.append(asset)
    return out[:MAX_MESSAGE_IMAGES]


def without_image_marks(content: str, count: int) -> str:
    """`content` with its first `count` "[image]" marks taken out (those images are attached now)."""
    pieces = content.split("\n\n")
    kept = []
    for piece in pieces:
        if count and piece == IMAGE_MARK:
            count -= 1
            continue
        kept.append(piece)
    return "\n\n".join(kept)


# Open WebUI -------------------------------------------------------------------------------------

SUMMARY_TAG = re.compile(r"^\s*<summary\b[^>]*>.*?</summary>", re.S | re.I)
ATTRIBUTE = re.compile(r"([\w-]+)\s*=\s*\"([^\"]*)\"")
THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)


def details_blocks(content: str) -> Iterator[tuple[int, int, str, str]]:
    """(start, end, attributes, body) of each `<details ...>...</details>` block, in one pass
    (a regular expression rescanned the rest of a long reply for each unclosed tag)."""
    at = 0
    while (start := content.find("<details", at)) != -1:
        head = content.find(">", start)
        if head == -1:
            return
        if content[start + 8] not in " \t\n>":  # <detailsfoo>: not this tag
            at = start + 8
            continue
        close = content.find("</details>", head)
        if close == -1:
            return
        end = close + len("</details>")
        if content.startswith("\n", end):
            end += 1
        yield start, end, content[start + 8:head], content[head + 1:close]
        at = end


def open_webui_reply(content: str, at: float) -> tuple[str, list[dict]]:
    """An assistant message's visible text and its activity steps: Open WebUI keeps reasoning
    (`<details type="reasoning">`), tool calls (`type="tool_calls"`) and code it ran
    (`type="code_interpreter"`) as HTML in the reply; an older one, `<think>` at its start."""
    if "<details" not in content and "<think>" not in content:
        return content, []
    steps: list[dict] = []
    think = THINK.match(content)
    if think:
        steps.append({"kind": "thinking", "text": think.group(1).strip()[:MAX_STEP_TEXT], "started_at": at, "ended_at": at})
        content = content[think.end():]
    kept, copied_to = [], 0
    for start, end, head, body in details_blocks(content):
        attributes = {k.lower(): html.unescape(v) for k, v in ATTRIBUTE.findall(head)}
        kind = attributes.get("type")
        if not kind:
            continue  # a <details> the model wrote itself is its text
        kept.append(content[copied_to:start])
        copied_to = end
        if len(steps) < MAX_STEPS:
            body = html.unescape(SUMMARY_TAG.sub("", body, count=1)).strip()
            steps.append(open_webui_step(kind, attributes, body, at, len(steps)))
    kept.append(content[copied_to:])
    return "".join(kept).strip(), steps


def open_webui_step(kind: str, attributes: dict[str, str], body: str, at: float, index: int) -> dict:
    if kind == "reasoning":
        text = re.sub(r"(?m)^> ?", "", body)  # Open WebUI quotes each line of a thought
        try:
            seconds = min(max(float(attributes.get("duration", "0")), 0.0), 86_400.0)
        except ValueError:
            seconds = 0.0
        return {"kind": "thinking", "text": text[:MAX_STEP_TEXT], "started_at": at - seconds, "ended_at": at}
    if kind == "code_interpreter":
        code = re.sub(r"^```\w*\n?|```$", "", body).strip()
        result = attributes.get("output", "")
        return {"kind": "tool", "call_id": attributes.get("id") or f"imported-{index}", "name": "code_interpreter",
                "arguments": {"code": code[:MAX_STEP_TEXT]}, "status": "done", "summary": _short(_result_text(result)),
                "at": at}
    name = attributes.get("name") or ("tool" if kind == "tool_calls" else kind)
    arguments = _arguments(attributes["arguments"], "input") if attributes.get("arguments") else {}
    result = attributes.get("result") if "result" in attributes else body
    return {"kind": "tool", "call_id": attributes.get("id") or f"imported-{index}", "name": name[:100],
            "arguments": arguments, "status": "done", "summary": _short(_result_text(result)), "at": at}


def _result_text(value: str) -> str:
    """A tool result as Open WebUI writes it (often a JSON string or object) as plain text."""
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError:
        return value
    return parsed if isinstance(parsed, str) else orjson.dumps(parsed).decode()


def from_open_webui(item: dict) -> ImportedConversation:
    if isinstance(item.get("chat"), dict):
        chat = item["chat"]
    elif is_bare_chat(item):
        chat = item  # the chat object on its own, without the row around it
    else:
        raise Unreadable("it has no `chat` object (nor a chat's `history` or `messages`)")
    created = iso_from_epoch(item.get("created_at") or chat.get("timestamp"), now_iso())
    created_epoch = epoch_seconds(item.get("created_at") or chat.get("timestamp")) or time.time()
    history = chat.get("history") if isinstance(chat.get("history"), dict) else None
    messages = history.get("messages") if history else None
    current = _str(history.get("currentId")) if history else None
    if not isinstance(messages, dict):
        listed = chat.get("messages")
        if not isinstance(listed, list):
            raise Unreadable("it has neither a message history nor a list of messages")
        messages, previous = {}, None
        for m in listed:
            if not isinstance(m, dict) or not isinstance(m.get("id"), str):
                raise Unreadable("its list of messages holds an entry without an id")
            messages[m["id"]] = {**m, "parentId": m.get("parentId", previous)}
            previous = m["id"]
        current = previous
    params = chat.get("params") if isinstance(chat.get("params"), dict) else {}
    system = [t for t in (chat.get("system"), params.get("system")) if isinstance(t, str)]
    roles: Counter[str] = Counter()
    raw: dict[str, Raw] = {}
    order: dict[str, list[str]] = {}
    for key, m in messages.items():
        if not isinstance(m, dict):
            raise Unreadable(f"message {str(key)[:40]} is not an object")
        parent = m.get("parentId")
        if parent is not None and not isinstance(parent, str):
            raise Unreadable(f"message {str(key)[:40]} has a parent that is not an id")
        kids = m.get("childrenIds") or []
        order[key] = [k for k in kids if isinstance(k, str)] if isinstance(kids, list) else []
        raw[key] = open_webui_node(m, parent, iso_from_epoch(m.get("timestamp"), created),
                                   epoch_seconds(m.get("timestamp")) or created_epoch, system, roles)
    nodes, leaf = build_tree(raw, order, current)
    models = chat.get("models") if isinstance(chat.get("models"), list) else []
    return _finish({
        "title": clean_title(item.get("title") or chat.get("title")), "created_at": created,
        "updated_at": iso_from_epoch(item.get("updated_at") or chat.get("timestamp"), created),
        "model": next((m for m in models if isinstance(m, str) and m), None),
        "nodes": nodes, "current": leaf,
    }, system, roles)


def open_webui_node(m: dict, parent: str | None, stamp: str, at: float, system: list[str], roles: Counter[str]) -> Raw:
    out: Raw = {"parent": parent, "role": None, "content": "", "created_at": stamp, "model": None}
    role, content = m.get("role"), m.get("content")
    if not isinstance(content, str):
        return out
    if role == "system":
        system.append(content)
    elif role == "tool":
        name = _str(m.get("name")) or "tool"
        out["steps"] = [{"kind": "tool", "call_id": "", "name": name[:100], "arguments": {}, "status": "done",
                         "summary": _short(content), "at": at, "merge": True}]
    elif role == "assistant":
        text, steps = open_webui_reply(checked_content(content), at)
        if text or steps:
            out.update(role="assistant", content=text, model=_str(m.get("model")))
            if steps:
                out["steps"] = steps
    elif role == "user":
        if content.strip():
            out.update(role="user", content=checked_content(content))
    elif isinstance(role, str) and role:
        roles[role] += 1
    return out


def _check_time(value: str) -> str:
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("not a time like 2024-05-29T16:26:40.122Z") from None
    return value


Time = Annotated[str, Field(max_length=64), AfterValidator(_check_time)]
ModelName = Annotated[str, Field(max_length=200)]


class _Exported(BaseModel):
    # Strict: a number is not a string. Fields this server does not import (a message's usage,
    # activity...) are not read, so they are not checked either.
    model_config = ConfigDict(strict=True, extra="ignore")


class ExportedNode(_Exported):
    id: str = Field(min_length=1, max_length=200)
    parent_id: str | None = None
    role: str  # "user" and "assistant" are imported; notices and anything else are left out
    content: str
    created_at: Time | None = None
    model: ModelName | None = None
    # Shown, never sent upstream: each step is checked on its own and one of another shape left
    # out (an older server's step, another version's), never the conversation.
    activity: Any = None


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
ShortText = Annotated[str, Field(max_length=MAX_STEP_TEXT)]


class ExportedThinking(_Exported):
    kind: Literal["thinking"]
    text: ShortText
    started_at: Seconds
    ended_at: Seconds


class ExportedResult(_Exported):
    url: Annotated[str, Field(max_length=2000)]
    title: ShortText | None = None
    page_age: Annotated[str, Field(max_length=100)] | None = None


class ExportedSearch(_Exported):
    kind: Literal["search"]
    query: ShortText
    results: list[ExportedResult] | None = None
    at: Seconds
    error: Annotated[str, Field(max_length=100)] | None = None


class ExportedFetch(_Exported):
    kind: Literal["fetch"]
    url: Annotated[str, Field(max_length=2000)]
    title: ShortText | None = None
    ok: bool
    at: Seconds
    error: Annotated[str, Field(max_length=100)] | None = None


class ExportedTool(_Exported):
    kind: Literal["tool"]
    call_id: Annotated[str, Field(max_length=200)]
    name: Annotated[str, Field(max_length=200)]
    arguments: dict
    status: Literal["running", "done", "error"]
    summary: ShortText | None = None
    error: ShortText | None = None
    duration_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    at: Seconds


ExportedStep: TypeAdapter = TypeAdapter(Annotated[ExportedThinking | ExportedSearch | ExportedFetch | ExportedTool,
                                                  Field(discriminator="kind")])


def own_steps(value: object) -> list[dict]:
    """The steps of an exported reply's `activity` that have one of our shapes, as stored."""
    steps = []
    for item in value[:MAX_STEPS] if isinstance(value, list) else []:
        try:
            step = ExportedStep.validate_python(item)
        except ValidationError:
            continue
        out = step.model_dump(exclude_none=True)
        if out["kind"] == "search":
            out["results"] = out.get("results")  # null means "no results yet", which the page shows
        steps.append(out)
    return steps


class ExportedFolded(_Exported):
    """A message of `archive`: the same ids as its nodes, or (an older export) outside the tree."""

    id: str | None = None
    role: str
    content: str
    created_at: Time | None = None
    model: ModelName | None = None


class ExportedConversation(_Exported):
    """One conversation of this server's export: every field it imports, type-checked, so what
    is stored is what the rest of the server can read (a number as a folded message's `model`
    made every Markdown export of it fail)."""

    title: str | None = None
    model: ModelName | None = None
    created_at: Time | None = None
    updated_at: Time | None = None
    summary: str | None = Field(None, max_length=MAX_CONTENT_CHARS)
    settings: dict | None = None
    nodes: list[ExportedNode]
    current: str | None = None
    archive: list[ExportedFolded] | None = None


def field_errors(exc: ValidationError) -> str:
    """The first problems of a ValidationError, each named by its field (`nodes[3].model: ...`)."""
    out = []
    for error in exc.errors()[:3]:
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
        out.append(f"{where}: {error['msg']}" if where else error["msg"])
    return "; ".join(out)


def from_own(item: dict) -> ImportedConversation:
    try:
        conv = ExportedConversation.model_validate(item)
    except ValidationError as exc:
        raise Unreadable(field_errors(exc)) from None
    created = conv.created_at or now_iso()
    raw: dict[str, Raw] = {}
    for n in conv.nodes:
        if n.id in raw:
            raise Unreadable("two messages share an id")
        role = n.role if n.role in ROLES and n.content.strip() else None
        raw[n.id] = {"parent": n.parent_id, "role": role, "content": checked_content(n.content) if role else "",
                     "created_at": n.created_at or created, "model": n.model if role == "assistant" else None}
        if role == "assistant" and n.activity:
            raw[n.id]["steps"] = own_steps(n.activity)
    order = {None: [n.id for n in conv.nodes]}  # the file lists parents before children, siblings in order
    fresh: dict[str, str] = {}
    tree, leaf = build_tree(raw, order, conv.current or None, fresh)
    archived = conv.archive or []
    # An export that lists its folded messages among the nodes too says which they were by id;
    # an older one holds them only in `archive`, outside the tree.
    folded = [fresh[m.id] for m in archived if m.id in fresh]
    archive = [] if folded else [
        {"role": m.role, "content": checked_content(m.content), "created_at": m.created_at or created,
         **({"model": m.model} if m.model and m.role == "assistant" else {})}
        for m in archived if m.role in ROLES
    ]
    out: ImportedConversation = {
        "title": clean_title(conv.title), "created_at": created, "updated_at": conv.updated_at or created,
        "model": conv.model or None, "nodes": tree, "current": leaf,
    }
    if folded:
        out["folded"] = folded
    if archive:
        out["archive"] = archive
    if conv.summary:
        out["summary"] = conv.summary
    return out
