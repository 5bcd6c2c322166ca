"""Conversations out (Markdown, this server's JSON) and in (this server's JSON, ChatGPT, Open WebUI).

Every import becomes the same neutral tree, `ImportedConversation`: nodes with fresh ids and
`parent_id` links (None for roots), roles "user" or "assistant" only, and `current`, the leaf of
the path that was on screen. System, tool and hidden messages, reasoning and empty messages are
left out, and their children hang from the nearest message that was kept, so the tree stays
connected. A file that cannot be read raises `Unreadable` with the reason, before anything is
returned: callers store nothing then.

This module knows the export formats and the shape of a stored conversation's messages
(`id`, `role`, `content`, `created_at`, `model`, optional `parent_id`); it does not know how
conversations are stored, or whose they are.
"""

from __future__ import annotations

import time
import unicodedata
from collections import Counter
from datetime import datetime
from typing import Annotated, Callable, Iterator, NotRequired, TypedDict
from urllib.parse import quote

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

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

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Node(TypedDict):
    id: str
    parent_id: str | None
    role: str
    content: str
    created_at: str
    model: NotRequired[str]


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


def export_markdown(conv: dict) -> str:
    """The current path as Markdown: folded messages first, in a marked section; notices as quotes."""
    title = one_line(conv.get("title") or "Conversation")
    out = [f"# {title}", ""]
    if conv.get("model"):
        out.append(f"- Model: {conv['model']}")
    out += [f"- Created: {conv.get('created_at', '')}", f"- Exported: {now_iso()}", ""]
    archive = conv.get("archive") or []
    if archive:
        out += ["## Earlier messages (folded into the summary)", "",
                "> These messages were folded by compression: the model saw them only through the summary.", ""]
        out += [line for m in archive for line in markdown_message(m)]
        out += ["## Conversation", ""]
    for m in conv.get("messages", []):
        out += markdown_message(m)
    return "\n".join(out).rstrip("\n") + "\n"


def markdown_message(m: dict) -> list[str]:
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
    sources = [c for c in m.get("citations") or [] if isinstance(c, dict) and isinstance(c.get("url"), str)]
    if sources:
        lines += ["Sources:", ""] + [f"- [{one_line(c.get('title') or c['url'])}]({c['url']})" for c in sources] + [""]
    return lines


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


def parse_import(raw: bytes, progress: Callable[[int, int], None] | None = None) -> list[ImportedConversation]:
    """Every conversation in the file, or Unreadable; `progress(done, total)` after each one."""
    out = []
    for done, total, conv in iter_import(raw):
        out.append(conv)
        if progress is not None:
            progress(done, total)
    return out


