"""The per-turn pipeline: project, compress, assemble, stream, record, and save exactly once.

A turn is begun by the route (so 404/409/422 are plain HTTP answers: the conversation's turn
lock is taken in the store, and the person's message is added) and then run as an async
generator of typed turn events (`events.TurnEvent`); the route encodes them. Whatever ends it
(the reply finishing, the upstream breaking, the person pressing Stop or closing the tab) the
reply is saved once: the first of the exits to run settles the turn's `Outcome`, and the others
see it settled.

It knows the order of the pipeline and the turn's invariants; wire formats live in `upstream/`,
the prompt layout and token arithmetic in `context.py`, persistence behind `storage.OwnerStore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import enum
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

import context
from config import Settings
from events import (
    Compressed, Event, Reply, TurnDone, TurnEvent, TurnFailed, TurnStarted, TurnWarning, accumulate,
)
from failures import UpstreamError, classify_exception
from storage import Change, NotFound, OwnerStore, TurnLock, new_id, now_iso, recover_interrupted
from upstream import chat
from upstream import messages as web_tools
from upstream.client import Gateway

log = logging.getLogger("chat.turns")

NEW_TITLE = "New conversation"


class NothingToAnswer(Exception):
    """Regenerate on a conversation with no user message to answer."""


class OpeningFailed(Exception):
    """The turn's opening write did not reach the store (it is re-read without it)."""


class Outcome(enum.Enum):
    """How a turn was settled; only the first exit to run settles it."""

    PENDING = "pending"
    SAVED = "saved"                # the reply is stored
    EMPTY = "empty"                # nothing arrived and nothing was billed: nothing to store
    ROLLED_BACK = "rolled_back"    # it failed before any output: the person's message went back to them
    DISCARDED = "discarded"        # the opening write failed: nothing of this turn may be stored
    ABANDONED = "abandoned"        # the client left before the stream began


@dataclass(slots=True)
class Turn:
    store: OwnerStore
    lock: TurnLock
    model: str
    user_message: dict | None  # None when regenerating: the question is already stored
    assistant_id: str = field(default_factory=new_id)
    reply: Reply = field(default_factory=Reply)
    outcome: Outcome = Outcome.PENDING
    # Set once the request went upstream: from then on a stopped reply was billed, text or not.
    requested: bool = False
    # Our own count of the prompt, the floor under the measured one; counted on a worker thread
    # (tiktoken lets go of the GIL), because the first count of a long conversation takes
    # hundreds of milliseconds that every other stream would otherwise wait through.
    counting: asyncio.Future | None = None
    # The opening write (the person's message, or the answers cleared to regenerate), left running
    # while the prompt is assembled and sent; awaited before the first upstream event is passed on.
    opening: asyncio.Future | None = None

    @property
    def conv_id(self) -> str:
        return self.lock.conv_id

    @property
    def settled(self) -> bool:
        return self.outcome is not Outcome.PENDING


def title_from(text: str, limit: int = 60) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), NEW_TITLE)
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


def failed(failure: UpstreamError, *, partial: bool, draft: str | None = None) -> TurnFailed:
    """The one place an upstream failure becomes the page's `error` event."""
    return TurnFailed(failure.kind, failure.message, failure.retryable, failure.retry_after, partial, draft)


