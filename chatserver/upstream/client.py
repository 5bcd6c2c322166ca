"""The one client every upstream call goes through: send, classify, decode, drain, close.

A call is a path, a JSON body, headers and a decoder. The client owns the HTTP: a non-200
answer is read, closed and raised as a classified `UpstreamError`; a 200 stream is split into
SSE records and fed to the decoder, whose events are passed on; a finished body is read to its
end (so its connection serves the next call) and the socket is closed whatever happens, Stop
included. The decoders (`chat.ChatDecoder`, `messages.MessagesDecoder`) never see HTTP.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Protocol

import anyio
import httpx2
import orjson

from chatserver import metrics
from chatserver.turns.events import CallOpened, Event
from chatserver.upstream.body import body_pieces
from chatserver.upstream.failures import UpstreamError, classify_exception, classify_http, redact
from chatserver.upstream.sse import SSEDecoder, SSERecord

# How long the end of a finished body may take to arrive (it normally comes with the last record).
DRAIN_SECONDS = 0.1


class Decoder(Protocol):
    """SSE records of one response in, events out; raises UpstreamError on a failure."""

    @property
    def finished(self) -> bool:
        """True once the stream's own end marker arrived (nothing after it matters)."""

    def feed(self, record: SSERecord) -> list[Event]: ...

    def end(self) -> list[Event]:
        """The events the end of the body completes; raises when the stream ended unfinished."""


def parse_error_body(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        # Redacted before the cut, which could otherwise leave half a secret behind.
        return redact(raw.decode("utf-8", "replace"))[:500]


class Gateway:
    """One OpenAI-compatible gateway at `base_url`, reached through a shared httpx2 client."""

    def __init__(self, client: httpx2.AsyncClient, base_url: str, api_key: str | None) -> None:
        self.client = client
        self.base_url = base_url
        self.api_key = api_key

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    async def stream(self, path: str, body: dict, headers: dict, decoder: Decoder) -> AsyncIterator[Event]:
        """The decoded events of one streamed call; closing the iterator closes the socket (Stop)."""
        response = await self._open(path, body, headers)
        call = billing_record(response.headers)
        try:
            yield CallOpened(call)
            records = self._records(response)
            async for record in records:
                for event in decoder.feed(record):
                    yield event
                if call["generation"] is None:
                    call["generation"] = getattr(decoder, "generation_id", None)
                if decoder.finished:
                    await _drain(records)
                    break
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()
        for event in decoder.end():
            yield event

    async def complete(self, path: str, body: dict, headers: dict, call: dict | None = None) -> dict:
        """One non-streamed call's JSON object; `call`, when given, receives its billing record."""
        try:
            response = await self.client.post(self.url(path), content=orjson.dumps(body),
                                              headers={"content-type": "application/json", **headers})
        except httpx2.HTTPError as exc:
            raise classify_exception(exc) from exc
        if response.status_code != 200:
            raise classify_http(response.status_code, response.headers, parse_error_body(response.content))
        try:
            data = json.loads(response.content)
        except ValueError:
            raise UpstreamError("upstream", "The gateway answered with something that is not JSON.") from None
        if not isinstance(data, dict):
            raise UpstreamError("upstream", "The gateway answered with JSON that is not an object.")
        if call is not None:
            call.update(billing_record(response.headers), generation=data["id"] if isinstance(data.get("id"), str) else None)
        return data

    async def _open(self, path: str, body: dict, headers: dict) -> httpx2.Response:
        try:
            # A long history makes a body of megabytes: its walked runs are sent from where they are.
            pieces = body_pieces(body)
            request = self.client.build_request(
                "POST", self.url(path), content=pieces[0] if len(pieces) == 1 else _sent(pieces),
                headers={"content-type": "application/json", "content-length": str(sum(map(len, pieces))), **headers})
            began = time.monotonic()
            response = await self.client.send(request, stream=True)
            metrics.active.gateway_seconds.observe(time.monotonic() - began)
        except httpx2.HTTPError as exc:
            raise classify_exception(exc) from exc
        if response.status_code != 200:
            try:
                raw = await response.aread()
            except httpx2.HTTPError:
                raw = b""
            finally:
                await response.aclose()
            raise classify_http(response.status_code, response.headers, parse_error_body(raw))
        return response

    @staticmethod
    async def _records(response: httpx2.Response) -> AsyncIterator[SSERecord]:
        decoder = SSEDecoder()
        try:
            async for chunk in response.aiter_raw():
                for record in decoder.feed(chunk):
                    yield record
        except httpx2.HTTPError as exc:
            raise classify_exception(exc) from exc


def billing_record(headers: httpx2.Headers) -> dict:
    """A request's ids as the gateway gave them in its answer's head: LiteLLM's call id and, on a
    whole (non-streamed) answer, its cost; the generation id comes from the body."""
    try:
        header_cost: float | None = float(headers["x-litellm-response-cost"])
    except (KeyError, ValueError):
        header_cost = None
    if header_cost is not None and not (0 <= header_cost < 1e6):
        header_cost = None
    request = headers.get("x-litellm-call-id")
    return {"generation": None, "request": request[:200] if request else None, "header_cost": header_cost}


async def _sent(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def _drain(rest: AsyncIterator) -> None:
    """Read a finished stream to the end of its body, so its connection can serve the next call.

    A gateway that keeps the body open past its last record is not waited for: the connection
    is then closed instead of reused.
    """
    with anyio.move_on_after(DRAIN_SECONDS):
        async for _ in rest:
            pass
