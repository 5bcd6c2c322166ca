"""A conversation's message tree: the current path in `archive` + `messages`, the rest in `off_path`.

Promises:
- `messages` (after the folded `archive`) is always exactly one root-to-leaf path of the tree, so
  the prompt, compression, sealing and search keep working on a plain list. Every other branch's
  messages sit in `off_path`, each with an explicit `parent_id`.
- A message's `parent_id` is the message before it on its path (None for the first). A message on
  the path without one (older files, sealed segments written before branches existed) follows
  the user/assistant message before it. Notices hang from the history message they follow and
  go wherever it goes; they are never anyone's parent.
- `switch` makes another path current. What compression folded stays folded only as far as it is
  still on the new path: each fold leaves a record (`folds`: the last folded message's id and the
  summary the fold produced), and the deepest record whose message is on the new path decides
  `archive` and `summary`. So the summary never describes messages that are not on the path, and
  switching back restores the folded state exactly. The measured prompt (`last_prompt_tokens`)
  was another path's: it is cleared.
- Each switch first notes, for every message of the path it leaves, which child was on it
  (`last_child`), and descending follows those notes: going back to an older version returns to
  the path last viewed under it, not to its most recent child. A child the notes do not name
  (never viewed, an import, a rewind) is the most recent one.

It changes conversation dicts in place (inside `Store.update`) and knows nothing of turns or HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator

HISTORY_ROLES = ("user", "assistant")


class UnknownMessage(Exception):
    """No message with that id in the conversation's tree."""


def is_node(message: dict) -> bool:
    """A user or assistant message: a node of the tree (notices only annotate one)."""
    return message.get("role") in HISTORY_ROLES


def path_items(conv: dict) -> list[dict]:
    """The current path with what hangs from it, oldest first: folded messages, then `messages`."""
    return (conv.get("archive") or []) + conv["messages"]


def linked(items: list[dict]) -> Iterator[tuple[dict, str | None]]:
    """(message, its parent id) along a path; a missing `parent_id` means the history message before it."""
    previous = None
    for m in items:
        parent = m["parent_id"] if "parent_id" in m else previous
        yield m, parent
        if is_node(m):
            previous = m["id"]


def last_node_id(conv: dict) -> str | None:
    """The leaf of the current path (None for an empty conversation)."""
    for items in (conv["messages"], conv.get("archive") or []):
        for m in reversed(items):
            if is_node(m):
                return m["id"]
    return None


def parents(conv: dict) -> dict[str, str | None]:
    """{id: parent id} for every message of the tree, notices included."""
    out = {m["id"]: parent for m, parent in linked(path_items(conv))}
    for m in conv.get("off_path") or []:
        out[m["id"]] = m.get("parent_id")
    return out


def _nodes(conv: dict) -> list[dict]:
    return [m for m in path_items(conv) + (conv.get("off_path") or []) if is_node(m)]


def _children(conv: dict, parent_of: dict[str, str | None]) -> dict[str | None, list[dict]]:
    """Each message's children in creation order (the time they were made, then their place)."""
    children: dict[str | None, list[dict]] = {}
    for m in _nodes(conv):
        children.setdefault(parent_of[m["id"]], []).append(m)
    for group in children.values():
        group.sort(key=lambda m: m.get("created_at") or "")  # stable: equal times keep their order
    return children


def siblings(conv: dict) -> dict[str, list[str]]:
    """`Conversation.branches`: {message id: [it and its siblings, in creation order]} for each
    message of the current path that has some.

    Only the path's: each group is listed once, so the answer stays linear in the number of
    messages (listing every sibling's group made 4,000 sibling answers a 382 MiB answer)."""
    children = _children(conv, parents(conv))
    out = {}
    for m, parent in linked(path_items(conv)):
        group = children.get(parent, []) if is_node(m) else []
        if len(group) > 1:
            out[m["id"]] = [s["id"] for s in group]
    return out


def user_parents(conv: dict) -> set[str | None]:
    """Where a message may be sent from: the parent of any message the person typed on the path
    (that is editing it), or the path's leaf (a plain send)."""
    allowed = {parent for m, parent in linked(path_items(conv)) if m.get("role") == "user"}
    allowed.add(last_node_id(conv))
    return allowed


def _fold_records(conv: dict) -> list[dict]:
    """The folds, with one made up for a file from before branches: its archive is one fold."""
    folds = conv.setdefault("folds", [])
    archive = [m for m in conv.get("archive") or [] if is_node(m)]
    if archive and not any(f["through"] == archive[-1]["id"] for f in folds):
        folds.append({"through": archive[-1]["id"], "summary": conv.get("summary", "")})
    return folds


def record_fold(conv: dict) -> None:
    """After a compression stored its outcome: remember where the fold ends and the summary it left."""
    archive = [m for m in conv.get("archive") or [] if is_node(m)]
    if archive:
        conv.setdefault("folds", []).append({"through": archive[-1]["id"], "summary": conv.get("summary", "")})


