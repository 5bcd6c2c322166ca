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
import contextvars
import dataclasses
import datetime as dt
import enum
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from fastapi import HTTPException

from chatserver.attachments.readers import image as image_reader
from chatserver.attachments.store import (
    AttachmentError,
    Attachments,
    BlobMissing,
    StoredImage,
    attachment_context,
    attachment_listing,
    conversation_scope,
    image_words,
    is_image,
    write_closing,
)
from chatserver.config import ModelInfo, Settings
from chatserver.conversations import branches, pii
from chatserver.conversations.document import new_id, now_iso, recover_interrupted
from chatserver.conversations.presets import PresetNotFound, presets_for
from chatserver.conversations.projects import Projects
from chatserver.conversations.usage import add_usage, count_reply
from chatserver.costs.service import Costs, has_images
from chatserver.store.files import Change, NotFound, OwnerStore, StoreUnavailable, TurnLock
from chatserver.tools import registry as tools
from chatserver.turns import context, images, titles
from chatserver.turns.claim import Claim
from chatserver.turns.events import (
    Compressed,
    Event,
    ImageAttached,
    ImageProduced,
    ReasoningDelta,
    Reply,
    TextDelta,
    TurnEvent,
    TurnFailed,
    TurnStarted,
    TurnWarning,
    accumulate,
)
from chatserver.turns.reply import done_event, reply_message, reply_usage
from chatserver.turns.sampling import Sampling
from chatserver.turns.toolloop import ToolLoop
from chatserver.upstream import chat
from chatserver.upstream.client import Gateway
from chatserver.upstream.failures import StreamRedactor, UpstreamError, classify_exception, redact_value

if TYPE_CHECKING:
    from chatserver.turns.compare import Lane

log = logging.getLogger("chat.turns")
# A prompt with at most this much text not counted before is counted on the loop (well under 1 ms).
INLINE_COUNT_CHARS = 4_000

NEW_TITLE = "New conversation"
# How long a turn that ended while the store was down keeps trying to release its lock.
ATTACHMENT_TOOLS = ("search_attachments", "read_attachment")
VISION_TOOL = "analyze_image"
# What VISION_MODEL may answer about one image for `analyze_image`.
VISION_MAX_TOKENS = 1024


class NothingToAnswer(Exception):
    """Regenerate on a conversation with no user message to answer."""


class NotAnAnswerPoint(Exception):
    """A send's `parent_id` is neither the current path's leaf nor the parent of a message the person typed on it."""


class NotContinuable(Exception):
    """Continue asked of a message that is not an assistant reply at the end of the current path."""


class ModelNotInLineup(Exception):
    """The conversation's model is not one of the lineup's, so no turn may use it."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.detail = not_in_lineup(model)


# The lineup a running turn read at its start (set in the turn's own task, so it is the turn's alone).
_turn_lineup: contextvars.ContextVar[list[ModelInfo] | None] = contextvars.ContextVar("turn_lineup", default=None)


def not_in_lineup(model: object) -> str:
    """The 422 detail for a model id the lineup does not hold."""
    return f"model: {model!r} is not in the model lineup (GET /api/models lists it; an admin can add models)"


# `begin`'s parent when none is given: the leaf of the current path (a plain send).
LEAF = object()


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


class Redactor:
    """Takes kept secrets (the gateway key) out of upstream events before anyone sees or stores them.

    Reply and reasoning text arrive in pieces, so each goes through its own StreamRedactor (a key
    split across two deltas is still caught); every other event is redacted whole.
    """

    def __init__(self) -> None:
        self.text = StreamRedactor()
        self.reasoning = StreamRedactor()

    def __call__(self, event: Event) -> Event | None:
        match event:
            case TextDelta(text=text):
                return TextDelta(safe) if (safe := self.text.feed(text)) else None
            case ReasoningDelta(text=text):
                return ReasoningDelta(safe) if (safe := self.reasoning.feed(text)) else None
        values = {f.name: getattr(event, f.name) for f in dataclasses.fields(event) if f.name != "type"}
        safe = {name: redact_value(value) for name, value in values.items()}
        changed = any(safe[name] is not values[name] for name in values)
        return dataclasses.replace(event, **safe) if changed else event

    def rest(self) -> list[Event]:
        """What the text streams held back, once they ended (the start of a key is not the key)."""
        return [e for e in (ReasoningDelta(self.reasoning.flush()), TextDelta(self.text.flush())) if e.text]


@dataclass(slots=True)
class Turn:
    store: OwnerStore
    claim: Claim  # the conversation's turn lock, released once whatever happens
    model: str
    user_message: dict | None  # None when regenerating: the question is already stored
    assistant_id: str = field(default_factory=new_id)
    reply: Reply = field(default_factory=Reply)
    outcome: Outcome = Outcome.PENDING
    # Set once the request went upstream: from then on a stopped reply was billed, text or not.
    requested: bool = False
    redactor: Redactor = field(default_factory=Redactor)
    masked: int | None = None  # items of personal data masked in the person's message, when masking is on
    # Facts the model asked to remember while the person approves facts first: stored with the
    # reply as a notice to review, never written to memory by the turn.
    proposed_facts: list[str] = field(default_factory=list)
    # Our own count of the prompt, the floor under the measured one; counted on a worker thread
    # (tiktoken lets go of the GIL), because the first count of a long conversation takes
    # hundreds of milliseconds that every other stream would otherwise wait through.
    counting: asyncio.Future | None = None
    # The opening write (the person's message, or the answers cleared to regenerate), left running
    # while the prompt is assembled and sent; awaited before the first upstream event is passed on.
    opening: asyncio.Future | None = None
    # The message the reply answers (its `parent_id`), and the path's leaf before the turn began,
    # so a turn that fails before any output puts the path back where it was.
    parent_id: str | None = None
    previous_leaf: str | None = None
    # The conversation's project as the prompt was built (its files are the tools' too).
    project_id: str | None = None
    # The parameters the person set (`sampling.Sampling`), sent upstream and kept with the reply.
    sampling: Sampling = field(default_factory=Sampling)
    # Continue: the stored reply this turn goes on from (same id); the two parts are saved as one.
    continues: dict | None = None
    # Compare: this turn is one of several answers to one message (`compare.Lane`).
    lane: Lane | None = None
    vision: bool = False  # the prompt carried an image (its requests are charged as `vision`)

    @property
    def lock(self) -> TurnLock:
        return self.claim.lock

    @property
    def conv_id(self) -> str:
        return self.claim.lock.conv_id

    @property
    def settled(self) -> bool:
        return self.outcome is not Outcome.PENDING


def title_from(text: str, limit: int = 60) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), NEW_TITLE)
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0]
    return (cut if len(cut) > limit // 2 else line[:limit]).rstrip() + "…"


def add_call_tokens(totals: dict, kind: str, usage: dict) -> None:
    """A summarizer call's tokens apart (`title_input_tokens`...), so the header can itemise the totals."""
    for key in ("input_tokens", "output_tokens"):
        totals[f"{kind}_{key}"] = totals.get(f"{kind}_{key}", 0) + (usage.get(key) or 0)


