"""Per-person quotas: QUOTA_FILE_BYTES over the files of their conversations and library together,
QUOTA_CONVERSATIONS over their conversations. Passing one is 413 naming it; `GET /api/quota`
says where the person stands, for Settings.

Usage is counted from what is stored when asked, not kept as a running total that could drift.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel

from chatserver.api.deps import OwnerStoreDep, StateDep
from chatserver.attachments.store import Attachments, conversation_scope, library_scope, project_scope
from chatserver.conversations.projects import Projects
from chatserver.sizes import size_words
from chatserver.store.files import OwnerStore

router = APIRouter(prefix="/api/quota", tags=["quota"])


class QuotaOut(BaseModel):
    file_bytes: int
    file_quota: int
    conversations: int
    conversation_quota: int


async def file_usage(attachments: Attachments, store: OwnerStore, conversations: list[dict]) -> int:
    """The bytes of every file this person keeps: their conversations', projects' and library's."""
    scopes = [library_scope(store.owner), *(conversation_scope(c["id"]) for c in conversations),
              *(project_scope(p["id"]) for p in await Projects(store).list())]
    return await attachments.used_bytes(scopes)


async def check_files(attachments: Attachments, store: OwnerStore, size: int) -> None:
    """413 when a file of `size` bytes would take the person past QUOTA_FILE_BYTES."""
    quota = attachments.limits.quota_bytes
    used = await file_usage(attachments, store, await store.list())
    if used + size > quota:
        raise HTTPException(413, f"QUOTA_FILE_BYTES: your files take {size_words(used)} of the "
                                 f"{size_words(quota)} each person may keep, and this one ({size_words(size)}) "
                                 "does not fit; delete some files (in conversations or the library) first")


async def check_conversations(quota: int, store: OwnerStore, adding: int = 1) -> None:
    """413 when `adding` more conversations would take the person past QUOTA_CONVERSATIONS."""
    have = len(await store.list())
    if have + adding > quota:
        raise HTTPException(413, f"QUOTA_CONVERSATIONS: you have {have:,} of the {quota:,} conversations each "
                                 f"person may keep{f', and this adds {adding:,}' if adding > 1 else ''}; "
                                 "delete some first")


@router.get("", response_model=QuotaOut)
async def get_quota(state: StateDep, store: OwnerStoreDep) -> dict:
    """What this person's files and conversations take, against their quotas."""
    conversations = await store.list()
    return {
        "file_bytes": await file_usage(state.attachments, store, conversations),
        "file_quota": state.attachments.limits.quota_bytes,
        "conversations": len(conversations),
        "conversation_quota": state.settings.quota_conversations,
    }
