"""The tools that run on this server: a registry, the safety wrapper every call passes, the context
a call acts in, and the built-in local tools (`web_fetch`, `web_search`, `remember`).

A tool is a typed async function with a docstring: the docstring is its description and pydantic
derives its JSON Schema from the signature. `Registry.run` is the only way to call one, and it
never raises for a tool's failure: bad or non-JSON arguments, a tool that is unknown or not
enabled, a network error or a timeout become a `[tool error] name: reason` result the model reads
and can recover from; an unexpected exception (a bug) becomes the same kind of result but is also
logged with its traceback and counted. Cancellation (Stop) always propagates.

Who a call acts for (owner, conversation, memory access, settings) travels in a ContextVar set
by `tool_context` around the calls, never in the arguments the model chooses. This module knows
nothing of the loop that calls it, of how memory is stored, or of the upstream wire formats
beyond the two declaration shapes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import typing
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Annotated, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from chatserver.attachments import store as attachments
from chatserver.attachments.extraction import Extractor
from chatserver.config import Settings
from chatserver.tools import webfetch
from chatserver.turns import context as prompt_context
from chatserver.turns.events import Call, ImageProduced

log = logging.getLogger("chat.tools")

# A result longer than this is cut (and says so): one page must not eat the context budget.
TOOL_RESULT_MAX_CHARS = 20_000
SUMMARY_MAX_CHARS = 120
DEFAULT_TOOL_TIMEOUT = 30.0
SEARCH_RESULTS_MAX = 5
TOOL_NAME_MAX_CHARS = 64  # the longest tool name the gateways accept
TOOL_ID_MAX_CHARS = 128
# An MCP server's tool is `server__tool`; a whitelist names a whole server as `server__*`.
MCP_SEPARATOR = "__"
# The tools the gateway itself can run as server tools on /v1/messages (tool_runtime "gateway").
GATEWAY_TOOLS = ("web_search", "web_fetch")
Wire = Literal["chat", "messages"]
Runtime = Literal["gateway", "local", "none"]


class ToolError(Exception):
    """An expected failure, told to the model in its own words (no traceback, not counted as a bug)."""


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """What a tool may return instead of a plain string: text plus a summary and citations."""

    text: str
    summary: str | None = None
    citations: tuple[dict, ...] = ()
    # What a model the tool asked cost (context.normalize_usage's record, plus "model"): shown in
    # the trail and counted in the turn's usage.
    usage: dict | None = None
    # Images the tool returned (an MCP image block, decoded): the turn stores them as the reply's
    # attachments and adds a note naming each to `text`; the model never gets their bytes.
    images: tuple[ImageProduced, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolResult:
    """The outcome of one call: `text` goes back to the model, the rest feeds the activity trail."""

    call_id: str
    name: str
    arguments: dict
    text: str
    ok: bool
    summary: str
    duration_ms: int
    citations: tuple[dict, ...] = ()
    error: str | None = None
    usage: dict | None = None
    images: tuple[ImageProduced, ...] = ()

    def event(self) -> dict:
        """The data of the finished `tool` turn event (API.md)."""
        data = {"call_id": self.call_id, "name": self.name, "arguments": self.arguments,
                "status": "done" if self.ok else "error", "summary": self.summary, "duration_ms": self.duration_ms}
        if self.error is not None:
            data["error"] = self.error
        if self.usage is not None:
            data["usage"] = self.usage
        return data

    def chat_message(self) -> dict:
        """The `/v1/chat/completions` message answering this call."""
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.text}

    def messages_block(self) -> dict:
        """The `/v1/messages` `tool_result` block answering this call (sent inside a user message)."""
        block = {"type": "tool_result", "tool_use_id": self.call_id, "content": self.text}
        if not self.ok:
            block["is_error"] = True
        return block


def running_event(call: Call) -> dict:
    """The data of the first `tool` turn event, sent when a call starts."""
    arguments = call.arguments if isinstance(call.arguments, dict) else _arguments_or_empty(call.arguments)
    return {"call_id": call.id, "name": call.name, "arguments": arguments, "status": "running"}


# --- Who a call acts for ------------------------------------------------------------------------

@dataclass
class ToolContext:
    """What the running turn lends its tools: never chosen by the model."""

    conversation_id: str
    settings: Settings
    read_memory: Callable[[], Awaitable[str]]
    write_memory: Callable[[str], Awaitable[None]]
    owner: str | None = None
    # Set when the person approves facts first: `remember` proposes the fact through it, for the
    # turn to put before the person, instead of writing memory.
    propose_fact: Callable[[str], None] | None = None
    # Parallel `remember` calls in one batch read and write the same memory: one at a time.
    memory_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The server's file readers (the uploads' own): web_fetch reads a PDF through them, in `owner`'s turn.
    extractor: Extractor | None = None
    # Asks VISION_MODEL about an image: (image, question) -> (answer, usage). Set by a turn that
    # offers `analyze_image`.
    ask_vision: Callable[[attachments.StoredImage, str], Awaitable[tuple[str, dict]]] | None = None


_current: ContextVar[ToolContext | None] = ContextVar("tool_context", default=None)


@contextmanager
def tool_context(ctx: ToolContext) -> Iterator[ToolContext]:
    """Make `ctx` the context of tool calls inside the block; always reset, so nothing leaks to the next turn."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def current_context() -> ToolContext | None:
    """The running turn's tool context, or None outside a turn."""
    return _current.get()