def _note_path(conv: dict, parent_of: dict[str, str | None]) -> dict[str, str]:
    """Remember the current path's child of each of its messages (`last_child`), for `switch` to return to."""
    last_child = conv.setdefault("last_child", {})
    for m in path_items(conv):
        if is_node(m) and parent_of.get(m["id"]) is not None:
            last_child[parent_of[m["id"]]] = m["id"]
    return last_child


def switch(conv: dict, leaf: str | None, *, descend: bool) -> bool:
    """Make the path to `leaf` current (None: the empty path, before the first message).

    `descend`: then follow, at each level below `leaf`, the child last on the path there
    (`last_child`), else the most recent one, to a leaf of the tree. Returns whether the path
    changed. UnknownMessage when `leaf` is not a user or assistant message of this conversation.
    """
    folds = _fold_records(conv)
    items = path_items(conv)
    parent_of = parents(conv)
    last_child = _note_path(conv, parent_of)
    by_id = {m["id"]: m for m in items + (conv.get("off_path") or [])}
    if leaf is not None and (leaf not in by_id or not is_node(by_id[leaf])):
        raise UnknownMessage(leaf)
    chain: list[str] = []
    at = leaf
    while at is not None:
        chain.append(at)
        at = parent_of[at]
    chain.reverse()
    if descend and leaf is not None:
        children = _children(conv, parent_of)
        while group := children.get(chain[-1]):
            ids = [m["id"] for m in group]
            chain.append(last_child[chain[-1]] if last_child.get(chain[-1]) in ids else ids[-1])
    on_chain = set(chain)

    # The current path stays up to its first message that is not on the new one.
    stop = next((i for i, (m, _) in enumerate(linked(items)) if is_node(m) and m["id"] not in on_chain), len(items))
    kept, leaving = items[:stop], list(linked(items))[stop:]
    fork = next((m["id"] for m in reversed(kept) if is_node(m)), None)
    off = conv.get("off_path") or []
    notices: dict[str | None, list[dict]] = {}
    for m in off:
        if not is_node(m):
            notices.setdefault(m.get("parent_id"), []).append(m)
    tail = list(notices.get(fork, []))
    for node_id in chain[len([m for m in kept if is_node(m)]):]:
        tail += [by_id[node_id], *notices.get(node_id, [])]
    arriving = {m["id"] for m in tail}
    path = kept + tail
    conv["off_path"] = [m for m in off if m["id"] not in arriving] + [
        m if m.get("parent_id", object()) == parent else {**m, "parent_id": parent} for m, parent in leaving]
    changed = bool(leaving) or bool(tail)

    # Folded as far as the deepest fold still on the path; the summary is that fold's.
    depth = {node_id: i for i, node_id in enumerate(chain)}
    fold = max((f for f in folds if f["through"] in depth), key=lambda f: depth[f["through"]], default=None)
    split = 0
    if fold is not None:
        split = next(i for i, m in enumerate(path) if m["id"] == fold["through"]) + 1
        # Notices hanging from the fold's last message were older than the fold: folded with it.
        while split < len(path) and not is_node(path[split]) and parent_of.get(path[split]["id"]) == fold["through"]:
            split += 1
    archive, messages = path[:split], path[split:]
    summary = fold["summary"] if fold is not None else ""
    changed = changed or len(archive) != len(conv.get("archive") or [])
    if archive or "archive" in conv:
        conv["archive"] = archive
    conv["messages"] = messages
    conv["summary"] = summary
    if changed:
        conv["last_prompt_tokens"] = None  # it measured another path's prompt
    return changed


def subtree(conv: dict, root: str) -> set[str]:
    """`root` and everything below it, notices included."""
    parent_of = parents(conv)
    below: dict[str | None, list[str]] = {}
    for child, parent in parent_of.items():
        below.setdefault(parent, []).append(child)
    out, stack = set(), [root]
    while stack:
        at = stack.pop()
        out.add(at)
        stack.extend(below.get(at, []))
    return out


def drop(conv: dict, ids: set[str]) -> None:
    """Remove these messages from everywhere (rewind: taken back, not kept as a branch)."""
    conv["messages"] = [m for m in conv["messages"] if m["id"] not in ids]
    if conv.get("off_path"):
        conv["off_path"] = [m for m in conv["off_path"] if m["id"] not in ids]
    if conv.get("folds"):
        conv["folds"] = [f for f in conv["folds"] if f["through"] not in ids]
    if conv.get("last_child"):
        conv["last_child"] = {p: c for p, c in conv["last_child"].items() if p not in ids and c not in ids}
    conv["last_prompt_tokens"] = None


def has_user_message(conv: dict) -> bool:
    """Whether the person ever typed anything here, on any branch."""
    return any(m.get("role") == "user" for m in path_items(conv) + (conv.get("off_path") or []))