def iter_import(raw: bytes) -> Iterator[tuple[int, int, ImportedConversation]]:
    """(done, total, conversation) one at a time; Unreadable may come at any one of them."""
    if len(raw) > MAX_IMPORT_BYTES:
        raise Unreadable(f"the file is over {MAX_IMPORT_BYTES // (1024 * 1024)} MB")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Unreadable(f"the file is not JSON ({exc})") from None
    kind, items = detect(data)
    if not items:
        raise Unreadable("the file holds no conversations")
    if len(items) > MAX_CONVERSATIONS:
        raise Unreadable(f"the file holds over {MAX_CONVERSATIONS} conversations")
    convert = {"chat-server": from_own, "chatgpt": from_chatgpt, "open-webui": from_open_webui}[kind]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise Unreadable(f"conversation {i + 1} is not an object")
        title = item.get("title") if isinstance(item.get("title"), str) else ""
        where = f"conversation {i + 1}" + (f" (“{one_line(title)[:60]}”)" if title else "")
        try:
            converted = convert(item)
        except Unreadable as exc:
            raise Unreadable(f"{where}: {exc.reason}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            # A shape no check above foresaw is still the file's fault, not the server's.
            raise Unreadable(f"{where}: an unexpected shape ({type(exc).__name__}: {str(exc)[:100]})") from None
        yield i + 1, len(items), converted


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
    first = next((item for item in data if isinstance(item, dict)), None)
    if first is None:
        return "chatgpt", data
    if isinstance(first.get("mapping"), dict):
        return "chatgpt", data
    if isinstance(first.get("chat"), dict):
        return "open-webui", data
    raise Unreadable("not a ChatGPT, Open WebUI or chat-server export (no `mapping` or `chat` in its conversations)")


class Raw(TypedDict):
    parent: str | None
    role: str | None  # None: left out, its children hang from its parent
    content: str
    created_at: str
    model: str | None


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
    # where walking up from each node made long chains of left-out nodes quadratic.
    kept_at: dict[str | None, str | None] = {None: None}
    kept_children: Counter[str | None] = Counter()
    nodes: list[Node] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        old = stack.pop()
        node = raw[old]
        above = kept_at[node["parent"]]
        if node["role"] is None:
            kept_at[old] = above
        else:
            kept_at[old] = old
            kept_children[above] += 1
            if kept_children[above] > MAX_SIBLINGS:
                raise Unreadable(f"a message has over {MAX_SIBLINGS} versions side by side "
                                 "(answers or edits of the same point)")
            out: Node = {"id": fresh[old], "parent_id": fresh.get(above),
                         "role": node["role"], "content": node["content"], "created_at": node["created_at"]}
            if node["model"]:
                out["model"] = node["model"]
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


def iso_from_epoch(value: object, fallback: str) -> str:
    """Seconds (or milliseconds, or nanoseconds) since 1970 as this server's time format."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return fallback
    seconds = float(value)
    while seconds > 1e11:  # milliseconds, microseconds or nanoseconds
        seconds /= 1000
    try:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):
        return fallback
    return stamp + f".{int(seconds % 1 * 1000):03d}Z"


def checked_content(text: str) -> str:
    if len(text) > MAX_CONTENT_CHARS:
        raise Unreadable(f"a message is over {MAX_CONTENT_CHARS} characters")
    return text


def clean_title(value: object) -> str:
    return one_line(value)[:MAX_TITLE_CHARS] if isinstance(value, str) and value.strip() else "Imported conversation"


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def from_chatgpt(item: dict) -> ImportedConversation:
    mapping = item.get("mapping")
    if not isinstance(mapping, dict):
        raise Unreadable("it has no `mapping` of messages")
    created = iso_from_epoch(item.get("create_time"), now_iso())
    raw: dict[str, Raw] = {}
    order: dict[str, list[str]] = {}
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
        role, content, model, stamp = chatgpt_message(node.get("message"), created)
        raw[key] = {"parent": parent, "role": role, "content": content, "created_at": stamp, "model": model}
    nodes, current = build_tree(raw, order, _str(item.get("current_node")))
    models = [n["model"] for n in current_path(nodes, current) if n.get("model")]
    return {
        "title": clean_title(item.get("title")), "created_at": created,
        "updated_at": iso_from_epoch(item.get("update_time"), created),
        "model": _str(item.get("default_model_slug")) or (models[-1] if models else None),
        "nodes": nodes, "current": current,
    }


def chatgpt_message(message: object, fallback_time: str) -> tuple[str | None, str, str | None, str]:
    """(role or None to leave it out, text, model, time) of one mapping node's message."""
    if not isinstance(message, dict):
        return None, "", None, fallback_time
    author = message.get("author") if isinstance(message.get("author"), dict) else {}
    metadata = message.get("metadata") if isinstance(message.get("metadata"), dict) else {}
    stamp = iso_from_epoch(message.get("create_time"), fallback_time)
    role = author.get("role")
    hidden = metadata.get("is_visually_hidden_from_conversation") or metadata.get("is_user_system_message")
    # An assistant message to a tool (recipient "browser", "python"...) is a call, not a reply.
    to_tool = message.get("recipient") not in (None, "all")
    if role not in ROLES or hidden or to_tool:
        return None, "", None, stamp
    text = chatgpt_text(message.get("content"))
    if not text.strip():
        return None, "", None, stamp
    model = _str(metadata.get("model_slug")) if role == "assistant" else None
    return role, checked_content(text), model, stamp


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
                pieces.append("[image]" if "image" in str(part.get("content_type", "")) else "[attachment]")
        return "\n\n".join(p for p in pieces if p)
    if kind == "code" and isinstance(content.get("text"), str):
        return f"```{content.get('language') or ''}\n{content['text']}\n```"
    if kind in ("thoughts", "reasoning_recap", "execution_output", "tether_browsing_display",
                "tether_quote", "system_error", "user_editable_context"):
        return ""
    return content.get("text") if isinstance(content.get("text"), str) else ""


def from_open_webui(item: dict) -> ImportedConversation:
    chat = item.get("chat")
    if not isinstance(chat, dict):
        raise Unreadable("it has no `chat` object")
    created = iso_from_epoch(item.get("created_at") or chat.get("timestamp"), now_iso())
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
        content = m.get("content")
        role = m.get("role") if m.get("role") in ROLES and isinstance(content, str) and content.strip() else None
        raw[key] = {"parent": parent, "role": role, "content": checked_content(content) if role else "",
                    "created_at": iso_from_epoch(m.get("timestamp"), created),
                    "model": _str(m.get("model")) if role == "assistant" else None}
    nodes, leaf = build_tree(raw, order, current)
    models = chat.get("models") if isinstance(chat.get("models"), list) else []
    return {
        "title": clean_title(item.get("title") or chat.get("title")), "created_at": created,
        "updated_at": iso_from_epoch(item.get("updated_at"), created),
        "model": next((m for m in models if isinstance(m, str) and m), None),
        "nodes": nodes, "current": leaf,
    }


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
