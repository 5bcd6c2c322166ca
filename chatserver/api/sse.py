"""The edge where a turn's typed events become the page's SSE frames (API.md's turn stream).

`encode` is the only place that knows event names and payload shapes (and numbers each frame
with its SSE `id`); `TurnResponse` sends a turn's frames. Nothing here knows the pipeline or a
wire format upstream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError

from chatserver import metrics
from chatserver.turns.events import (
    CompareDone,
    CompareStarted,
    Compressed,
    FetchDone,
    ImageAttached,
    LaneEvent,
    ReasoningDelta,
    SearchResults,
    SearchStarted,
    TextDelta,
    ToolStep,
    TurnDone,
    TurnEvent,
    TurnFailed,
    TurnStarted,
    TurnWarning,
)

log = logging.getLogger("chat.streaming")


def frame(name: str, data: dict, seq: int | None = None) -> bytes:
    """One SSE record, encoded once here (sse-starlette passes bytes through untouched).

    Compact JSON holds no line break, so `data` is always one line. `seq` becomes the record's
    `id:`, which a browser sends back as `Last-Event-ID` when it reconnects.
    """
    head = b"id: %d\r\n" % seq if seq is not None else b""
    return head + b"event: " + name.encode() + b"\r\ndata: " + orjson.dumps(data) + b"\r\n\r\n"


def payload(event: TurnEvent) -> dict | None:
    """The `data` of the page's event for one turn event; None for events the page never sees."""
    match event:
        case TextDelta(text=text) | ReasoningDelta(text=text):
            return {"text": text}
        case SearchStarted(query=query):
            return {"query": query, "results": None}
        case SearchResults(query=query, results=results, error_code=error_code):
            data = {"query": query, "results": results}
            if error_code:
                data["error"] = error_code
            return data
        case FetchDone(url=url, title=title, ok=ok, error_code=error_code):
            data = {"url": url, "title": title, "ok": ok}
            if error_code:
                data["error"] = error_code
            return data
        case ToolStep(data=data):
            return data
        case ImageAttached(attachment=attachment):
            return {"attachment": attachment}
        case TurnWarning(code=code, message=message):
            return {"code": code, "message": message}
        case TurnStarted(assistant_message_id=assistant, model=model, user_message_id=user, masked=masked):
            data = {"assistant_message_id": assistant, "model": model}
            if masked is not None:
                data["masked"] = masked
            return {"user_message_id": user, **data} if user else data
        case Compressed(data=data):
            return data
        case TurnFailed():
            data = {"kind": event.kind, "message": event.message, "retryable": event.retryable,
                    "retry_after": event.retry_after, "partial": event.partial}
            if event.draft is not None:
                data["draft"] = event.draft
            return data
        case TurnDone():
            return {"assistant_message_id": event.assistant_message_id, "usage": event.usage,
                    "citations": event.citations, "status": event.status}
        case CompareStarted(user_message_id=user, replies=replies, masked=masked):
            data = {"user_message_id": user, "assistant_message_id": replies[0]["assistant_message_id"],
                    "model": replies[0]["model"], "compare": list(replies)}
            if masked is not None:
                data["masked"] = masked
            return data
        case LaneEvent(assistant_message_id=assistant, event=inner):
            data = payload(inner)
            return None if data is None else {**data, "assistant_message_id": assistant}
        case CompareDone(replies=replies, status=status):
            return {"assistant_message_id": None, "usage": None, "citations": [], "status": status,
                    "compare": list(replies)}
    return None


def name_of(event: TurnEvent) -> str:
    return NAMES[event.event.type] if isinstance(event, LaneEvent) else NAMES[event.type]


NAMES = {"delta": "delta", "reasoning": "reasoning", "search_started": "search", "search_results": "search",
         "fetch": "fetch", "tool": "tool", "warning": "warning", "start": "start", "compression": "compression",
         "error": "error", "done": "done", "image": "image"}


def encode(event: TurnEvent, seq: int | None = None) -> bytes | None:
    """The SSE frame the page sees for one event (numbered `seq` within its turn), if any."""
    data = payload(event)
    return None if data is None else frame(name_of(event), data, seq)


class TurnResponse(EventSourceResponse):
    """A turn's SSE frames; `closed` runs however the response ends, even if the client left before it started.

    A reader that takes over `send_timeout` seconds to accept a frame is dropped.
    """

    def __init__(self, frames: AsyncIterator[bytes], closed: Callable[[], Awaitable[object]] | None = None,
                 send_timeout: float | None = None) -> None:
        super().__init__(frames, headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
                         send_timeout=send_timeout)
        self._closed = closed

    async def __call__(self, scope, receive, send) -> None:
        metrics.active.streams_open.inc()
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            # A reader that stopped reading (a frozen tab, a dead network path): not a server fault.
            log.info("dropped a turn stream whose reader accepted nothing for %ss", self.send_timeout)
        finally:
            metrics.active.streams_open.dec()
            if self._closed is not None:
                await self._closed()
