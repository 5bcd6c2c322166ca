"""The `/v1/chat/completions` wire format: request bodies, and a pure decoder of its stream.

Owns everything about that endpoint's bytes: chunk shapes (checked: a chunk that is not what
the format says ends the turn with a message naming what was wrong), the reasoning field's two
names, the usage chunk, finish reasons, errors inside the stream. `ChatDecoder` takes SSE
records and gives `events` values; it knows no HTTP (that is `upstream.client`) and nothing of
conversations.
"""

from __future__ import annotations

import base64
import json
import re

from chatserver.turns.events import (
    Call,
    Event,
    Finished,
    ImageProduced,
    ReasoningDelta,
    TextDelta,
    ToolCallsRequested,
    UsageReport,
)
from chatserver.turns.sampling import Sampling
from chatserver.upstream.failures import UpstreamError, classify_finish, classify_stream_error
from chatserver.upstream.sse import SSERecord

PATH = "/v1/chat/completions"


def plain(content: object) -> str | None:
    """Text parts as one string, their cache markers dropped (a tool-call message's null stays null)."""
    if content is None or isinstance(content, str):
        return content
    return "\n\n".join(p.get("text", "") for p in content)


def shaped(content: object) -> object:
    """A message's content in this format: a neutral image part (context.py) as an `image_url`
    part holding a data URL; everything else as it is."""
    if not isinstance(content, list) or not any(p.get("type") == "image" for p in content):
        return content
    return [{"type": "image_url", "image_url": {"url": f"data:{p['media_type']};base64,{p['data']}"}}
            if p.get("type") == "image" else p for p in content]


