"""Typed events: what the upstream decoders give, and what a turn tells the page.

`upstream.chat` and `upstream.messages` turn wire bytes into the first kind; the turn pipeline
(`turns.py`) folds them into a reply with `accumulate()` and yields the page's events (the
visible upstream ones plus `TurnStarted`, `Compressed`, `TurnWarning`, `TurnFailed`,
`TurnDone`); `streaming.encode` makes SSE frames of them at the route, the only place that
does. Nothing here knows a wire format.

Upstream failures are not events: a decoder raises `failures.UpstreamError`, and the pipeline
decides what the person sees (a `TurnFailed`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class Call:
    """One tool call as the model made it; `arguments` is the raw JSON text (or an already parsed
    dict). Wire-neutral: both decoders make it, the tool registry runs it."""

    id: str
    name: str
    arguments: str | dict


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    type: Literal["delta"] = "delta"


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str
    type: Literal["reasoning"] = "reasoning"


@dataclass(frozen=True, slots=True)
class SearchStarted:
    query: str
    type: Literal["search_started"] = "search_started"


@dataclass(frozen=True, slots=True)
class SearchResults:
    """Results of the latest search; `results` is None and `error_code` set when it failed."""

    query: str
    results: list[dict] | None
    error_code: str | None = None
    type: Literal["search_results"] = "search_results"


@dataclass(frozen=True, slots=True)
class FetchDone:
    url: str
    title: str | None
    ok: bool
    error_code: str | None = None
    type: Literal["fetch"] = "fetch"


@dataclass(frozen=True, slots=True)
class CitationFound:
    url: str
    title: str
    type: Literal["citation"] = "citation"


@dataclass(frozen=True, slots=True)
class ImageProduced:
    """An image the model returned as output (chat `images`: OpenRouter's image generation)."""

    media_type: str
    data: bytes
    type: Literal["image_produced"] = "image_produced"


@dataclass(frozen=True, slots=True)
class ImageAttached:
    """An image the model returned, stored as the reply's attachment (`attachment`: its public meta)."""

    attachment: dict
    type: Literal["image"] = "image"


@dataclass(frozen=True, slots=True)
class UsageReport:
    """One request's usage exactly as the vendor reported it; `context.normalize_usage` reads every dialect."""

    raw: dict
    type: Literal["usage"] = "usage"


@dataclass(frozen=True, slots=True)
class CallOpened:
    """One upstream request was answered: `call` is its billing record (`{"generation", "request",
    "header_cost"}`), the gateway's ids for it, which the client keeps filling in as the stream
    names them, so a stream cut short still says which generation to ask the gateway about."""

    call: dict
    type: Literal["call"] = "call"


@dataclass(frozen=True, slots=True)
class Finished:
    """The upstream's own finish/stop reason, as sent (`stop`, `length`, `end_turn`, ...)."""

    reason: str
    type: Literal["finished"] = "finished"


@dataclass(frozen=True, slots=True)
class TurnWarning:
    """Something the person should know about a reply that still goes on (API.md's warning codes)."""

    code: str
    message: str
    type: Literal["warning"] = "warning"


@dataclass(frozen=True, slots=True)
class ToolCallsRequested:
    """The response ended asking for client tool calls (`Call`s, in the model's order).

    `blocks` (Messages only) is the assistant's content exactly as received, server tool blocks
    included, for the request that carries the results.
    """

    calls: tuple
    blocks: tuple = ()
    type: Literal["tool_calls"] = "tool_calls"


@dataclass(frozen=True, slots=True)
class ToolStep:
    """A tool call started (`status` running) or ended (done/error): the `tool` event's data (API.md)."""

    data: dict
    citations: tuple = ()
    type: Literal["tool"] = "tool"


@dataclass(frozen=True, slots=True)
class ToolRound:
    """One finished tool round, wire-neutral, kept with the reply so later requests can resend it.

    `round` is `{"text", "calls": [{"id", "name", "arguments"}], "results": [{"call_id", "name",
    "content", "is_error"}]}`; `text` is what the model wrote before calling.
    """

    round: dict
    type: Literal["tool_round"] = "tool_round"


Event = (
    TextDelta | ReasoningDelta | SearchStarted | SearchResults | FetchDone | CitationFound
    | UsageReport | CallOpened | Finished | TurnWarning | ToolCallsRequested | ToolStep | ToolRound | ImageProduced
    | ImageAttached
)


# --- What a turn tells the page -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TurnStarted:
    assistant_message_id: str
    model: str
    user_message_id: str | None = None
    masked: int | None = None  # personal data replaced in the person's message (PII_MASKING=on)
    type: Literal["start"] = "start"


@dataclass(frozen=True, slots=True)
class Compressed:
    """A compression ran before this turn's reply: the `compression` event's data, notice included."""

    data: dict
    type: Literal["compression"] = "compression"


@dataclass(frozen=True, slots=True)
class TurnFailed:
    """The turn ended without a complete reply; `draft` is set when the person's message was rolled back."""

    kind: str
    message: str
    retryable: bool
    retry_after: float | None
    partial: bool
    draft: str | None = None
    type: Literal["error"] = "error"


@dataclass(frozen=True, slots=True)
class TurnDone:
    """The reply is saved; `status` is `interrupted` when Stop ended it."""

    assistant_message_id: str
    usage: dict | None
    citations: list[dict]
    status: str = "complete"
    type: Literal["done"] = "done"


@dataclass(frozen=True, slots=True)
class CompareStarted:
    """A comparison began: the person's message and, per model, the reply it is writing."""

    user_message_id: str
    replies: tuple[dict, ...]  # {"assistant_message_id", "model"}, in the order the models were asked
    masked: int | None = None
    type: Literal["start"] = "start"


@dataclass(frozen=True, slots=True)
class LaneEvent:
    """One compared reply's event (its own `done` or `error` included), sent under the event's own
    name with the reply's id in its data."""

    assistant_message_id: str
    event: TurnEvent
    type: Literal["lane"] = "lane"


@dataclass(frozen=True, slots=True)
class CompareDone:
    """Every compared reply has ended (each said how in its own `done` or `error`)."""

    replies: tuple[dict, ...]  # {"assistant_message_id", "model", "status"}
    status: str = "complete"  # "interrupted" when Stop ended the comparison
    type: Literal["done"] = "done"


TurnEvent = (
    TurnStarted | Compressed | TextDelta | ReasoningDelta | SearchStarted | SearchResults | FetchDone
    | TurnWarning | TurnFailed | TurnDone | ToolStep | ImageAttached | CompareStarted | LaneEvent | CompareDone
)


@dataclass(slots=True)
class Reply:
    """What one assistant reply has accumulated so far."""

    text: str = ""
    reasoning: str = ""
    activity: list[dict] = field(default_factory=list)
    citations: list[dict] = field(default_factory=list)
    # One raw usage per upstream request: a paused tool turn makes several.
    usages: list[dict] = field(default_factory=list)
    # One billing record per upstream request (CallOpened.call), its raw usage under "usage" once reported.
    calls: list[dict] = field(default_factory=list)
    warnings: list[dict] = field(default_factory=list)
    # Finished tool rounds (ToolRound.round), stored with the reply as its hidden history.
    rounds: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    searches: int = 0
    fetches: int = 0
    # Images the model returned, stored as attachments of the conversation: the reply's own.
    attachment_ids: list[str] = field(default_factory=list)

    def end_running_tools(self, reason: str = "stopped") -> None:
        """Mark calls that never finished (Stop, a failure) as failed, so the trail does not spin forever."""
        for step in self.activity:
            if step["kind"] == "tool" and step["status"] == "running":
                step.update(status="error", error=reason)

    @property
    def has_output(self) -> bool:
        """True once anything the person can see has arrived (text, thought, tool step)."""
        return bool(self.text or self.reasoning or self.activity or self.attachment_ids)


def accumulate(reply: Reply, event: Event, now: float | None = None) -> Reply:
    """Fold one event into `reply` (in place, returned for chaining).

    Activity steps carry wall-clock times so the trail can say "Thought for 5s".
    """
    now = time.time() if now is None else now
    match event:
        case TextDelta(text=text):
            reply.text += text
        case ReasoningDelta(text=text):
            reply.reasoning += text
            last = reply.activity[-1] if reply.activity else None
            if last and last["kind"] == "thinking":
                last["text"] += text
                last["ended_at"] = now
            else:
                reply.activity.append(
                    {"kind": "thinking", "text": text, "started_at": now, "ended_at": now}
                )
        case SearchStarted(query=query):
            reply.searches += 1
            reply.activity.append({"kind": "search", "query": query, "results": None, "at": now})
        case SearchResults(query=query, results=results, error_code=error_code):
            step = next(
                (s for s in reversed(reply.activity)
                 if s["kind"] == "search" and s["results"] is None and "error" not in s),
                None,
            )
            if step is None:
                step = {"kind": "search", "query": query, "at": now}
                reply.activity.append(step)
            step["results"] = results
            if error_code:
                step["error"] = error_code
        case FetchDone(url=url, title=title, ok=ok, error_code=error_code):
            reply.fetches += 1
            step = {"kind": "fetch", "url": url, "title": title, "ok": ok, "at": now}
            if error_code:
                step["error"] = error_code
            reply.activity.append(step)
        case CitationFound(url=url, title=title):
            if url.startswith(("http://", "https://")) and all(
                c["url"] != url for c in reply.citations
            ):
                reply.citations.append({"url": url, "title": title})
        case ToolStep(data=data, citations=citations):
            step = next((s for s in reply.activity if s["kind"] == "tool" and s["call_id"] == data["call_id"]
                         and s["status"] == "running"), None)
            if step is None:
                reply.activity.append({"kind": "tool", **data, "at": now})
            else:
                step.update(data)
            for citation in citations:
                if _citable(citation):
                    _cite(reply.citations, citation)
        case ToolRound(round=done):
            reply.rounds.append(done)
        case ImageAttached(attachment=attachment):
            reply.attachment_ids.append(attachment["id"])
        case UsageReport(raw=raw):
            reply.usages.append(raw)
            if reply.calls:
                reply.calls[-1]["usage"] = raw
        case CallOpened(call=call):
            reply.calls.append(call)
        case Finished(reason=reason):
            reply.finish_reason = reason
        case TurnWarning(code=code, message=message):
            reply.warnings.append({"code": code, "message": message})
    return reply


QUERY_CHARS = 1000  # the words a chip keeps from the searches that cited it


def _cite(citations: list[dict], citation: dict) -> None:
    """Add `citation` once per place: a page a later search cites again keeps one chip, which
    gathers that search's words (`query`) for the viewer to highlight too."""
    place = {k: v for k, v in citation.items() if k != "query"}
    for held in citations:
        if {k: v for k, v in held.items() if k != "query"} == place:
            query = citation.get("query")
            if isinstance(query, str) and query not in (held.get("query") or ""):
                held["query"] = f"{held['query']} {query}"[:QUERY_CHARS] if held.get("query") else query
            return
    citations.append(dict(citation))


def _citable(citation: dict) -> bool:
    """A web page (http/https URL) or an attachment page: the two kinds of chip the page draws."""
    url = citation.get("url")
    if isinstance(url, str):
        return url.startswith(("http://", "https://"))
    return isinstance(citation.get("attachment_id"), str) and isinstance(citation.get("name"), str) \
        and isinstance(citation.get("page"), int)
