"""What lifespan builds and routes share, and the dependencies every route receives it through.

`OwnerStoreDep` is the one place a request's owner is decided (from the user `auth` recognised)
and its view of the store made: a route that takes it can only ever see that owner's
conversations, memory and turns.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from chatserver.accounts.auth import User, current_user
from chatserver.attachments.store import Attachments
from chatserver.config import ModelInfo, Settings
from chatserver.store.files import OwnerStore, Store
from chatserver.store.person_events import AnnouncingStore, PersonEvents
from chatserver.tools.mcp import McpServers
from chatserver.turns.hub import LocalTurnHub, TurnHub
from chatserver.turns.pipeline import Turns
from chatserver.upstream.catalog import GatewayCatalog


class State:
    """What lifespan builds; tests reach it as `app.state.chat`."""

    def __init__(self, settings: Settings, store: Store, turns: Turns, attachments: Attachments,
                 hub: TurnHub | None = None, events: PersonEvents | None = None,
                 catalog: GatewayCatalog | None = None) -> None:
        self.settings = settings
        self.catalog = catalog
        self.store = store
        self.turns = turns
        self.attachments = attachments
        self.events = events if events is not None else PersonEvents()
        self.hub = hub if hub is not None else LocalTurnHub(turns, self.events)
        self.mcp: McpServers | None = None  # set by lifespan
        # The built-in part of the lineup for the last set of seeing models: a turn asks for the
        # lineup four times, and the settings it comes from never change while the server runs.
        self._builtin: tuple[frozenset[str], list[ModelInfo]] | None = None

    async def lineup(self) -> list[ModelInfo]:
        # Who reads images: VISION_MODELS, or the gateway's list says so; a custom model's own
        # choice, when it made one, wins over both.
        seeing = self.settings.vision_ids | (await self.catalog.vision_ids() if self.catalog else frozenset())
        if self._builtin is None or self._builtin[0] != seeing:
            self._builtin = seeing, [dataclasses.replace(m, vision=m.id in seeing) for m in self.settings.lineup()]
        builtin = list(self._builtin[1])
        known = {m.id for m in builtin}
        # From the setting itself: a custom model can be a reasoning model too.
        reasoning = {m.strip() for m in self.settings.reasoning_models.split(",") if m.strip()}
        custom = [
            ModelInfo(m["id"], m.get("tier", "balanced"), m["id"] in reasoning, custom=True,
                      tool_runtime=m.get("tool_runtime") or self.settings.runtime_for(m["id"]),
                      vision=m["vision"] if isinstance(m.get("vision"), bool) else m["id"] in seeing)
            for m in await self.store.read_custom_models() if m["id"] not in known
        ]
        return builtin + custom


async def get_state(request: Request) -> State:
    # async: FastAPI runs a plain-def dependency in its thread pool, a hop that cost every request ~1 ms.
    return request.app.state.chat


StateDep = Annotated[State, Depends(get_state)]


UserDep = Annotated[User, Depends(current_user)]


async def get_owner(user: UserDep) -> str:
    """Whose data this request may touch: the one local person while AUTH=none."""
    return user.owner


OwnerDep = Annotated[str, Depends(get_owner)]


async def require_admin(user: UserDep) -> User:
    if not user.admin:
        raise HTTPException(403, "only an administrator may change the model lineup")
    return user


AdminDep = Annotated[User, Depends(require_admin)]


async def get_owner_store(state: StateDep, owner: OwnerDep) -> OwnerStore:
    return AnnouncingStore(state.store.for_owner(owner), state.events)


OwnerStoreDep = Annotated[OwnerStore, Depends(get_owner_store)]
