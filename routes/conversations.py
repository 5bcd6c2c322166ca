"""Conversations and their turns: CRUD, send, regenerate, rewind, compress.

Every handler reaches the store through `OwnerStoreDep`, so another owner's conversation is
NotFound here exactly like an unknown id.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
import orjson
from fastapi.responses import JSONResponse, Response

import context
from config import Settings
from deps import OwnerStoreDep, StateDep
from routes.presets import PROMPTS, read_presets
from schemas import (
    Conversation, ConversationCreate, ConversationEntry, ConversationPatch, Draft, Empty, MessageCreate,
)
from storage import OwnerStore, TurnBusy, new_id, now_iso
from streaming import TurnResponse
from turns import NEW_TITLE, NothingToAnswer, Turn

router = APIRouter(prefix="/api/conversations", tags=["conversations"])

# The smallest prompt a budget must leave room for beside the completion reserve.
MIN_PROMPT_TOKENS = 256


def json_answer(obj: object, status_code: int = 200) -> Response:
    """A stored document as JSON, encoded by orjson without a validation pass (a conversation can be megabytes)."""
    return Response(orjson.dumps(obj), status_code=status_code, media_type="application/json")


class Conflict(Exception):
    """The request cannot run now (a turn is streaming, or there is nothing to act on)."""


def default_settings(settings: Settings, preset: str | None) -> dict:
    presets = {p["name"]: p["text"] for p in read_presets()}
    name = preset if preset in presets else "default"
    return {
        "preset": name,
        "system_prompt": presets.get(name, ""),
        "context_budget": settings.context_budget_tokens,
        "web_search": True,
        "web_fetch": True,
        "tool_instructions": (PROMPTS / "tool_instructions.txt").read_text(encoding="utf-8").strip()
        .replace("{search_max_uses}", str(settings.search_max_uses))
        .replace("{fetch_max_uses}", str(settings.fetch_max_uses)),
        "compression_prompt": context.default_compression_prompt(),
    }


async def conversation_out(state, store: OwnerStore, conv: dict, status_code: int = 200) -> Response:
    out = {k: v for k, v in conv.items() if k not in ("schema_version", "owner")}
    out["context"] = context.context_breakdown(conv, await store.read_memory(), state.settings)
    out["streaming"] = await store.turn_locked(conv["id"])
    out["turn"] = await state.hub.info(conv["id"])
    return json_answer(out, status_code)


def turn_response(state, turn: Turn) -> TurnResponse:
    """The new turn runs in the server's own task; this response follows it from its first event.

    With ON_DISCONNECT=stop, the response ending before the turn did (a hang-up, a stalled
    reader) stops it, as it always did; by default the turn runs on and is saved.
    """
    running = state.hub.start(turn)
    closed = running.stop if state.settings.on_disconnect == "stop" else None
    return TurnResponse(running.follow(0), closed, send_timeout=state.settings.stream_send_timeout)


@router.get("", response_model=list[ConversationEntry])
async def list_conversations(store: OwnerStoreDep) -> Response:
    """Most recent conversation first, by its last message (a rename or a settings change does not move it)."""
    entries = sorted(await store.list(), key=lambda c: c["last_message_at"], reverse=True)
    for entry in entries:
        entry["streaming"] = await store.turn_locked(entry["id"])
    return json_answer(entries)


@router.post("", status_code=201, response_model=Conversation)
async def create_conversation(state: StateDep, store: OwnerStoreDep,
                              body: ConversationCreate | None = None) -> Response:
    body = body or ConversationCreate()
    created = now_iso()
    conv = await store.create({
        "id": new_id(), "title": NEW_TITLE,
        "model": body.model or state.settings.default_model,
        "created_at": created, "updated_at": created,
        "settings": default_settings(state.settings, body.preset),
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

    def apply(conv: dict) -> None:
        if body.title is not None:
            conv["title"] = body.title.strip() or conv["title"]
        if body.model is not None:
            conv["model"] = body.model
        if body.settings is not None:
            conv["settings"].update(body.settings.model_dump(exclude_none=True))

    return await conversation_out(state, store, await store.update(conv_id, apply))


@router.delete("/{conv_id}", status_code=204)
async def delete_conversation(conv_id: str, state: StateDep, store: OwnerStoreDep) -> Response:
    await store.get(conv_id)
    # A reply nobody can ever read would otherwise go on being generated and billed.
    await state.hub.stop(conv_id)
    await store.delete(conv_id)
    return Response(status_code=204)


@router.post("/{conv_id}/messages",
             responses={200: {"content": {"text/event-stream": {}}, "description": "the turn stream"}})
async def send_message(conv_id: str, body: MessageCreate, state: StateDep, store: OwnerStoreDep) -> Response:
    if len(body.content) > state.settings.max_message_chars:
        return JSONResponse(
            {"detail": f"the message is over {state.settings.max_message_chars} characters"}, status_code=422)
    return turn_response(state, await state.turns.begin(store, conv_id, body.content))


@router.post("/{conv_id}/regenerate",
             responses={200: {"content": {"text/event-stream": {}}, "description": "the turn stream"}})
async def regenerate(conv_id: str, state: StateDep, store: OwnerStoreDep, body: Empty | None = None) -> Response:
    try:
        turn = await state.turns.begin(store, conv_id, None)
    except NothingToAnswer:
        raise Conflict("there is no message to answer again") from None
    return turn_response(state, turn)


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
async def stop_turn(conv_id: str, state: StateDep, store: OwnerStoreDep, body: Empty | None = None) -> Response:
    """Stop the running turn (closing its upstream call) and answer once its partial reply is saved."""
    await store.get(conv_id)
    await state.hub.stop(conv_id)
    return Response(status_code=204)


@router.post("/{conv_id}/rewind", response_model=Draft)
async def rewind(conv_id: str, store: OwnerStoreDep, body: Empty | None = None) -> dict:
    if await store.turn_locked(conv_id):
        raise TurnBusy(conv_id)
    conv = await store.get(conv_id)
    users = [i for i, m in enumerate(conv["messages"]) if m["role"] == "user"]
    if not users:
        raise Conflict("there is no message to take back")
    content = conv["messages"][users[-1]]["content"]

    def cut(c: dict) -> None:
        c["messages"] = c["messages"][: users[-1]]
        if len(users) == 1:
            c["title"] = NEW_TITLE

    await store.update(conv_id, cut)
    return {"content": content}


@router.post("/{conv_id}/compress")
async def compress(conv_id: str, state: StateDep, store: OwnerStoreDep, body: Empty | None = None) -> dict:
    """Compress now, whatever the budget: the `compression` event's data (folded 0 when nothing is old enough)."""
    return await state.turns.compress_now(store, conv_id)
