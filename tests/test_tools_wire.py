"""The /v1/messages decoder on hand-written Anthropic streams: bytes split anywhere, every block kind,
usage, stop reasons, both error forms, and the socket closed when the consumer stops."""

from __future__ import annotations

import contextlib
import json

import anyio
import httpx2
import pytest

from chatserver.config import Settings
from chatserver.turns import context
from chatserver.turns.events import (
    CallOpened,
    CitationFound,
    FetchDone,
    Finished,
    ReasoningDelta,
    SearchResults,
    SearchStarted,
    TextDelta,
    UsageReport,
)
from chatserver.upstream import messages as tools
from chatserver.upstream.client import Gateway as GatewayClient
from chatserver.upstream.failures import UpstreamError

BASE_URL = "http://gateway.test"
SEARCH_TOOLS = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]


def sse(event: str | None, data: dict) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def block_start(index: int, block: dict) -> bytes:
    return sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def block_delta(index: int, delta: dict) -> bytes:
    return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def block_stop(index: int) -> bytes:
    return sse("content_block_stop", {"type": "content_block_stop", "index": index})


MESSAGE_START = sse("message_start", {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
    "usage": {"input_tokens": 40, "output_tokens": 1, "cache_creation_input_tokens": 100,
              "cache_read_input_tokens": 1500, "service_tier": "standard"}}})
MESSAGE_STOP = sse("message_stop", {"type": "message_stop"})


def message_delta(stop_reason: str, details: dict | None = None, **usage) -> bytes:
    return sse("message_delta", {"type": "message_delta",
                                 "delta": {"stop_reason": stop_reason, "stop_sequence": None, "stop_details": details},
                                 "usage": usage or {"output_tokens": 7}})


# One realistic turn: thinking, a search (input in pieces), results, cited Korean text, a failed fetch.
FULL_TURN = b"".join([
    MESSAGE_START,
    b": keep-alive comment\n\n",
    sse("ping", {"type": "ping"}),
    block_start(0, {"type": "thinking", "thinking": "", "signature": ""}),
    block_delta(0, {"type": "thinking_delta", "thinking": "생각 중… "}),
    block_delta(0, {"type": "thinking_delta", "thinking": "done."}),
    block_delta(0, {"type": "signature_delta", "signature": "c2lnbmVk"}),
    block_stop(0),
    block_start(1, {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}),
    block_delta(1, {"type": "input_json_delta", "partial_json": ""}),
    block_delta(1, {"type": "input_json_delta", "partial_json": '{"query": "서울 '}),
    block_delta(1, {"type": "input_json_delta", "partial_json": 'weather"}'}),
    block_stop(1),
    block_start(2, {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
        {"type": "web_search_result", "url": "https://kma.go.kr/a", "title": "기상청", "encrypted_content": "E1",
         "page_age": "April 30, 2025"},
        {"type": "web_search_result", "url": "https://example.com/b", "title": "B", "encrypted_content": "E2"}]}),
    block_stop(2),
    block_start(3, {"type": "text", "text": ""}),
    block_delta(3, {"type": "citations_delta", "citation": {
        "type": "web_search_result_location", "url": "https://kma.go.kr/a", "title": "기상청",
        "cited_text": "맑음", "encrypted_index": "I1"}}),
    block_delta(3, {"type": "text_delta", "text": "오늘은 맑음 é"}),
    block_stop(3),
    block_start(4, {"type": "server_tool_use", "id": "srvtoolu_2", "name": "web_fetch", "input": {}}),
    block_delta(4, {"type": "input_json_delta", "partial_json": '{"url": "https://kma.go.kr/a"}'}),
    block_stop(4),
    block_start(5, {"type": "web_fetch_tool_result", "tool_use_id": "srvtoolu_2",
                    "content": {"type": "web_fetch_tool_error", "error_code": "url_not_accessible"}}),
    block_stop(5),
    message_delta("end_turn", input_tokens=40, cache_creation_input_tokens=100, cache_read_input_tokens=1500,
                  output_tokens=95, server_tool_use={"web_search_requests": 1, "web_fetch_requests": 1}),
    MESSAGE_STOP,
])

FULL_TURN_EVENTS = [
    ReasoningDelta("생각 중… "),
    ReasoningDelta("done."),
    SearchStarted("서울 weather"),
    SearchResults("서울 weather", [
        {"url": "https://kma.go.kr/a", "title": "기상청", "page_age": "April 30, 2025"},
        {"url": "https://example.com/b", "title": "B"}]),
    CitationFound("https://kma.go.kr/a", "기상청"),
    TextDelta("오늘은 맑음 é"),
    FetchDone("https://kma.go.kr/a", None, False, "url_not_accessible"),
    UsageReport({"input_tokens": 40, "output_tokens": 95, "cache_creation_input_tokens": 100,
                 "cache_read_input_tokens": 1500, "service_tier": "standard",
                 "server_tool_use": {"web_search_requests": 1, "web_fetch_requests": 1}}),
    Finished("end_turn"),
]


