"""What a person does to an answer besides reading it, where no model is asked: an assistant reply
edited by the person. (Regenerate, Continue and Compare ask a model: they are turns, `pipeline` and
`compare`.)

An edit is never written over the reply: it is a sibling marked `edited`, made current, so the
prompt uses it from then on and the original, with whatever followed it, stays on the old branch.
"""

from __future__ import annotations

from chatserver.conversations import branches
from chatserver.conversations.document import new_id, now_iso


def edited_reply(original: dict, content: str, parent_id: str | None) -> dict:
    """The person's version of `original`: its model and place, no usage (nothing was billed)."""
    reply = {"id": new_id(), "role": "assistant", "content": content, "parent_id": parent_id,
             "created_at": now_iso(), "status": "complete", "activity": [], "citations": [],
             "edited": True, "edited_from": original["id"]}
    if original.get("model"):
        reply["model"] = original["model"]
    return reply


def put_edited(conv: dict, reply: dict) -> None:
    """Make the edited reply current: the path up to its parent, then it."""
    branches.switch(conv, reply["parent_id"], descend=False)
    conv["messages"].append(reply)
