"""The gateway simulator speaks both wire formats over real loopback HTTP, as docs/PROTOCOLS.md shows them."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from gateway_sim.simulator import (
    CHAT_PATH,
    MESSAGES_PATH,
    CacheAccount,
    Cite,
    Close,
    Fetch,
    GatewaySimulator,
    Raw,
    Reasoning,
    Script,
    Search,
    Sleep,
    StreamError,
    Text,
    ToolCall,
    Usage,
    cache_account,
    errors,
    steps,
)

ROOT = Path(__file__).resolve().parent.parent
REASONER = "sim/reasoner"


@pytest.fixture(scope="module")
def running():
    with GatewaySimulator(reasoning_models={REASONER}, keep_requests=1000) as sim:
        yield sim


@pytest.fixture
def sim(running):
    running.reset()
    yield running
    running.reset()


def chat_body(content="hi", *, stream=True, include_usage=True, system=None, model="sim/model"):
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": content}]}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if system is not None:
        body["messages"].insert(0, {"role": "system", "content": system})
    return body


def messages_body(content="hi", *, tools=False, system=None, model="sim/model"):
    body = {"model": model, "max_tokens": 1024, "stream": True, "messages": [{"role": "user", "content": content}]}
    if system is not None:
        body["system"] = system
    if tools:
        body["tools"] = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                         {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 2}]
    return body


def sse_records(text: str) -> list[tuple[str | None, str | None, list[str]]]:
    """(event, data, comment lines) per SSE record."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event, data, comments = None, [], []
        for line in block.split("\n"):
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        out.append((event, "\n".join(data) if data else None, comments))
    return out


def chat_chunks(text: str) -> list[dict | str]:
    """Each data payload of a chat stream: parsed JSON, or the literal "[DONE]"."""
    return [d if d == "[DONE]" else json.loads(d) for _, d, _ in sse_records(text) if d is not None]


def message_events(text: str) -> list[dict]:
    events = []
    for event, data, _ in sse_records(text):
        obj = json.loads(data)
        assert obj.get("type") == event, "event line and data type disagree"
        events.append(obj)
    return events


def post(sim, path, body, **kw) -> httpx.Response:
    return httpx.post(sim.base_url + path, json=body, timeout=10, **kw)


def big_persona(words: int = 1500) -> str:
    return "You are a meticulous assistant. " * (words // 5)


def layered_system(persona: str, ttl: str | None = None) -> list[dict]:
    marker = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": persona},
            {"type": "text", "text": "Memory: prefers Python.", "cache_control": marker},
            {"type": "text", "text": "Today is 2026-11-29."}]


# --- Chat completions -------------------------------------------------------------------------