class Upstream(httpx2.AsyncByteStream):
    """A response body delivered in the given pieces; remembers whether it was closed."""

    def __init__(self, pieces: list[bytes], then_hang: bool = False) -> None:
        self.pieces = pieces
        self.then_hang = then_hang
        self.closed = False

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece
        if self.then_hang:
            await anyio.sleep_forever()

    async def aclose(self) -> None:
        self.closed = True


class Gateway:
    """Answers each request with the next scripted body; keeps the requests."""

    def __init__(self, *bodies: Upstream | list[bytes]) -> None:
        self.bodies = [b if isinstance(b, Upstream) else Upstream(b) for b in bodies]
        self.requests: list[httpx2.Request] = []
        self.opened: list[dict] = []  # each request's billing record (CallOpened), apart from the events

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=self.bodies.pop(0))


def stream_of(client: httpx2.AsyncClient, **overrides):
    kwargs = {"model": "m", "system": [{"type": "text", "text": "sys"}],
              "messages": [{"role": "user", "content": "hi"}], "tools": SEARCH_TOOLS,
              "max_tokens": 100, "pause_turn_max": 3, **overrides}
    return tools.stream(GatewayClient(client, BASE_URL, None), **kwargs)


async def collect(*bodies, **overrides) -> tuple[list, UpstreamError | None, Gateway]:
    gateway = Gateway(*bodies)
    events: list = []
    async with httpx2.AsyncClient(transport=httpx2.MockTransport(gateway)) as client:
        try:
            async for event in stream_of(client, **overrides):
                if isinstance(event, CallOpened):
                    gateway.opened.append(event.call)
                else:
                    events.append(event)
        except UpstreamError as failure:
            return events, failure, gateway
    return events, None, gateway


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


async def test_each_request_opens_one_billing_record_named_by_its_message_id():
    _, failure, gateway = await collect([FULL_TURN])
    assert failure is None
    assert [call["generation"] for call in gateway.opened] == ["msg_1"]


@pytest.mark.parametrize("size", [len(FULL_TURN), 1, 2, 7], ids=["whole", "1-byte", "2-byte", "7-byte"])
async def test_every_block_kind_decodes_the_same_however_the_bytes_are_split(size):
    # 1-byte pieces cut every line and every multi-byte character (Korean is 3 bytes each).
    events, failure, _ = await collect(split_every(FULL_TURN, size))

    assert failure is None
    assert events == FULL_TURN_EVENTS


async def test_split_inside_a_multibyte_character_and_mid_line():
    cut = FULL_TURN.index("맑음 é".encode()) + 1   # inside the first 3-byte character
    events, failure, _ = await collect([FULL_TURN[:cut], FULL_TURN[cut:]])

    assert failure is None
    assert events == FULL_TURN_EVENTS


async def test_usage_is_one_anthropic_report_that_normalize_usage_reads():
    events, _, _ = await collect([FULL_TURN])

    raw = next(e.raw for e in events if isinstance(e, UsageReport))
    usage = context.normalize_usage(raw, sent_floor=0)
    # Anthropic's input buckets are separate: the whole prompt is their sum.
    assert (usage["input_tokens"], usage["cached_tokens"], usage["cache_write_tokens"]) == (1640, 1500, 100)
    assert (usage["output_tokens"], usage["searches"], usage["fetches"]) == (95, 1, 1)


@pytest.mark.parametrize("spelling", ["web_fetch_tool_result_error", "web_fetch_tool_error"])
async def test_fetch_results_and_both_error_spellings(spelling):
    body = [MESSAGE_START,
            block_start(0, {"type": "server_tool_use", "id": "t1", "name": "web_fetch", "input": {}}),
            block_delta(0, {"type": "input_json_delta", "partial_json": '{"url": "https://a.org/x"}'}),
            block_stop(0),
            block_start(1, {"type": "web_fetch_tool_result", "tool_use_id": "t1", "content": {
                "type": "web_fetch_result", "url": "https://a.org/x", "retrieved_at": "2025-08-25T10:30:00Z",
                "content": {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "…"},
                            "title": "Page X"}}}),
            block_stop(1),
            block_start(2, {"type": "server_tool_use", "id": "t2", "name": "web_fetch", "input": {}}),
            block_delta(2, {"type": "input_json_delta", "partial_json": '{"url": "https://b.org/y"}'}),
            block_stop(2),
            block_start(3, {"type": "web_fetch_tool_result", "tool_use_id": "t2",
                            "content": {"type": spelling, "error_code": "url_not_allowed"}}),
            block_stop(3),
            message_delta("end_turn"), MESSAGE_STOP]

    events, failure, _ = await collect(body)

    assert failure is None
    assert [e for e in events if isinstance(e, FetchDone)] == [
        FetchDone("https://a.org/x", "Page X", True), FetchDone("https://b.org/y", None, False, "url_not_allowed")]


