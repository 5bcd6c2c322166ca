"""The one place a turn's reply becomes the stored assistant message and its usage (the final
save and every checkpoint, what a crash leaves behind, build it here), and the one place a stored
reply becomes the turn's `done`."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from chatserver.conversations.document import now_iso
from chatserver.conversations.usage import combined
from chatserver.turns import context
from chatserver.turns.events import TurnDone

if TYPE_CHECKING:
    from chatserver.turns.pipeline import Turn


def reply_usage(turn: Turn, sent_floor: int, *, output_tokens: int | None = None) -> tuple[dict, list[dict]]:
    """The reply's usage (its requests' reports summed) and those reports.

    With no report from the gateway the prompt is our own count (`sent_floor`) and the output is
    `output_tokens`, or counted from the text when not given; such a record is an estimate.
    """
    reply = turn.reply
    reports = [context.normalize_usage(raw, sent_floor=sent_floor) for raw in reply.usages]
    if not reports:
        report = context.normalize_usage(None, sent_floor=sent_floor,
                                         output_text=reply.text if output_tokens is None else "")
        if output_tokens is not None:
            report["output_tokens"] = output_tokens
        reports = [report]
    # What the tools' own model calls cost (analyze_image's) is the turn's too.
    asked = [step["usage"] for step in reply.activity if step.get("kind") == "tool" and isinstance(step.get("usage"), dict)]
    usage = combined(reports + [{k: v for k, v in u.items() if k != "model"} for u in asked]) if asked \
        else combined(reports)
    usage["searches"] = max(usage["searches"], reply.searches)
    usage["fetches"] = max(usage["fetches"], reply.fetches)
    return usage, reports


def reply_message(turn: Turn, status: str, usage: dict, *, error: str | None = None,
                  snapshot: bool = False) -> dict:
    """The assistant message as stored. `snapshot`: a checkpoint's copy, taken while the pipeline
    keeps growing the reply's lists; the final save stores them as they are."""
    reply = turn.reply
    keep = copy.deepcopy if snapshot else (lambda value: value)
    message = {
        "id": turn.assistant_id, "role": "assistant", "content": reply.text, "parent_id": turn.parent_id,
        "created_at": now_iso(), "model": turn.model, "status": status,
        "activity": keep(reply.activity), "citations": keep(reply.citations), "usage": usage,
    }
    if reply.warnings:
        message["warnings"] = keep(reply.warnings)
    if reply.rounds and not snapshot:
        message["rounds"] = reply.rounds
    if reply.attachment_ids:
        message["attachment_ids"] = list(reply.attachment_ids)
    if error:
        message["error"] = error
    if params := turn.sampling.shown():
        message["params"] = params
    if turn.continues is not None:
        message = continued(turn.continues, message)
    return message


def joined(before: str, after: str) -> str:
    """A reply's two parts as one text: a continuation that starts with a space follows the text
    without the whitespace it ended on (a prefill is sent without it, so the model supplies its own)."""
    return before.rstrip() + after if after[:1].isspace() else before + after


def continued(earlier: dict, message: dict) -> dict:
    """A continued reply as stored: one message, the earlier part's text, trail and citations first,
    both parts' usage summed. Its warnings are the new part's: the old part's cut-off is healed."""
    out = {**message, "content": joined(earlier.get("content") or "", message["content"]),
           "created_at": earlier.get("created_at") or message["created_at"],
           "activity": (earlier.get("activity") or []) + message["activity"],
           "citations": (earlier.get("citations") or []) + message["citations"],
           "continued": earlier.get("continued", 0) + 1}
    if isinstance(earlier.get("usage"), dict) and message.get("usage"):
        out["usage"] = combined([earlier["usage"], message["usage"]])
    if earlier.get("rounds") or message.get("rounds"):
        out["rounds"] = (earlier.get("rounds") or []) + (message.get("rounds") or [])
    for key in ("params", "edited", "edited_from"):
        if key in earlier and key not in out:
            out[key] = earlier[key]
    return out


def done_event(assistant_id: str, stored: dict | None, status: str = "complete") -> TurnDone:
    """The turn's `done`, saying what its stored reply says (`stored` None: nothing was stored)."""
    if stored is None:
        return TurnDone(assistant_id, None, [], status=status)
    return TurnDone(assistant_id, stored.get("usage"), stored.get("citations") or [], status=status)
