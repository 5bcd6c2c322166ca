"""Tools from MCP servers, in the same registry and behind the same wrapper as our own.

Servers come from the `MCP_SERVERS` file (Streamable HTTP, SSE or a stdio command) and from the
list admins keep in the page (HTTP and SSE only: nobody starts a process from a browser), which
lives in the store so every process of a deployment reads it. Each process keeps its own
connections: one background task per server connects through the official `mcp` SDK, lists the
tools, registers them as `server__tool` (schema checked, description capped) and watches the line:
a change stream (or, on older servers, their `tools/list_changed` notifications) refreshes the
list, listing again when the line is quiet catches a server that went away, and a lost connection is retried with a growing pause.
A server that is down keeps its last tools registered, so a call reads as a tool error that says
so instead of an unknown tool.

Calls go through `Registry.run` like any tool: MCP_TIMEOUT bounds each one, the answer is cut to
the registry's length cap (and an HTTP answer is not read past MCP_MAX_BYTES), and every
failure of the server (down, slow, an error, garbage) becomes a `[tool error]` the model reads.
Image blocks leave here decoded, on the `ToolOutput`: the turn stores them (this module never
touches storage) and names them in the text the model reads.
Header values are secrets: kept out of every answer and redacted from messages and logs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx2
import jsonschema
import mcp_types as types
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import ListenNotSupportedError
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError, create_model

from chatserver.config import Settings
from chatserver.tools.registry import (
    MCP_SEPARATOR,
    TOOL_NAME_MAX_CHARS,
    TOOL_RESULT_MAX_CHARS,
    Registry,
    Tool,
    ToolError,
    ToolOutput,
)
from chatserver.turns.events import ImageProduced
from chatserver.upstream.failures import keep_secret, redact

log = logging.getLogger("chat.mcp")

# Letters, digits and inner hyphens: `__` separates the server from its tool, so a name has none.
SERVER_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,22}[A-Za-z0-9])?")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]+")
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}")
DESCRIPTION_MAX_CHARS = 1_000
SCHEMA_MAX_CHARS = 32_000
TOOLS_MAX = 100  # per server: more would drown any model's choice
URL_MAX_CHARS = 2_000
HEADERS_MAX = 20
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
PING_SECONDS = 15.0
# How often each process re-reads the page's list (another process may have changed it).
RECHECK_SECONDS = 10.0
ERROR_MAX_CHARS = 300
# Images one call may add to the reply, and the size of each as returned (the upload's checks
# and the person's quota still apply when they are stored).
IMAGES_MAX = 4
IMAGE_MAX_BYTES = 10 * 1024 * 1024
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
Transport = Literal["http", "sse", "stdio"]


class ServerConfigError(ValueError):
    """An MCP server entry that cannot be used; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One configured server. `headers` hold secrets: `public` never shows their values."""

    name: str
    transport: Transport
    source: Literal["file", "page"]
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict, repr=False)

    def public(self) -> dict:
        """What an admin sees: where it is, never a header's value."""
        entry: dict[str, Any] = {"transport": self.transport, "source": self.source,
                                 "header_names": sorted(self.headers)}
        if self.url is not None:
            entry["url"] = self.url
        if self.command is not None:
            entry["command"] = self.command
        return entry

    def stored(self) -> dict:
        return {"name": self.name, "url": self.url, "transport": self.transport, "headers": dict(self.headers)}


