"""The `/v1/messages` wire format (Anthropic Messages) for turns with the gateway's web tools.

`MessagesDecoder` is the pure part (SSE records in, events out, no HTTP); `stream` runs a
whole tool turn through `upstream.client.Gateway`.

Promises: given the system blocks and messages `context.build_prompt` laid out and the server
tools a conversation has switched on, one continuous stream of `events` values for the whole
turn, however many times the gateway paused it (`pause_turn` is resent with every block
received so far, at most PAUSE_TURN_MAX times), with one Anthropic-dialect `UsageReport`
per request (the turn sums them for the bill and keeps the last as the prompt size). A tool
the gateway rejects outright (HTTP 4xx naming it) is dropped and the request sent once more
without it, announced by a `tool_dropped` warning; when no tool is left
`ToolsRejected` is raised and the caller answers without tools (turns.py sends such a turn
to chat completions, the path every tool-less turn takes). Everything else fails as
`failures.UpstreamError`, classified exactly as on chat turns. Closing the stream (Stop)
closes the upstream socket.

It does not know conversations, the prompt's layout (`context.py`), how events are shown or
saved (`turns.py`), or how to run a tool: the gateway runs search and fetch, and this module
only reports what the gateway says it did.

The person's parameters (`sampling_fields`) are sent in this format's terms: reasoning effort as
extended thinking's budget. Deliberately not sent: per-model extra params (`settings.params_for`). They are
chat-completions params (`reasoning_effort`), and a strict Messages endpoint answers an unknown
top-level field with a 400 that would kill the tool turn. The Messages default (no extended
thinking) is already the cheap setting those params ask for.
Not requested either: citations for fetched pages (`char_location` entries carry no URL), so
citation chips come from search results; pages read still show in the trail.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import AsyncIterator

from chatserver.config import Settings
from chatserver.turns.events import (
    Call,
    CitationFound,
    Event,
    FetchDone,
    Finished,
    ReasoningDelta,
    SearchResults,
    SearchStarted,
    TextDelta,
    ToolCallsRequested,
    TurnWarning,
    UsageReport,
)
from chatserver.turns.sampling import Sampling
from chatserver.upstream import chat
from chatserver.upstream.client import Gateway
from chatserver.upstream.failures import UpstreamError, classify_finish, classify_stream_error
from chatserver.upstream.sse import SSERecord

PATH = "/v1/messages"
ANTHROPIC_VERSION = "2023-06-01"
# The first web fetch version sat behind a beta flag; later versions need none (docs/PROTOCOLS.md, section B).
BETA_FLAGS = {"web_fetch_20250910": "web-fetch-2025-09-10"}
TOOL_LABELS = {"web_search": "web search", "web_fetch": "web fetch"}
# Statuses with which a gateway turns down a request it will not run as declared.
_REJECTING_STATUSES = (400, 403, 404, 422)


class ToolsRejected(Exception):
    """The gateway turned down every declared tool; the turn must be answered without tools."""

    def __init__(self, names: list[str], failure: UpstreamError) -> None:
        super().__init__(failure.message)
        self.names = names
        self.failure = failure

    @property
    def warning(self) -> TurnWarning:
        return dropped_warning(self.names, self.failure)


def declarations(names: list[str], settings: Settings) -> list[dict]:
    """Tool declarations; the type names come from config, so a gateway's own names are one line."""
    kinds = {
        "web_search": (settings.web_search_tool_type, settings.search_max_uses),
        "web_fetch": (settings.web_fetch_tool_type, settings.fetch_max_uses),
    }
    return [{"type": kinds[name][0], "name": name, "max_uses": kinds[name][1]} for name in names]


# Extended thinking's budget for each reasoning effort (Anthropic's minimum budget is 1,024 tokens).
THINKING_BUDGET = {"minimal": 1024, "low": 2048, "medium": 8192, "high": 16384}


def sampling_fields(sampling: Sampling, max_tokens: int) -> tuple[dict, int]:
    """The person's parameters as Messages fields, and the request's `max_tokens`.

    Reasoning effort becomes `thinking` with a token budget; `max_tokens` counts thinking too and
    must exceed the budget, so the reply keeps its own limit on top of it. With thinking on,
    Anthropic refuses a changed temperature or top_p, so neither is sent then. Temperature is
    0-1 on this wire (0-2 on chat completions): a higher one is sent as 1."""
    if sampling.reasoning_effort is not None:
        budget = THINKING_BUDGET[sampling.reasoning_effort]
        return {"thinking": {"type": "enabled", "budget_tokens": budget}}, budget + max_tokens
    fields: dict = {}
    if sampling.temperature is not None:
        fields["temperature"] = min(sampling.temperature, 1.0)
    if sampling.top_p is not None:
        fields["top_p"] = sampling.top_p
    return fields, max_tokens