class Turns:
    """Runs turns against one gateway."""

    def __init__(self, settings: Settings, gateway: Gateway) -> None:
        self.settings = settings
        self.gateway = gateway

    async def begin(self, store: OwnerStore, conv_id: str, content: str | None) -> Turn:
        """Claim the conversation and add the person's message (or clear the answer to regenerate).

        The change is visible at once; its write runs while `run` sends the request upstream.
        """
        lock = await store.lock_turn(conv_id)
        try:
            conv = await store.get(conv_id)
            if content is None:
                if not any(m["role"] == "user" for m in conv["messages"]):
                    raise NothingToAnswer(conv_id)
                turn = Turn(store, lock, conv["model"], None)
                change = _drop_trailing_answers
            else:
                user = {"id": new_id(), "role": "user", "content": content, "created_at": now_iso()}

                def change(c: dict) -> None:
                    if not any(m["role"] == "user" for m in c["messages"]):
                        c["title"] = title_from(content)
                    c["messages"].append(user)

                turn = Turn(store, lock, conv["model"], user)
            _, turn.opening = await store.update_soon(conv_id, _settling_the_dead(change), lock=lock)
        except BaseException:
            await store.unlock_turn(lock)
            raise
        return turn

    async def release(self, turn: Turn) -> None:
        """Give the conversation back; a turn whose stream never ran stores nothing."""
        if not turn.settled:
            turn.outcome = Outcome.ABANDONED
        with anyio.CancelScope(shield=True):
            await turn.store.unlock_turn(turn.lock)

    async def _opened(self, turn: Turn) -> None:
        """Wait for the opening write; if it failed, nothing of this turn may be stored."""
        opening, turn.opening = turn.opening, None
        if opening is None:
            return
        try:
            await asyncio.shield(opening)
        except Exception as exc:
            turn.outcome = Outcome.DISCARDED  # a reply without its question must never be stored
            raise OpeningFailed(getattr(exc, "strerror", None) or type(exc).__name__) from exc

    async def compress(self, store: OwnerStore, conv_id: str, *, pending: bool,
                       lock: TurnLock | None = None) -> dict:
        """Compress one conversation: the `compression` event's data plus the stored `notice`.

        A no-op (folded 0, no notice) when nothing is old enough. `pending`: the last message is
        the one being answered. The summarizer's call is charged to the conversation like a
        turn's, and counted apart as compression cost.
        """
        result = await context.compress(await store.get(conv_id), self.settings, self._summarize, pending=pending)
        if not result.history:
            return result.event(0)
        # Memory is read only now: another conversation may have added facts while the summarizer ran.
        memory, added = context.merge_facts(await store.read_memory(), list(result.facts))
        if added:
            await store.write_memory(memory)
        data = result.event(added)
        notice = result.notice(data)

        def save(c: dict) -> None:
            result.apply(c, notice, pending=pending)
            totals = c["totals"]
            totals["compression_calls"] += 1
            if result.usage is not None:
                add_usage(totals, result.usage)
                totals["compression_cost"] = round(totals["compression_cost"] + (result.usage["cost"] or 0), 10)

        await store.update(conv_id, save, lock=lock)
        return {**data, "notice": notice}

    async def compress_now(self, store: OwnerStore, conv_id: str) -> dict:
        """Compress now (whatever the budget), with the conversation claimed as a turn would claim it."""
        lock = await store.lock_turn(conv_id)
        try:
            return await self.compress(store, conv_id, pending=False, lock=lock)
        finally:
            with anyio.CancelScope(shield=True):
                await store.unlock_turn(lock)

    async def _summarize(self, messages: list[dict]) -> tuple[str, str, dict | None]:
        """One non-streamed call to SUMMARIZER_MODEL, capped at SUMMARY_MAX_TOKENS."""
        model = self.settings.summarizer_model
        body = chat.build_body(model, [], messages, max_tokens=self.settings.summary_max_tokens,
                               params=self.settings.params_for(model), stream=False)
        return chat.read_completion(await self.gateway.complete(chat.PATH, body, chat.auth_headers(self.gateway.api_key)))

    async def run(self, turn: Turn) -> AsyncIterator[TurnEvent]:
        """The turn's events; `done` comes only after the reply is saved."""
        reply = turn.reply
        user_id = turn.user_message["id"] if turn.user_message else None
        try:
            yield TurnStarted(turn.assistant_id, turn.model, user_id)
            conv = await turn.store.get(turn.conv_id)
            memory = await turn.store.read_memory()
            if context.project(conv, memory, self.settings) > context.budget_of(conv, self.settings):
                await self._opened(turn)  # compression folds the stored messages, the new one included
                outcome = await self.compress(turn.store, turn.conv_id, pending=True, lock=turn.lock)
                if outcome["folded"] or outcome["dropped"]:
                    yield Compressed(outcome)
                else:
                    yield self._warn(reply, "over_budget", "This conversation is over its context budget, "
                                     "but nothing is old enough to fold: the most recent messages are kept verbatim.")
            healed = False
            while True:
                conv = await turn.store.get(turn.conv_id)
                prompt = context.build_prompt(conv, await turn.store.read_memory(), self.settings,
                                              today=dt.date.today(),
                                              tool_instructions=web_tools.instructions(conv["settings"], self.settings))
                turn.counting = asyncio.ensure_future(anyio.to_thread.run_sync(prompt.tokens))
                try:
                    turn.requested = True
                    async with contextlib.aclosing(self._transport(turn, conv, prompt)) as events:
                        async for event in events:
                            if turn.opening is not None:
                                await self._opened(turn)
                            accumulate(reply, event)
                            yield event
                    break
                except UpstreamError as failure:
                    # An overflow before the first token means our projection fell short: compress
                    # and retry once. If nothing could be folded, a retry would overflow the same way.
                    if failure.kind != "context_overflow" or reply.has_output or healed:
                        raise
                    healed = True
                    await self._opened(turn)
                    outcome = await self.compress(turn.store, turn.conv_id, pending=True, lock=turn.lock)
                    if not (outcome["folded"] or outcome["dropped"]):
                        raise
                    yield Compressed(outcome)
            if reply.finish_reason in ("length", "max_tokens"):
                yield self._warn(reply, "max_tokens", "The reply stopped at the output limit (MAX_COMPLETION_TOKENS).")
            usage = await self._save(turn, "complete")
            yield TurnDone(turn.assistant_id, usage, reply.citations)
        except UpstreamError as failure:
            yield await self._fail(turn, failure)
        except OpeningFailed as exc:
            log.error("turn on %s could not save its opening change: %s", turn.conv_id, exc)
            draft = turn.user_message["content"] if turn.user_message is not None else None
            yield TurnFailed("storage", f"The conversation could not be saved ({exc}); nothing was kept.",
                             True, None, False, draft)
        except Exception as exc:  # a bug or an unexpected fault must still end the stream cleanly
            log.exception("turn on %s failed", turn.conv_id)
            yield await self._fail(turn, classify_exception(exc))
        finally:
            # Stop and closed tabs land here (cancellation or aclose): keep what arrived. Shielded,
            # because a cancelled task would otherwise be cancelled again at the save's first await.
            with anyio.CancelScope(shield=True):
                await self._save(turn, "interrupted")
                await turn.store.unlock_turn(turn.lock)

    @staticmethod
    def _warn(reply: Reply, code: str, message: str) -> TurnWarning:
        """A warning of the pipeline's own, kept with the reply like the transports' warnings."""
        warning = TurnWarning(code, message)
        accumulate(reply, warning)
        return warning

    def _transport(self, turn: Turn, conv: dict, prompt: context.Prompt) -> AsyncIterator[Event]:
        """Turns with web tools go to /v1/messages, the only endpoint that shows the searches."""
        names = web_tools.enabled(conv["settings"], self.settings)
        if names:
            return self._tool_transport(turn, conv, prompt, names)
        return self._chat_transport(turn, prompt)

    def _chat_transport(self, turn: Turn, prompt: context.Prompt) -> AsyncIterator[Event]:
        body = chat.build_body(
            turn.model, prompt.system, prompt.messages,
            max_tokens=self.settings.max_completion_tokens, params=self.settings.params_for(turn.model),
        )
        return self.gateway.stream(chat.PATH, body, chat.auth_headers(self.gateway.api_key), chat.ChatDecoder())

    async def _tool_transport(self, turn: Turn, conv: dict, prompt: context.Prompt,
                              names: list[str]) -> AsyncIterator[Event]:
        """A tool turn; when the gateway rejects every tool, the turn is answered as a chat turn."""
        try:
            async with contextlib.aclosing(web_tools.stream(
                self.gateway, model=turn.model, system=prompt.system, messages=prompt.messages,
                tools=web_tools.declarations(names, self.settings),
                max_tokens=self.settings.max_completion_tokens, pause_turn_max=self.settings.pause_turn_max,
            )) as events:
                async for event in events:
                    yield event
            return
        except web_tools.ToolsRejected as rejected:
            yield rejected.warning
        # Without tools the budget sentence would promise searches the model cannot make.
        sentence = (web_tools.instructions(conv["settings"], self.settings) or "").strip()
        plain = context.Prompt([p for p in prompt.system if p["text"] != sentence], prompt.messages)
        async with contextlib.aclosing(self._chat_transport(turn, plain)) as events:
            async for event in events:
                yield event

    async def _fail(self, turn: Turn, failure: UpstreamError) -> TurnFailed:
        """Save or roll back, then the `error` event that ends the stream."""
        partial = turn.reply.has_output
        draft = None
        if partial:
            await self._save(turn, "interrupted", error=failure.kind)
        elif not turn.settled:
            turn.outcome = Outcome.ROLLED_BACK
            if turn.user_message is not None:
                await self._roll_back(turn)
                draft = turn.user_message["content"]
        log.info("turn on %s ended with %s: %s", turn.conv_id, failure.kind, failure.message)
        return failed(failure, partial=partial, draft=draft)

    async def _roll_back(self, turn: Turn) -> None:
        """Take the person's message back out, so sending the draft again does not duplicate it."""
        message_id = turn.user_message["id"]

        def remove(c: dict) -> None:
            c["messages"] = [m for m in c["messages"] if m["id"] != message_id]
            if not any(m["role"] == "user" for m in c["messages"]):
                c["title"] = NEW_TITLE

        with contextlib.suppress(NotFound):
            await turn.store.update(turn.conv_id, remove, lock=turn.lock)

    async def _save(self, turn: Turn, status: str, error: str | None = None) -> dict | None:
        """Store the reply once; an empty reply is stored only when Stop cut a billed request short."""
        if turn.settled:
            return None
        reply = turn.reply
        stopped_early = status == "interrupted" and error is None and turn.requested
        if not reply.has_output and not stopped_early:
            turn.outcome = Outcome.EMPTY
            return None
        turn.outcome = Outcome.SAVED
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
        if reply.warnings:
            message["warnings"] = reply.warnings
        if error:
            message["error"] = error

        def append(c: dict) -> None:
            messages = c["messages"]
            # The reply's last checkpoint (status "streaming") is replaced: the reply is stored once.
            if messages and messages[-1]["id"] == message["id"]:
                messages[-1] = message
            else:
                messages.append(message)
            add_usage(c["totals"], usage)
            c["totals"]["turns"] += 1
            if not usage["estimated"]:
                # The last request of a paused turn carried the whole prompt; the sum is the bill.
                c["last_prompt_tokens"] = reports[-1]["input_tokens"]

        try:
            await turn.store.update(turn.conv_id, append, lock=turn.lock)
        except NotFound:
            log.info("conversation %s was deleted while it streamed; reply dropped", turn.conv_id)
        return usage


def _settling_the_dead(change: Change) -> Change:
    """`change`, after any reply a dead process left `streaming` is made `interrupted`.

    The lock is this turn's now, so such a reply cannot be a live one, even where the store reads
    it as streaming (a store shared by processes sees a lock held, by this very turn).
    """
    def settled_first(conv: dict) -> None:
        recover_interrupted(conv)
        change(conv)

    return settled_first


def _drop_trailing_answers(conv: dict) -> None:
    """Regenerate: everything after the last user message goes (interrupted replies too)."""
    messages = conv["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    conv["messages"] = messages[: last_user + 1]
