"""The `/v1/chat/completions` wire format: request bodies, and streams decoded into events.

Owns everything about that endpoint's bytes: chunk shapes, the reasoning field's two names,
the usage chunk, finish reasons, errors as HTTP status or inside the stream. It yields
`events` values and raises `failures.UpstreamError`; it knows nothing of conversations.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import httpx
import orjson

from events import Event, Finished, ReasoningDelta, TextDelta, UsageReport
from failures import UpstreamError, classify_exception, classify_finish, classify_http, classify_stream_error, redact
from upstream.sse import SSEDecoder

# How long the end of a finished body may take to arrive (it normally comes with the last record).
DRAIN_SECONDS = 0.1


def build_body(model: str, system_parts: list[dict], messages: list[dict], *,
               max_tokens: int, params: dict, stream: bool = True) -> dict:
    body: dict = {
        "model": model,
        "messages": ([{"role": "system", "content": system_parts}] if system_parts else []) + messages,
        "max_tokens": max_tokens,
        **params,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def open_stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> httpx.Response:
    """Send the request; a non-200 answer is read, closed and raised as a classified error."""
    try:
        # orjson: a long history makes a body of megabytes, which the stdlib encoder takes ~10x longer on.
        request = client.build_request("POST", url, content=orjson.dumps(body),
                                       headers={"content-type": "application/json", **headers})
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise classify_exception(exc) from exc
    if response.status_code != 200:
        try:
            raw = await response.aread()
        except httpx.HTTPError:
            raw = b""
        finally:
            await response.aclose()
        raise classify_http(response.status_code, response.headers, parse_error_body(raw))
    return response


def parse_error_body(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        # Redacted before the cut, which could otherwise leave half a secret behind.
        return redact(raw.decode("utf-8", "replace"))[:500]


async def close_quietly(response: httpx.Response) -> None:
    """Close the upstream socket even while our task is being cancelled (that is Stop)."""
    with anyio.CancelScope(shield=True):
        await response.aclose()


async def records(response: httpx.Response) -> AsyncIterator:
    """SSE records of a response body; transport faults become classified errors."""
    decoder = SSEDecoder()
    try:
        async for chunk in response.aiter_raw():
            for record in decoder.feed(chunk):
                yield record
    except httpx.HTTPError as exc:
        raise classify_exception(exc) from exc
    for record in decoder.close():
        yield record


async def drain(rest: AsyncIterator) -> None:
    """Read a finished stream to the end of its body, so its connection can serve the next turn.

    A gateway that keeps the body open past its last record is not waited for: the connection
    is then closed instead of reused.
    """
    with anyio.move_on_after(DRAIN_SECONDS):
        async for _ in rest:
            pass


def _json(data: str) -> dict:
    try:
        obj = json.loads(data)
    except ValueError:
        raise UpstreamError("upstream", "The gateway sent a malformed stream chunk.") from None
    if not isinstance(obj, dict):
        raise UpstreamError("upstream", "The gateway sent a malformed stream chunk.")
    return obj


async def stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> AsyncIterator[Event]:
    """Events of one streamed chat completion, ending with `Finished`, or an UpstreamError."""
    response = await open_stream(client, url, body, headers)
    finish: str | None = None
    refusal = ""
    try:
        stream_records = records(response)
        async for record in stream_records:
            if record.data == "[DONE]":
                await drain(stream_records)
                break
            chunk = _json(record.data)
            if chunk.get("error"):
                raise classify_stream_error(chunk)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                reasoning = delta.get("reasoning") or delta.get("reasoning_content")
                if reasoning:
                    yield ReasoningDelta(reasoning)
                if delta.get("content"):
                    yield TextDelta(delta["content"])
                if delta.get("refusal"):
                    refusal += delta["refusal"]
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
            if chunk.get("usage"):
                yield UsageReport(chunk["usage"])
    finally:
        await close_quietly(response)
    if refusal:
        raise UpstreamError("refused", refusal)
    if finish is None:
        raise UpstreamError("upstream", "The gateway's stream ended before the reply was finished.")
    yield Finished(finish)
    if (failure := classify_finish(finish)) is not None:
        raise failure


async def complete(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> tuple[str, str, dict | None]:
    """One non-streamed completion: (text, finish_reason, raw usage)."""
    try:
        response = await client.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise classify_exception(exc) from exc
    if response.status_code != 200:
        raise classify_http(response.status_code, response.headers, parse_error_body(response.content))
    data = _json(response.text)
    if data.get("error"):
        raise classify_stream_error(data)
    choice = (data.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    return text, choice.get("finish_reason") or "", data.get("usage")