# --- The registry -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Tool:
    """A registered tool: the function, its argument model and the schema derived from it."""

    name: str
    description: str
    fn: Callable[..., Awaitable[str | ToolOutput]]
    arguments: type[BaseModel]
    parameters: dict
    # None: always offered; otherwise whether these settings configure it (web_search needs SEARXNG_URL).
    requires: Callable[[Settings], bool] | None = None
    # A tool of an MCP server (mcp.py): `server` names it, `call` takes the checked arguments as
    # they came (`fn` and `arguments` are unused), `check` refuses arguments its schema does not
    # allow, and `timeout` (MCP_TIMEOUT) replaces TOOL_TIMEOUT.
    server: str | None = None
    call: Callable[[dict], Awaitable[str | ToolOutput]] | None = None
    check: Callable[[dict], None] | None = None
    timeout: float | None = None

    def available(self, settings: Settings | None) -> bool:
        return self.requires is None or (settings is not None and self.requires(settings))


class Registry:
    """Tools by name, in registration order, with per-tool failure counts."""

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}
        self.failures: Counter[str] = Counter()  # unexpected exceptions: bugs
        self.errors: Counter[str] = Counter()    # expected failures: network, timeouts, bad arguments
        # The MCP servers this process is configured with, connected or not (mcp.py keeps it):
        # a preset may name their tools, or `server__*`, before the server first answers.
        self.servers: dict[str, Callable[[], dict]] = {}

    def tool(self, fn=None, *, name: str | None = None, requires: Callable[[Settings], bool] | None = None):
        """Decorator form of `register`: `@registry.tool` or `@registry.tool(requires=...)`."""
        def wrap(f):
            self.register(f, name=name, requires=requires)
            return f
        return wrap(fn) if fn is not None else wrap

    def register(self, fn: Callable[..., Awaitable[str | ToolOutput]], *, name: str | None = None,
                 requires: Callable[[Settings], bool] | None = None) -> Tool:
        """Add a typed async function as a tool; its docstring is the description the model reads."""
        tool_name = name or fn.__name__
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {tool_name} must be an async function")
        if tool_name in self._tools:
            raise ValueError(f"a tool named {tool_name} is already registered")
        description = inspect.getdoc(fn)
        if not description:
            raise TypeError(f"tool {tool_name} needs a docstring: it is what the model reads")
        model = _arguments_model(tool_name, fn)
        tool = Tool(tool_name, description, fn, model, _clean_schema(model.model_json_schema()), requires)
        self._tools[tool_name] = tool
        return tool

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def set_server_tools(self, server: str, server_tools: Iterable[Tool]) -> None:
        """Replace every tool of one MCP server (none: the server is gone)."""
        for name in [n for n, t in self._tools.items() if t.server == server]:
            del self._tools[name]
        for tool in server_tools:
            if tool.name in self._tools:
                raise ValueError(f"a tool named {tool.name} is already registered")
            self._tools[tool.name] = tool

    def accepts(self, name: str) -> bool:
        """Whether a preset's whitelist may name this: a registered tool, or `server__tool` and
        `server__*` of a configured MCP server (its tools may not be listed yet)."""
        if name in self._tools:
            return True
        server, sep, rest = name.partition(MCP_SEPARATOR)
        return bool(sep and rest) and server in self.servers

    def names(self) -> list[str]:
        """Every registered tool, configured or not."""
        return list(self._tools)

    def available(self, settings: Settings | None) -> list[str]:
        """The tools these settings let us offer."""
        return [n for n, t in self._tools.items() if t.available(settings)]

    def declarations(self, names: Iterable[str], wire: Wire) -> list[dict]:
        """The named tools declared for one wire format, in registration order; unknown names are skipped."""
        wanted = set(names)
        out = []
        for tool in self._tools.values():
            if tool.name not in wanted:
                continue
            if wire == "chat":
                out.append({"type": "function", "function": {
                    "name": tool.name, "description": tool.description, "parameters": tool.parameters}})
            else:
                out.append({"name": tool.name, "description": tool.description, "input_schema": tool.parameters})
        return out

    def listing(self, settings: Settings | None) -> list[dict]:
        """`GET /api/tools`: local and MCP tools with schemas and failure counts, then the gateway's server tools."""
        local = []
        for t in self._tools.values():
            entry = {"name": t.name, "description": t.description, "parameters": t.parameters, "runs": "local",
                     "available": t.available(settings), "failures": self.failures[t.name],
                     "errors": self.errors[t.name]}
            if t.server is not None:
                state = self.servers.get(t.server)
                entry.update(runs="mcp", server=t.server, available=bool(state and state().get("connected")))
            local.append(entry)
        return local + [dict(entry, failures=0, errors=0) for entry in _GATEWAY_LISTING]

    def server_states(self) -> list[dict]:
        """Each configured MCP server's `{name, connected, error, failures}`."""
        return [state() for state in self.servers.values()]

    async def run(self, name: str, raw_arguments: str | dict, enabled: Iterable[str], *,
                  call_id: str = "", timeout: float | None = None) -> ToolResult:
        """Call one tool through the safety wrapper: every failure becomes a result; Stop propagates."""
        started = time.perf_counter()
        enabled = frozenset(enabled)
        arguments: dict = {}
        try:
            tool = self._tools.get(name)
            if tool is None:
                raise ToolError(f"there is no tool by that name; you can call: {_names(enabled)}")
            if name not in enabled:
                raise ToolError(f"this tool is not enabled in this conversation; you can call: {_names(enabled)}")
            ctx = current_context()
            if not tool.available(ctx.settings if ctx else None):
                raise ToolError("this tool is not configured on this server")
            arguments = _parse_arguments(raw_arguments)
            limit = timeout or tool.timeout or (ctx.settings.tool_timeout if ctx else DEFAULT_TOOL_TIMEOUT)
            if tool.call is not None:
                if tool.check is not None:
                    tool.check(arguments)
                output = await _with_deadline(tool.call(arguments), limit)
            else:
                try:
                    parsed = tool.arguments.model_validate(arguments)
                except ValidationError as exc:
                    raise ToolError(f"bad arguments: {_validation_message(exc)}") from None
                kwargs = {key: getattr(parsed, key) for key in type(parsed).model_fields}
                output = await _with_deadline(tool.fn(**kwargs), limit)
            if isinstance(output, str):
                output = ToolOutput(output)
            elif not isinstance(output, ToolOutput):
                raise TypeError(f"tool {name} returned {type(output).__name__}, not str or ToolOutput")
        except ToolError as exc:
            return self._failed(name, call_id, arguments, str(exc), started, expected=True)
        except (httpx.HTTPError, OSError) as exc:
            return self._failed(name, call_id, arguments, f"network error ({_exception_text(exc)})", started,
                                expected=True)
        except Exception as exc:  # a bug in the tool: still a result, but loud
            log.error("tool %s failed unexpectedly", name, exc_info=exc)
            return self._failed(name, call_id, arguments,
                                f"the tool failed unexpectedly ({type(exc).__name__}); this is a fault on the "
                                "server, not in your arguments", started, expected=False)
        text = _capped(output.text)
        return ToolResult(call_id, name, arguments, text, True, _short(output.summary or output.text),
                          _elapsed_ms(started), tuple(output.citations), usage=output.usage,
                          images=tuple(output.images))

    async def run_batch(self, calls: Sequence[Call], enabled: Iterable[str], *,
                        on_result: Callable[[ToolResult], None] | None = None,
                        timeout: float | None = None) -> list[ToolResult]:
        """Run the calls of one model response in parallel; results in call order.

        `on_result` sees each result as it finishes (for the live `tool` events). Cancelling the
        caller cancels every call still running.
        """
        allowed = frozenset(enabled)

        async def one(call: Call) -> ToolResult:
            result = await self.run(call.name, call.arguments, allowed, call_id=call.id, timeout=timeout)
            if on_result is not None:
                on_result(result)
            return result

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def run_streaming(self, calls: Sequence[Call], enabled: Iterable[str], ctx: ToolContext, *,
                            timeout: float | None = None) -> AsyncIterator[ToolResult]:
        """Run the calls in parallel under `ctx`, yielding each result as it finishes.

        Made for a turn that is itself an async generator: `ctx` is set only while the calls are
        started (each task keeps a copy), never across a `yield`, so it cannot leak to whatever
        runs between events. Closing or cancelling the iteration cancels the calls still running.
        """
        allowed = frozenset(enabled)
        with tool_context(ctx):
            tasks = [asyncio.ensure_future(self.run(c.name, c.arguments, allowed, call_id=c.id, timeout=timeout))
                     for c in calls]
        try:
            for finished in asyncio.as_completed(tasks):
                yield await finished
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def bound(self, calls: Sequence[Call], *, max_calls: int, max_argument_bytes: int
              ) -> tuple[tuple[Call, ...], list[ToolResult]]:
        """The calls of one response cut to size before any runs: what is kept (`kept[i]` stands for
        `calls[i]`), and the refusals.

        The first `max_calls` are kept; a call whose arguments exceed `max_argument_bytes` is kept
        with `{}` as its arguments and refused, and so is the first call past the limit, which
        answers for all of them: a response of 5,000 calls is stored and resent as at most
        `max_calls + 1`, so the model still reads why the rest did not run.
        """
        kept: list[Call] = []
        refused: list[ToolResult] = []
        started = time.perf_counter()
        for call in calls[:max_calls]:
            call = _short_name(call)
            size = _argument_bytes(call.arguments)
            if size <= max_argument_bytes:
                kept.append(call)
                continue
            kept.append(Call(call.id, call.name, "{}"))
            refused.append(self._failed(call.name, call.id, {}, f"the arguments are {size:,} bytes, more than the "
                                        f"{max_argument_bytes:,} a call may carry (TOOL_ARGS_MAX_BYTES); this call "
                                        "was not run", started, expected=True))
        if len(calls) > max_calls:
            first = _short_name(calls[max_calls])
            kept.append(Call(first.id, first.name, "{}"))
            refused.append(self._failed(first.name, first.id, {}, f"not run: this response made {len(calls):,} "
                                        f"calls and at most {max_calls} run in one round (TOOL_CALLS_MAX); this one "
                                        f"and the {len(calls) - max_calls - 1:,} after it were dropped. Ask again "
                                        "for what you still need, in fewer calls", started, expected=True))
        return tuple(kept), refused

    def _failed(self, name: str, call_id: str, arguments: dict, reason: str, started: float, *,
                expected: bool) -> ToolResult:
        if name in self._tools:
            (self.errors if expected else self.failures)[name] += 1
        if expected:
            log.info("tool %s: %s", name, reason)
        return ToolResult(call_id, name, arguments, f"[tool error] {name}: {reason}", False, _short(reason),
                          _elapsed_ms(started), (), reason)


