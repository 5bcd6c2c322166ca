"""`GET /api/events`: the signed-in person's live events (person_events.py), one SSE stream per page."""

from __future__ import annotations

from contextlib import AsyncExitStack

from fastapi import APIRouter, Response

from chatserver.api.deps import OwnerDep, StateDep
from chatserver.api.sse import TurnResponse, frame

router = APIRouter(prefix="/api/events", tags=["events"])


@router.get("", status_code=200,
            responses={200: {"content": {"text/event-stream": {}}, "description": "the person's live events"}})
async def person_events(state: StateDep, owner: OwnerDep) -> Response:
    """`conversation`, `deleted` and `turn` events for this person's conversations, as they happen."""
    stack = AsyncExitStack()
    # Subscribed before the answer starts: once a client has the headers, no later change is missed.
    follower = await stack.enter_async_context(state.events.follow(owner))

    async def frames():
        async for name, data in follower:
            yield frame(name, data)

    return TurnResponse(frames(), stack.aclose, send_timeout=state.settings.stream_send_timeout)
