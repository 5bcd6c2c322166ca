"""`/api/presets` (API.md): list, create, replace and delete presets; `GET /api/tools`, the
tools those presets choose from; and `/api/tools/servers`, the MCP servers those tools come from
(admins add and remove the page's own).

Routes validate the body's shape (pydantic) and hand the rest to `presets.Presets`, whose errors
carry the HTTP status they become. The person's store and the tool names come from `get_presets`,
a dependency the app can override.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from chatserver.api.deps import OwnerStoreDep, StateDep, UserDep
from chatserver.api.schemas import SamplingFields
from chatserver.conversations.presets import MODEL_MAX_CHARS, NAME_PATTERN, TEXT_MAX_CHARS, PresetError, Presets, presets_for
from chatserver.tools import registry as tools
from chatserver.tools.mcp import HEADERS_MAX, URL_MAX_CHARS, McpServers, ServerConfigError

router = APIRouter(tags=["presets"])


class PresetIn(BaseModel):
    """The body of POST and PUT."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    text: str = Field(min_length=1, max_length=TEXT_MAX_CHARS)
    tools: list[str] = Field(default_factory=list, max_length=64)
    model: str | None = Field(default=None, min_length=1, max_length=MODEL_MAX_CHARS)
    params: SamplingFields | None = None  # generation parameters its conversations start with


async def get_presets(store: OwnerStoreDep) -> Presets:
    """This person's presets (the built-in ones and their own), checked against the registered tools."""
    return presets_for(store)


PresetsDep = Annotated[Presets, Depends(get_presets)]


async def get_registry() -> tools.Registry:
    return tools.registry


RegistryDep = Annotated[tools.Registry, Depends(get_registry)]


def _params(body: PresetIn) -> dict:
    return body.params.model_dump(exclude_none=True) if body.params is not None else {}


def _answer(exc: PresetError) -> HTTPException:
    return HTTPException(status_code=exc.status, detail=str(exc))


@router.get("/api/presets")
async def list_presets(presets: PresetsDep) -> list[dict]:
    try:
        return [p.out() for p in await presets.entries()]
    except PresetError as exc:
        raise _answer(exc) from None


@router.post("/api/presets", status_code=201)
async def create_preset(body: PresetIn, presets: PresetsDep) -> dict:
    try:
        return (await presets.create(body.name, body.text, body.tools, body.model, _params(body))).out()
    except PresetError as exc:
        raise _answer(exc) from None


@router.put("/api/presets/{name}")
async def replace_preset(name: str, body: PresetIn, presets: PresetsDep) -> dict:
    try:
        return (await presets.update(name, body.name, body.text, body.tools, body.model, _params(body))).out()
    except PresetError as exc:
        raise _answer(exc) from None


@router.delete("/api/presets/{name}", status_code=204)
async def delete_preset(name: str, presets: PresetsDep) -> Response:
    try:
        await presets.delete(name)
    except PresetError as exc:
        raise _answer(exc) from None
    return Response(status_code=204)


@router.get("/api/tools")
async def list_tools(request: Request, registry: RegistryDep) -> list[dict]:
    """Local tools with their schemas, whether this server has them configured, and failure counts."""
    return registry.listing(request.app.state.chat.settings)


class McpServerIn(BaseModel):
    """The body of `POST /api/tools/servers`: an HTTP server only (stdio commands come from MCP_SERVERS)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=24)
    url: str = Field(min_length=1, max_length=URL_MAX_CHARS)
    transport: Literal["http", "sse"] = "http"
    headers: dict[str, str] = Field(default_factory=dict, max_length=HEADERS_MAX)


def _servers(state, user=None) -> McpServers:
    if user is not None and not user.admin:
        raise HTTPException(403, "only an administrator may add or remove MCP servers")
    if state.mcp is None:
        raise HTTPException(503, "the MCP servers are still starting")
    return state.mcp


@router.get("/api/tools/servers")
async def list_servers(state: StateDep, user: UserDep) -> dict:
    """Each MCP server's state; admins also see its address and header names (never their values)."""
    return {"servers": _servers(state).describe(admin=user.admin)}


@router.post("/api/tools/servers", status_code=201)
async def add_server(body: McpServerIn, state: StateDep, user: UserDep) -> dict:
    servers = _servers(state, user)
    try:
        return await servers.add(body.model_dump())
    except ServerConfigError as exc:
        raise HTTPException(422, str(exc)) from None
    except KeyError:
        raise HTTPException(409, f"an MCP server named {body.name!r} already exists") from None


@router.delete("/api/tools/servers/{name}", status_code=204)
async def remove_server(name: str, state: StateDep, user: UserDep) -> Response:
    servers = _servers(state, user)
    try:
        await servers.remove(name)
    except PermissionError:
        raise HTTPException(400, f"{name!r} is set in the MCP_SERVERS file; change it there") from None
    except LookupError:
        raise HTTPException(404, f"no MCP server named {name!r} was added in the page") from None
    return Response(status_code=204)