def test_chat_stream_frames_text_then_finish_usage_and_done(sim):
    text = "Hello there, this reply arrives in several small chunks."
    sim.enqueue(Script([Text(text)]))
    r = post(sim, "/v1/chat/completions", chat_body())
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    records = sse_records(r.text)
    assert records[0][2] == [": OPENROUTER PROCESSING"]
    chunks = chat_chunks(r.text)
    assert chunks[-1] == "[DONE]"
    body = [c for c in chunks[:-1] if c["choices"]]
    assert all(c["object"] == "chat.completion.chunk" for c in body)
    assert body[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"]["content"] for c in body[1:-1]]
    assert len(contents) > 2 and "".join(contents) == text
    assert body[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    usage_chunk = chunks[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in body), "earlier chunks carry usage: null"


@pytest.mark.parametrize(("dialect", "expected"), [
    ("openai", {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
                "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 120}}),
    ("openrouter", {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
                    "prompt_tokens_details": {"cached_tokens": 1920, "cache_write_tokens": 50},
                    "completion_tokens_details": {"reasoning_tokens": 120},
                    "cost": 0.0042, "cost_details": {"upstream_inference_cost": None}}),
    ("litellm", {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
                 "prompt_tokens_details": {"cached_tokens": 1920, "cache_write_tokens": 50},
                 "cache_creation_input_tokens": 50, "cache_read_input_tokens": 1920,
                 "completion_tokens_details": {"reasoning_tokens": 120}, "cost": 0.0042}),
    ("deepseek", {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
                  "prompt_cache_hit_tokens": 1920, "prompt_cache_miss_tokens": 86,
                  "completion_tokens_details": {"reasoning_tokens": 120}}),
    ("vllm", {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
              "prompt_tokens_details": {"cached_tokens": 1920}}),
    ("anthropic_passthrough", {"prompt_tokens": 36, "completion_tokens": 300, "total_tokens": 336,
                               "prompt_tokens_details": {"cached_tokens": 1920, "cache_write_tokens": 50},
                               "cache_creation_input_tokens": 50, "cache_read_input_tokens": 1920,
                               "completion_tokens_details": {"reasoning_tokens": 120}}),
])
def test_usage_chunk_in_each_dialect(sim, dialect, expected):
    usage = Usage(prompt=2006, completion=300, cached=1920, cache_write=50, cost=0.0042, reasoning=120, dialect=dialect)
    sim.enqueue(Script([Text("ok")], usage=usage))
    chunks = chat_chunks(post(sim, "/v1/chat/completions", chat_body()).text)
    assert chunks[-2]["choices"] == []
    assert chunks[-2]["usage"] == expected


def test_usage_needs_include_usage_except_on_openrouter_and_omit_sends_none(sim):
    sim.enqueue(Script([Text("a")], usage=Usage(10, 1)),
                Script([Text("b")], usage=Usage(10, 1, dialect="openrouter")),
                Script([Text("c")], usage="omit"))
    plain = chat_chunks(post(sim, "/v1/chat/completions", chat_body(include_usage=False)).text)
    openrouter = chat_chunks(post(sim, "/v1/chat/completions", chat_body(include_usage=False)).text)
    omitted = chat_chunks(post(sim, "/v1/chat/completions", chat_body()).text)
    assert not any(isinstance(c, dict) and c.get("usage") for c in plain)
    assert openrouter[-2]["usage"]["prompt_tokens"] == 10
    assert not any(isinstance(c, dict) and c.get("usage") for c in omitted)
    assert omitted[-1] == "[DONE]"


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_streams_in_the_chosen_delta_field_before_content(sim, field):
    sim.enqueue(Script([Reasoning("First, consider the question.", field=field), Text("Answer.")]))
    chunks = [c for c in chat_chunks(post(sim, "/v1/chat/completions", chat_body()).text)[1:]
              if isinstance(c, dict) and c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    thought = "".join(d.get(field) or "" for d in deltas)
    assert thought == "First, consider the question."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(d.get(field) is None for d in deltas[first_content:])
    assert all(d["content"] is None for d in deltas if d.get(field))


def test_chat_hides_server_tools_and_maps_messages_stop_reasons(sim):
    sim.enqueue(Script([Search("q", [{"url": "https://a.example", "title": "A"}]), Fetch("https://a.example"),
                        Cite("https://a.example", "A"), Text("done")], finish="max_tokens"))
    chunks = chat_chunks(post(sim, "/v1/chat/completions", chat_body()).text)
    deltas = [c["choices"][0] for c in chunks if isinstance(c, dict) and c["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "done"
    assert deltas[-1]["finish_reason"] == "length"


def test_non_streaming_completion_joins_text_steps(sim):
    sim.enqueue(Script([Text("{\"summary\": "), Sleep(0.05), Text("\"s\", \"facts\": []}")],
                       usage=Usage(50, 9, dialect="openrouter")))
    started = time.monotonic()
    r = post(sim, "/v1/chat/completions", chat_body(stream=False))
    assert time.monotonic() - started >= 0.05
    obj = r.json()
    assert obj["object"] == "chat.completion"
    assert obj["choices"][0]["message"]["content"] == "{\"summary\": \"s\", \"facts\": []}"
    assert obj["choices"][0]["finish_reason"] == "stop"
    assert obj["usage"]["prompt_tokens"] == 50


# --- Messages ---------------------------------------------------------------------------------

def test_messages_event_sequence_with_thinking_search_fetch_citation_and_pause_turn(sim):
    results = [{"url": "https://news.example/a", "title": "A", "page_age": "April 30, 2025"},
               {"url": "https://docs.example/b", "title": "B"}]
    sim.enqueue(Script([Reasoning("Need a search."), Search("weather in Paris", results),
                        Fetch("https://news.example/a", "A"), Cite("https://news.example/a", "A", "It is sunny."),
                        Text("It is sunny in Paris.")],
                       finish="pause_turn", usage=Usage(prompt=3000, completion=42, cached=2000, cache_write=900)))
    events = message_events(post(sim, "/v1/messages", messages_body()).text)
    kinds = [e["type"] if e["type"] != "content_block_start" else "start:" + e["content_block"]["type"]
             for e in events]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert kinds[:3] == ["message_start", "ping", "start:thinking"]
    assert [k for k in kinds if k.startswith("start:")] == [
        "start:thinking", "start:server_tool_use", "start:web_search_tool_result",
        "start:server_tool_use", "start:web_fetch_tool_result", "start:text"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert deltas.index("signature_delta") < deltas.index("input_json_delta")
    assert kinds.count("content_block_stop") == 6

    start = events[0]["message"]["usage"]
    assert (start["input_tokens"], start["cache_read_input_tokens"], start["cache_creation_input_tokens"]) == (100, 2000, 900)
    final = events[-2]
    assert final["delta"]["stop_reason"] == "pause_turn"
    assert final["usage"]["output_tokens"] == 42
    assert final["usage"]["server_tool_use"] == {"web_search_requests": 1, "web_fetch_requests": 1}

    tool_inputs: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            tool_inputs[e["index"]] = tool_inputs.get(e["index"], "") + e["delta"]["partial_json"]
    assert [json.loads(v) for v in tool_inputs.values()] == [{"query": "weather in Paris"},
                                                            {"url": "https://news.example/a"}]
    search_result = next(e["content_block"] for e in events if e.get("content_block", {}).get("type") == "web_search_tool_result")
    assert [r["url"] for r in search_result["content"]] == ["https://news.example/a", "https://docs.example/b"]
    assert search_result["content"][0]["page_age"] == "April 30, 2025"
    fetch_result = next(e["content_block"] for e in events if e.get("content_block", {}).get("type") == "web_fetch_tool_result")
    assert fetch_result["content"]["type"] == "web_fetch_result"
    citation = next(e["delta"]["citation"] for e in events if e.get("delta", {}).get("type") == "citations_delta")
    assert citation["type"] == "web_search_result_location" and citation["url"] == "https://news.example/a"
    text = "".join(e["delta"]["text"] for e in events if e.get("delta", {}).get("type") == "text_delta")
    assert text == "It is sunny in Paris."


def test_messages_tool_failures_use_the_error_forms_and_are_not_billed(sim):
    sim.enqueue(Script([Search("q", error_code="max_uses_exceeded"),
                        Fetch("https://x.example", ok=False, error_code="url_not_accessible",
                              error_spelling="web_fetch_tool_error"),
                        Text("Sorry.")], finish="stop"))
    events = message_events(post(sim, "/v1/messages", messages_body()).text)
    results = [e["content_block"]["content"] for e in events if e["type"] == "content_block_start"
               and e["content_block"]["type"].endswith("_tool_result")]
    assert results == [{"type": "web_search_tool_result_error", "error_code": "max_uses_exceeded"},
                       {"type": "web_fetch_tool_error", "error_code": "url_not_accessible"}]
    assert events[-2]["delta"]["stop_reason"] == "end_turn", "chat's 'stop' maps to end_turn"
    assert events[-2]["usage"]["server_tool_use"] == {"web_search_requests": 0, "web_fetch_requests": 0}


def test_messages_refusal_carries_stop_details(sim):
    sim.enqueue(Script([Text("I can't help with that.")], finish="refusal"))
    final = message_events(post(sim, "/v1/messages", messages_body()).text)[-2]
    assert final["delta"]["stop_reason"] == "refusal"
    assert final["delta"]["stop_details"]["type"] == "refusal"


# --- Errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("script", "path", "status", "retry_after", "check"), [
    (errors.openai_context_overflow(), "/v1/chat/completions", 400, None,
     lambda b: b["error"]["code"] == "context_length_exceeded" and "maximum context length" in b["error"]["message"]),
    (errors.openai_rate_limit(retry_after=2), "/v1/chat/completions", 429, "2",
     lambda b: b["error"]["code"] == "rate_limit_exceeded"),
    (errors.openai_insufficient_quota(), "/v1/chat/completions", 429, None,
     lambda b: b["error"]["code"] == "insufficient_quota"),
    (errors.openai_invalid_key(), "/v1/chat/completions", 401, None,
     lambda b: b["error"]["code"] == "invalid_api_key"),
    (errors.openai_model_not_found("gpt-x"), "/v1/chat/completions", 404, None,
     lambda b: b["error"]["code"] == "model_not_found" and "`gpt-x`" in b["error"]["message"]),
    (errors.openrouter_moderation(), "/v1/chat/completions", 403, None,
     lambda b: b["error"]["code"] == 403 and b["error"]["metadata"]["reasons"] == ["harassment"]),
    (errors.openrouter_no_endpoints("x/y"), "/v1/chat/completions", 404, None,
     lambda b: b["error"] == {"code": 404, "message": "No endpoints found for x/y."}),
    (errors.openrouter_no_provider(retry_after=5), "/v1/chat/completions", 503, "5",
     lambda b: b["error"]["code"] == 503),
    (errors.litellm_context_window(), "/v1/chat/completions", 400, None,
     lambda b: b["error"]["code"] == "400" and b["error"]["message"].startswith("litellm.ContextWindowExceededError")),
    (errors.vllm_context_overflow(legacy=True), "/v1/chat/completions", 400, None,
     lambda b: b["object"] == "error" and b["code"] == 400),
    (errors.server_error_502(), "/v1/chat/completions", 502, None, lambda b: b["error"]["code"] == 502),
    (errors.anthropic_overloaded(), "/v1/messages", 529, None,
     lambda b: b["type"] == "error" and b["error"]["type"] == "overloaded_error" and b["request_id"].startswith("req_")),
    (errors.anthropic_prompt_too_long(), "/v1/messages", 400, None,
     lambda b: b["error"]["message"] == "prompt is too long: 208656 tokens > 200000 maximum"),
    (errors.anthropic_rate_limit(retry_after=3), "/v1/messages", 429, "3",
     lambda b: b["error"]["type"] == "rate_limit_error"),
    (errors.anthropic_spend_limit(), "/v1/messages", 429, None,
     lambda b: b["error"]["details"]["error_code"] == "enforced_spend_limit_reached"),
    (errors.anthropic_auth(), "/v1/messages", 401, None, lambda b: b["error"]["type"] == "authentication_error"),
    (errors.anthropic_not_found(), "/v1/messages", 404, None, lambda b: b["error"]["type"] == "not_found_error"),
])
def test_pre_stream_errors_have_vendor_status_headers_and_body(sim, script, path, status, retry_after, check):
    sim.enqueue(script)
    body = messages_body() if path == "/v1/messages" else chat_body()
    r = post(sim, path, body)
    assert r.status_code == status
    assert r.headers.get("retry-after") == retry_after
    assert check(r.json())
    assert sim.requests[-1].status == status and sim.requests[-1].completed


def test_proxy_html_502_is_sent_verbatim(sim):
    sim.enqueue(errors.proxy_502_html())
    r = post(sim, "/v1/chat/completions", chat_body())
    assert r.status_code == 502 and r.headers["content-type"] == "text/html"
    assert "<h1>502 Bad Gateway</h1>" in r.text


def test_mid_stream_errors_in_every_form_end_the_stream(sim):
    sim.enqueue(Script([Text("partial "), StreamError()]),
                Script([Text("partial "), StreamError(openrouter=True)]),
                Script([Text("partial "), StreamError({"type": "error", "error": {"type": "overloaded_error",
                                                                                  "message": "Overloaded"}})]),
                Script([Text("partial "), StreamError({"type": "overloaded_error", "message": "Overloaded"},
                                                      with_event_line=False)]))
    openai = chat_chunks(post(sim, "/v1/chat/completions", chat_body()).text)
    openrouter = chat_chunks(post(sim, "/v1/chat/completions", chat_body()).text)
    anthropic = sse_records(post(sim, "/v1/messages", messages_body()).text)
    litellm = sse_records(post(sim, "/v1/messages", messages_body()).text)

    assert openai[-1] == {"error": {"message": "The server had an error while processing your request. "
                                               "Sorry about that!", "type": "server_error"}}
    assert openrouter[-1]["error"]["code"] == "server_error"
    assert openrouter[-1]["choices"][0]["finish_reason"] == "error"
    assert anthropic[-1][0] == "error"
    assert json.loads(anthropic[-1][1]) == {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert litellm[-1][0] is None
    assert json.loads(litellm[-1][1]) == {"error": {"type": "overloaded_error", "message": "Overloaded"}}


def test_stream_error_accepts_the_bare_object_or_the_whole_payload(sim):
    inner = {"message": "Provider disconnected unexpectedly", "type": "server_error"}
    sim.enqueue(Script([StreamError(inner)]), Script([StreamError({"error": inner})]))
    bare, wrapped = (chat_chunks(post(sim, "/v1/chat/completions", chat_body()).text)[-1] for _ in range(2))
    assert bare == wrapped == {"error": inner}


def test_close_truncates_without_finish_usage_or_stop(sim):
    sim.enqueue(Script([Text("cut off mid"), Close()]), Script([Text("cut off mid"), Close()]))
    chat = chat_chunks(post(sim, "/v1/chat/completions", chat_body()).text)
    messages = message_events(post(sim, "/v1/messages", messages_body()).text)
    assert "[DONE]" not in chat
    assert all(c["choices"] and c["choices"][0]["finish_reason"] is None for c in chat)
    assert [e["type"] for e in messages][-1] == "content_block_delta"


def test_close_with_reset_drops_the_connection_mid_body_without_logging_a_crash(sim, caplog):
    sim.enqueue(Script([Text("cut off"), Close(reset=True)]))
    with pytest.raises(httpx.RemoteProtocolError):
        post(sim, "/v1/chat/completions", chat_body())
    record = sim.requests[-1]
    assert record.ended.wait(1) and record.completed and record.error is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_raw_bytes_go_out_verbatim(sim):
    sim.enqueue(Script([Raw(b"data: {not json\n\n"), Text("after")]))
    assert "data: {not json\n\n" in post(sim, "/v1/chat/completions", chat_body()).text


def test_a_broken_script_drops_the_connection_and_is_recorded(sim, caplog):
    sim.enqueue(Script([Text("before "), StreamError({"unserialisable": object()})]))
    with pytest.raises(httpx.RemoteProtocolError):
        post(sim, "/v1/chat/completions", chat_body())
    record = sim.requests[-1]
    assert record.error and "TypeError" in record.error and not record.completed
    assert any("script" in r.getMessage() for r in caplog.records)


def test_invalid_requests_are_rejected_without_consuming_a_script(sim):
    sim.enqueue(Script([Text("valid-one")]))
    no_max_tokens = messages_body()
    del no_max_tokens["max_tokens"]
    r = post(sim, "/v1/messages", no_max_tokens)
    assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error",
                                                           "message": "max_tokens: Field required"}
    empty = messages_body("")
    assert post(sim, "/v1/messages", empty).status_code == 400
    bad_json = httpx.post(sim.base_url + "/v1/chat/completions", content=b"{nope", timeout=5)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    assert "valid-one" in post(sim, "/v1/chat/completions", chat_body()).text


# --- Queue, recording, disconnects --------------------------------------------------------------

def test_scripts_are_fifo_across_endpoints_and_requests_are_recorded(sim):
    sim.enqueue(Script([Text("first")]), Script([Text("second")]))
    a = post(sim, "/v1/messages", messages_body("q1"), headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
    b = post(sim, "/v1/chat/completions", chat_body("q2"), headers={"Authorization": "Bearer k"})
    assert "first" in a.text and "second" in b.text
    first, second = sim.wait_for_requests(2)
    assert (first.path, second.path) == ("/v1/messages", "/v1/chat/completions")
    assert first.headers["anthropic-version"] == "2023-06-01" and second.headers["authorization"] == "Bearer k"
    assert second.body["messages"][-1]["content"] == "q2"
    assert second.started_at <= second.first_byte_at <= second.finished_at
    assert second.completed and second.disconnected_at is None
    with pytest.raises(TimeoutError):
        sim.wait_for_requests(3, timeout=0.05)
    with pytest.raises(TimeoutError):
        sim.wait_for_disconnect(timeout=0.05)


def test_first_byte_delay_holds_the_headers(sim):
    sim.enqueue(Script([Text("late")], first_byte_delay=0.2))
    post(sim, "/v1/chat/completions", chat_body())
    record = sim.requests[-1]
    assert record.first_byte_at - record.started_at >= 0.2


def test_client_hangup_mid_stream_is_recorded_before_the_stream_would_end(sim):
    sim.enqueue(Script([Text("word " * 400, chunk_size=1)], chunk_delay=0.02))
    with httpx.Client(timeout=5) as client, \
            client.stream("POST", sim.base_url + "/v1/chat/completions", json=chat_body()) as r:
        for n, _ in enumerate(r.iter_raw(), 1):
            if n == 3:
                break
    record = sim.wait_for_disconnect(timeout=5)  # the script would stream for eight seconds
    assert record.disconnected_at is not None and not record.completed and record.finished_at is None


def test_client_hangup_mid_upload_is_recorded_as_a_disconnect(sim):
    with socket.create_connection(("127.0.0.1", int(sim.base_url.rsplit(":", 1)[1]))) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n{\"model\":")
        time.sleep(0.05)  # let the server start reading the body before we vanish
    record = sim.wait_for_disconnect(timeout=5)
    assert record.body == {} and not record.completed


async def test_many_concurrent_streams(sim):
    n = 400
    sim.enqueue(*[Script([Text("one two three four", chunk_size=1)], chunk_delay=0.05)] * n)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=20) as client:
        started = time.monotonic()
        replies = await asyncio.gather(*[client.post(sim.base_url + "/v1/chat/completions", json=chat_body())
                                         for _ in range(n)])
        elapsed = time.monotonic() - started
    assert all(r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") for r in replies)
    assert len(sim.requests) == n and all(rec.completed for rec in sim.requests)
    assert elapsed < 10


async def test_start_async_serves_from_the_current_loop():
    async with GatewaySimulator() as sim:
        sim.enqueue(Script([Text("in-loop")]))
        async with httpx.AsyncClient() as client:
            r = await client.post(sim.base_url + "/v1/chat/completions", json=chat_body())
    assert "in-loop" in r.text


def test_steps_namespace_and_script_validation():
    assert steps.Text is Text and steps.StreamError is StreamError
    with pytest.raises(TypeError):
        Script(["not a step"])
    with pytest.raises(ValueError):
        Usage(1, 1, dialect="bogus")
    with pytest.raises(ValueError):
        Script(usage="bogus")


# --- Prompt-cache accounting --------------------------------------------------------------------

def test_cache_account_reads_a_live_prefix_and_writes_the_rest():
    body = chat_body("hello", system=layered_system(big_persona()))
    cold = cache_account(body, now=0.0)
    assert cold.read == 0 and cold.write >= 1024 and cold.uncached > 0
    assert cold.write + cold.uncached == cold.prompt_tokens

    warm = cache_account(body, now=10.0, cache=cold.entries)
    assert (warm.read, warm.write, warm.prompt_tokens) == (cold.write, 0, cold.prompt_tokens)

    expired = cache_account(body, now=301.0, cache=cold.entries)
    assert (expired.read, expired.write) == (0, cold.write)

    refreshed = cache_account(body, now=290.0, cache=cold.entries)
    assert cache_account(body, now=500.0, cache=refreshed.entries).read == cold.write, "a read refreshes the TTL"


def test_cache_account_longest_live_prefix_wins_and_only_four_markers_count():
    persona = big_persona()
    system = [{"type": "text", "text": persona, "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": big_persona(400), "cache_control": {"type": "ephemeral"}}]
    body = chat_body("q", system=system)
    first = cache_account({**body, "messages": [{"role": "system", "content": system[:1]}, body["messages"][1]]}, 0.0)
    second = cache_account(body, 1.0, first.entries)
    assert second.read == first.write and second.write > 0
    assert second.read + second.write + second.uncached == second.prompt_tokens

    many = [{"type": "text", "text": f"part {i} " + persona, "cache_control": {"type": "ephemeral"}} for i in range(6)]
    five_on = cache_account(chat_body("q", system=many), 0.0)
    four_on = cache_account(chat_body("q", system=many[:4] + [{"type": "text", "text": p["text"]} for p in many[4:]]), 0.0)
    assert five_on.write == four_on.write and len(five_on.entries) == 4


def test_cache_account_below_minimum_caches_nothing_and_persona_change_is_cold():
    small = chat_body("hi", system=layered_system("Short persona."))
    assert cache_account(small, 0.0) == CacheAccount(prompt_tokens=cache_account(small, 0.0).prompt_tokens)

    body = chat_body("hi", system=layered_system(big_persona()))
    cached = cache_account(body, 0.0).entries
    edited = chat_body("hi", system=layered_system(big_persona().replace("meticulous", "cheerful")))
    assert cache_account(edited, 1.0, cached).read == 0
    other_model = {**body, "model": "other/model"}
    assert cache_account(other_model, 1.0, cached).read == 0
    new_turn = {**body, "messages": body["messages"] + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}
    assert cache_account(new_turn, 1.0, cached).read > 0, "appending history keeps the system prefix"


def test_cache_account_one_hour_marker_outlives_the_default_ttl():
    body = messages_body(system=layered_system(big_persona(), ttl="1h"))
    cold = cache_account(body, 0.0)
    assert cold.write_1h == cold.write > 0
    assert cache_account(body, 1800.0, cold.entries).read == cold.write


def test_automatic_usage_reports_cache_reads_on_the_second_identical_request(sim):
    body = chat_body("hello", system=layered_system(big_persona()))
    usages = []
    for _ in range(2):
        sim.enqueue(Script([Text("ok")]))
        usages.append(chat_chunks(post(sim, "/v1/chat/completions", body).text)[-2]["usage"])
    first, second = (u["prompt_tokens_details"] for u in usages)
    assert first["cached_tokens"] == 0 and first["cache_write_tokens"] >= 1024
    assert second == {"cached_tokens": first["cache_write_tokens"], "cache_write_tokens": 0}
    assert usages[0]["prompt_tokens"] == usages[1]["prompt_tokens"]
    assert "cost" not in usages[1]
    stats = sim.cache_stats
    assert (stats.read, stats.write, stats.requests) == (first["cache_write_tokens"], first["cache_write_tokens"], 2)


def test_messages_usage_splits_anthropic_buckets_from_the_cache_model(sim):
    body = messages_body(system=layered_system(big_persona(), ttl="1h"))
    starts = []
    for _ in range(2):
        sim.enqueue(Script([Text("ok")]))
        starts.append(message_events(post(sim, "/v1/messages", body).text)[0]["message"]["usage"])
    cold, warm = starts
    assert cold["cache_read_input_tokens"] == 0
    assert cold["cache_creation"]["ephemeral_1h_input_tokens"] == cold["cache_creation_input_tokens"] > 0
    assert warm["cache_read_input_tokens"] == cold["cache_creation_input_tokens"]
    assert warm["input_tokens"] == cold["input_tokens"], "input_tokens excludes both cache buckets"


# --- Demo mode --------------------------------------------------------------------------------

def demo_text(sim, body) -> str:
    chunks = chat_chunks(post(sim, "/v1/chat/completions", body).text)
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if isinstance(c, dict) and c["choices"])


def test_demo_reply_describes_the_request_and_says_it_is_simulated(sim):
    text = demo_text(sim, chat_body("What is prompt caching?", system=layered_system("Be brief.")))
    assert "SIMULATED" in text and "no gateway" in text.lower()
    assert "`sim/model`" in text and "3 part(s)" in text
    assert "cache_control" in text and "date part" in text
    assert text.count("```") == 2 and "What is prompt caching?" in text


def test_demo_reasoning_model_thinks_first(sim):
    chunks = chat_chunks(post(sim, "/v1/chat/completions", chat_body(model=REASONER)).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if isinstance(c, dict) and c["choices"]]
    first = next(d for d in deltas if d.get("reasoning_content") or d.get("content"))
    assert first["reasoning_content"].startswith("Simulated reasoning")


def test_demo_messages_with_tools_searches_fetches_and_cites_made_up_pages(sim):
    events = message_events(post(sim, "/v1/messages", messages_body("latest Python release notes", tools=True)).text)
    blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    search = next(b for b in blocks if b["type"] == "web_search_tool_result")
    assert 2 <= len(search["content"]) <= 3
    assert all("example." in r["url"] and "Simulated" in r["title"] for r in search["content"])
    assert any(b["type"] == "web_fetch_tool_result" for b in blocks)
    assert any(e.get("delta", {}).get("type") == "citations_delta" for e in events)
    query = next(b for b in blocks if b["type"] == "server_tool_use")
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e.get("delta", {}).get("type") == "input_json_delta" and e["index"] == blocks.index(query))
    assert json.loads(partial) == {"query": "latest Python release notes"}


def test_demo_summary_is_valid_json_saying_it_is_simulated(sim):
    body = chat_body("Summarise:\nuser: I prefer Python\nassistant: Noted.\nuser: I live in UTC+8", stream=False)
    content = post(sim, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    summary = json.loads(content)
    assert summary["facts"] == []
    assert "SIMULATED" in summary["summary"] and "3 message(s)" in summary["summary"]
    assert "I prefer Python" in summary["summary"]


def test_standalone_entry_point_serves_and_reports_stats():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gateway_sim", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                stats = httpx.get(f"http://127.0.0.1:{port}/_simulator/stats", timeout=1).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.1)
        assert stats == {"requests": 0, "queued": 0, "cache": {"read": 0, "write": 0, "uncached": 0, "requests": 0}}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body(stream=False), timeout=5)
        assert "SIMULATED" in reply.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# --- Client tool calls ------------------------------------------------------------------------

REMEMBER_FN = {"type": "function", "function": {"name": "remember", "description": "Save a fact.",
                                                "parameters": {"type": "object", "properties": {"fact": {"type": "string"}}}}}
FETCH_FN = {"type": "function", "function": {"name": "web_fetch", "description": "Read a page.",
                                             "parameters": {"type": "object", "properties": {"url": {"type": "string"}}}}}
REMEMBER_TOOL = {"name": "remember", "description": "Save a fact.",
                 "input_schema": {"type": "object", "properties": {"fact": {"type": "string"}}}}


def tool_deltas(text: str) -> list[dict]:
    """Every `tool_calls` entry of a chat stream, in order."""
    return [call for c in chat_chunks(text) if isinstance(c, dict) and c["choices"]
            for call in c["choices"][0]["delta"].get("tool_calls") or []]


def assembled_calls(text: str) -> dict[int, dict]:
    """The calls as a client rebuilds them: by index, arguments concatenated."""
    calls: dict[int, dict] = {}
    for piece in tool_deltas(text):
        call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
        call["id"] = piece.get("id") or call["id"]
        call["name"] = (piece.get("function") or {}).get("name") or call["name"]
        call["arguments"] += (piece.get("function") or {}).get("arguments") or ""
    return calls


def chat_text(text: str) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chat_chunks(text)
                   if isinstance(c, dict) and c["choices"])


def finish_of(text: str) -> str:
    return [c for c in chat_chunks(text) if isinstance(c, dict) and c["choices"]][-1]["choices"][0]["finish_reason"]


def test_chat_parallel_calls_stream_as_indexed_deltas_with_arguments_in_pieces(sim):
    sim.enqueue(Script([Text("Let me check both."),
                        ToolCall("web_fetch", {"url": "https://example.com/a"}, id="call_a", chunk_chars=5),
                        ToolCall("remember", {"fact": "Likes tea"}, id="call_b", chunk_chars=4)]))
    r = post(sim, "/v1/chat/completions", {**chat_body(), "tools": [FETCH_FN, REMEMBER_FN]})
    deltas = tool_deltas(r.text)
    # The first piece of each call names it and carries empty arguments; later pieces carry only the index.
    assert deltas[0] == {"index": 0, "id": "call_a", "type": "function",
                         "function": {"name": "web_fetch", "arguments": ""}}
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
               for d in deltas[1:] if d["index"] == 0)
    assert sum(1 for d in deltas if d["index"] == 0) > 3  # the arguments really are split
    first_b = next(i for i, d in enumerate(deltas) if d["index"] == 1)
    assert deltas[first_b]["id"] == "call_b" and deltas[first_b]["function"] == {"name": "remember", "arguments": ""}
    calls = assembled_calls(r.text)
    assert {i: (c["id"], c["name"], json.loads(c["arguments"])) for i, c in calls.items()} == {
        0: ("call_a", "web_fetch", {"url": "https://example.com/a"}),
        1: ("call_b", "remember", {"fact": "Likes tea"})}
    assert finish_of(r.text) == "tool_calls"
    chunks = chat_chunks(r.text)
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] > 0


def test_chat_call_with_all_arguments_in_its_first_piece(sim):
    sim.enqueue(Script([ToolCall("remember", {"fact": "x"}, chunk_chars=0)]))
    deltas = tool_deltas(post(sim, "/v1/chat/completions", {**chat_body(), "tools": [REMEMBER_FN]}).text)
    assert len(deltas) == 1 and deltas[0]["function"] == {"name": "remember", "arguments": '{"fact":"x"}'}
    assert deltas[0]["id"].startswith("call_")


def test_chat_malformed_arguments_and_unknown_names_go_out_verbatim(sim):
    sim.enqueue(Script([ToolCall("no_such_tool", '{"url": "https://exa', chunk_chars=6)]))
    calls = assembled_calls(post(sim, "/v1/chat/completions", {**chat_body(), "tools": [FETCH_FN]}).text)
    assert calls[0]["name"] == "no_such_tool" and calls[0]["arguments"] == '{"url": "https://exa'


def test_chat_tool_calls_finish_can_come_without_calls(sim):
    sim.enqueue(Script([Text("Hmm.")], finish="tool_calls"))
    r = post(sim, "/v1/chat/completions", {**chat_body(), "tools": [REMEMBER_FN]})
    assert tool_deltas(r.text) == [] and finish_of(r.text) == "tool_calls"


def test_chat_non_streaming_completion_carries_tool_calls(sim):
    sim.enqueue(Script([ToolCall("remember", {"fact": "x"}, id="call_1")]))
    obj = post(sim, "/v1/chat/completions", {**chat_body(stream=False), "tools": [REMEMBER_FN]}).json()
    choice = obj["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "remember", "arguments": '{"fact":"x"}'}}]


def chat_round_two(results: list[dict]) -> dict:
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "web_fetch", "arguments": "{}"}},
        {"id": "call_b", "type": "function", "function": {"name": "remember", "arguments": "{}"}}]}
    body = chat_body("fetch and remember")
    body["messages"] += [call, *results]
    body["tools"] = [FETCH_FN, REMEMBER_FN]
    return body


