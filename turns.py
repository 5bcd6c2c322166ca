"""The per-turn pipeline: project, compress, assemble, stream, record, and save exactly once.

A turn is begun synchronously by the route (so 404/409/422 are plain HTTP answers) and then
run as an async generator of SSE frames. Whatever ends it (the reply finishing, the upstream
breaking, the person pressing Stop or closing the tab) the reply is saved once: the first of
the three exits to run wins, and the others see it done.

It knows the order of the pipeline and the turn's invariants; wire formats live in `chat.py`
and `tools.py`, the prompt layout and token arithmetic in `context.py`, files in `storage.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import httpx
import orjson

from upstream import chat
import context
from upstream import messages as tools
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


class OpeningFailed(Exception):
    """The turn's opening write did not reach the disk (the file is re-read without it)."""


@dataclass(frozen=True, slots=True)
class Gateway:
    base_url: str
    api_key: str | None

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
    # Our own count of the prompt, the floor under the measured one; counted on a worker thread
    # (tiktoken lets go of the GIL), because the first count of a long conversation takes
    # hundreds of milliseconds that every other stream would otherwise wait through.
    counting: asyncio.Future | None = None
    # The opening write (the person's message, or the answers cleared to regenerate), left running
    # while the prompt is assembled and sent; awaited before the first upstream event is passed on.
    opening: asyncio.Future | None = None


def frame(name: str, data: dict) -> bytes:
    """One SSE record, encoded once here (sse-starlette passes bytes through untouched).

    Compact JSON holds no line break, so `data` is always one line.
    """
    return b"event: " + name.encode() + b"\r\ndata: " + orjson.dumps(data) + b"\r\n\r\n"


def event_frame(event: Event) -> bytes | None:
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