async def _with_deadline(call: Awaitable[str | ToolOutput], limit: float) -> str | ToolOutput:
    """The tool's own coroutine under TOOL_TIMEOUT (MCP_TIMEOUT for MCP tools); only our deadline
    reads as a timeout."""
    deadline = asyncio.timeout(limit)
    try:
        async with deadline:
            return await call
    except TimeoutError:
        if deadline.expired():
            raise ToolError(f"timed out after {limit:g} s") from None
        raise


def _arguments_model(name: str, fn: Callable) -> type[BaseModel]:
    """A pydantic model of the function's parameters: the schema and the validator in one."""
    hints = typing.get_type_hints(fn, include_extras=True)
    fields: dict[str, tuple] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise TypeError(f"tool {name}: parameter {param.name} must be a named parameter")
        if param.name not in hints:
            raise TypeError(f"tool {name}: parameter {param.name} needs a type annotation")
        fields[param.name] = (hints[param.name], ... if param.default is param.empty else param.default)
    # extra="forbid": an argument the schema does not name is a mistake the model should hear about.
    return create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)


def _clean_schema(schema: dict) -> dict:
    """The schema without pydantic's generated titles, which only repeat the names to the model."""
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        if isinstance(prop, dict):
            prop.pop("title", None)
    return schema