def test_chat_second_round_is_recorded_with_the_call_message_and_results_in_order(sim):
    sim.enqueue(Script([Text("Both done.")]))
    results = [{"role": "tool", "tool_call_id": "call_a", "content": "page text"},
               {"role": "tool", "tool_call_id": "call_b", "content": "Saved"}]
    r = post(sim, "/v1/chat/completions", chat_round_two(results))
    assert r.status_code == 200 and finish_of(r.text) == "stop"
    sent = sim.requests[-1].body["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]
    assert [m.get("tool_call_id") for m in sent[2:]] == ["call_a", "call_b"]


def test_chat_a_call_without_its_result_or_a_stray_result_is_a_400(sim):
    missing = post(sim, "/v1/chat/completions",
                   chat_round_two([{"role": "tool", "tool_call_id": "call_a", "content": "page text"}]))
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == (
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        "'tool_call_id'. The following tool_call_ids did not have response messages: call_b")
    body = chat_body("hi")
    body["messages"].append({"role": "tool", "tool_call_id": "call_zz", "content": "orphan"})
    stray = post(sim, "/v1/chat/completions", body)
    assert stray.status_code == 400 and "must be a response to a preceeding message with 'tool_calls'" in \
        stray.json()["error"]["message"]


def test_messages_tool_use_streams_input_json_pieces_next_to_server_tools(sim):
    sim.enqueue(Script([Search("seoul weather", [{"url": "https://kma.go.kr", "title": "KMA"}]),
                        ToolCall("remember", {"fact": "Lives in Seoul"}, id="toolu_1", chunk_chars=5),
                        ToolCall("remember", '{"fact": ', id="toolu_2")]))
    body = messages_body("weather?", tools=True)
    body["tools"].append(REMEMBER_TOOL)
    events = message_events(post(sim, "/v1/messages", body).text)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["server_tool_use", "web_search_tool_result", "tool_use", "tool_use"]
    assert starts[2] == {"type": "tool_use", "id": "toolu_1", "name": "remember", "input": {}}
    pieces = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == 2]
    assert pieces[0] == {"type": "input_json_delta", "partial_json": ""} and len(pieces) > 3
    assert json.loads("".join(p["partial_json"] for p in pieces)) == {"fact": "Lives in Seoul"}
    malformed = "".join(e["delta"]["partial_json"] for e in events
                        if e["type"] == "content_block_delta" and e["index"] == 3)
    assert malformed == '{"fact": '
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["server_tool_use"] == {"web_search_requests": 1, "web_fetch_requests": 0}


