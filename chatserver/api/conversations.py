"""Conversations and their turns: CRUD, send, regenerate, rewind, compress.

Every handler reaches the store through `OwnerStoreDep`, so another owner's conversation is
NotFound here exactly like an unknown id.
"""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from chatserver.api.deps import OwnerStoreDep, StateDep
from chatserver.api.quota import check_conversations
from chatserver.api.schemas import (
    BranchSwitch,
    CompareRequest,
    ContinueRequest,
    Conversation,
    ConversationCreate,
    ConversationEntry,
    ConversationPatch,
    Draft,
    Empty,
    FactsReview,
    Message,
    MessageCreate,
    RegenerateRequest,
    ReplyEdit,
    StopRequest,
)
from chatserver.api.sse import TurnResponse
from chatserver.attachments.store import AttachmentNotFound, conversation_scope
from chatserver.config import PACKAGE, Settings
from chatserver.conversations import branches, pii
from chatserver.conversations.document import new_id, now_iso
from chatserver.conversations.presets import PresetNotFound, presets_for
from chatserver.conversations.projects import Projects
from chatserver.sizes import admin_setting
from chatserver.store.files import OwnerStore, TurnBusy
from chatserver.tools import registry as tools
from chatserver.turns import answers, context, sampling
from chatserver.turns.claim import Claim
from chatserver.turns.compare import Comparison
from chatserver.turns.pipeline import (
    LEAF,
    NEW_TITLE,
    ModelNotInLineup,
    NotAnAnswerPoint,
    NotContinuable,
    NothingToAnswer,
    Turn,
    not_in_lineup,
)

router = APIRouter(prefix="/api/conversations", tags=["conversations"])

# The smallest prompt a budget must leave room for beside the completion reserve.
MIN_PROMPT_TOKENS = 256


def json_answer(obj: object, status_code: int = 200) -> Response:
    """A stored document as JSON, encoded by orjson without a validation pass (a conversation can be megabytes)."""
    return Response(orjson.dumps(obj), status_code=status_code, media_type="application/json")


class Conflict(Exception):
    """The request cannot run now (a turn is streaming, or there is nothing to act on)."""


async def default_settings(settings: Settings, preset_name: str | None, store: OwnerStore) -> dict:
    """A new conversation's settings: its preset's persona and tools, web tools off unless configured on."""
    presets = presets_for(store)
    try:
        preset = await presets.get(preset_name or "default")
    except PresetNotFound:
        preset = await presets.get("default")
    return {
        "preset": preset.name,
        "system_prompt": preset.text,
        "context_budget": settings.context_budget_tokens,
        "web_search": settings.default_web_search,
        "web_fetch": settings.default_web_fetch,
        "approve_facts": settings.approve_facts,
        "tools": list(preset.tools),
        "library": False,
        "tool_instructions": (PACKAGE / "prompts" / "tool_instructions.txt").read_text(encoding="utf-8").strip()
        .replace("{search_max_uses}", str(settings.search_max_uses))
        .replace("{fetch_max_uses}", str(settings.fetch_max_uses)),
        "compression_prompt": context.default_compression_prompt(),
        **preset.params,
    }


# Stored, never answered: the other branches (reachable through `branches`), the fold records and
# the child last viewed under each message.
PRIVATE_FIELDS = ("schema_version", "owner", "off_path", "folds", "last_child")


def with_parents(messages: list[dict]) -> list[dict]:
    """The path's messages, each with its `parent_id` (older files leave it implicit)."""
    if all("parent_id" in m for m in messages):
        return messages
    return [m if "parent_id" in m else {**m, "parent_id": parent} for m, parent in branches.linked(messages)]


async def conversation_out(state, store: OwnerStore, conv: dict, status_code: int = 200) -> Response:
    out = {k: v for k, v in conv.items() if k not in PRIVATE_FIELDS}
    path = with_parents(branches.path_items(conv))
    folded = len(conv.get("archive") or [])
    if "archive" in conv:
        out["archive"] = path[:folded]
    out["messages"] = path[folded:]
    out["branches"] = branches.siblings(conv)
    # A store that holds documents from before version 4 without upgrading them on read (Redis).
    out.setdefault("pinned", False)
    out.setdefault("archived", False)
    out.setdefault("title_source", "auto")
    _, project = await Projects(store).instructions_for(conv)
    out["context"] = context.context_breakdown(conv, await store.read_memory(), state.settings,
                                               await state.turns.image_tokens(conv, conv["model"]), project)
    out["streaming"] = await store.turn_locked(conv["id"])
    out["turn"] = await state.hub.info(conv["id"])
    return json_answer(out, status_code)