def _parse_arguments(raw: str | dict) -> dict:
    if isinstance(raw, dict):
        return raw
    if not raw.strip():
        return {}  # some gateways send "" for a call without arguments
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ToolError(f"the arguments are not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(value, dict):
        raise ToolError("the arguments must be a JSON object")
    return value


def _argument_bytes(raw: str | dict) -> int:
    text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
    return len(text.encode("utf-8", "surrogatepass"))


def _short_name(call: Call) -> Call:
    """The call with its id and name cut to what any gateway accepts: the model chose them, and they
    are stored and resent like the arguments."""
    if len(call.name) <= TOOL_NAME_MAX_CHARS and len(call.id) <= TOOL_ID_MAX_CHARS:
        return call
    return Call(call.id[:TOOL_ID_MAX_CHARS], call.name[:TOOL_NAME_MAX_CHARS], call.arguments)


def _arguments_or_empty(raw: str) -> dict:
    try:
        return _parse_arguments(raw)
    except ToolError:
        return {}


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())


def _exception_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _names(enabled: Iterable[str]) -> str:
    names = sorted(set(enabled))
    return ", ".join(names) if names else "none"


def _capped(text: str) -> str:
    if len(text) <= TOOL_RESULT_MAX_CHARS:
        return text
    return text[:TOOL_RESULT_MAX_CHARS] + f"\n[cut: {len(text) - TOOL_RESULT_MAX_CHARS} more characters not shown]"


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= SUMMARY_MAX_CHARS else flat[:SUMMARY_MAX_CHARS - 1].rstrip() + "…"