def failed(failure: UpstreamError, *, partial: bool, draft: str | None = None) -> TurnFailed:
    """The one place an upstream failure becomes the page's `error` event."""
    return TurnFailed(failure.kind, failure.message, failure.retryable, failure.retry_after, partial, draft)


def web_tools_enabled(conv_settings: dict, settings: Settings) -> list[str]:
    """The gateway's web tools this conversation uses: switched on (the default) and with uses left."""
    limits = {"web_search": settings.search_max_uses, "web_fetch": settings.fetch_max_uses}
    return [name for name, limit in limits.items() if conv_settings.get(name, True) and limit > 0]


def web_tool_instructions(conv_settings: dict, settings: Settings) -> str | None:
    """The budget sentence for the system blocks, only when a web tool turn will be sent."""
    return conv_settings.get("tool_instructions") if web_tools_enabled(conv_settings, settings) else None


class Turns:
    """Runs turns against one gateway."""

    def __init__(self, settings: Settings, gateway: Gateway, attachments: Attachments | None = None) -> None:
        self.settings = settings
        self.gateway = gateway
        self.attachments = attachments
        # The whole lineup, custom models included; unset, only the built-in models are usable.
        self.lineup: Callable[[], Awaitable[list[ModelInfo]]] | None = None
        # Models that must get plain-text content: configured, or learned from a refusal of the layout.
        self.plain_text_models = {m.strip() for m in settings.plain_text_models.split(",") if m.strip()}
        # Work that follows a turn (its title), kept so it is not collected mid-flight and can be awaited.
        self.background: set[asyncio.Task] = set()
        self._naming: set[str] = set()  # conversations whose title call is under way
        # Images scaled for upstream, once each (the same image rides in every turn until folded).
        self.scaler = images.Scaler()
        # The ledger every request is charged to, prices, reconciliation and budgets (issue 28).
        self.costs = Costs(settings, gateway)

    async def begin(self, store: OwnerStore, conv_id: str, content: str | None,
                    parent_id: str | None | object = LEAF, *, attachment_ids: list[str] | None = None,
                    answer_to: str | None = None, model: str | None = None) -> Turn:
        """Claim the conversation and add the person's message (or set the answers aside to regenerate).

        `parent_id` (a send): answer from that point of the current path, the old branch kept
        (edit and resend); NotAnAnswerPoint when it is not one (`branches.user_parents`). The
        change is visible at once; its write runs while `run` sends the request upstream.
        Regenerate (`content` None): the answer `answer_to` of the current path (default: the
        answers to the last message typed) gets a sibling; `model` answers with another model.
        """
        claim = await Claim.take(store, conv_id, keep_alive=True)
        lock = claim.lock
        try:
            conv = await store.get(conv_id)
            model = model or conv["model"]
            if not await self.in_lineup(model):
                raise ModelNotInLineup(model)
            previous = branches.last_node_id(conv)
            if content is None:
                question = _question_of(conv, answer_to)
                turn = Turn(store, claim, model, None, parent_id=question, previous_leaf=previous)
                change = functools.partial(_set_answers_aside, question=question)
            else:
                edit = parent_id is not LEAF and parent_id != previous
                parent = parent_id if edit else previous
                if edit and parent not in branches.user_parents(conv):
                    raise NotAnAnswerPoint(parent)
                masked = None
                if self.settings.pii_masking == "on":
                    content, masked = pii.mask(content)
                user = {"id": new_id(), "role": "user", "content": content, "created_at": now_iso(),
                        "parent_id": parent}
                if attachment_ids:
                    user["attachment_ids"] = list(attachment_ids)

                def change(c: dict) -> None:
                    if not branches.has_user_message(c) and c.get("title_source", "auto") == "auto":
                        c["title"] = title_from(content)
                    if edit:
                        branches.switch(c, parent, descend=False)
                    c["messages"].append(user)

                turn = Turn(store, claim, model, user, parent_id=user["id"], previous_leaf=previous,
                            masked=masked)
            _, turn.opening = await store.update_soon(conv_id, _settling_the_dead(change), lock=lock)
        except BaseException:
            await claim.release()
            raise
        return turn

    async def resume(self, store: OwnerStore, conv_id: str, message_id: str | None) -> Turn:
        """Claim the conversation to continue its reply `message_id` (default: the path's last
        reply), which must end the current path; NotContinuable otherwise. It is answered by the
        model that wrote it when that model is still in the lineup, else by the conversation's."""
        claim = await Claim.take(store, conv_id, keep_alive=True)
        try:
            conv = await store.get(conv_id)
            nodes = [m for m in branches.path_items(conv) if branches.is_node(m)]
            last = nodes[-1] if nodes else None
            if last is None or last["role"] != "assistant" or message_id not in (None, last["id"]) \
                    or last.get("status") == "streaming":
                raise NotContinuable(message_id)
            model = last.get("model") if await self.in_lineup(last.get("model") or "") else conv["model"]
            if not await self.in_lineup(model):
                raise ModelNotInLineup(model)
            turn = Turn(store, claim, model, None, assistant_id=last["id"], parent_id=last.get("parent_id"),
                        previous_leaf=last["id"], continues=last)
            _, turn.opening = await store.update_soon(conv_id, _settling_the_dead(lambda c: None), lock=claim.lock)
        except BaseException:
            await claim.release()
            raise
        return turn

    async def _lineup(self) -> list[ModelInfo]:
        """The lineup as the running turn first read it, or as it is now outside a turn."""
        if (known := _turn_lineup.get()) is not None:
            return known
        return await self.lineup() if self.lineup is not None else self.settings.lineup()

    async def is_reasoning(self, model: str) -> bool:
        """Whether the lineup marks this model as a reasoning model (reasoning effort is sent only to those)."""
        return any(m.id == model and m.reasoning for m in await self._lineup())

    async def in_lineup(self, model: str) -> bool:
        """Whether a turn may use this model: only the lineup's go upstream."""
        return any(m.id == model for m in await self._lineup())

    async def sees(self, model: str) -> bool:
        """Whether this model reads images (the lineup's `vision`): only such a model is sent them."""
        return any(m.id == model and m.vision for m in await self._lineup())

    async def conversation_images(self, conv_id: str) -> dict[str, dict]:
        """The conversation's images (their stored meta) by id."""
        if self.attachments is None:
            return {}
        return {m["id"]: m for m in await self.attachments.list(conversation_scope(conv_id)) if is_image(m)}

    async def image_tokens(self, conv: dict, model: str, found: dict[str, dict] | None = None) -> dict[str, int]:
        """Attachment id -> the estimated tokens of that image as `model` is sent it (none when it cannot see).

        From the conversation's images (`found`, when the caller listed them), never from a walk of
        its messages: a long history would cost that walk on every turn."""
        if not await self.sees(model):
            return {}
        if found is None:
            found = await self.conversation_images(conv["id"])
        edge = self.settings.image_max_edge
        return {aid: images.image_tokens(model, *images.fitted(m["width"], m["height"], edge))
                for aid, m in found.items()}

    async def _image_extras(self, turn: Turn, conv: dict, found: dict[str, dict], vision: bool) -> dict[str, list[dict]]:
        """What goes before each of the person's messages that carries images: the images themselves
        (scaled) for a model that sees, else a note naming each (and its id, for `analyze_image`)."""
        if not found:
            return {}  # no image anywhere: nothing to walk the whole history for
        carrying = {m["id"]: [aid for aid in m.get("attachment_ids") or () if aid in found]
                    for m in conv["messages"] if m.get("role") == "user" and context.is_history(m)}
        carrying = {mid: ids for mid, ids in carrying.items() if ids}
        if not vision:
            return {mid: [{"type": "text", "text": self._image_note(found[aid])} for aid in ids]
                    for mid, ids in carrying.items()}
        wanted = list(dict.fromkeys(aid for ids in carrying.values() for aid in ids))
        scaled = await asyncio.gather(*(self._scaled(turn, aid) for aid in wanted), return_exceptions=True)
        parts = {}
        for aid, done in zip(wanted, scaled):
            if isinstance(done, (AttachmentError, BlobMissing)):
                # Deleted meanwhile, or the child refused it (busy, over its limits): the turn goes on without it.
                parts[aid] = {"type": "text", "text": f"[Attached image {found[aid]['name']} could not be sent: {done}]"}
            elif isinstance(done, BaseException):
                raise done
            else:
                parts[aid] = done.part(images.image_tokens(turn.model, done.width, done.height))
        return {mid: [parts[aid] for aid in ids] for mid, ids in carrying.items()}

    @staticmethod
    def _image_note(meta: dict) -> str:
        size = image_words(meta).removeprefix("image, ")
        return (f"[Attached image {meta['name']} (id {meta['id']}, {size}). You cannot see images: "
                "if the analyze_image tool is offered, call it with this id to ask about the image.]")

    async def _scaled(self, turn: Turn, attachment_id: str) -> images.Scaled:
        async def load() -> tuple[bytes, str, int, int]:
            assert self.attachments is not None
            stored = await self.attachments.image(conversation_scope(turn.conv_id), attachment_id)
            return stored.data, stored.media_type, stored.width, stored.height

        return await self.scaler.scaled(attachment_id, load, self._shrinker(turn.store.owner),
                                        self.settings.image_max_edge)

    def _shrinker(self, person: str) -> images.Shrink:
        """How `person`'s images are drawn smaller: in the attachments' limited child, in their turn."""
        async def shrink(data: bytes, edge: int) -> tuple[bytes, dict]:
            assert self.attachments is not None
            return await self.attachments.scaled(data, edge, person)

        return shrink

    async def ask_vision(self, image: StoredImage, question: str, person: str) -> tuple[str, dict]:
        """`analyze_image`'s call: VISION_MODEL answers `question` about the image (scaled like any)."""
        model = self.settings.vision_model
        if model is None or self.attachments is None:
            raise tools.ToolError("no vision model is configured (VISION_MODEL)")

        async def load() -> tuple[bytes, str, int, int]:
            return image.data, image.media_type, image.width, image.height

        try:
            scaled = await self.scaler.scaled(image.id, load, self._shrinker(person), self.settings.image_max_edge)
        except AttachmentError as exc:
            raise tools.ToolError(f"the image could not be prepared: {exc}") from None
        part = scaled.part(images.image_tokens(model, scaled.width, scaled.height))
        messages = [{"role": "user", "content": [part, {"type": "text", "text": question}]}]
        body = chat.build_body(model, [], messages, max_tokens=VISION_MAX_TOKENS, params=self.settings.params_for(model),
                               stream=False)
        try:
            text, finish, raw = chat.read_completion(
                await self.gateway.complete(chat.PATH, body, chat.auth_headers(self.gateway.api_key)))
        except UpstreamError as exc:
            raise tools.ToolError(f"the vision model ({model}) failed: {exc.message}") from None
        if not text.strip():
            raise tools.ToolError(f"the vision model ({model}) gave no answer (finish: {finish or 'none'})")
        usage = context.normalize_usage(raw, sent_floor=context.count_tokens(question) + part["tokens"],
                                        output_text=text)
        return text, usage

    async def release(self, turn: Turn) -> None:
        """Give the conversation back; a turn whose stream never ran stores nothing."""
        if not turn.settled:
            turn.outcome = Outcome.ABANDONED
        await turn.claim.release()
        if turn.outcome is Outcome.SAVED and self.settings.auto_title:
            self.name_soon(turn.store, turn.conv_id)

    def name_soon(self, store: OwnerStore, conv_id: str) -> None:
        """Title the conversation in the background (after the reply was delivered: it never delays one)."""
        if conv_id in self._naming:
            return  # a quick second reply must not ask for a second title
        self._naming.add(conv_id)
        task = asyncio.create_task(self.name(store, conv_id))
        self.background.add(task)

        def finished(done: asyncio.Task) -> None:
            self.background.discard(done)
            self._naming.discard(conv_id)

        task.add_done_callback(finished)

    async def idle(self) -> None:
        """Wait for the background work started so far (tests, shutdown)."""
        while self.background:
            await asyncio.wait(list(self.background))

    async def name(self, store: OwnerStore, conv_id: str) -> None:
        """After the first reply: a short title from SUMMARIZER_MODEL, unless the person named it.

        Tried once per conversation; a failed call keeps the first-line title. Its cost is the
        conversation's, counted apart as `title_cost` / `title_calls` (like compression's).
        """
        try:
            conv = await store.get(conv_id)
            if conv.get("title_source", "auto") != "auto" or conv["totals"].get("title_calls"):
                return
            path = branches.path_items(conv)
            question = next((m for m in path if m["role"] == "user"), None)
            reply = next((m for m in path if m["role"] == "assistant" and (m.get("content") or "").strip()), None)
            if question is None or reply is None:
                return
            request = titles.request(question["content"], reply["content"])
            usage = title = None
            charges: list[dict] = []
            try:
                call: dict = {}
                text, finish, raw = await self._ask_summarizer([{"role": "user", "content": request}], titles.MAX_TOKENS,
                                                               call)
                usage = context.normalize_usage(raw, sent_floor=context.count_tokens(request), output_text=text or "")
                charges = await self.costs.call(store.owner, conv_id, "title", self.settings.summarizer_model, usage, call)
                title = titles.parse(text, finish)
                if title is not None and self.settings.pii_masking == "on":
                    title = pii.mask(title)[0]
            except UpstreamError as exc:
                log.info("titling %s failed: %s", conv_id, exc.message)

            def save(c: dict) -> None:
                totals = c["totals"]
                totals["title_calls"] = totals.get("title_calls", 0) + 1
                if usage is not None:
                    add_usage(totals, usage)
                    add_call_tokens(totals, "title", usage)
                    totals["title_cost"] = round(totals.get("title_cost", 0.0) + (usage["cost"] or 0), 10)
                if title is not None and c.get("title_source", "auto") == "auto":  # not renamed meanwhile
                    c["title"] = title
                    c["title_source"] = "model"

            await store.update(conv_id, save)
            self.costs.reconcile_soon(store.owner, charges)
        except NotFound:
            return
        except Exception:  # a title is a nicety: it must never surface as a failure
            log.exception("titling %s failed", conv_id)

    async def _ask_summarizer(self, messages: list[dict], max_tokens: int,
                              call: dict | None = None) -> tuple[str, str, dict | None]:
        """One non-streamed call to SUMMARIZER_MODEL; `call` receives its billing record."""
        model = self.settings.summarizer_model
        body = chat.build_body(model, [], messages, max_tokens=max_tokens,
                               params=self.settings.params_for(model), stream=False)
        return chat.read_completion(await self.gateway.complete(chat.PATH, body, chat.auth_headers(self.gateway.api_key),
                                                                call))

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
        named = {aid: f"{m['name']} ({image_words(m)})" for aid, m in (await self.conversation_images(conv_id)).items()}
        call: dict = {}
        result = await context.compress(await store.get(conv_id), self.settings,
                                        functools.partial(self._summarize, call=call), pending=pending, images=named)
        if not result.history:
            return result.event(0)
        facts = list(result.facts)
        if self.settings.pii_masking == "on":
            # The summarizer may repeat what a fetched page or a tool result held: the summary
            # rides in every later prompt, so it is masked like the facts.
            result = dataclasses.replace(result, summary=result.summary and pii.mask(result.summary)[0])
            facts = [pii.mask(fact)[0] for fact in facts]
        # Memory is read only now: another conversation may have added facts while the summarizer ran.
        memory = await store.read_memory()
        fresh = context.fresh_facts(memory, facts)
        # Facts can come from fetched pages: with approval on, none is kept until the person says so.
        review = (await store.get(conv_id))["settings"].get("approve_facts", self.settings.approve_facts)
        if fresh and not review:
            await store.write_memory(context.merge_facts(memory, fresh)[0])
        data = {**result.event(0 if review else len(fresh)), "facts": fresh, "facts_pending": bool(review and fresh)}
        notice = result.notice(data)
        charges = [] if result.usage is None else await self.costs.call(
            store.owner, conv_id, "summary", self.settings.summarizer_model, result.usage, call, message_id=notice["id"])

        def save(c: dict) -> None:
            result.apply(c, notice, pending=pending)
            totals = c["totals"]
            totals["compression_calls"] += 1
            if result.usage is not None:
                add_usage(totals, result.usage)
                add_call_tokens(totals, "compression", result.usage)
                totals["compression_cost"] = round(totals["compression_cost"] + (result.usage["cost"] or 0), 10)

        await store.update(conv_id, save, lock=lock)
        self.costs.reconcile_soon(store.owner, charges)
        return {**data, "notice": notice}

    async def review_facts(self, store: OwnerStore, conv_id: str, notice_id: str, keep: list[str]) -> dict:
        """The person's word on a compression's facts: `keep` (edited or not) is what memory holds of
        them from now on; the others are dropped from memory, or never written when they waited for
        approval. Answers the updated notice."""
        conv = await store.get(conv_id)
        notice = next((m for m in conv["messages"] + conv.get("archive", [])
                       if m["id"] == notice_id and m["role"] == "notice" and "compression" in m), None)
        if notice is None:
            raise NotFound(notice_id)
        if self.settings.pii_masking == "on":
            keep = [pii.mask(fact)[0] for fact in keep]
        data = notice["compression"]
        memory = await store.read_memory()
        if not data.get("facts_pending"):
            memory = context.forget_facts(memory, data.get("facts") or [])
        memory, added = context.merge_facts(memory, keep)
        await store.write_memory(memory)
        kept = [" ".join(f.split()) for f in keep if f.strip()]

        def record(c: dict) -> None:
            for m in c["messages"] + c.get("archive", []):
                if m["id"] == notice_id:
                    m["compression"] = {**m["compression"], "facts": kept, "facts_pending": False,
                                        "facts_reviewed": True, "facts_added": added}

        await store.update(conv_id, record)
        return next(m for m in (await store.get(conv_id))["messages"] + conv.get("archive", [])
                    if m["id"] == notice_id)

    async def compress_now(self, store: OwnerStore, conv_id: str) -> dict:
        """Compress now (whatever the budget), with the conversation claimed as a turn would claim it."""
        async with await Claim.take(store, conv_id) as claim:
            return await self.compress(store, conv_id, pending=False, lock=claim.lock)

    async def _summarize(self, messages: list[dict], call: dict | None = None) -> tuple[str, str, dict | None]:
        """One non-streamed call to SUMMARIZER_MODEL, capped at SUMMARY_MAX_TOKENS."""
        return await self._ask_summarizer(messages, self.settings.summary_max_tokens, call)

    async def run(self, turn: Turn) -> AsyncIterator[TurnEvent]:
        """The turn's events; `done` comes only after the reply is saved."""
        reply = turn.reply
        user_id = turn.user_message["id"] if turn.user_message else None
        try:
            yield TurnStarted(turn.assistant_id, turn.model, user_id, turn.masked)
            # Read once for the turn (a store read on Redis): it asks which model sees, reasons, runs tools.
            _turn_lineup.set(await self._lineup())
            await self.costs.admit(turn.store.owner)
            conv = await turn.store.get(turn.conv_id)
            memory = await turn.store.read_memory()
            vision = await self.sees(turn.model)
            turn.project_id, project = await Projects(turn.store).instructions_for(conv)
            # The files the tools see, listed in one read for the turn: its images come from the
            # conversation's, and a retry below (plain text, a healed overflow) uses the same.
            listed = await self._listed_files(turn, conv)
            found = {m["id"]: m for m in listed.get(conversation_scope(turn.conv_id).key, ()) if is_image(m)}
            seen = await self.image_tokens(conv, turn.model, found)
            # Read again only after a compression, which folds the stored messages and may add facts
            # to memory: on Redis each read is a round trip before the first token.
            compressed = False
            if context.project(conv, memory, self.settings, seen, project) > context.budget_of(conv, self.settings):
                await self._opened(turn)  # compression folds the stored messages, the new one included
                outcome = await self.compress(turn.store, turn.conv_id, pending=True, lock=turn.lock)
                compressed = True
                if outcome["folded"] or outcome["dropped"]:
                    yield Compressed(outcome)
                else:
                    yield self._warn(reply, "over_budget", "This conversation is over its context budget, "
                                     "but nothing is old enough to fold: the most recent messages are kept verbatim.")
            healed = False
            while True:
                if compressed:
                    conv = await turn.store.get(turn.conv_id)
                    memory = await turn.store.read_memory()
                    turn.project_id, project = await Projects(turn.store).instructions_for(conv)
                    compressed = False
                files = await self._attachment_listing(turn, conv, listed)
                prompt = context.build_prompt(conv, memory, self.settings,
                                              today=dt.date.today(),
                                              tool_instructions=web_tool_instructions(conv["settings"], self.settings),
                                              attachments=files, project=project,
                                              extras=await self._image_extras(turn, conv, found, vision))
                turn.counting = count_soon(prompt)
                turn.vision = bool(found) and has_images(prompt.messages)  # images come from `found` alone
                try:
                    turn.requested = True
                    # A model that cannot see is offered the vision tool, when there is an image to look at.
                    looks = bool(found) and not vision
                    async with contextlib.aclosing(self._transport(turn, conv, prompt, bool(files), looks)) as events:
                        async for event in events:
                            if turn.opening is not None:
                                await self._opened(turn)
                            if isinstance(event, ImageProduced):
                                event = await self._keep_image(turn, event)
                            if (event := turn.redactor(event)) is not None:
                                accumulate(reply, event)
                                yield event
                    for event in turn.redactor.rest():
                        accumulate(reply, event)
                        yield event
                    break
                except UpstreamError as failure:
                    if self._learned_plain_text(turn, conv, failure):
                        continue
                    # An overflow before the first token means our projection fell short: compress
                    # and retry once. If nothing could be folded, a retry would overflow the same way.
                    if failure.kind != "context_overflow" or reply.has_output or healed:
                        raise
                    healed = True
                    await self._opened(turn)
                    outcome = await self.compress(turn.store, turn.conv_id, pending=True, lock=turn.lock)
                    if not (outcome["folded"] or outcome["dropped"]):
                        raise
                    compressed = True
                    yield Compressed(outcome)
            if reply.finish_reason in ("length", "max_tokens"):
                yield self._warn(reply, "max_tokens", "The reply stopped at the output limit (MAX_COMPLETION_TOKENS).")
            yield done_event(turn.assistant_id, await self._save(turn, "complete"))
        except UpstreamError as failure:
            yield await self._fail(turn, failure)
        except OpeningFailed as exc:
            log.error("turn on %s could not save its opening change: %s", turn.conv_id, exc)
            draft = turn.user_message["content"] if turn.user_message is not None else None
            yield TurnFailed("storage", f"The conversation could not be saved ({exc}); nothing was kept.",
                             True, None, False, draft)
        except StoreUnavailable as exc:
            log.error("turn on %s could not reach the store: %s", turn.conv_id, exc)
            if not turn.settled:
                turn.outcome = Outcome.DISCARDED
            yield TurnFailed("storage", "The conversation store (Redis) is unreachable; this reply could not be "
                             "saved. Try again once it is back.",
                             True, None, turn.reply.has_output)
        except Exception as exc:  # a bug or an unexpected fault must still end the stream cleanly
            log.exception("turn on %s failed", turn.conv_id)
            yield await self._fail(turn, classify_exception(exc))
        finally:
            # Stop and closed tabs land here (cancellation or aclose): keep what arrived. Shielded,
            # because a cancelled task would otherwise be cancelled again at the save's first await.
            with anyio.CancelScope(shield=True):
                try:
                    await self._save(turn, "interrupted")
                    await self.costs.leftovers(turn)
                except StoreUnavailable as exc:  # the person was already told
                    log.warning("turn on %s ended while the store was unreachable: %s", turn.conv_id, exc)
                await turn.claim.release()

    def _learned_plain_text(self, turn: Turn, conv: dict, failure: UpstreamError) -> bool:
        """A server that refused the layered system blocks as malformed: send plain text from now on.

        True when this turn should be sent again that way (once: a second refusal is a real one).
        """
        if not failure.malformed_request or turn.reply.has_output or turn.model in self.plain_text_models \
                or web_tools_enabled(conv["settings"], self.settings):
            return False
        self.plain_text_models.add(turn.model)
        log.warning("%s refused the layered system prompt; sending it plain text from now on (no cache markers)",
                    turn.model)
        return True

    async def _keep_image(self, turn: Turn, produced: ImageProduced, tool: str | None = None
                          ) -> ImageAttached | TurnWarning:
        """An image the model (or `tool`) returned, stored as an attachment of the conversation
        (cleaned and checked like an upload, counted in the person's quota): the reply's own image."""
        who = "The model" if tool is None else f"The tool {tool}"
        if self.attachments is None:
            return TurnWarning("image_not_kept", f"{who} returned an image, but this server keeps no files.")
        if not image_reader.is_image(produced.data[:16]):
            # An upload may be any file type; this must be an image, whatever else it would read as.
            return TurnWarning("image_not_kept", f"{who} returned an image that could not be kept: "
                               "it is not a PNG, JPEG, GIF or WebP image")
        from chatserver.api.quota import check_files  # the quota's one rule, as uploads apply it

        attachments = self.attachments
        kept = len(turn.reply.attachment_ids) + 1
        stem = "image" if tool is None else f"{tool}-image"
        name = f"{stem}-{kept}.{produced.media_type.removeprefix('image/').replace('jpeg', 'jpg')}"
        fd, path = attachments.incoming_file()
        await anyio.to_thread.run_sync(write_closing, fd, produced.data)

        async def fits(size: int) -> None:
            await check_files(attachments, turn.store, size)

        try:
            stored = await attachments.ingest(conversation_scope(turn.conv_id), name, path, turn.store.owner, fits)
        except AttachmentError as exc:
            return TurnWarning("image_not_kept", f"{who} returned an image that could not be kept: {exc}")
        except HTTPException as exc:
            return TurnWarning("image_not_kept", f"{who} returned an image that could not be kept: {exc.detail}")
        return ImageAttached(stored)

    @staticmethod
    def _warn(reply: Reply, code: str, message: str) -> TurnWarning:
        """A warning of the pipeline's own, kept with the reply like the transports' warnings."""
        warning = TurnWarning(code, message)
        accumulate(reply, warning)
        return warning

    def _attachment_scope(self, turn: Turn, conv: dict) -> contextlib.AbstractContextManager:
        """Whose files the attachment tools see: this conversation's, its project's (as found when the
        prompt was built, through the owner's own projects), and the library where enabled."""
        if self.attachments is None:
            return contextlib.nullcontext()
        return attachment_context(self.attachments, turn.conv_id, turn.store.owner,
                                  library=bool(conv["settings"].get("library")), project_id=turn.project_id)

    async def _listed_files(self, turn: Turn, conv: dict) -> dict[str, list[dict]]:
        """The attachments of every scope the tools see, by scope key."""
        with self._attachment_scope(turn, conv) as scope:
            return {} if scope is None else await scope.attachments.list_many(scope.scopes)

    async def _attachment_listing(self, turn: Turn, conv: dict, listed: dict[str, list[dict]]) -> str:
        with self._attachment_scope(turn, conv) as scope:
            return await attachment_listing(scope, listed)

    async def _selection(self, turn: Turn, conv: dict, has_files: bool, looks: bool = False) -> tools.Selection:
        """The tools this turn offers: the model's runtime, the preset's whitelist, the conversation's choice."""
        # Where the model's tools run: its lineup entry's (custom models included), read once for the turn.
        runtime = next((m.tool_runtime for m in await self._lineup() if m.id == turn.model),
                       self.settings.runtime_for(turn.model))
        web = web_tools_enabled(conv["settings"], self.settings)
        preset_name = conv["settings"].get("preset") or "default"
        try:
            allowed = (await presets_for(turn.store).get(preset_name)).tools
        except PresetNotFound:
            allowed = ()
        selection = tools.select_tools(tools.registry, self.settings, allowed=allowed,
                                       chosen=conv["settings"].get("tools"), runtime=runtime,
                                       web_search="web_search" in web, web_fetch="web_fetch" in web)
        if not has_files:
            # No files to search: the attachment tools would only be noise for the model to pick from.
            selection = tools.Selection(tuple(n for n in selection.local if n not in ATTACHMENT_TOOLS),
                                        selection.gateway)
        if not looks:
            # No image, or a model that sees them itself: analyze_image would only cost a second call.
            selection = tools.Selection(tuple(n for n in selection.local if n != VISION_TOOL), selection.gateway)
        return selection

    async def _transport(self, turn: Turn, conv: dict, prompt: context.Prompt,
                         has_files: bool, looks: bool = False) -> AsyncIterator[Event]:
        """Every turn goes through the tool loop: with the gateway's web tools on /v1/messages, the
        only endpoint that shows the searches; otherwise on chat completions, with our tools if any."""
        selection = await self._selection(turn, conv, has_files, looks)
        if not selection.gateway and not set(selection.local) & set(tools.GATEWAY_TOOLS):
            prompt = self._without_web_sentence(conv, prompt)
        turn.sampling = Sampling.of(conv["settings"], reasoning=await self.is_reasoning(turn.model))
        loop = ToolLoop(self.gateway, self.settings, wire="messages" if selection.gateway else "chat",
                        model=turn.model, selection=selection, ctx=self._tool_context(turn, conv),
                        scope=lambda: self._attachment_scope(turn, conv),
                        plain_text=turn.model in self.plain_text_models,
                        without_web=lambda p: self._without_web_sentence(conv, p),
                        sampling=turn.sampling, continuing=turn.continues is not None,
                        keep_image=lambda image, tool: self._keep_image(turn, image, tool))
        async with contextlib.aclosing(loop.run(prompt)) as events:
            async for event in events:
                yield event

    def _tool_context(self, turn: Turn, conv: dict) -> tools.ToolContext:
        masking = self.settings.pii_masking == "on"

        async def write_masked(text: str) -> None:
            await turn.store.write_memory(pii.mask(text)[0])

        def propose(fact: str) -> None:
            fact = pii.mask(fact)[0] if masking else fact
            turn.proposed_facts += context.fresh_facts("\n".join(turn.proposed_facts), [fact])

        # A fact the model remembers is masked like the person's message, and waits for the
        # person's word when they approve facts first (as a compression's facts do).
        write_memory = write_masked if masking else turn.store.write_memory
        approve = conv["settings"].get("approve_facts", self.settings.approve_facts)
        return tools.ToolContext(turn.conv_id, self.settings, turn.store.read_memory, write_memory,
                                 owner=turn.store.owner, propose_fact=propose if approve else None,
                                 extractor=self.attachments.extractor if self.attachments else None,
                                 ask_vision=functools.partial(self.ask_vision, person=turn.store.owner))

    def _without_web_sentence(self, conv: dict, prompt: context.Prompt) -> context.Prompt:
        """Without web tools the budget sentence would promise searches the model cannot make."""
        sentence = (web_tool_instructions(conv["settings"], self.settings) or "").strip()
        if not sentence:
            return prompt
        return context.Prompt([p for p in prompt.system if p["text"] != sentence], prompt.messages)

    async def _fail(self, turn: Turn, failure: UpstreamError) -> TurnFailed:
        """Save or roll back, then the `error` event that ends the stream."""
        partial = turn.reply.has_output
        draft = None
        if partial:
            await self._save(turn, "interrupted", error=failure.kind)
        elif not turn.settled:
            turn.outcome = Outcome.ROLLED_BACK
            # One compared answer failing leaves the message and the other answers (`compare`) as they are.
            if turn.lane is None:
                await self.roll_back(turn)
                if turn.user_message is not None:
                    draft = turn.user_message["content"]
        log.info("turn on %s ended with %s: %s", turn.conv_id, failure.kind, failure.message)
        return failed(failure, partial=partial, draft=draft)

    async def roll_back(self, turn: Turn) -> None:
        """Take the person's message back out, so sending the draft again does not duplicate it,
        and put the path back where it was (an edit's old branch, a regenerated answer)."""
        message_id = turn.user_message["id"] if turn.user_message is not None else None

        def remove(c: dict) -> None:
            c["messages"] = [m for m in c["messages"] if m["id"] != message_id]
            if turn.previous_leaf != branches.last_node_id(c):
                with contextlib.suppress(branches.UnknownMessage):
                    branches.switch(c, turn.previous_leaf, descend=False)
            if not branches.has_user_message(c) and c.get("title_source", "auto") == "auto":
                c["title"] = NEW_TITLE

        with contextlib.suppress(NotFound):
            await turn.store.update(turn.conv_id, remove, lock=turn.lock)

    async def _save(self, turn: Turn, status: str, error: str | None = None) -> dict | None:
        """Store the reply once and return it as stored (None: nothing was); an empty reply is
        stored only when Stop cut a billed request short."""
        if turn.settled:
            return None
        reply = turn.reply
        for held in turn.redactor.rest():
            accumulate(reply, held)
        stopped_early = status == "interrupted" and error is None and turn.requested
        if not reply.has_output and not stopped_early:
            turn.outcome = Outcome.EMPTY
            return None
        turn.outcome = Outcome.SAVED
        reply.end_running_tools()
        sent_floor = await asyncio.shield(turn.counting) if turn.counting is not None else 0
        usage, reports = reply_usage(turn, sent_floor)
        charges = await self.costs.reply(turn, usage, sent_floor)
        message = reply_message(turn, status, usage, error=error)

        # Facts the model proposed follow the reply, so they leave the path with it (a regenerate).
        notice = context.proposed_facts_notice(turn.proposed_facts, turn.assistant_id) if turn.proposed_facts else None

        def append(c: dict) -> None:
            on_path = turn.lane is None or turn.lane.on_path(c)
            messages = c["messages"] if on_path else c.setdefault("off_path", [])
            # The reply's last checkpoint (status "streaming"), or the reply it continues, is replaced:
            # the reply is stored once.
            at = len(messages) - 1 if messages and messages[-1]["id"] == message["id"] else None
            if at is None and (turn.continues is not None or not on_path):
                # Notices may follow the reply it continues; a comparison's siblings' checkpoints
                # may follow this one off the path.
                at = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["id"] == message["id"]), None)
            if at is not None:
                messages[at] = message
            else:
                messages.append(message)
            if notice is not None:
                messages.append(notice)
            count_reply(c["totals"], usage)
            if on_path and not usage["estimated"]:
                # The last request of a paused turn carried the whole prompt; the sum is the bill.
                c["last_prompt_tokens"] = reports[-1]["input_tokens"]

        try:
            await turn.store.update(turn.conv_id, append, lock=turn.lock)
        except NotFound:
            log.info("conversation %s was deleted while it streamed; reply dropped", turn.conv_id)
        self.costs.reconcile_soon(turn.store.owner, charges)
        return message


