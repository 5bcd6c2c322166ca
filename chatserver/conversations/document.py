"""The conversation document's own rules, the same whichever store keeps it: ids and times, the
schema and its upgrades, the shape every route relies on, recovery of a reply a dead process left
streaming, where a checkpoint goes, and the list entry a conversation shows as."""

from __future__ import annotations

import operator
import re
import secrets
import time
from collections.abc import Callable

from chatserver.conversations.usage import count_reply

SCHEMA_VERSION = 4
# The owner of everything while the server serves one person (AUTH=none).
LOCAL_OWNER = "local"
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{8,64}")

def new_id() -> str:
    """A random, unguessable id that is safe as a file name."""
    return secrets.token_urlsafe(16)


def valid_id(value: str) -> bool:
    return ID_PATTERN.fullmatch(value) is not None


def starts_with(items: list, prefix: list) -> bool:
    """Whether `items` begins with the messages of `prefix`: the very dicts, or equal ones.

    Stored messages are replaced, never edited in place, so this tells whether any before the
    end of `prefix` was removed, moved or replaced. Comparing a slice runs in C and checks
    identity before equality: about 7x faster than walking pairs with `operator.is_` (20 against
    140 us over 10,000 messages), and it runs several times a turn.
    """
    return len(items) >= len(prefix) and items[:len(prefix)] == prefix


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"

def empty_totals() -> dict:
    return {
        "input_tokens": 0, "output_tokens": 0, "cached_tokens": 0, "searches": 0, "fetches": 0,
        "cost": 0.0, "cost_unreported": 0, "turns": 0,
        "compression_cost": 0.0, "compression_calls": 0,
        "title_cost": 0.0, "title_calls": 0,
    }


def _upgrade_unversioned(conv: dict) -> dict:
    """Version 0 (hand-written or pre-release files): fill every field the server relies on."""
    conv.setdefault("title", "New conversation")
    conv.setdefault("created_at", now_iso())
    conv.setdefault("updated_at", conv["created_at"])
    conv.setdefault("settings", {})
    conv.setdefault("summary", "")
    conv.setdefault("messages", [])
    conv.setdefault("last_prompt_tokens", None)
    conv["totals"] = {**empty_totals(), **conv.get("totals", {})}
    return conv


def _allow_earlier_messages(conv: dict) -> dict:
    """Version 2 may keep sealed messages in segment files; a version-1 file simply has none.

    The version is bumped so that an older server refuses such a file instead of reading a
    conversation that seems to start in the middle.
    """
    return conv


def _add_owner(conv: dict) -> dict:
    """Version 3 names the conversation's owner; everything older was the one local person's."""
    conv.setdefault("owner", LOCAL_OWNER)
    return conv


def _add_branches(conv: dict) -> dict:
    """Version 4 keeps branches (`parent_id`, `off_path`, `folds`: see branches.py), pin and archive
    flags and where the title came from. An older file is one path: each message's parent is the
    user/assistant message before it. Where a list starts after sealed segments that are not read
    here, the parent stays implicit (that same rule, applied when it is read)."""
    if not conv.get("earlier_messages") and not conv.get("earlier_archive"):
        previous = None
        for m in (conv.get("archive") or []) + (conv.get("messages") or []):
            if isinstance(m, dict):
                m.setdefault("parent_id", previous)
                if m.get("role") in ("user", "assistant") and isinstance(m.get("id"), str):
                    previous = m["id"]
    conv.setdefault("pinned", False)
    conv.setdefault("archived", False)
    conv.setdefault("title_source", "auto")
    if isinstance(conv.get("totals"), dict):
        conv["totals"] = {**empty_totals(), **conv["totals"]}
    return conv


# Upgrades in order: MIGRATIONS[n] turns a version-n file into version n+1.
MIGRATIONS: list[Callable[[dict], dict]] = [_upgrade_unversioned, _allow_earlier_messages, _add_owner, _add_branches]


def upgrade(conv: dict) -> dict:
    version = conv.get("schema_version", 0)
    if not isinstance(version, int) or version > SCHEMA_VERSION or version < 0:
        raise ValueError(f"unknown schema_version {version!r}")
    for migrate in MIGRATIONS[version:]:
        conv = migrate(conv)
    conv["schema_version"] = SCHEMA_VERSION
    return conv