def _elapsed_ms(started: float) -> int:
    return round((time.perf_counter() - started) * 1000)


# --- Which tools a turn offers ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Selection:
    """The tools of one turn: local ones to declare and run here, gateway server tools to declare."""

    local: tuple[str, ...]
    gateway: tuple[str, ...]


def select_tools(reg: Registry, settings: Settings, *, allowed: Iterable[str], chosen: Iterable[str] | None,
                 runtime: Runtime, web_search: bool = False, web_fetch: bool = False) -> Selection:
    """The preset's whitelist ∩ the conversation's `tools` ∩ what the server has configured, per runtime.

    `allowed` is the preset's list, `chosen` the conversation's `tools` setting (None: the preset's
    list). The `web_search`/`web_fetch` toggles decide the web tools on every runtime: on `gateway`
    they become server tools and never local ones; on `local` they run here; `none` offers nothing.
    """
    if runtime == "none":
        return Selection((), ())
    allowed_set = set(allowed)
    chosen_set = allowed_set if chosen is None else set(chosen)
    toggles = {"web_search": web_search, "web_fetch": web_fetch}
    local = [n for n in reg.available(settings)
             if whitelisted(reg, n, allowed_set) and whitelisted(reg, n, chosen_set) and toggles.get(n, True)]
    if runtime == "gateway":
        gateway = tuple(n for n in GATEWAY_TOOLS if toggles[n])
        return Selection(tuple(n for n in local if n not in GATEWAY_TOOLS), gateway)
    return Selection(tuple(local), ())


