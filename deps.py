"""What lifespan builds and routes share, and the dependencies every route receives it through.

`OwnerStoreDep` is the one place a request's owner is decided and its view of the store made:
a route that takes it can only ever see that owner's conversations, memory and turns.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from config import ModelInfo, Settings
from storage import LOCAL_OWNER, OwnerStore, Store
from turn_hub import LocalTurnHub, TurnHub
from turns import Turns


class State:
    """What lifespan builds; tests reach it as `app.state.chat`."""

    def __init__(self, settings: Settings, store: Store, turns: Turns, hub: TurnHub | None = None) -> None:
        self.settings = settings
        self.store = store
        self.turns = turns
        self.hub = hub if hub is not None else LocalTurnHub(turns)

    async def lineup(self) -> list[ModelInfo]:
        builtin = self.settings.lineup()
        known = {m.id for m in builtin}
        reasoning = {m.id for m in builtin if m.reasoning}
        custom = [
            ModelInfo(m["id"], m.get("tier", "balanced"), m["id"] in reasoning, custom=True)
            for m in await self.store.read_custom_models() if m["id"] not in known
        ]
        return builtin + custom


async def get_state(request: Request) -> State:
    # async: FastAPI runs a plain-def dependency in its thread pool, a hop that cost every request ~1 ms.
    return request.app.state.chat


StateDep = Annotated[State, Depends(get_state)]


async def get_owner(request: Request) -> str:
    """Whose data this request may touch: the one local person while AUTH=none."""
    return LOCAL_OWNER


OwnerDep = Annotated[str, Depends(get_owner)]


async def get_owner_store(state: StateDep, owner: OwnerDep) -> OwnerStore:
    return state.store.for_owner(owner)


OwnerStoreDep = Annotated[OwnerStore, Depends(get_owner_store)]