def check_shape(conv: dict) -> None:
    """The fields every route relies on have the right types; ValueError names the first that does not."""
    for name in ("id", "owner", "title", "model", "created_at", "updated_at", "summary"):
        if not isinstance(conv.get(name), str):
            raise ValueError(f"{name} is not a string")
    if not isinstance(conv.get("settings"), dict) or not isinstance(conv.get("totals"), dict):
        raise ValueError("settings or totals is not an object")
    messages = conv.get("messages")
    if not isinstance(messages, list):
        raise ValueError("messages is not a list")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("id"), str) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError("messages holds an entry without a string id, role and content")


def recover_interrupted(conv: dict) -> bool:
    """Replies left `streaming` by a turn that no longer runs become `interrupted`; True if any did.

    Call it only while no turn holds the conversation's lock: a checkpoint is then all that is
    left of a reply whose process died (SIGKILL, power cut). Its usage is an estimate and says so,
    and it is counted in the totals as the final save would have counted it.
    """
    found = False
    totals = conv["totals"]
    for message in streaming_replies(conv):
        found = True
        message["status"] = "interrupted"
        usage = message.get("usage")
        if isinstance(usage, dict):
            usage["estimated"] = True
            count_reply(totals, usage)
        else:
            totals["turns"] = totals.get("turns", 0) + 1
    return found


def streaming_replies(conv: dict) -> list[dict]:
    """The replies stored `streaming` (checkpoints): after the last question on the path, and off
    it, where a comparison's other replies are its siblings."""
    found = []
    # A reply always follows the question it answers: only what comes after the last one is looked at.
    for message in reversed(conv.get("messages") or []):
        if message.get("role") == "user":
            break
        if message.get("role") == "assistant" and message.get("status") == "streaming":
            found.append(message)
    found += [m for m in conv.get("off_path") or () if m.get("status") == "streaming" and m.get("role") == "assistant"]
    return found


def place_checkpoint(conv: dict, message: dict, *, off_path: bool = False) -> bool:
    """Put a streaming reply's latest state in `conv`: it replaces the copy with its id while that
    is still `streaming`, or comes last (on the path, or `off_path` for a comparison's other
    replies); a settled reply is never touched. True if `conv` changed."""
    messages = conv.setdefault("off_path", []) if off_path else conv["messages"]
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("id") == message["id"]:
            if messages[i].get("status") != "streaming":
                return False
            messages[i] = message
            return True
    messages.append(message)
    return True

_ROLE = operator.itemgetter("role")
# Long conversations' counted messages: the very dicts counted (all but the last, which a
# checkpoint replaces) and how many of them are notices. Every change of a conversation tells the
# list its entry, twice a turn; checking the counted prefix (`starts_with`) is several times cheaper than reading each
# message's role again. Bounded, and dropped when the conversation is deleted (`forget_counted`).
COUNTED_FROM = 1000
COUNTED_KEPT = 32
_counted: dict[str, tuple[list[dict], int]] = {}


def _notices(conv_id: str, messages: list[dict]) -> int:
    if len(messages) < COUNTED_FROM:
        return list(map(_ROLE, messages)).count("notice")
    known = _counted.pop(conv_id, None)
    keep = len(messages) - 1
    if known is not None and len(known[0]) <= keep and starts_with(messages, known[0]):
        prefix, notices = known
        notices += list(map(_ROLE, messages[len(prefix):keep])).count("notice")
    else:
        notices = list(map(_ROLE, messages[:keep])).count("notice")
    _counted[conv_id] = (messages[:keep], notices)
    while len(_counted) > COUNTED_KEPT:
        del _counted[next(iter(_counted))]
    return notices + (messages[-1]["role"] == "notice")


def forget_counted(conv_id: str) -> None:
    """A deleted conversation's messages are not kept here."""
    _counted.pop(conv_id, None)


def summary_of(conv: dict) -> dict:
    """One conversation as the list shows it (API.md's list entry)."""
    messages = conv["messages"]
    last = next((m["created_at"] for m in reversed(messages) if m["role"] != "notice"), None)
    return {
        "id": conv["id"], "title": conv["title"], "model": conv["model"], "updated_at": conv["updated_at"],
        "message_count": len(messages) - _notices(conv["id"], messages),
        "last_message_at": last or conv["created_at"],
        "pinned": bool(conv.get("pinned")), "archived": bool(conv.get("archived")),
        "project_id": conv.get("project_id"),
    }