def combined(reports: list[dict]) -> dict:
    """Usage records of one reply's requests, summed; a cost missing from any is unreported."""
    if len(reports) == 1:
        return reports[0]
    total = dict(reports[0])
    for report in reports[1:]:
        for key in ("input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens", "searches", "fetches"):
            total[key] += report[key]
        total["cost"] = None if total["cost"] is None or report["cost"] is None else total["cost"] + report["cost"]
        total["estimated"] = total["estimated"] or report["estimated"]
    return total


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
        """Claim the conversation and add the person's message (or clear the answer to regenerate).

        The change is made now; its write to disk runs while `run` sends the request upstream.
        """
        if conv_id in self.active:
            raise TurnBusy(conv_id)
        conv = self.store.get(conv_id)
        if content is None:
            if not any(m["role"] == "user" for m in conv["messages"]):
                raise NothingToAnswer(conv_id)
            turn = Turn(conv_id, conv["model"], None)
            self.active[conv_id] = turn
            self._open(turn, _drop_trailing_answers)
        else:
            user = {"id": new_id(), "role": "user", "content": content, "created_at": now_iso()}

            def append(c: dict) -> None:
                if not any(m["role"] == "user" for m in c["messages"]):
                    c["title"] = title_from(content)
                c["messages"].append(user)

            turn = Turn(conv_id, conv["model"], user)
            self.active[conv_id] = turn
            self._open(turn, append)
        return turn

    def _open(self, turn: Turn, change) -> None:
        """The turn's opening change; the conversation is claimed first, so a second turn is 409."""
        try:
            _, turn.opening = self.store.update_soon(turn.conv_id, change)
        except BaseException:
            self.active.pop(turn.conv_id, None)
            raise

    async def _opened(self, turn: Turn) -> None:
        """Wait for the opening write; if it failed, nothing of this turn may be stored."""
        opening, turn.opening = turn.opening, None
        if opening is None:
            return
        try:
            await asyncio.shield(opening)
        except Exception as exc:
            turn.saved = True  # a reply without its question must never be stored
            raise OpeningFailed(getattr(exc, "strerror", None) or type(exc).__name__) from exc

    async def compress(self, conv_id: str, *, pending: bool) -> dict:
        """Compress one conversation: the `compression` event's data plus the stored `notice`.

        A no-op (folded 0, no notice) when nothing is old enough. `pending`: the last message is
        the one being answered. The summarizer's call is charged to the conversation like a
        turn's, and counted apart as compression cost.
        """
        result = await context.compress(self.store.get(conv_id), self.settings, self._summarize, pending=pending)
        if not result.history:
            return result.event(0)
        # Memory is read only now, with no await before the write: another conversation may
        # have added facts while the summarizer ran.
        memory, added = context.merge_facts(self.store.read_memory(), list(result.facts))
        if added:
            self.store.write_memory(memory)
        data = result.event(added)
        notice = result.notice(data)

        def store(c: dict) -> None:
            result.apply(c, notice, pending=pending)
            totals = c["totals"]
            totals["compression_calls"] += 1
            if result.usage is not None:
                add_usage(totals, result.usage)
                totals["compression_cost"] = round(totals["compression_cost"] + (result.usage["cost"] or 0), 10)

        await self.store.update(conv_id, store)
        return {**data, "notice": notice}

    async def compress_now(self, conv_id: str) -> dict:
        """Compress now (whatever the budget), with the conversation claimed as a turn would claim it."""
        if conv_id in self.active:
            raise TurnBusy(conv_id)
        claim = Turn(conv_id, self.store.get(conv_id)["model"], None)
        self.active[conv_id] = claim
        try:
            return await self.compress(conv_id, pending=False)
        finally:
            if self.active.get(conv_id) is claim:
                del self.active[conv_id]

    async def _summarize(self, messages: list[dict]) -> tuple[str, str, dict | None]:
        """One non-streamed call to SUMMARIZER_MODEL, capped at SUMMARY_MAX_TOKENS."""
        model = self.settings.summarizer_model
        body = chat.build_body(model, [], messages, max_tokens=self.settings.summary_max_tokens,
                               params=self.settings.params_for(model), stream=False)
        return await chat.complete(self.client, self.gateway.url("/v1/chat/completions"), body,
                                   chat.auth_headers(self.gateway.api_key))

    def abandon(self, turn: Turn) -> None:
        """Release a turn whose stream never ran (the client left before the first byte)."""
        if self.active.get(turn.conv_id) is turn and not turn.saved:
            turn.saved = True
            del self.active[turn.conv_id]

    async def run(self, turn: Turn) -> AsyncIterator[bytes]:
        """SSE frames of one turn; `done` is sent only after the reply is saved."""
        reply = turn.reply
        start = {"assistant_message_id": turn.assistant_id, "model": turn.model}
        if turn.user_message:
            start = {"user_message_id": turn.user_message["id"], **start}
        try:
            yield frame("start", start)
            conv = self.store.get(turn.conv_id)
            if context.project(conv, self.store.read_memory(), self.settings) > context.budget_of(conv, self.settings):
                await self._opened(turn)  # compression folds the stored messages, the new one included
                outcome = await self.compress(turn.conv_id, pending=True)
                yield frame("compression", outcome) if outcome["folded"] or outcome["dropped"] else frame(
                    "warning", {"code": "over_budget", "message": "This conversation is over its context budget, "
                                "but nothing is old enough to fold: the most recent messages are kept verbatim."})
            healed = False
            while True:
                conv = self.store.get(turn.conv_id)
                prompt = context.build_prompt(conv, self.store.read_memory(), self.settings, today=dt.date.today(),
                                              tool_instructions=tools.instructions(conv["settings"], self.settings))
                turn.counting = asyncio.ensure_future(anyio.to_thread.run_sync(prompt.tokens))
                try:
                    async with contextlib.aclosing(self._transport(turn, conv, prompt)) as events:
                        async for event in events:
                            if turn.opening is not None:
                                await self._opened(turn)
                            accumulate(reply, event)
                            if (out := event_frame(event)) is not None:
                                yield out
                    break
                except UpstreamError as failure:
                    # An overflow before the first token means our projection fell short: compress
                    # and retry once. If nothing could be folded, a retry would overflow the same way.
                    if failure.kind != "context_overflow" or reply.has_output or healed:
                        raise
                    healed = True
                    await self._opened(turn)
                    outcome = await self.compress(turn.conv_id, pending=True)
                    if not (outcome["folded"] or outcome["dropped"]):
                        raise
                    yield frame("compression", outcome)
            if reply.finish_reason in ("length", "max_tokens"):
                yield frame("warning", {
                    "code": "max_tokens",
                    "message": "The reply stopped at the output limit (MAX_COMPLETION_TOKENS).",
                })
            usage = await self._save(turn, "complete")
            yield frame("done", {"assistant_message_id": turn.assistant_id, "usage": usage,
                                 "citations": reply.citations})
        except UpstreamError as failure:
            yield await self._fail(turn, failure)
        except OpeningFailed as exc:
            log.error("turn on %s could not save its opening change: %s", turn.conv_id, exc)
            data = {"kind": "upstream", "message": f"The conversation could not be saved ({exc}); nothing was kept.",
                    "retryable": True, "retry_after": None, "partial": False}
            if turn.user_message is not None:
                data["draft"] = turn.user_message["content"]
            yield frame("error", data)
        except Exception as exc:  # a bug or an unexpected fault must still end the stream cleanly
            log.exception("turn on %s failed", turn.conv_id)
            yield await self._fail(turn, classify_exception(exc))
        finally:
            # Stop and closed tabs land here (cancellation or aclose): keep what arrived. Shielded,
            # because a cancelled task would otherwise be cancelled again at the save's first await.
            with anyio.CancelScope(shield=True):
                await self._save(turn, "interrupted")
            self.active.pop(turn.conv_id, None)

    def _transport(self, turn: Turn, conv: dict, prompt: context.Prompt) -> AsyncIterator[Event]:
        """Turns with web tools go to /v1/messages, the only endpoint that shows the searches."""
        names = tools.enabled(conv["settings"], self.settings)
        if names:
            return self._tool_transport(turn, conv, prompt, names)
        return self._chat_transport(turn, prompt)

    def _chat_transport(self, turn: Turn, prompt: context.Prompt) -> AsyncIterator[Event]:
        body = chat.build_body(
            turn.model, prompt.system, prompt.messages,
            max_tokens=self.settings.max_completion_tokens, params=self.settings.params_for(turn.model),
        )
        return chat.stream(self.client, self.gateway.url("/v1/chat/completions"), body,
                           chat.auth_headers(self.gateway.api_key))

    async def _tool_transport(self, turn: Turn, conv: dict, prompt: context.Prompt,
                              names: list[str]) -> AsyncIterator[Event]:
        """A tool turn; when the gateway rejects every tool, the turn is answered as a chat turn."""
        try:
            async with contextlib.aclosing(tools.stream(
                self.client, self.gateway.url("/v1/messages"), model=turn.model,
                system=prompt.system, messages=prompt.messages,
                tools=tools.declarations(names, self.settings), api_key=self.gateway.api_key,
                max_tokens=self.settings.max_completion_tokens, pause_turn_max=self.settings.pause_turn_max,
            )) as events:
                async for event in events:
                    yield event
            return
        except tools.ToolsRejected as rejected:
            yield rejected.warning
        # Without tools the budget sentence would promise searches the model cannot make.
        sentence = (tools.instructions(conv["settings"], self.settings) or "").strip()
        plain = context.Prompt([p for p in prompt.system if p["text"] != sentence], prompt.messages)
        async with contextlib.aclosing(self._chat_transport(turn, plain)) as events:
            async for event in events:
                yield event

    async def _fail(self, turn: Turn, failure: UpstreamError) -> bytes:
        """Save or roll back, then the `error` frame that ends the stream."""
        data = {
            "kind": failure.kind, "message": failure.message, "retryable": failure.retryable,
            "retry_after": failure.retry_after, "partial": turn.reply.has_output,
        }
        if turn.reply.has_output:
            await self._save(turn, "interrupted", error=failure.kind)
        else:
            turn.saved = True
            if turn.user_message is not None:
                await self._roll_back(turn)
                data["draft"] = turn.user_message["content"]
        log.info("turn on %s ended with %s: %s", turn.conv_id, failure.kind, failure.message)
        return frame("error", data)

    async def _roll_back(self, turn: Turn) -> None:
        """Take the person's message back out, so sending the draft again does not duplicate it."""
        message_id = turn.user_message["id"]

        def remove(c: dict) -> None:
            c["messages"] = [m for m in c["messages"] if m["id"] != message_id]
            if not any(m["role"] == "user" for m in c["messages"]):
                c["title"] = "New conversation"

        with contextlib.suppress(NotFound):
            await self.store.update(turn.conv_id, remove)

    async def _save(self, turn: Turn, status: str, error: str | None = None) -> dict | None:
        """Store the reply once; an empty reply is never stored."""
        if turn.saved:
            return None
        turn.saved = True
        reply = turn.reply
        if not reply.has_output:
            return None
        sent_floor = await asyncio.shield(turn.counting) if turn.counting is not None else 0
        reports = [context.normalize_usage(raw, sent_floor=sent_floor) for raw in reply.usages] or [
            context.normalize_usage(None, sent_floor=sent_floor, output_text=reply.text)]
        usage = combined(reports)
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
                # The last request of a paused turn carried the whole prompt; the sum is the bill.
                c["last_prompt_tokens"] = reports[-1]["input_tokens"]

        try:
            await self.store.update(turn.conv_id, append)
        except NotFound:
            log.info("conversation %s was deleted while it streamed; reply dropped", turn.conv_id)
        return usage


def _drop_trailing_answers(conv: dict) -> None:
    """Regenerate: everything after the last user message goes (interrupted replies too)."""
    messages = conv["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    conv["messages"] = messages[: last_user + 1]