def _question_of(conv: dict, answer_to: str | None) -> str:
    """The message a regenerated answer answers: `answer_to`'s parent, or the last one typed."""
    if answer_to is None:
        question = next((m["id"] for m in reversed(conv["messages"]) if m["role"] == "user"), None)
    else:
        reply = next((m for m, _ in branches.linked(branches.path_items(conv)) if m["id"] == answer_to), None)
        if reply is None or reply["role"] != "assistant":
            raise NothingToAnswer(conv["id"])
        question = branches.parents(conv)[answer_to]
    if question is None:
        raise NothingToAnswer(conv["id"])
    return question
def count_soon(prompt: context.Prompt) -> asyncio.Future:
    """Our count of the prompt: here when little text is new to it (the usual turn: its history's
    count is kept with its walk), in a worker thread when much is, so that counting a long history
    or a long message never holds up the loop."""
    if prompt.uncounted() <= INLINE_COUNT_CHARS:
        done = asyncio.get_running_loop().create_future()
        done.set_result(prompt.tokens())
        return done
    return asyncio.ensure_future(anyio.to_thread.run_sync(prompt.tokens))


def _set_answers_aside(conv: dict, *, question: str) -> None:
    """Regenerate: the answers after the last user message (interrupted ones too) become the new
    answer's siblings, kept off the current path."""
    branches.switch(conv, question, descend=False)


def _settling_the_dead(change: Change) -> Change:
    """`change`, after any reply a dead process left `streaming` is made `interrupted`.

    The lock is this turn's now, so such a reply cannot be a live one, even where the store reads
    it as streaming (a store shared by processes sees a lock held, by this very turn).
    """
    def settled_first(conv: dict) -> None:
        recover_interrupted(conv)
        change(conv)

    return settled_first

