"""Shared read-only copies: a snapshot of a conversation's current path that anyone with its link
may read without an account, until its owner revokes it.

Promises:
- The link's id is 32 random URL-safe characters (192 bits from `secrets`): not guessable, never
  a path (`store.files.SHARE_ID`), never derived from the conversation's id.
- A snapshot holds the title, the model and the person's and the model's messages of the current
  path as they were when it was made: no memory, no persona, no summary, no notices, no tool
  rounds or reasoning; the files a message was about (their names only) and the replies' token
  and cost figures only when the person chose them.
- The snapshot (`<store>.write_share`) names its owner; the owner's `shares` document lists
  their links, so Settings can show and revoke them. Revoking deletes both.

It knows conversations' documents and the store, not HTTP or HTML.
"""

from __future__ import annotations

import secrets

import orjson

from chatserver.conversations import branches
from chatserver.conversations.document import now_iso
from chatserver.store.files import NotFound, OwnerStore, Store, check_share_id

DOCUMENT = "shares"
SHARE_ID_BYTES = 24  # 32 URL-safe characters
MAX_SHARES = 1000


class TooManyShares(ValueError):
    pass


def new_share_id() -> str:
    return secrets.token_urlsafe(SHARE_ID_BYTES)


def _listed(raw: bytes | None) -> list[dict]:
    if raw is None:
        return []
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return []
    found = data.get("shares") if isinstance(data, dict) else None
    return [s for s in found or [] if isinstance(s, dict) and isinstance(s.get("id"), str)]


def _dump(shares: list[dict]) -> bytes:
    return orjson.dumps({"version": 1, "shares": shares}, option=orjson.OPT_INDENT_2)


def snapshot_messages(conv: dict, *, costs: bool, file_names: dict[str, str] | None = None) -> list[dict]:
    """The current path's messages as a reader may see them; `file_names` (attachment id -> name):
    the person chose to show which files the messages were about."""
    attachments = file_names is not None
    out = []
    for m in branches.path_items(conv):
        if not branches.is_node(m) or not (m.get("content") or "").strip():
            continue
        shown: dict = {"role": m["role"], "content": m["content"], "created_at": m.get("created_at")}
        if m["role"] == "assistant":
            shown["model"] = m.get("model")
            shown["status"] = m.get("status", "complete")
            web = [c for c in m.get("citations") or [] if "url" in c]
            files = [c for c in m.get("citations") or [] if "attachment_id" in c]
            shown["citations"] = [{"url": c["url"], "title": c.get("title", "")} for c in web]
            if attachments:
                shown["citations"] += [{"name": c.get("name", ""), "label": c.get("label", "")} for c in files]
            if costs and m.get("usage"):
                usage = m["usage"]
                shown["usage"] = {k: usage.get(k) for k in ("input_tokens", "output_tokens", "cost")}
        if file_names is not None and m.get("attachment_ids"):
            shown["files"] = [file_names[i] for i in m["attachment_ids"] if i in file_names]
        out.append(shown)
    return out


class Shares:
    """One person's shared links: made from their conversations, listed and revoked by them only."""

    def __init__(self, store: Store, owner_store: OwnerStore) -> None:
        self.store = store
        self.mine = owner_store

    async def list(self) -> list[dict]:
        return sorted(_listed(await self.mine.read_document(DOCUMENT)), key=lambda s: s["created_at"], reverse=True)

    async def create(self, conv: dict, *, costs: bool, file_names: dict[str, str] | None = None) -> dict:
        """Snapshot the conversation (read through the owner's store) at a new link; the link's entry.
        `file_names`: the names of its files, when the person chose to show them."""
        conv_id = conv["id"]
        messages = snapshot_messages(conv, costs=costs, file_names=file_names)
        attachments = file_names is not None
        entry = {"id": new_share_id(), "conversation_id": conv_id, "title": conv["title"], "created_at": now_iso(),
                 "messages": len(messages), "attachments": attachments, "costs": costs}
        snapshot = {"version": 1, "owner": self.mine.owner, **entry, "model": conv["model"], "messages": messages}

        def add(raw: bytes | None) -> bytes:
            shares = _listed(raw)
            if len(shares) >= MAX_SHARES:
                raise TooManyShares(f"a person may keep at most {MAX_SHARES} shared links; revoke some first")
            return _dump([*shares, entry])

        await self.mine.update_document(DOCUMENT, add)
        await self.store.write_share(entry["id"], orjson.dumps(snapshot))
        return entry

    async def revoke(self, share_id: str) -> None:
        """Delete the person's link and its snapshot; NotFound when it is not theirs."""
        if share_id not in {s["id"] for s in _listed(await self.mine.read_document(DOCUMENT))}:
            raise NotFound(share_id)
        await self.store.delete_share(check_share_id(share_id))

        def drop(raw: bytes | None) -> bytes:
            return _dump([s for s in _listed(raw) if s["id"] != share_id])

        await self.mine.update_document(DOCUMENT, drop)

    async def forget_all(self) -> int:
        """Revoke every link of the person (they are being removed); how many there were."""
        shares = _listed(await self.mine.read_document(DOCUMENT))
        for share in shares:
            await self.store.delete_share(share["id"])
        await self.mine.forget_document(DOCUMENT)
        return len(shares)


async def read_snapshot(store: Store, share_id: str) -> dict:
    """A shared snapshot for anyone holding its link; NotFound for anything else."""
    raw = await store.read_share(share_id)
    if raw is None:
        raise NotFound(share_id)
    return orjson.loads(raw)