def whitelisted(reg: Registry, name: str, names: Iterable[str]) -> bool:
    """Whether a whitelist names this tool, itself or (an MCP tool) its whole server as `server__*`."""
    wanted = names if isinstance(names, (set, frozenset)) else set(names)
    if name in wanted:
        return True
    tool = reg.get(name)
    return tool is not None and tool.server is not None and f"{tool.server}{MCP_SEPARATOR}*" in wanted


# --- The built-in tools -------------------------------------------------------------------------

registry = Registry()

_GATEWAY_LISTING = (
    {"name": "web_search", "runs": "gateway", "available": True,
     "description": "The gateway's own web search (a server tool on /v1/messages, billed per use).",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
    {"name": "web_fetch", "runs": "gateway", "available": True,
     "description": "The gateway's own page fetch (a server tool on /v1/messages, billed per use).",
     "parameters": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}},
)


@registry.tool
async def web_fetch(
    url: Annotated[str, Field(min_length=1, max_length=2048, description="The http or https address to read.")],
) -> ToolOutput:
    """Read one web page or PDF and return its readable text, title first. Use it for addresses the person gives or that a search found."""  # noqa: E501
    ctx = current_context()
    settings = ctx.settings if ctx else None
    try:
        page = await webfetch.fetch(
            url,
            max_bytes=settings.fetch_max_bytes if settings else webfetch.DEFAULT_MAX_BYTES,
            timeout=settings.tool_timeout if settings else DEFAULT_TOOL_TIMEOUT,
            allow_hosts=settings.fetch_allow_hosts if settings else (),
            extractor=ctx.extractor if ctx else None,
            person=(ctx.owner or "") if ctx else "",
            pdf_max_pages=settings.max_attachment_pages if settings else webfetch.PDF_MAX_PAGES,
        )
    except webfetch.FetchError as exc:
        raise ToolError(str(exc)) from None
    host = urlsplit(page.url).hostname or page.url
    summary = f"{host}: {page.title or 'untitled'} ({len(page.text):,} characters{', cut' if page.truncated else ''})"
    return ToolOutput(page.for_model(), summary, ({"url": page.url, "title": page.title or host},))


@registry.tool(requires=lambda s: bool(s.searxng_url))
async def web_search(
    query: Annotated[str, Field(min_length=1, max_length=400, description="What to search the web for.")],
) -> ToolOutput:
    """Search the web and return the top results (title, address, snippet). Fetch a result to read it in full."""
    ctx = current_context()
    if ctx is None or not ctx.settings.searxng_url:
        raise ToolError("no search engine is configured (SEARXNG_URL)")
    # The operator chose this address (often on loopback), so it is not subject to the SSRF rules.
    async with httpx.AsyncClient(timeout=ctx.settings.tool_timeout, trust_env=False) as client:
        response = await client.get(f"{ctx.settings.searxng_url}/search",
                                    params={"q": query, "format": "json"}, headers={"Accept": "application/json"})
    if response.status_code != 200:
        raise ToolError(f"the search engine answered HTTP {response.status_code}")
    try:
        results = response.json().get("results") or []
    except ValueError:
        raise ToolError("the search engine did not answer JSON (is format=json enabled in SearXNG?)") from None
    hits = [r for r in results if isinstance(r, dict) and isinstance(r.get("url"), str)][:SEARCH_RESULTS_MAX]
    if not hits:
        return ToolOutput(f"No results for: {query}", f"no results for “{query}”")
    lines = [f"Results for: {query}", ""]
    for n, hit in enumerate(hits, 1):
        lines.append(f"{n}. {hit.get('title') or hit['url']}\n   {hit['url']}")
        if snippet := " ".join(str(hit.get("content") or "").split()):
            lines.append(f"   {snippet}")
    citations = tuple({"url": h["url"], "title": h.get("title") or h["url"]} for h in hits)
    return ToolOutput("\n".join(lines), f"{len(hits)} results for “{query}”", citations)