def turn_response(state, turn: Turn | Comparison) -> TurnResponse:
    """The new turn runs in the server's own task; this response follows it from its first event.

    With ON_DISCONNECT=stop, the response ending before the turn did (a hang-up, a stalled
    reader) stops it, as it always did; by default the turn runs on and is saved.
    """
    running = state.hub.start(turn)
    closed = running.stop if state.settings.on_disconnect == "stop" else None
    return TurnResponse(running.follow(0), closed, send_timeout=state.settings.stream_send_timeout)


@router.get("", response_model=list[ConversationEntry])
async def list_conversations(store: OwnerStoreDep, archived: Annotated[bool, Query()] = False) -> Response:
    """Pinned conversations first, then the most recent by its last message (a rename or a settings
    change does not move it). Archived ones only, and only they, with `?archived=true`."""
    entries = [c for c in await store.list() if c.get("archived", False) == archived]
    entries.sort(key=lambda c: c["last_message_at"], reverse=True)
    entries.sort(key=lambda c: not c.get("pinned", False))  # stable: each group stays newest first
    for entry in entries:
        entry["streaming"] = await store.turn_locked(entry["id"])
    return json_answer(entries)


@router.post("", status_code=201, response_model=Conversation)
async def create_conversation(state: StateDep, store: OwnerStoreDep,
                              body: ConversationCreate | None = None) -> Response:
    body = body or ConversationCreate()
    await check_conversations(state.settings.quota_conversations, store)
    model = body.model or state.settings.default_model
    if not await state.turns.in_lineup(model):
        return JSONResponse({"detail": not_in_lineup(model)}, status_code=422)
    if body.project_id is not None:
        await Projects(store).get(body.project_id)
    created = now_iso()
    conv = await store.create({
        "id": new_id(), "title": NEW_TITLE,
        "model": model,
        "created_at": created, "updated_at": created,
        "settings": await default_settings(state.settings, body.preset, store),
        "project_id": body.project_id,
    })
    return await conversation_out(state, store, conv, 201)


@router.get("/{conv_id}", response_model=Conversation)
async def get_conversation(conv_id: str, state: StateDep, store: OwnerStoreDep) -> Response:
    return await conversation_out(state, store, await store.get(conv_id))


@router.patch("/{conv_id}", response_model=Conversation)
async def patch_conversation(conv_id: str, body: ConversationPatch, state: StateDep,
                             store: OwnerStoreDep) -> Response:
    reserve = state.settings.max_completion_tokens
    if body.settings is not None and body.settings.context_budget is not None \
            and body.settings.context_budget < reserve + MIN_PROMPT_TOKENS:
        return JSONResponse({"detail": f"settings.context_budget: must be at least {reserve + MIN_PROMPT_TOKENS} "
                                       f"(the completion reserve of {reserve} tokens plus a minimal prompt)"},
                            status_code=422)
    if body.model is not None and not await state.turns.in_lineup(body.model):
        return JSONResponse({"detail": not_in_lineup(body.model)}, status_code=422)
    if body.settings is not None and body.settings.tools is not None:
        problem = await _unusable_tools(state, store, conv_id, body.settings)
        if problem:
            return JSONResponse({"detail": f"settings.tools: {problem}"}, status_code=422)
    moving = "project_id" in body.model_fields_set
    if moving and body.project_id is not None:
        await Projects(store).get(body.project_id)  # another person's project is 404, like an unknown one
    if body.settings is not None and body.settings.reasoning_effort is not None:
        model = body.model or (await store.get(conv_id))["model"]
        if not await state.turns.is_reasoning(model):
            return JSONResponse({"detail": f"settings.reasoning_effort: {model!r} is not a reasoning model "
                                           "(GET /api/models marks those with reasoning: true)"}, status_code=422)

    masking = state.settings.pii_masking == "on"
    if masking and body.settings is not None and body.settings.system_prompt is not None:
        body.settings.system_prompt = pii.mask(body.settings.system_prompt)[0]

    def apply(conv: dict) -> None:
        if body.title is not None and body.title.strip():
            conv["title"] = pii.mask(body.title.strip())[0] if masking else body.title.strip()
            conv["title_source"] = "user"  # a name the person chose is never replaced by a generated one
        if body.pinned is not None:
            conv["pinned"] = body.pinned
        if body.archived is not None:
            conv["archived"] = body.archived
        if body.model is not None:
            conv["model"] = body.model
        if body.settings is not None:
            conv["settings"].update(body.settings.model_dump(exclude_none=True))
            # An explicit null puts a generation parameter back to its default.
            for key in sampling.KEYS:
                if key in body.settings.model_fields_set and getattr(body.settings, key) is None:
                    conv["settings"].pop(key, None)
        if moving:
            conv["project_id"] = body.project_id

    return await conversation_out(state, store, await store.update(conv_id, apply))