def build_body(model: str, system_parts: list[dict], messages: list, *,
               max_tokens: int, params: dict, stream: bool = True, plain_text: bool = False,
               tools: list[dict] | None = None, tool_choice: str | None = None) -> dict:
    """The request; `plain_text` for servers that take only a string as a message's content
    (llama-cpp-python's): the layered system blocks become one string and no cache marker is sent."""
    system = [{"role": "system", "content": plain(system_parts) if plain_text else system_parts}] if system_parts else []
    if plain_text:
        messages = [{**m, "content": plain(m["content"])} for m in messages]
    else:
        # A walked history comes as encoded runs (context.Prompt.encodable): sent as they are.
        messages = [{**m, "content": shaped(m["content"])}
                    if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]
    body: dict = {
        "model": model,
        "messages": system + messages,
        "max_tokens": max_tokens,
        **params,
    }
    if tools:
        body["tools"] = tools
        if tool_choice:
            body["tool_choice"] = tool_choice
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def sampling_fields(sampling: Sampling, *, openrouter: bool) -> dict:
    """The person's parameters as chat-completions fields (the reply limit is `max_tokens`, set apart).

    Reasoning effort is OpenAI's top-level `reasoning_effort`; OpenRouter documents its own
    `reasoning: {effort}` (its unified form across providers), so that is what it is sent."""
    fields: dict = {}
    if sampling.temperature is not None:
        fields["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        fields["top_p"] = sampling.top_p
    if sampling.reasoning_effort is not None:
        if openrouter:
            fields["reasoning"] = {"effort": sampling.reasoning_effort}
        else:
            fields["reasoning_effort"] = sampling.reasoning_effort
    return fields


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def malformed(what: str) -> UpstreamError:
    return UpstreamError("upstream", f"The gateway sent a malformed stream chunk: {what}.")


def parse_object(data: str) -> dict:
    try:
        obj = json.loads(data)
    except ValueError:
        raise malformed("not JSON") from None
    if not isinstance(obj, dict):
        raise malformed("not a JSON object")
    return obj


def _optional_text(container: dict, key: str, where: str) -> str:
    value = container.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise malformed(f"{where}.{key} is {type(value).__name__}, not a string")
    return value


_DATA_URL = re.compile(r"data:(image/(?:png|jpeg|gif|webp));base64,([A-Za-z0-9+/=\s]*)")


def _images(images: object) -> list[Event]:
    """OpenRouter's output images (`delta.images` / `message.images`): `[{"type": "image_url",
    "image_url": {"url": "data:image/png;base64,..."}}]`. Only inline data is kept: an address
    would have to be fetched, and reply text already has a safe way to show one."""
    if images is None:
        return []
    if not isinstance(images, list):
        raise malformed(f"delta.images is {type(images).__name__}, not a list")
    out: list[Event] = []
    for image in images:
        inner = image.get("image_url") if isinstance(image, dict) else None
        url = inner.get("url") if isinstance(inner, dict) else None
        match = _DATA_URL.fullmatch(url) if isinstance(url, str) else None
        if match is None:
            continue
        try:
            data = base64.b64decode(match.group(2), validate=False)
        except ValueError:
            raise malformed("an output image's data is not base64") from None
        out.append(ImageProduced(match.group(1), data))
    return out


class ChatDecoder:
    """One streamed chat completion: records in, events out, the finish checked at the end.

    Streamed `tool_calls` are gathered by `index` (id and name in a call's first piece, the
    arguments in pieces after it) and given as one `ToolCallsRequested` at the end, whatever the
    finish reason says: Ollama sends every call whole at index 0 (a new id at a used index is a
    new call), some proxies then say `stop`, and a `tool_calls` finish with no call is just a finish.
    """

    def __init__(self) -> None:
        self.finished = False
        # The response's id, OpenRouter's generation id (`gen-...`): its bill can be looked up by it.
        self.generation_id: str | None = None
        self._finish: str | None = None
        self._refusal = ""
        # {"id", "name", "arguments": [pieces]} in arrival order; joined once at the end, since
        # adding each piece to a string would copy all of it again for every piece.
        self._calls: list[dict] = []
        self._at_index: dict[int, dict] = {}   # the call a piece at this index continues

    def feed(self, record: SSERecord) -> list[Event]:
        if record.data == "[DONE]":
            self.finished = True
            return []
        chunk = parse_object(record.data)
        if self.generation_id is None and isinstance(chunk.get("id"), str):
            self.generation_id = chunk["id"][:200]
        if chunk.get("error"):
            raise classify_stream_error(chunk)
        events: list[Event] = []
        choices = chunk.get("choices")
        if choices is None:
            choices = []
        if not isinstance(choices, list):
            raise malformed(f"choices is {type(choices).__name__}, not a list")
        for choice in choices:
            if not isinstance(choice, dict):
                raise malformed("a choice is not an object")
            delta = choice.get("delta")
            if delta is None:
                delta = {}
            if not isinstance(delta, dict):
                raise malformed(f"delta is {type(delta).__name__}, not an object")
            # vLLM and Ollama say `reasoning`; DeepSeek and GLM `reasoning_content`.
            reasoning = _optional_text(delta, "reasoning", "delta") or _optional_text(delta, "reasoning_content", "delta")
            if reasoning:
                events.append(ReasoningDelta(reasoning))
            if content := _optional_text(delta, "content", "delta"):
                events.append(TextDelta(content))
            events += _images(delta.get("images"))
            self._refusal += _optional_text(delta, "refusal", "delta")
            calls = delta.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise malformed(f"delta.tool_calls is {type(calls).__name__}, not a list")
                for piece in calls:
                    self._tool_piece(piece)
            if finish := _optional_text(choice, "finish_reason", "choice"):
                self._finish = finish
        usage = chunk.get("usage")
        if usage is not None:
            if not isinstance(usage, dict):
                raise malformed(f"usage is {type(usage).__name__}, not an object")
            events.append(UsageReport(usage))
        return events

    def _tool_piece(self, piece: object) -> None:
        if not isinstance(piece, dict):
            raise malformed("a tool_calls entry is not an object")
        index = piece.get("index", 0)
        if not isinstance(index, int) or isinstance(index, bool):
            raise malformed(f"tool_calls.index is {type(index).__name__}, not int")
        function = piece.get("function")
        if function is None:
            function = {}
        if not isinstance(function, dict):
            raise malformed("tool_calls.function is not an object")
        call_id = _optional_text(piece, "id", "tool_calls")
        name = _optional_text(function, "name", "tool_calls.function")
        arguments = function.get("arguments")
        if isinstance(arguments, dict):  # some servers send the arguments already parsed
            arguments = json.dumps(arguments)
        elif arguments is not None and not isinstance(arguments, str):
            raise malformed("tool_calls.function.arguments is not a string")
        call = self._at_index.get(index)
        # A name comes only in a call's first piece, so a second name (or another id) at a used
        # index starts a new call: Ollama's whole calls, all at index 0, some without ids.
        if call is None or (call_id and call["id"] and call_id != call["id"]) or (name and call["name"]):
            call = {"id": call_id, "name": "", "arguments": []}
            self._calls.append(call)
            self._at_index[index] = call
        elif call_id:
            call["id"] = call_id
        if name and not call["name"]:
            call["name"] = name
        if arguments:
            call["arguments"].append(arguments)

    @property
    def calls(self) -> list[dict]:
        return self._calls

    def end(self) -> list[Event]:
        if self._refusal:
            raise UpstreamError("refused", self._refusal)
        if self._finish is None:
            raise UpstreamError("upstream", "The gateway's stream ended before the reply was finished.")
        if (failure := classify_finish(self._finish)) is not None:
            raise failure
        events: list[Event] = []
        if self._calls:
            events.append(ToolCallsRequested(tuple(
                Call(c["id"] or f"call_{n}", c["name"], "".join(c["arguments"])) for n, c in enumerate(self._calls))))
        return events + [Finished(self._finish)]


def read_completion(data: dict) -> tuple[str, str, dict | None]:
    """A non-streamed completion's (text, finish_reason, raw usage)."""
    if data.get("error"):
        raise classify_stream_error(data)
    choices = data.get("choices") or [{}]
    choice = choices[0] if isinstance(choices, list) and isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    return text, str(choice.get("finish_reason") or ""), usage