async def test_search_error_block_is_a_result_not_a_failure():
    body = [MESSAGE_START,
            block_start(0, {"type": "server_tool_use", "id": "t1", "name": "web_search", "input": {}}),
            block_delta(0, {"type": "input_json_delta", "partial_json": '{"query": "q"}'}),
            block_stop(0),
            block_start(1, {"type": "web_search_tool_result", "tool_use_id": "t1",
                            "content": {"type": "web_search_tool_result_error", "error_code": "max_uses_exceeded"}}),
            block_stop(1),
            message_delta("end_turn"), MESSAGE_STOP]

    events, failure, _ = await collect(body)

    assert failure is None
    assert events[:2] == [SearchStarted("q"), SearchResults("q", None, "max_uses_exceeded")]


@pytest.mark.parametrize("record,kind", [
    (sse("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}), "upstream"),
    (sse("error", {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}), "rate_limited"),
    # Older LiteLLM proxies: no `event:` line, just an error object.
    (sse(None, {"error": {"type": "overloaded_error", "message": "Overloaded"}}), "upstream"),
    (sse(None, {"error": {"type": "rate_limit_error", "message": "slow down"}}), "rate_limited"),
], ids=["event-overloaded", "event-rate-limit", "bare-overloaded", "bare-rate-limit"])
async def test_mid_stream_error_in_both_forms(record, kind):
    body = [MESSAGE_START, block_start(0, {"type": "text", "text": ""}),
            block_delta(0, {"type": "text_delta", "text": "Half"}), record]

    events, failure, _ = await collect(body)

    assert events == [TextDelta("Half")]
    assert failure is not None and failure.kind == kind


async def test_eof_before_message_stop_is_an_upstream_failure():
    body = [MESSAGE_START, block_start(0, {"type": "text", "text": ""}),
            block_delta(0, {"type": "text_delta", "text": "Half"}), block_stop(0), message_delta("end_turn")]

    events, failure, _ = await collect(body)

    assert events == [TextDelta("Half")]
    assert failure is not None and failure.kind == "upstream"


@pytest.mark.parametrize("reason,details,kind,message", [
    ("refusal", {"type": "refusal", "category": "cyber", "explanation": "Not this one."}, "refused", "Not this one."),
    ("model_context_window_exceeded", None, "context_overflow", None),
])
async def test_stop_reasons_that_are_failures(reason, details, kind, message):
    events, failure, _ = await collect([MESSAGE_START, message_delta(reason, details), MESSAGE_STOP])

    assert events[-1] == Finished(reason)
    assert failure is not None and failure.kind == kind
    if message:
        assert failure.message == message


async def test_max_tokens_is_a_normal_finish():
    events, failure, _ = await collect([MESSAGE_START, message_delta("max_tokens"), MESSAGE_STOP])

    assert failure is None and events[-1] == Finished("max_tokens")


async def test_stopping_the_consumer_closes_the_upstream_response():
    upstream = Upstream([MESSAGE_START, block_start(0, {"type": "text", "text": ""}),
                         block_delta(0, {"type": "text_delta", "text": "Once"})], then_hang=True)
    gateway = Gateway(upstream)
    async with httpx2.AsyncClient(transport=httpx2.MockTransport(gateway)) as client:
        async with contextlib.aclosing(stream_of(client)) as events:
            assert isinstance(await anext(events), CallOpened)
            assert await anext(events) == TextDelta("Once")
        assert upstream.closed


async def test_headers_carry_both_key_forms_version_and_fetch_beta_only_for_its_old_type():
    settings = Settings(_env_file=None)
    old = tools.request_headers("sk-1", tools.declarations(["web_search", "web_fetch"], settings))
    assert old["x-api-key"] == "sk-1" and old["Authorization"] == "Bearer sk-1"
    assert old["anthropic-version"] == "2023-06-01" and old["content-type"] == "application/json"
    assert old["anthropic-beta"] == "web-fetch-2025-09-10"

    newer = Settings(_env_file=None, web_fetch_tool_type="web_fetch_20260209")
    assert "anthropic-beta" not in tools.request_headers(None, tools.declarations(["web_fetch"], newer))
    assert "x-api-key" not in tools.request_headers(None, [])


async def test_input_given_whole_in_the_start_event_is_used():
    # Some gateways send the tool input complete in content_block_start and no input_json_delta.
    body = [MESSAGE_START,
            block_start(0, {"type": "server_tool_use", "id": "t1", "name": "web_search", "input": {"query": "whole"}}),
            block_stop(0), message_delta("end_turn"), MESSAGE_STOP]

    events, _, _ = await collect(body)

    assert events[0] == SearchStarted("whole")