async def _unusable_tools(state, store: OwnerStore, conv_id: str, patch) -> str | None:
    """Why `patch.tools` cannot be set: a tool that does not exist, or one the person's preset does not allow."""
    preset_name = patch.preset or (await store.get(conv_id))["settings"].get("preset") or "default"
    try:
        allowed = (await presets_for(store).get(preset_name)).tools
    except PresetNotFound:
        return f"the preset {preset_name!r} does not exist"
    unknown = [n for n in patch.tools if not tools.registry.accepts(n)]
    if unknown:
        return f"no tool is called {', '.join(map(repr, unknown))}; tools: {', '.join(tools.registry.names())}"
    refused = [n for n in patch.tools if not tools.whitelisted(tools.registry, n, allowed)]
    if refused:
        return (f"the preset {preset_name!r} does not allow {', '.join(map(repr, refused))}; it allows: "
                f"{', '.join(allowed) or 'no tools'}")
    return None


@router.delete("/{conv_id}", status_code=204)
async def delete_conversation(conv_id: str, state: StateDep, store: OwnerStoreDep) -> Response:
    await store.get(conv_id)
    # A reply nobody can ever read would otherwise go on being generated and billed.
    await state.hub.stop(conv_id)
    await store.delete(conv_id)
    context.forget(conv_id)
    # Its files go with it (the conversation was this owner's, or delete would have been 404).
    await state.attachments.delete_scope(conversation_scope(conv_id))
    return Response(status_code=204)


@router.post("/{conv_id}/messages",
             responses={200: {"content": {"text/event-stream": {}}, "description": "the turn stream"}})
async def send_message(conv_id: str, body: MessageCreate, state: StateDep, store: OwnerStoreDep) -> Response:
    if len(body.content) > (limit := state.settings.max_message_chars):
        return JSONResponse(
            {"detail": f"the message is {len(body.content):,} characters, over the {limit:,} one message may "
                       f"be ({admin_setting('MAX_MESSAGE_CHARS')}); shorten it, or attach the text as a file"},
            status_code=422)
    ids = body.attachment_ids or []
    if ids:
        await store.get(conv_id)  # an unknown conversation is 404, not a complaint about its files
        try:
            ids = await state.attachments.check_ids(conversation_scope(conv_id), list(dict.fromkeys(ids)))
        except AttachmentNotFound:
            return JSONResponse({"detail": "attachment_ids: not every id names a file of this conversation"},
                                status_code=422)
    parent = body.parent_id if "parent_id" in body.model_fields_set else LEAF
    try:
        turn = await state.turns.begin(store, conv_id, body.content, parent, attachment_ids=ids)
    except NotAnAnswerPoint:
        return JSONResponse({"detail": "parent_id: not a point of the current path to answer from (the path's "
                                       "last message, or the message before one you typed)"}, status_code=422)
    except ModelNotInLineup as exc:
        return JSONResponse({"detail": exc.detail}, status_code=422)
    return turn_response(state, turn)


