"""The person's memory file: durable facts every conversation's prompt carries."""

from __future__ import annotations

from fastapi import APIRouter

from chatserver.api.deps import OwnerStoreDep, StateDep
from chatserver.api.schemas import MemoryPut, MemoryText
from chatserver.conversations import pii

router = APIRouter(prefix="/api/memory", tags=["memory"])


@router.get("", response_model=MemoryText)
async def get_memory(store: OwnerStoreDep) -> dict:
    return {"text": await store.read_memory()}


@router.put("", response_model=MemoryText)
async def put_memory(body: MemoryPut, state: StateDep, store: OwnerStoreDep) -> dict:
    # Memory rides in every prompt: masked like a message when masking is on.
    text = pii.mask(body.text)[0] if state.settings.pii_masking == "on" else body.text
    await store.write_memory(text)
    return {"text": text}