def messages_round_two(result_ids: list[str]) -> dict:
    body = messages_body("remember two things")
    body["tools"] = [REMEMBER_TOOL]
    body["messages"] += [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Saving."},
            {"type": "tool_use", "id": "toolu_1", "name": "remember", "input": {"fact": "a"}},
            {"type": "tool_use", "id": "toolu_2", "name": "remember", "input": {"fact": "b"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "Saved"} for i in result_ids]}]
    return body


def test_messages_tool_results_in_the_next_request_are_recorded_in_order(sim):
    sim.enqueue(Script([Text("Saved both.")]))
    r = post(sim, "/v1/messages", messages_round_two(["toolu_1", "toolu_2"]))
    assert r.status_code == 200
    assert next(e for e in message_events(r.text) if e["type"] == "message_delta")["delta"]["stop_reason"] == "end_turn"
    sent = sim.requests[-1].body["messages"]
    assert [b["tool_use_id"] for b in sent[-1]["content"]] == ["toolu_1", "toolu_2"]


def test_messages_missing_or_stray_tool_results_are_a_400(sim):
    missing = post(sim, "/v1/messages", messages_round_two(["toolu_1"]))
    assert missing.status_code == 400
    assert missing.json()["error"] == {"type": "invalid_request_error", "message": (
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_2. "
        "Each `tool_use` block must have a corresponding `tool_result` block in the next message.")}
    stray = post(sim, "/v1/messages", messages_round_two(["toolu_1", "toolu_2", "toolu_9"]))
    assert stray.status_code == 400 and "unexpected `tool_use_id` found in `tool_result` blocks: toolu_9" in \
        stray.json()["error"]["message"]