def parse_server(entry: object, *, source: Literal["file", "page"]) -> ServerSpec:
    """A checked server entry: `{"name", "url", "transport"?: "http"|"sse", "headers"?}`, or from
    the file only `{"name", "command", "args"?, "env"?}`."""
    if not isinstance(entry, dict):
        raise ServerConfigError("an MCP server is a JSON object with a name and a url (or, in MCP_SERVERS, a command)")
    name = entry.get("name")
    if not isinstance(name, str) or not SERVER_NAME.fullmatch(name):
        raise ServerConfigError("an MCP server's name is 1-24 letters, digits and inner hyphens "
                                f"(its tools are called name{MCP_SEPARATOR}tool); got {name!r}")
    known = {"name", "url", "transport", "headers"} | ({"command", "args", "env"} if source == "file" else set())
    unknown = sorted(set(entry) - known)
    if unknown:
        hint = " (stdio commands are set only in the MCP_SERVERS file)" if "command" in unknown else ""
        raise ServerConfigError(f"MCP server {name}: unknown field {', '.join(unknown)}{hint}")
    url, command = entry.get("url"), entry.get("command")
    if (url is None) == (command is None):
        raise ServerConfigError(f"MCP server {name}: give either a url or a command")
    if command is not None:
        args, env = entry.get("args", []), entry.get("env", {})
        if not isinstance(command, str) or not command.strip():
            raise ServerConfigError(f"MCP server {name}: command must be a program name or path")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ServerConfigError(f"MCP server {name}: args must be a list of strings")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ServerConfigError(f"MCP server {name}: env must map names to strings")
        return ServerSpec(name, "stdio", source, command=command, args=tuple(args), env=dict(env))
    transport = entry.get("transport", "http")
    if transport not in ("http", "sse"):
        raise ServerConfigError(f"MCP server {name}: transport is \"http\" (Streamable HTTP) or \"sse\"")
    if not isinstance(url, str) or len(url) > URL_MAX_CHARS:
        raise ServerConfigError(f"MCP server {name}: url must be an http or https address")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerConfigError(f"MCP server {name}: url must be an http or https address, e.g. http://127.0.0.1:8001/mcp")
    headers = entry.get("headers") or {}
    if not isinstance(headers, dict) or len(headers) > HEADERS_MAX:
        raise ServerConfigError(f"MCP server {name}: headers map at most {HEADERS_MAX} header names to values")
    for key, value in headers.items():
        if not isinstance(key, str) or not HEADER_NAME.fullmatch(key):
            raise ServerConfigError(f"MCP server {name}: {key!r} is not a header name")
        if not isinstance(value, str) or any(c in value for c in "\r\n\0") or len(value) > 8_000:
            raise ServerConfigError(f"MCP server {name}: the value of header {key} must be one line of text")
    return ServerSpec(name, transport, source, url=url.strip(), headers=dict(headers))


def load_file(path: Path | None) -> list[ServerSpec]:
    """The servers of the MCP_SERVERS file (a JSON list, or `{"servers": [...]}`); ServerConfigError
    names the problem, so a mistyped file stops the start instead of silently offering nothing."""
    if path is None:
        return []
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ServerConfigError(f"MCP_SERVERS={path}: cannot be read as JSON ({exc})") from None
    entries = data.get("servers") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ServerConfigError(f"MCP_SERVERS={path}: expected a JSON list of servers")
    specs = [parse_server(e, source="file") for e in entries]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ServerConfigError(f"MCP_SERVERS={path}: two servers share a name")
    return specs


class _Lost(Exception):
    """The connection to a server is gone (the reason is the message)."""


class AnswerTooBig(Exception):
    """A server's answer passed MCP_MAX_BYTES; reading stopped there."""


class _Capped(httpx2.AsyncByteStream):
    def __init__(self, stream: httpx2.AsyncByteStream, limit: int, on_cap: Callable[[], None]) -> None:
        self.stream, self.limit, self.on_cap = stream, limit, on_cap

    async def __aiter__(self):
        seen = 0
        async for chunk in self.stream:
            seen += len(chunk)
            if seen > self.limit:
                self.on_cap()  # the SDK reports the failure as a closed connection: this says why
                raise AnswerTooBig(f"the answer passed {self.limit:,} bytes (MCP_MAX_BYTES)")
            yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()


