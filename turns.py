"""The per-turn pipeline: project, compress, assemble, stream, record, and save exactly once.

A turn is begun synchronously by the route (so 404/409/422 are plain HTTP answers) and then
run as an async generator of SSE frames. Whatever ends it (the reply finishing, the upstream
breaking, the person pressing Stop or closing the tab) the reply is saved once: the first of
the three exits to run wins, and the others see it done.

It knows the order of the pipeline and the turn's invariants; wire formats live in `chat.py`
and `tools.py`, the prompt layout and token arithmetic in `context.py`, files in `storage.py`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import orjson

import chat
import context
from config import Settings
from events import (
    Event, FetchDone, ReasoningDelta, Reply, SearchResults, SearchStarted, TextDelta, Warning, accumulate,
)
from failures import UpstreamError, classify_exception
from storage import NotFound, Store, new_id, now_iso

log = logging.getLogger("chat.turns")


class TurnBusy(Exception):
    """A turn is already streaming on this conversation."""


class NothingToAnswer(Exception):
    """Regenerate on a conversation with no user message to answer."""


@dataclass(frozen=True, slots=True)
class Gateway:
    base_url: str
    api_key: str | None
    demo: bool

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"


@dataclass(slots=True)
class Turn:
    conv_id: str
    model: str
    user_message: dict | None  # None when regenerating: the question is already stored
    assistant_id: str = field(default_factory=new_id)
    reply: Reply = field(default_factory=Reply)
    saved: bool = False
    sent_floor: int = 0


def frame(name: str, data: dict) -> dict:
    return {"event": name, "data": orjson.dumps(data).decode()}


def event_frame(event: Event) -> dict | None:
    """The SSE frame the page sees for one upstream event, if any."""
    match event:
        case TextDelta(text=text):
            return frame("delta", {"text": text})
        case ReasoningDelta(text=text):
            return frame("reasoning", {"text": text})
        case SearchStarted(query=query):
            return frame("search", {"query": query, "results": None})
        case SearchResults(query=query, results=results, error_code=error_code):
            data = {"query": query, "results": results}
            if error_code:
                data["error"] = error_code
            return frame("search", data)
        case FetchDone(url=url, title=title, ok=ok, error_code=error_code):
            data = {"url": url, "title": title, "ok": ok}
            if error_code:
                data["error"] = error_code
            return frame("fetch", data)
        case Warning(code=code, message=message):
            return frame("warning", {"code": code, "message": message})
    return None


def title_from(text: str, limit: int = 60) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "New conversation")
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0]
    return (cut if len(cut) > limit // 2 else line[:limit]).rstrip() + "…"


def add_usage(totals: dict, usage: dict) -> None:
    """Conversation totals; a missing cost is counted as unreported, never as zero."""
    for key in ("input_tokens", "output_tokens", "cached_tokens", "searches", "fetches"):
        totals[key] += usage.get(key) or 0
    if usage.get("cost") is None:
        totals["cost_unreported"] += 1
    else:
        totals["cost"] = round(totals["cost"] + usage["cost"], 10)


class Turns:
    """Runs turns against one gateway; remembers which conversations are streaming."""

    def __init__(self, store: Store, settings: Settings, client: httpx.AsyncClient, gateway: Gateway) -> None:
        self.store = store
        self.settings = settings
        self.client = client
        self.gateway = gateway
        self.active: dict[str, Turn] = {}

    def is_streaming(self, conv_id: str) -> bool:
        return conv_id in self.active

    def begin(self, conv_id: str, content: str | None) -> Turn:
        """Commit the person's message (or clear the answer to regenerate) and claim the conversation."""
        if conv_id in self.active:
            raise TurnBusy(conv_id)
        conv = self.store.get(conv_id)
        if content is None:
            if not any(m["role"] == "user" for m in conv["messages"]):
                raise NothingToAnswer(conv_id)
            self.store.update(conv_id, _drop_trailing_answers)
            turn = Turn(conv_id, conv["model"], None)
        else:
            user = {"id": new_id(), "role": "user", "content": content, "created_at": now_iso()}

            def append(c: dict) -> None:
                if not any(m["role"] == "user" for m in c["messages"]):
                    c["title"] = title_from(content)
                c["messages"].append(user)

            self.store.update(conv_id, append)
            turn = Turn(conv_id, conv["model"], user)
        self.active[conv_id] = turn
        return turn

    def abandon(self, turn: Turn) -> None:
        """Release a turn whose stream never ran (the client left before the first byte)."""
        if self.active.get(turn.conv_id) is turn and not turn.saved:
            turn.saved = True
            del self.active[turn.conv_id]

    async def run(self, turn: Turn) -> AsyncIterator[dict]:
        """SSE frames of one turn; `done` is sent only after the reply is saved."""
        reply = turn.reply
        start = {"assistant_message_id": turn.assistant_id, "model": turn.model}
        if turn.user_message:
            start = {"user_message_id": turn.user_message["id"], **start}
        try:
            yield frame("start", start)
            conv = self.store.get(turn.conv_id)
            prompt = context.build_prompt(conv, self.store.read_memory(), self.settings, today=dt.date.today())
            turn.sent_floor = context.count_tokens(prompt.text())
            async with contextlib.aclosing(self._transport(turn, conv, prompt)) as events:
                async for event in events:
                    accumulate(reply, event)
                    if (out := event_frame(event)) is not None:
                        yield out
            if reply.finish_reason in ("length", "max_tokens"):
                yield frame("warning", {
                    "code": "max_tokens",
                    "message": "The reply stopped at the output limit (MAX_COMPLETION_TOKENS).",
                })
            usage = self._save(turn, "complete")
            yield frame("done", {"assistant_message_id": turn.assistant_id, "usage": usage,
                                 "citations": reply.citations})
        except UpstreamError as failure:
            yield self._fail(turn, failure)
        except Exception as exc:  # a bug or an unexpected fault must still end the stream cleanly
            log.exception("turn on %s failed", turn.conv_id)
            yield self._fail(turn, classify_exception(exc))
        finally:
            # Stop and closed tabs land here (cancellation or aclose): keep what arrived.
            self._save(turn, "interrupted")
            self.active.pop(turn.conv_id, None)

    def _transport(self, turn: Turn, conv: dict, prompt: context.Prompt) -> AsyncIterator[Event]:
        body = chat.build_body(
            turn.model, prompt.system, prompt.messages,
            max_tokens=self.settings.max_completion_tokens, params=self.settings.params_for(turn.model),
        )
        return chat.stream(self.client, self.gateway.url("/v1/chat/completions"), body,
                           chat.auth_headers(self.gateway.api_key))

    def _fail(self, turn: Turn, failure: UpstreamError) -> dict:
        """Save or roll back, then the `error` frame that ends the stream."""
        data = {
            "kind": failure.kind, "message": failure.message, "retryable": failure.retryable,
            "retry_after": failure.retry_after, "partial": turn.reply.has_output,
        }
        if turn.reply.has_output:
            self._save(turn, "interrupted", error=failure.kind)
        else:
            turn.saved = True
            if turn.user_message is not None:
                self._roll_back(turn)
                data["draft"] = turn.user_message["content"]
        log.info("turn on %s ended with %s: %s", turn.conv_id, failure.kind, failure.message)
        return frame("error", data)

    def _roll_back(self, turn: Turn) -> None:
        """Take the person's message back out, so sending the draft again does not duplicate it."""
        message_id = turn.user_message["id"]

        def remove(c: dict) -> None:
            c["messages"] = [m for m in c["messages"] if m["id"] != message_id]
            if not any(m["role"] == "user" for m in c["messages"]):
                c["title"] = "New conversation"

        with contextlib.suppress(NotFound):
            self.store.update(turn.conv_id, remove)

    def _save(self, turn: Turn, status: str, error: str | None = None) -> dict | None:
        """Store the reply once; an empty reply is never stored."""
        if turn.saved:
            return None
        turn.saved = True
        reply = turn.reply
        if not reply.has_output:
            return None
        usage = context.normalize_usage(reply.usage_raw, sent_floor=turn.sent_floor, output_text=reply.text)
        usage["searches"] = max(usage["searches"], reply.searches)
        usage["fetches"] = max(usage["fetches"], reply.fetches)
        message = {
            "id": turn.assistant_id, "role": "assistant", "content": reply.text,
            "created_at": now_iso(), "model": turn.model, "status": status,
            "activity": reply.activity, "citations": reply.citations, "usage": usage,
        }
        if error:
            message["error"] = error

        def append(c: dict) -> None:
            c["messages"].append(message)
            add_usage(c["totals"], usage)
            c["totals"]["turns"] += 1
            if not usage["estimated"]:
                c["last_prompt_tokens"] = usage["input_tokens"]

        try:
            self.store.update(turn.conv_id, append)
        except NotFound:
            log.info("conversation %s was deleted while it streamed; reply dropped", turn.conv_id)
        return usage


def _drop_trailing_answers(conv: dict) -> None:
    """Regenerate: everything after the last user message goes (interrupted replies too)."""
    messages = conv["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    conv["messages"] = messages[: last_user + 1]