@registry.tool
async def remember(
    fact: Annotated[str, Field(min_length=1, max_length=500,
                               description="One short, durable fact about the person, in the third person.")],
) -> ToolOutput:
    """Save a durable fact about the person (a preference, their name, their setup) to their long-term memory."""
    ctx = current_context()
    if ctx is None:
        raise ToolError("no active conversation, so there is no one to remember this for")
    line = " ".join(fact.split()).removeprefix("- ").strip()
    if not line:
        raise ToolError("the fact is empty")
    async with ctx.memory_lock:
        memory, added = prompt_context.merge_facts(await ctx.read_memory(), [line])
        if added and ctx.propose_fact is not None:
            # A fact can come from a fetched page that told the model what to remember: with
            # approval on, nothing reaches memory (and every later prompt) until the person says so.
            ctx.propose_fact(line)
            return ToolOutput(f"Proposed for the person's memory; it is kept only once they accept it: {line}",
                              f"proposed for memory: {line}")
        if added:
            await ctx.write_memory(memory)
    if not added:
        return ToolOutput(f"Already in memory: {line}", f"already known: {line}")
    return ToolOutput(f"Saved to memory: {line}", f"remembered: {line}")


# --- The attachment tools (attachments.py does the work; whose files: its `attachment_scope`) ----

def _from_attachments(result: attachments.AttachmentToolResult) -> ToolOutput:
    return ToolOutput(result.text, result.summary, tuple(result.citations))


@registry.tool(name="search_attachments")
async def _search_attachments(
    query: Annotated[str, Field(min_length=1, max_length=400,
                                description="What to look for, in words likely to appear in the file (any language).")],
) -> ToolOutput:
    """Search the files attached to this conversation (and the person's library when enabled) for passages about the query: the best passages, each with its file name and page."""  # noqa: E501
    return _from_attachments(await attachments.search_attachments(query))


@registry.tool(name="read_attachment")
async def _read_attachment(
    name: Annotated[str, Field(min_length=1, max_length=300, description='The file\'s name as listed (e.g. "report.pdf").')],
    start_page: Annotated[int, Field(ge=1, description="The first page (or section) to read, from 1.")] = 1,
    end_page: Annotated[int | None, Field(ge=1, description="The last page to read; omit to read on as far as the length cap allows.")] = None,  # noqa: E501
    offset: Annotated[int, Field(ge=0, description="Characters of start_page already read, as an answer's continue line gives it; 0 otherwise.")] = 0,  # noqa: E501
) -> ToolOutput:
    """Read a page range of an attached file (documents other than PDF have numbered sections instead of pages); a long range is cut short and says where to continue."""  # noqa: E501
    return _from_attachments(await attachments.read_attachment(name, start_page, end_page, offset))


@registry.tool(name="analyze_image", requires=lambda s: bool(s.vision_model))
async def _analyze_image(
    image_id: Annotated[str, Field(min_length=1, max_length=64,
                                   description="The image's id, as its message or the file list gives it.")],
    question: Annotated[str, Field(min_length=1, max_length=2000,
                                   description="What to find out about the image; ask for detail, text or numbers you need.")],
) -> ToolOutput:
    """Look at an image attached to this conversation: a vision model answers the question about it (you cannot see images yourself)."""  # noqa: E501
    ctx = current_context()
    if ctx is None or ctx.ask_vision is None:
        raise ToolError("no image can be looked at outside a conversation turn")
    try:
        image = await attachments.turn_image(image_id)  # the turn's scope decides whose images, never the model
    except attachments.AttachmentNotFound:
        raise ToolError(f"no image with id {image_id!r} is attached to this conversation (not found)") from None
    answer, usage = await ctx.ask_vision(image, question)
    model = ctx.settings.vision_model
    return ToolOutput(answer, f"{image.name}: {answer}", usage={"model": model, **usage})