class _CappedTransport(httpx2.AsyncBaseTransport):
    """Whole JSON answers cut at MCP_MAX_BYTES as they arrive (the SDK bounds each SSE event itself;
    a stream of events is long-lived and not bounded as a whole)."""

    def __init__(self, limit: int, on_cap: Callable[[], None]) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.limit = limit
        self.on_cap = on_cap

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            response.stream = _Capped(response.stream, self.limit, self.on_cap)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class ServerConnection:
    """One server's connection, kept by a background task, and its tools in the registry."""

    def __init__(self, spec: ServerSpec, registry: Registry, settings: Settings) -> None:
        self.spec = spec
        self.registry = registry
        self.timeout = settings.mcp_timeout
        self.max_bytes = settings.mcp_max_bytes
        self.connected = False
        self.error: str | None = None
        self.failures = 0
        self.tool_names: tuple[str, ...] = ()
        self._client: Client | None = None
        self._signal = asyncio.Event()  # the watcher wakes: tools changed, or the line is in doubt
        self._changed = False
        self._lost: str | None = None
        self._suspect = False
        self._retry_now = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._was_up = False
        self._too_big = False
        self._stopping = False
        for value in spec.headers.values():
            keep_secret(value)

    @property
    def name(self) -> str:
        return self.spec.name

    def state(self) -> dict:
        """`GET /api/tools/servers`: the part anyone may see."""
        return {"name": self.name, "connected": self.connected, "error": self.error, "failures": self.failures,
                "tools": len(self.tool_names)}

    def start(self) -> None:
        self.registry.servers[self.name] = self.state
        self._task = asyncio.create_task(self._run(), name=f"mcp server {self.name}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self._task), 10)
        self.registry.set_server_tools(self.name, ())
        self.registry.servers.pop(self.name, None)

    # The connection

    async def _run(self) -> None:
        delay = BACKOFF_FIRST
        while True:
            self._was_up = False
            try:
                await self._session()
            except asyncio.CancelledError:
                # The SDK's task group cancels the task it runs in when one of its own tasks fails
                # (an answer cut at MCP_MAX_BYTES): only stop() ends this loop.
                if self._stopping:
                    raise
                self._down(self._lost or "the connection was closed")
            except BaseException as exc:  # noqa: BLE001 - whatever a server or its transport does, retry
                self._down(_reason(exc, self.spec))
            if self._was_up:  # a connection that had worked: start the pauses again
                delay = BACKOFF_FIRST
            self._retry_now.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._retry_now.wait()
            delay = min(delay * 2, BACKOFF_MAX)

    async def _session(self) -> None:
        client = Client(self._transport(), message_handler=self._message, cache=None)
        # asyncio's timeout, not anyio's: the transport's task groups opened inside stay open after it.
        async with asyncio.timeout(self.timeout):
            await client.__aenter__()
        try:
            self._client = client
            self._lost, self._changed, self._suspect = None, False, False
            await self._refresh(client)
            self.connected, self.error, self._was_up = True, None, True
            log.info("MCP server %s connected: %d tools", self.name, len(self.tool_names))
            listener = asyncio.create_task(self._listen(client))
            try:
                await self._watch(client)
            finally:
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
        finally:
            self._client = None
            self.connected = False
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(5):
                    await client.__aexit__(None, None, None)

    def _transport(self) -> Any:
        spec = self.spec
        if spec.transport == "stdio":
            assert spec.command is not None
            return StdioServerParameters(command=spec.command, args=list(spec.args), env=spec.env or None)
        assert spec.url is not None
        timeout = httpx2.Timeout(self.timeout, read=max(300.0, self.timeout))
        if spec.transport == "sse":
            return sse_client(spec.url, headers=spec.headers, timeout=self.timeout, sse_read_timeout=300)
        http = httpx2.AsyncClient(headers=spec.headers, timeout=timeout, transport=_CappedTransport(self.max_bytes, self._capped))
        return streamable_http_client(spec.url, http_client=http, max_sse_event_size=self.max_bytes)

    async def _watch(self, client: Client) -> None:
        """Until the line is lost: list the tools again on a change, when quiet, or in doubt."""
        while True:
            try:
                async with asyncio.timeout(PING_SECONDS):
                    await self._signal.wait()
            except TimeoutError:
                self._suspect = True
            self._signal.clear()
            if self._lost is not None:
                raise _Lost(self._lost)
            # Listing the tools is the check (ping is gone from the 2026 protocol) and catches a missed change.
            if self._suspect or self._changed:
                self._suspect = self._changed = False
                await self._refresh(client)

    async def _listen(self, client: Client) -> None:
        """A 2026 server's change stream: each event refreshes the list; its end means the line is gone."""
        try:
            async with client.listen(tools_list_changed=True) as subscription:
                async for _ in subscription:
                    self._wake(changed=True)
            self._wake(lost="the server closed its change stream")
        except ListenNotSupportedError:
            return  # an older server: its notifications arrive through _message, and pings watch the line
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            self._wake(lost=_reason(exc, self.spec))

    async def _message(self, message: object) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self._wake(changed=True)

    def _capped(self) -> None:
        self._too_big = True

    def _wake(self, *, changed: bool = False, lost: str | None = None, suspect: bool = False) -> None:
        self._changed |= changed
        self._suspect |= suspect
        if lost is not None and self._lost is None:
            self._lost = lost
            self.connected = False  # at once: a call meanwhile is told so, and asks for the retry
        self._signal.set()

    def _down(self, reason: str) -> None:
        was = self.connected
        self.connected = False
        self.error = reason
        if was or self.failures == 0:
            log.warning("MCP server %s is down: %s", self.name, reason)
        self.failures += 1

    async def _refresh(self, client: Client) -> None:
        listed: list[types.Tool] = []
        cursor: str | None = None
        for _ in range(10):  # pages: a server that never stops paging does not hold us
            async with asyncio.timeout(self.timeout):
                page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor or len(listed) >= TOOLS_MAX:
                break
        tools = []
        for item in listed[:TOOLS_MAX]:
            tool = self._tool(item)
            if tool is not None:
                tools.append(tool)
        self.registry.set_server_tools(self.name, tools)
        self.tool_names = tuple(t.name for t in tools)

    def _tool(self, item: types.Tool) -> Tool | None:
        """Our registry's entry for one listed tool, or None (logged) when it cannot be offered."""
        full = f"{self.name}{MCP_SEPARATOR}{item.name}"
        if not TOOL_NAME.fullmatch(item.name) or len(full) > TOOL_NAME_MAX_CHARS:
            log.warning("MCP server %s: skipping tool %r: a name gateways accept is [A-Za-z0-9_-], at most %d "
                        "characters with the server's name", self.name, item.name[:80], TOOL_NAME_MAX_CHARS)
            return None
        schema = item.input_schema if isinstance(item.input_schema, dict) else None
        problem = _schema_problem(schema)
        if problem is not None or schema is None:
            log.warning("MCP server %s: skipping tool %s: %s", self.name, item.name, problem)
            return None
        validator = jsonschema.validators.validator_for(schema)(schema)
        description = " ".join((item.description or item.title or item.name).split())
        if len(description) > DESCRIPTION_MAX_CHARS:
            description = description[:DESCRIPTION_MAX_CHARS - 1].rstrip() + "…"
        remote = item.name

        async def call(arguments: dict) -> ToolOutput:
            return await self.call(remote, arguments)

        def check(arguments: dict) -> None:
            errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))[:5]
            if errors:
                raise ToolError("bad arguments: " + "; ".join(
                    f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message[:200]}" for e in errors))

        # The registry's own deadline is a backstop a little past ours, so the server's slowness is counted here.
        return Tool(full, description, _called_through_call, _NO_ARGUMENTS, schema, server=self.name, call=call, check=check,
                    timeout=self.timeout + 5)

    # Calls

    async def call(self, remote: str, arguments: dict) -> ToolOutput:
        client = self._client
        if client is None or not self.connected:
            self._retry_now.set()
            raise ToolError(f"the MCP server {self.name} is not connected ({self.error or 'still connecting'}); "
                            "it is retried in the background")
        try:
            async with asyncio.timeout(self.timeout):
                result = await client.call_tool(remote, arguments)
        except TimeoutError:
            self.failures += 1
            self.error = f"a call to {remote} timed out after {self.timeout:g} s"
            self._wake(suspect=True)
            raise ToolError(f"timed out after {self.timeout:g} s (MCP_TIMEOUT)") from None
        except asyncio.CancelledError:
            raise
        except (ValidationError, ValueError) as exc:
            self.failures += 1
            self.error = f"{remote} answered something that is not an MCP result"
            raise ToolError(f"the MCP server {self.name} answered something that is not a tool result "
                            f"({type(exc).__name__})") from None
        except MCPError as exc:
            self.failures += 1
            if self._too_big:  # reading stopped there, and the SDK closed its connection: open another
                self._too_big = False
                self.error = f"an answer of {remote} passed MCP_MAX_BYTES"
                self._wake(lost=self.error)
                raise ToolError(f"the answer passed {self.max_bytes:,} bytes (MCP_MAX_BYTES) and was not read") from None
            self._wake(suspect=True)  # a refusal, or the line broke under it: listing again tells which
            raise ToolError(f"the MCP server {self.name} answered an error: {_short(redact(exc.error.message))}") from None
        except BaseException as exc:  # noqa: BLE001 - a transport failing: the line is gone
            reason = _reason(exc, self.spec)
            self.failures += 1
            self._wake(lost=reason)
            raise ToolError(f"the MCP server {self.name} did not answer ({reason}); it is retried in the background"
                            ) from None
        return _output(result)


# The registry's slots for a function and its pydantic model, unused by an MCP tool (see Tool.call).
_NO_ARGUMENTS = create_model("mcp_tool_arguments")


async def _called_through_call() -> str:
    """MCP tools run through `Tool.call`."""
    raise AssertionError("an MCP tool is called through Tool.call")


def _output(result: types.CallToolResult) -> ToolOutput:
    """The text the model reads: text blocks as they are, other blocks named, cut to the registry's cap."""
    parts: list[str] = []
    images: list[ImageProduced] = []
    size, total = 0, 0
    room = TOOL_RESULT_MAX_CHARS - 200
    for block in result.content:
        if isinstance(block, types.TextContent):
            text = block.text
        elif isinstance(block, types.ImageContent):
            image, text = _image(block, len(images))
            if image is not None:
                images.append(image)  # the turn stores it and names it in the text
                continue
        elif isinstance(block, types.AudioContent):
            text = f"[audio ({block.mime_type}) was returned; not shown]"
        elif isinstance(block, types.EmbeddedResource):
            resource = block.resource
            text = resource.text if isinstance(resource, types.TextResourceContents) else \
                f"[a binary resource {resource.uri} was returned; not shown]"
        elif isinstance(block, types.ResourceLink):
            text = f"[resource: {block.uri}]"
        else:
            text = f"[a {getattr(block, 'type', 'content')} block; not shown]"
        total += len(text) + (1 if parts else 0)
        if size < room:
            piece = text[:room - size]
            parts.append(piece)
            size += len(piece) + 1
    if not parts and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
        total = len(text)
        parts.append(text[:room])
    body = "\n".join(parts)
    if total > len(body):
        body += f"\n[cut: {total - len(body):,} more characters not shown]"
    if result.is_error:
        raise ToolError(f"the tool reported an error: {_short(body, 2_000)}")
    summary = body.split("\n", 1)[0] if body else f"{len(images)} image{'s' * (len(images) != 1)}" if images \
        else "no output"
    return ToolOutput(body, _short(summary, 100), images=tuple(images))


def _image(block: types.ImageContent, held: int) -> tuple[ImageProduced | None, str]:
    """An image block decoded for the turn to store, or None and the note the model reads instead."""
    about = f"{block.mime_type}, about {len(block.data) * 3 // 4:,} bytes"
    if held >= IMAGES_MAX:
        return None, f"[an image ({about}) was returned; not kept: at most {IMAGES_MAX} images are kept per call]"
    if block.mime_type not in IMAGE_TYPES:
        return None, f"[an image ({about}) was returned; not kept: only PNG, JPEG, GIF and WebP images are kept]"
    if len(block.data) * 3 // 4 > IMAGE_MAX_BYTES:
        return None, f"[an image ({about}) was returned; not kept: it is over {IMAGE_MAX_BYTES:,} bytes]"
    try:
        data = base64.b64decode(block.data, validate=True)
    except ValueError:
        return None, f"[an image ({block.mime_type}) was returned; not kept: its data is not base64]"
    return ImageProduced(block.mime_type, data), ""


def _schema_problem(schema: dict | None) -> str | None:
    if schema is None:
        return "its input schema is not a JSON object"
    if schema.get("type", "object") != "object":
        return "its input schema does not describe an object"
    try:
        if len(json.dumps(schema)) > SCHEMA_MAX_CHARS:
            return f"its input schema is over {SCHEMA_MAX_CHARS:,} characters"
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except (TypeError, ValueError, jsonschema.SchemaError) as exc:
        return f"its input schema is not valid JSON Schema ({_short(str(exc), 200)})"
    return None


def _reason(exc: BaseException, spec: ServerSpec) -> str:
    """A short, secret-free reason: the innermost useful exception of a task group's bundle."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, TimeoutError):
        text = "no answer in time"
    if spec.url:
        text = text.replace(spec.url, spec.name)
    return _short(redact(text))


def _short(text: str, limit: int = ERROR_MAX_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


class McpServers:
    """This process's MCP connections: the file's servers and the page's (from the store), kept in step."""

    def __init__(self, settings: Settings, store: Any, registry: Registry) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry
        self.file_specs = load_file(settings.mcp_servers)
        self.connections: dict[str, ServerConnection] = {}
        self._follow: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        await self.sync()
        self._follow = asyncio.create_task(self._recheck(), name="mcp servers recheck")

    async def close(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
        await asyncio.gather(*(c.stop() for c in self.connections.values()))
        self.connections.clear()

    async def page_specs(self) -> list[ServerSpec]:
        specs = []
        for entry in await self.store.read_mcp_servers():
            try:
                specs.append(parse_server(entry, source="page"))
            except ServerConfigError as exc:
                log.warning("ignoring a stored MCP server: %s", exc)
        return specs

    async def sync(self) -> None:
        """Connect what is configured and not connected; drop what is no longer configured."""
        async with self._lock:
            wanted: dict[str, ServerSpec] = {s.name: s for s in self.file_specs}
            for spec in await self.page_specs():
                wanted.setdefault(spec.name, spec)  # the file's entry wins a name both use
            for name, conn in list(self.connections.items()):
                if wanted.get(name) != conn.spec:
                    await conn.stop()
                    del self.connections[name]
            for name, spec in wanted.items():
                if name not in self.connections:
                    conn = ServerConnection(spec, self.registry, self.settings)
                    self.connections[name] = conn
                    conn.start()

    async def _recheck(self) -> None:
        while True:
            await asyncio.sleep(RECHECK_SECONDS)
            try:
                await self.sync()
            except Exception as exc:  # noqa: BLE001 - the store away for a moment: next time
                log.warning("could not re-read the MCP servers: %s", exc)

    def describe(self, *, admin: bool) -> list[dict]:
        """Each server's state; admins also see where it is and its header names (never values)."""
        out = []
        for conn in self.connections.values():
            entry = conn.state()
            if admin:
                entry.update(conn.spec.public())
            out.append(entry)
        return out

    async def add(self, entry: dict) -> dict:
        spec = parse_server(entry, source="page")
        stored = await self.store.read_mcp_servers()
        if spec.name in {s.name for s in self.file_specs} or any(s.get("name") == spec.name for s in stored):
            raise KeyError(spec.name)
        await self.store.write_mcp_servers(stored + [spec.stored()])
        await self.sync()
        return next(e for e in self.describe(admin=True) if e["name"] == spec.name)

    async def remove(self, name: str) -> None:
        if name in {s.name for s in self.file_specs}:
            raise PermissionError(name)
        stored = await self.store.read_mcp_servers()
        kept = [s for s in stored if s.get("name") != name]
        if len(kept) == len(stored):
            raise LookupError(name)
        await self.store.write_mcp_servers(kept)
        await self.sync()
