"""The person's memory file: durable facts every conversation's prompt carries."""

from __future__ import annotations

from fastapi import APIRouter

from deps import OwnerStoreDep
from schemas import MemoryPut, MemoryText

router = APIRouter(prefix="/api/memory", tags=["memory"])


@router.get("", response_model=MemoryText)
async def get_memory(store: OwnerStoreDep) -> dict:
    return {"text": await store.read_memory()}


@router.put("", response_model=MemoryText)
async def put_memory(body: MemoryPut, store: OwnerStoreDep) -> dict:
    await store.write_memory(body.text)
    return {"text": body.text}