@router.post("/{conv_id}/regenerate",
             responses={200: {"content": {"text/event-stream": {}}, "description": "the turn stream"}})
async def regenerate(conv_id: str, state: StateDep, store: OwnerStoreDep,
                     body: RegenerateRequest | None = None) -> Response:
    """Answer again: a sibling of `message_id` (default: of the answers to the last message typed),
    what followed it kept on the old branch; `model` writes this answer with another model."""
    body = body or RegenerateRequest()
    try:
        turn = await state.turns.begin(store, conv_id, None, answer_to=body.message_id, model=body.model)
    except NothingToAnswer:
        if body.message_id is not None:
            return JSONResponse({"detail": "message_id: not an assistant message of the current path"},
                                status_code=422)
        raise Conflict("there is no message to answer again") from None
    except ModelNotInLineup as exc:
        return JSONResponse({"detail": exc.detail}, status_code=422)
    return turn_response(state, turn)


@router.post("/{conv_id}/continue",
             responses={200: {"content": {"text/event-stream": {}}, "description": "the turn stream"}})
async def continue_reply(conv_id: str, state: StateDep, store: OwnerStoreDep,
                         body: ContinueRequest | None = None) -> Response:
    """Go on from the path's last reply (interrupted or cut at the output limit): one reply, two parts."""
    body = body or ContinueRequest()
    try:
        turn = await state.turns.resume(store, conv_id, body.message_id)
    except NotContinuable:
        return JSONResponse({"detail": "message_id: only the reply that ends the current path can be continued"},
                            status_code=422)
    except ModelNotInLineup as exc:
        return JSONResponse({"detail": exc.detail}, status_code=422)
    return turn_response(state, turn)


@router.post("/{conv_id}/messages/{message_id}/edit", response_model=Conversation)
async def edit_reply(conv_id: str, message_id: str, body: ReplyEdit, state: StateDep,
                     store: OwnerStoreDep) -> Response:
    """Replace an assistant message of the current path with the person's text: a sibling marked
    `edited`, made current (what followed the original stays on the old branch)."""
    content = pii.mask(body.content)[0] if state.settings.pii_masking == "on" else body.content
    async with await Claim.take(store, conv_id) as claim:  # TurnBusy (409) while a turn runs
        conv = await store.get(conv_id)
        original = next((m for m, _ in branches.linked(branches.path_items(conv)) if m["id"] == message_id), None)
        if original is None or original["role"] != "assistant":
            return JSONResponse({"detail": "no assistant message with that id on the current path"}, status_code=404)
        edited = answers.edited_reply(original, content, branches.parents(conv)[message_id])
        conv = await store.update(conv_id, lambda c: answers.put_edited(c, edited), lock=claim.lock)
    return await conversation_out(state, store, conv)


@router.post("/{conv_id}/compare",
             responses={200: {"content": {"text/event-stream": {}}, "description": "the replies' streams, merged"}})
async def compare(conv_id: str, body: CompareRequest, state: StateDep, store: OwnerStoreDep) -> Response:
    """One message answered by two or three models at once, each reply a sibling of the others."""
    if len(body.content) > state.settings.max_message_chars:
        return JSONResponse(
            {"detail": f"the message is over {state.settings.max_message_chars} characters"}, status_code=422)
    for model in body.models:
        if not await state.turns.in_lineup(model):
            return JSONResponse({"detail": f"models: {not_in_lineup(model)}"}, status_code=422)
    ids = body.attachment_ids or []
    if ids:
        await store.get(conv_id)
        try:
            ids = await state.attachments.check_ids(conversation_scope(conv_id), list(dict.fromkeys(ids)))
        except AttachmentNotFound:
            return JSONResponse({"detail": "attachment_ids: not every id names a file of this conversation"},
                                status_code=422)
    parent = body.parent_id if "parent_id" in body.model_fields_set else LEAF
    try:
        turn = await state.turns.begin(store, conv_id, body.content, parent, attachment_ids=ids,
                                       model=body.models[0])
    except NotAnAnswerPoint:
        return JSONResponse({"detail": "parent_id: not a point of the current path to answer from"},
                            status_code=422)
    except ModelNotInLineup as exc:
        return JSONResponse({"detail": exc.detail}, status_code=422)
    return turn_response(state, Comparison.of(turn, body.models))