def test_a_model_that_never_stops_calling_until_tools_are_taken_away(sim):
    sim.keep_calling(Script([ToolCall("remember", {"fact": "again"})]), answer=Script([Text("Final answer.")]))
    with_tools = {**chat_body(), "tools": [REMEMBER_FN]}
    for _ in range(3):
        r = post(sim, "/v1/chat/completions", with_tools)
        assert finish_of(r.text) == "tool_calls" and assembled_calls(r.text)[0]["name"] == "remember"
    assert len({assembled_calls(post(sim, "/v1/chat/completions", with_tools).text)[0]["id"] for _ in range(2)}) == 2
    for body in (chat_body(), {**with_tools, "tool_choice": "none"}):
        r = post(sim, "/v1/chat/completions", body)
        assert finish_of(r.text) == "stop" and tool_deltas(r.text) == []
        assert chat_text(r.text) == "Final answer."
    on_messages = {**messages_body(), "tools": [REMEMBER_TOOL]}
    events = message_events(post(sim, "/v1/messages", on_messages).text)
    assert next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"
    sim.reset()
    assert tool_deltas(post(sim, "/v1/chat/completions", with_tools).text) == []


def test_the_demo_gateway_shows_a_simulated_tool_round(sim):
    first = post(sim, "/v1/chat/completions", {**chat_body("Please remember that I take my tea without sugar."),
                                                 "tools": [REMEMBER_FN, FETCH_FN]})
    calls = assembled_calls(first.text)
    assert json.loads(calls[0]["arguments"]) == {"fact": "I take my tea without sugar."}
    assert "SIMULATED tool call" in chat_text(first.text) and finish_of(first.text) == "tool_calls"
    body = {**chat_body("Please remember that I take my tea without sugar."), "tools": [REMEMBER_FN, FETCH_FN]}
    body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function", "function": {"name": "remember", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Saved to memory: I take my tea without sugar."}]
    second = post(sim, "/v1/chat/completions", body)
    text = chat_text(second.text)
    assert tool_deltas(second.text) == [] and finish_of(second.text) == "stop"
    assert "SIMULATED reply after a tool round" in text and "`remember` returned: `Saved to memory" in text