def build_body(model: str, system: list[dict], messages: list[dict], tools: list[dict], *,
               max_tokens: int, received: list[dict] | None = None, tool_choice: str | None = None,
               sampling: Sampling = Sampling()) -> dict:
    """The request; after a pause, the same request plus one assistant message of the blocks so far.

    `messages` may hold earlier tool rounds in the chat shape `context.wire_history` gives; they
    are sent as `tool_use` / `tool_result` blocks.
    """
    messages = as_blocks(messages)
    if received:
        blocks = list(received)
        if blocks[-1].get("type") == "text":
            # Resent as the final assistant message, which Anthropic refuses to see end in whitespace.
            blocks[-1] = {**blocks[-1], "text": blocks[-1]["text"].rstrip()}
        messages = [*messages, {"role": "assistant", "content": blocks}]
    fields, max_tokens = sampling_fields(sampling, max_tokens)
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "system": system,
            "messages": messages, "tools": tools, **fields}
    if tool_choice:
        body["tool_choice"] = {"type": tool_choice}
    return body


def _input_of(arguments: object) -> dict:
    """A stored call's arguments as the object a tool_use block needs (malformed ones as {})."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def as_blocks(messages: list[dict]) -> list[dict]:
    """Chat-shaped tool rounds (an assistant message with `tool_calls`, then `role: tool` messages) as
    Messages blocks: the calls as `tool_use` in the assistant message, the results as one user
    message of `tool_result` blocks; neutral image parts as `image` blocks. Other messages pass unchanged."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            last = out[-1] if out else None
            if last is not None and last.get("tool_results"):
                last["content"].append(block)
            else:
                out.append({"role": "user", "content": [block], "tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": _input_of(c["function"].get("arguments"))} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": blocks})
        elif isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"]):
            # A neutral image part (context.py) as this format's image block with a base64 source.
            out.append({**m, "content": [
                {"type": "image", "source": {"type": "base64", "media_type": p["media_type"], "data": p["data"]}}
                if p.get("type") == "image" else p for p in m["content"]]})
        else:
            out.append(m)
    for m in out:
        m.pop("tool_results", None)
    return out


def request_headers(api_key: str | None, tools: list[dict]) -> dict:
    headers = {"anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"}
    if api_key:
        # Anthropic reads x-api-key; OpenAI-style gateways read the bearer token.
        headers["x-api-key"] = api_key
        headers.update(chat.auth_headers(api_key))
    flags = sorted({BETA_FLAGS[t["type"]] for t in tools if t.get("type") in BETA_FLAGS})
    if flags:
        headers["anthropic-beta"] = ",".join(flags)
    return headers


def rejected_tools(failure: UpstreamError, tools: list[dict]) -> list[dict]:
    """The declared tools an HTTP refusal names (a key without fetch, an unknown tool type...)."""
    if failure.status not in _REJECTING_STATUSES:
        return []
    text = failure.message.lower()
    # Only the gateway's server tools (declared with a `type`) can be dropped; our own are plain schemas.
    return [
        t for t in tools
        if "type" in t and (t["name"] in text or t["type"].lower() in text or TOOL_LABELS[t["name"]] in text)
    ]


def dropped_warning(names: list[str], failure: UpstreamError) -> TurnWarning:
    what = " and ".join(TOOL_LABELS[n] for n in names)
    reason = failure.message if len(failure.message) <= 200 else failure.message[:199] + "…"
    return TurnWarning("tool_dropped",
                   f"The gateway rejected {what} ({reason}); this turn is answered without it.")


class MessagesDecoder:
    """One Messages response: SSE records in, events out, blocks kept verbatim for a resend.

    `tool_inputs` (server tool id -> input) is shared across a turn's continuations, so a
    result can be matched to its query even when the pause fell between the two.
    """

    def __init__(self, tool_inputs: dict[str, dict] | None = None) -> None:
        self.tool_inputs = {} if tool_inputs is None else tool_inputs
        self.usage: dict = {}
        self.generation_id: str | None = None  # the message id (a generation id through OpenRouter)
        self.stop_reason: str | None = None
        self.stop_detail = ""
        self.finished = False
        self._blocks: dict[int, dict] = {}
        # Input JSON pieces per block, joined once when the block stops.
        self._partial_json: dict[int, list[str]] = {}
        # Our own tools the model called (`tool_use` blocks), with their raw argument JSON.
        self.client_calls: list[Call] = []

    @property
    def blocks(self) -> list[dict]:
        return [self._blocks[i] for i in sorted(self._blocks)]

    def feed(self, record: SSERecord) -> list[Event]:
        if record.data in ("", "[DONE]"):
            return []
        try:
            obj = json.loads(record.data)
        except ValueError:
            raise malformed("not JSON") from None
        if not isinstance(obj, dict):
            raise malformed("not a JSON object")
        kind = obj.get("type") or record.event
        # `event: error`, and older LiteLLM proxies' bare `data: {"error": ...}` with no event line.
        if record.event == "error" or kind == "error" or obj.get("error"):
            raise classify_stream_error(obj)
        match kind:
            case "message_start":
                message = _member(obj, "message", dict, kind)
                if isinstance(message.get("id"), str):
                    self.generation_id = message["id"][:200]
                self.usage = _merge(self.usage, _member(message, "usage", dict, "message"))
            case "content_block_start":
                return self._start(_index(obj), copy.deepcopy(_member(obj, "content_block", dict, kind)))
            case "content_block_delta":
                return self._delta(_index(obj), _member(obj, "delta", dict, kind))
            case "content_block_stop":
                return self._stop(_index(obj))
            case "message_delta":
                delta = _member(obj, "delta", dict, kind)
                self.stop_reason = _member(delta, "stop_reason", str, "delta") or self.stop_reason
                details = delta.get("stop_details") or {}
                if isinstance(details, dict):
                    self.stop_detail = str(details.get("explanation") or details.get("category") or "")
                # Cumulative counts: later values replace earlier ones.
                self.usage = _merge(self.usage, _member(obj, "usage", dict, kind))
            case "message_stop":
                self.finished = True
        return []

    def end(self) -> list[Event]:
        """This response's usage; the turn's finish is decided across continuations by `stream`."""
        if not self.finished:
            raise UpstreamError("upstream", "The gateway's stream ended before the reply was finished.")
        return [UsageReport(self.usage)] if self.usage else []

    def _start(self, index: int, block: dict) -> list[Event]:
        self._blocks[index] = block
        match block.get("type"):
            case "text":
                # Gateways that do not stream a block may put all of it in the start event.
                text = _member(block, "text", str, "text block")
                events: list[Event] = [TextDelta(text)] if text else []
                return events + [c for c in map(_citation, _member(block, "citations", list, "text block")) if c]
            case "thinking":
                thinking = _member(block, "thinking", str, "thinking block")
                return [ReasoningDelta(thinking)] if thinking else []
            case "server_tool_use" | "tool_use":
                self._partial_json[index] = []
            case "web_search_tool_result":
                return [self._search_results(block)]
            case "web_fetch_tool_result":
                return [self._fetch_result(block)]
        return []

    def _delta(self, index: int, delta: dict) -> list[Event]:
        block = self._blocks.setdefault(index, {})
        match delta.get("type"):
            case "text_delta":
                text = _member(delta, "text", str, "text_delta")
                block["text"] = (block.get("text") or "") + text
                return [TextDelta(text)] if text else []
            case "thinking_delta":
                thinking = _member(delta, "thinking", str, "thinking_delta")
                block["thinking"] = (block.get("thinking") or "") + thinking
                return [ReasoningDelta(thinking)] if thinking else []
            case "signature_delta":
                block["signature"] = (block.get("signature") or "") + _member(delta, "signature", str, "signature_delta")
            case "input_json_delta":
                self._partial_json.setdefault(index, []).append(
                    _member(delta, "partial_json", str, "input_json_delta"))
            case "citations_delta":
                citation = delta.get("citation") or {}
                block["citations"] = [*(block.get("citations") or []), citation]
                return [c] if (c := _citation(citation)) else []
        return []

    def _stop(self, index: int) -> list[Event]:
        block = self._blocks.get(index, {})
        if block.get("type") not in ("server_tool_use", "tool_use"):
            return []
        # The input arrives as JSON pieces; only the whole of it parses.
        raw = "".join(self._partial_json.pop(index, []))
        if block.get("type") == "tool_use":
            # Our tool: malformed arguments are the model's mistake, answered as a tool error, and
            # the block is resent with an empty input (the API needs an object there).
            if not raw.strip():
                raw = block.get("input") if isinstance(block.get("input"), dict) else {}
            block["input"] = _input_of(raw)
            self.client_calls.append(Call(str(block.get("id", "")), str(block.get("name", "")), raw))
            return []
        if raw.strip():
            try:
                block["input"] = json.loads(raw)
            except ValueError:
                raise UpstreamError("upstream", "The gateway sent a malformed tool input.") from None
        tool_input = block.get("input") if isinstance(block.get("input"), dict) else {}
        self.tool_inputs[block.get("id", "")] = tool_input
        if block.get("name") == "web_search":
            return [SearchStarted(str(tool_input.get("query", "")))]
        return []

    def _search_results(self, block: dict) -> SearchResults:
        query = str(self.tool_inputs.get(block.get("tool_use_id", ""), {}).get("query", ""))
        content = block.get("content")
        if not isinstance(content, list):
            # web_search_tool_result_error: still HTTP 200 and the turn goes on; a step, not a crash.
            code = content.get("error_code") if isinstance(content, dict) else None
            return SearchResults(query, None, str(code or "unavailable"))
        results = []
        for item in content:
            if isinstance(item, dict) and item.get("url"):
                result = {"url": item["url"], "title": item.get("title") or item["url"]}
                if item.get("page_age"):
                    result["page_age"] = item["page_age"]
                results.append(result)
        return SearchResults(query, results)

    def _fetch_result(self, block: dict) -> FetchDone:
        asked = str(self.tool_inputs.get(block.get("tool_use_id", ""), {}).get("url", ""))
        content = block.get("content") if isinstance(block.get("content"), dict) else {}
        if content.get("type") == "web_fetch_result":
            document = content.get("content") if isinstance(content.get("content"), dict) else {}
            return FetchDone(str(content.get("url") or asked), document.get("title"), True)
        # Both `web_fetch_tool_result_error` and the docs' `web_fetch_tool_error` land here.
        return FetchDone(asked, None, False, str(content.get("error_code") or "unavailable"))


def malformed(what: str) -> UpstreamError:
    return UpstreamError("upstream", f"The gateway sent a malformed stream event: {what}.")


_EMPTY = {dict: dict, list: list, str: str}


def _member(obj: dict, key: str, kind: type, where: str):
    """`obj[key]` when it has the type the format says (absent or null: an empty one); else a named failure."""
    value = obj.get(key)
    if value is None:
        return _EMPTY[kind]()
    if not isinstance(value, kind):
        raise malformed(f"{where}.{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _index(obj: dict) -> int:
    index = obj.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool):
        raise malformed(f"index is {type(index).__name__}, not int")
    return index


def _citation(citation: object) -> CitationFound | None:
    """A citation the page can link (search result locations carry the URL)."""
    if isinstance(citation, dict) and isinstance(citation.get("url"), str):
        return CitationFound(citation["url"], str(citation.get("title") or citation["url"]))
    return None


def _merge(old: dict, new: dict) -> dict:
    """`old` updated by `new`, nested dicts merged (message_delta may repeat only some counts)."""
    out = dict(old)
    for key, value in new.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


async def stream(gateway: Gateway, *, model: str, system: list[dict], messages: list[dict],
                 tools: list[dict], max_tokens: int, pause_turn_max: int,
                 tool_choice: str | None = None, dropped: set[str] | None = None,
                 sampling: Sampling = Sampling()) -> AsyncIterator[Event]:
    """Events of one tool turn across its continuations, ending with `Finished`, or an error.

    When the model stops to call our own tools (`tool_use`), a `ToolCallsRequested` with the
    calls and every block received comes just before `Finished`.
    """
    received: list[dict] = []
    tool_inputs: dict[str, dict] = {}
    calls: list[Call] = []
    for continuation in range(pause_turn_max + 1):
        decoder = MessagesDecoder(tool_inputs)
        body = build_body(model, system, messages, tools, max_tokens=max_tokens, received=received,
                          tool_choice=tool_choice, sampling=sampling)
        events = gateway.stream(PATH, body, request_headers(gateway.api_key, tools), decoder)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except UpstreamError as failure:
            # Only the first request may drop a tool: a continuation must resend what was run.
            rejected = rejected_tools(failure, tools) if continuation == 0 else []
            if not rejected:
                raise
            tools = [t for t in tools if t not in rejected]
            if dropped is not None:
                dropped.update(t["name"] for t in rejected)  # a tool loop's later rounds leave them out
            if not tools:
                raise ToolsRejected([t["name"] for t in rejected], failure) from failure
            yield dropped_warning([t["name"] for t in rejected], failure)
            body = build_body(model, system, messages, tools, max_tokens=max_tokens, tool_choice=tool_choice,
                              sampling=sampling)
            events = gateway.stream(PATH, body, request_headers(gateway.api_key, tools), decoder)
            first = None
        async with contextlib.aclosing(events):
            if first is not None:
                yield first
            async for event in events:
                yield event
        # Messages rejects an empty text block, so one that only opened a citation is not resent.
        received += [b for b in decoder.blocks if not (b.get("type") == "text" and not b.get("text"))]
        calls += decoder.client_calls
        if decoder.stop_reason != "pause_turn":
            break
    else:
        yield TurnWarning("pause_turn_limit",
                          f"The gateway kept pausing this turn after {pause_turn_max} continuations "
                          "(PAUSE_TURN_MAX), so the reply was cut here. Ask it to go on.")
    reason = decoder.stop_reason or "end_turn"
    if calls and reason == "tool_use":
        yield ToolCallsRequested(tuple(calls), tuple(received))
    yield Finished(reason)
    if (failure := classify_finish(reason, decoder.stop_detail)) is not None:
        raise failure