@router.post("/{conv_id}/branch", response_model=Conversation)
async def switch_branch(conv_id: str, body: BranchSwitch, state: StateDep, store: OwnerStoreDep) -> Response:
    """Make the path through `message_id` current, following below it the path last viewed there."""
    async with await Claim.take(store, conv_id) as claim:  # TurnBusy (409) while a turn runs
        conv = await store.get(conv_id)
        if not any(m["id"] == body.message_id and branches.is_node(m)
                   for m in branches.path_items(conv) + (conv.get("off_path") or [])):
            return JSONResponse({"detail": "no such message in this conversation"}, status_code=404)
        conv = await store.update(conv_id, lambda c: branches.switch(c, body.message_id, descend=True),
                                  lock=claim.lock)
    return await conversation_out(state, store, conv)


@router.get("/{conv_id}/stream", status_code=200,
            responses={200: {"content": {"text/event-stream": {}}, "description": "the running turn's stream"},
                       204: {"description": "no turn is running"}})
async def follow_turn(conv_id: str, request: Request, state: StateDep, store: OwnerStoreDep,
                      after: int | None = Query(None, ge=0, description="replay the events after this id")) -> Response:
    """Re-attach to the running turn: the events after `Last-Event-ID` (or `?after=`), then live ones."""
    await store.get(conv_id)
    header = request.headers.get("last-event-id")
    if header is not None:
        # A browser reconnecting sends the header and repeats the URL it first used: the header is newer.
        if not header.strip().isdigit():
            return JSONResponse({"detail": "Last-Event-ID: must be an event id (a whole number)"}, status_code=422)
        after = int(header)
    frames = await state.hub.follow(conv_id, after or 0)
    if frames is None:
        return Response(status_code=204)
    return TurnResponse(frames, send_timeout=state.settings.stream_send_timeout)


@router.post("/{conv_id}/stop", status_code=204)
async def stop_turn(conv_id: str, state: StateDep, store: OwnerStoreDep,
                    body: StopRequest | None = None) -> Response:
    """Stop the running turn (closing its upstream call) and answer once its partial reply is saved;
    `assistant_message_id` stops only that reply of a comparison."""
    await store.get(conv_id)
    if body is not None and body.assistant_message_id is not None:
        await state.hub.stop_reply(conv_id, body.assistant_message_id)
    else:
        await state.hub.stop(conv_id)
    return Response(status_code=204)


@router.post("/{conv_id}/rewind", response_model=Draft)
async def rewind(conv_id: str, store: OwnerStoreDep, body: Empty | None = None) -> dict:
    """Take back the last message the person typed and everything after it (its other answers too):
    dropped, not kept as a branch; its earlier siblings stay."""
    if await store.turn_locked(conv_id):
        raise TurnBusy(conv_id)
    conv = await store.get(conv_id)
    last = next((m for m in reversed(conv["messages"]) if m["role"] == "user"), None)
    if last is None:
        raise Conflict("there is no message to take back")

    def cut(c: dict) -> None:
        at = next(i for i, m in enumerate(c["messages"]) if m["id"] == last["id"])
        gone = branches.subtree(c, last["id"]) | {m["id"] for m in c["messages"][at:]}
        branches.drop(c, gone)
        if not branches.has_user_message(c) and c.get("title_source", "auto") == "auto":
            c["title"] = NEW_TITLE

    await store.update(conv_id, cut)
    return {"content": last["content"]}


@router.post("/{conv_id}/compress")
async def compress(conv_id: str, state: StateDep, store: OwnerStoreDep, body: Empty | None = None) -> dict:
    """Compress now, whatever the budget: the `compression` event's data (folded 0 when nothing is old enough)."""
    return await state.turns.compress_now(store, conv_id)


@router.post("/{conv_id}/facts", response_model=Message)
async def review_facts(conv_id: str, body: FactsReview, state: StateDep, store: OwnerStoreDep) -> dict:
    """Accept, edit or drop the facts a compression took for memory: `keep` is what memory holds of them."""
    return await state.turns.review_facts(store, conv_id, body.notice_id, body.keep)