def test_the_demo_gateway_fetches_a_url_with_a_client_tool_on_messages(sim):
    body = {**messages_body("What does https://example.org/post say?"), "tools": [
        {"name": "web_fetch", "description": "Read a page.",
         "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}}}]}
    events = message_events(post(sim, "/v1/messages", body).text)
    use = next(e["content_block"] for e in events if e["type"] == "content_block_start"
               and e["content_block"]["type"] == "tool_use")
    pieces = "".join(e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta"
                     and e["delta"]["type"] == "input_json_delta")
    assert use["name"] == "web_fetch" and json.loads(pieces) == {"url": "https://example.org/post"}
    assert not any(e["type"] == "content_block_start" and e["content_block"]["type"] == "server_tool_use"
                   for e in events)  # a client tool named web_fetch is not the gateway's server tool


def test_ollama_style_parallel_calls_share_index_0_and_come_whole(sim):
    sim.enqueue(Script([ToolCall("remember", {"fact": "a"}, id="call_1", chunk_chars=0, index=0),
                        ToolCall("remember", {"fact": "b"}, id="call_2", chunk_chars=0, index=0)], finish="stop"))
    r = post(sim, "/v1/chat/completions", {**chat_body(), "tools": [REMEMBER_FN]})
    assert [(d["index"], d["id"], d["function"]["arguments"]) for d in tool_deltas(r.text)] == [
        (0, "call_1", '{"fact":"a"}'), (0, "call_2", '{"fact":"b"}')]
    assert finish_of(r.text) == "stop"


def test_the_demo_streams_a_long_reply_slowly_when_asked_so_stop_and_reload_can_be_tried(sim):
    """Demo replies all finished in 1.4 s, too soon to try Stop, reload or switching."""
    started = time.monotonic()
    first_bytes = None
    text = ""
    with httpx.stream("POST", f"{sim.base_url}/v1/chat/completions", json=chat_body("Write a long story, please"),
                      timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and (piece := chunk["choices"][0]["delta"].get("content")):
                    first_bytes = first_bytes or time.monotonic() - started
                    text += piece
    took = time.monotonic() - started
    print(f"long demo reply: first text after {first_bytes:.2f} s, whole after {took:.1f} s, {len(text)} chars")
    assert first_bytes < 1.0 and 15 <= took <= 21
    assert "SIMULATED long reply" in text and len(text) > 2000


def test_a_repeated_demo_request_is_answered_differently_each_take(sim):
    """Every regenerated demo reply was the same, so a regenerate looked like nothing happened."""
    body = chat_body("What is prompt caching?")
    takes = [demo_text(sim, body) for _ in range(3)]
    assert len(set(takes)) == 3
    assert "(take 2)" in takes[1] and "(take 3)" in takes[2] and "(take" not in takes[0]
    assert "(take" not in demo_text(sim, chat_body("Something else")), "another request is a first take"


SEARCH_FILES_FN = {"type": "function", "function": {
    "name": "search_attachments", "description": "Search the attached files.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}


def test_the_demo_searches_attached_files_when_the_message_asks_about_them(sim):
    """The demo never called the attachment tools, so file answers could not be tried without a model."""
    asked = post(sim, "/v1/chat/completions", {**chat_body("What does the attached report say about revenue?"),
                                               "tools": [REMEMBER_FN, SEARCH_FILES_FN]})
    calls = assembled_calls(asked.text)
    assert [c["name"] for c in calls.values()] == ["search_attachments"] and finish_of(asked.text) == "tool_calls"
    assert json.loads(calls[0]["arguments"]) == {"query": "What does the attached report say about revenue?"}
    unrelated = post(sim, "/v1/chat/completions", {**chat_body("Hello there"), "tools": [SEARCH_FILES_FN]})
    assert tool_deltas(unrelated.text) == [], "a message not about the files is answered without a search"


# --- Issue 27: what Continue, parameters and Compare rely on ----------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon "}]},
     "final assistant content cannot end with trailing whitespace"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "text", "text": "Once upon\n"}]}]},
     "final assistant content cannot end with trailing whitespace"),
    ({"temperature": 1.5}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "greater than or equal to 1024"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "`max_tokens` must be greater"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 4096, "temperature": 0.5},
     "`temperature` may only be set to 1"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 4096,
      "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]}, "thinking"),
])
def test_messages_refuses_what_anthropic_refuses_in_a_prefill_or_sampling(sim, change, message):
    response = post(sim, MESSAGES_PATH, {**messages_body(), **change})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


def test_messages_takes_a_prefill_without_trailing_space_and_a_thinking_budget_under_max_tokens(sim):
    sim.enqueue(Script([Text(" upon a time.")]))
    body = {**messages_body(), "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "hi"}]}
    assert post(sim, MESSAGES_PATH, body).status_code == 200
    prefill = {**messages_body(), "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]}
    assert post(sim, MESSAGES_PATH, prefill).status_code == 200


def test_scripts_queued_for_a_model_go_to_that_models_requests_whatever_their_order(sim):
    sim.enqueue(Script([Text("anyone's")]))
    sim.enqueue_for("sim/b", Script([Text("for b")]))
    sim.enqueue_for("sim/a", Script([Text("for a")]))
    texts = {}
    for model in ("sim/a", "sim/b", "sim/c"):
        chunks = chat_chunks(post(sim, CHAT_PATH, chat_body(model=model)).text)
        texts[model] = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                               if isinstance(c, dict) and c.get("choices"))
    assert texts == {"sim/a": "for a", "sim/b": "for b", "sim/c": "anyone's"}


def test_a_held_stream_waits_for_its_release(sim):
    release = threading.Event()
    sim.enqueue(Script([Text("before "), steps.Hold(release, 10), Text("after")]))
    with httpx.stream("POST", sim.base_url + CHAT_PATH, json=chat_body(), timeout=10) as response:
        seen = ""
        for chunk in response.iter_text():
            seen += chunk
            if "before" in seen and not release.is_set():
                assert "after" not in seen
                release.set()
    assert "after" in seen
