"""Web search and fetch turns through the real app and the gateway simulator on /v1/messages:
request shape, live trail and citations, pause_turn, dropped tools, failures and Stop.

Conversations here switch our own tools off (`tools: []`), so the gateway's server tools are the
only ones; turns mixing both are in test_tool_loop.py."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from chatserver.app import create_app
from chatserver.config import Settings
from gateway_sim.simulator import Script, Usage, errors, steps
from support import Api, hang_up_after_first_delta, names

BUDGET_SENTENCE = "You can use web search up to 3 times and web fetch up to 2 times in this turn."
RESULTS = [{"url": "https://kma.go.kr/weather", "title": "KMA forecast", "page_age": "April 30, 2025"},
           {"url": "https://www.example.com/seoul", "title": "Seoul today"}]


def paths(sim) -> list[str]:
    return [r.path for r in sim.requests]


@contextlib.asynccontextmanager
async def app_with(sim, tmp_path, **overrides):
    """The real app on its own settings, for tests that need a key or other limits."""
    overrides = {"default_web_search": True, "default_web_fetch": True, **overrides}
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "own", upstream_timeout=5,
                        **overrides)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=30) as client:
            yield Api(client)


@pytest.fixture
def settings(settings):
    """This module's conversations start with both web tools on, as DEFAULT_WEB_SEARCH/FETCH can say."""
    return settings.model_copy(update={"default_web_search": True, "default_web_fetch": True})


@pytest.fixture
async def conv(api):
    created = await api.new()
    return await api.patch(created["id"], settings={"tools": []})


async def test_tool_turn_request_shape(sim, tmp_path):
    sim.enqueue(Script(steps=[steps.Text("Hi.")]))
    async with app_with(sim, tmp_path, gateway_api_key="sk-sim-key") as api:
        await api.client.put("/api/memory", json={"text": "- prefers metric units"})
        created = await api.new()   # the default model carries reasoning_effort for chat turns
        await api.patch(created["id"], settings={"tools": []})

        await api.send(created["id"], "Weather in Seoul?")

    [request] = sim.requests
    body, headers = request.body, request.headers
    assert request.path == "/v1/messages" and body["stream"] is True and body["max_tokens"] == 4096
    assert body["tools"] == [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                             {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 2}]
    # persona, memory (cache marker on the last stable layer), then date and the budget sentence.
    system = body["system"]
    assert [("cache_control" in p) for p in system] == [False, True, False, False]
    assert "prefers metric units" in system[1]["text"] and system[2]["text"].startswith("Today's date: ")
    assert system[3]["text"].startswith(BUDGET_SENTENCE)
    assert body["messages"][-1]["role"] == "user"
    assert body["messages"][-1]["content"][-1]["text"] == "Weather in Seoul?"
    # A chat-completions param would be an unknown field to a strict Messages endpoint.
    assert "reasoning_effort" not in body
    assert headers["x-api-key"] == "sk-sim-key" and headers["authorization"] == "Bearer sk-sim-key"
    assert headers["anthropic-version"] == "2023-06-01" and headers["content-type"] == "application/json"
    assert headers["anthropic-beta"] == "web-fetch-2025-09-10"


async def test_tool_types_and_limits_come_from_config(sim, tmp_path):
    sim.enqueue(Script(steps=[steps.Text("Hi.")]))
    async with app_with(sim, tmp_path, web_search_tool_type="synthorai:web_search", search_max_uses=5,
                        web_fetch_tool_type="web_fetch_20260209", fetch_max_uses=1) as api:
        created = await api.new()
        await api.patch(created["id"], settings={"tools": []})
        await api.send(created["id"], "hello")

    [request] = sim.requests
    assert request.body["tools"] == [{"type": "synthorai:web_search", "name": "web_search", "max_uses": 5},
                                     {"type": "web_fetch_20260209", "name": "web_fetch", "max_uses": 1}]
    assert "anthropic-beta" not in request.headers
    assert "up to 5 times and web fetch up to 1 times" in request.body["system"][-1]["text"]


async def test_search_and_fetch_stream_live_and_the_trail_and_citations_are_saved(api, sim, conv):
    sim.enqueue(Script(steps=[
        steps.Reasoning("Need today's forecast.", chunk_size=50),
        steps.Search("seoul weather today", results=RESULTS),
        steps.Fetch("https://kma.go.kr/weather", "KMA forecast"),
        steps.Cite("https://kma.go.kr/weather", "KMA forecast"),
        steps.Text("Sunny, 21°C.", chunk_size=50),
        steps.Cite("https://www.example.com/seoul", "Seoul today"),
        steps.Text(" Light wind.", chunk_size=50),
        steps.Cite("https://kma.go.kr/weather", "KMA forecast"),   # cited twice, one chip
        steps.Text(" Enjoy.", chunk_size=50),
    ], usage=Usage(prompt=2000, completion=80, cached=1500, dialect="openai")))

    events = await api.send(conv["id"], "Weather in Seoul?")

    assert names(events) == ["start", "reasoning", "search", "search", "fetch", "delta", "delta", "delta", "done"]
    data = [d for _, d in events]
    assert data[2] == {"query": "seoul weather today", "results": None}
    assert data[3]["results"] == [
        {"url": "https://kma.go.kr/weather", "title": "KMA forecast", "page_age": "April 30, 2025"},
        {"url": "https://www.example.com/seoul", "title": "Seoul today"}]
    assert data[4] == {"url": "https://kma.go.kr/weather", "title": "KMA forecast", "ok": True}
    done = data[-1]
    assert done["citations"] == [{"url": "https://kma.go.kr/weather", "title": "KMA forecast"},
                                 {"url": "https://www.example.com/seoul", "title": "Seoul today"}]
    assert (done["usage"]["searches"], done["usage"]["fetches"]) == (1, 1)
    assert (done["usage"]["input_tokens"], done["usage"]["cached_tokens"]) == (2000, 1500)

    stored = await api.get(conv["id"])
    reply = stored["messages"][-1]
    assert reply["content"] == "Sunny, 21°C. Light wind. Enjoy." and reply["status"] == "complete"
    assert [s["kind"] for s in reply["activity"]] == ["thinking", "search", "fetch"]
    thinking, search, fetch = reply["activity"]
    assert thinking["text"] == "Need today's forecast." and thinking["ended_at"] >= thinking["started_at"]
    assert search["query"] == "seoul weather today" and [r["url"] for r in search["results"]] == [
        "https://kma.go.kr/weather", "https://www.example.com/seoul"]
    assert "domains" not in search, "the page derives domains from the results: one source of truth"
    assert (fetch["url"], fetch["ok"]) == ("https://kma.go.kr/weather", True)
    assert reply["citations"] == done["citations"]
    assert (stored["totals"]["searches"], stored["totals"]["fetches"]) == (1, 1)


async def test_trail_is_saved_when_the_reply_has_no_text(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Reasoning("Look it up."), steps.Search("q", results=RESULTS[:1])]))

    events = await api.send(conv["id"], "find it")

    assert names(events)[-1] == "done"
    reply = (await api.get(conv["id"]))["messages"][-1]
    assert reply["content"] == "" and [s["kind"] for s in reply["activity"]] == ["thinking", "search"]


async def test_search_error_block_is_a_step_not_a_crash(api, sim, conv):
    sim.enqueue(Script(steps=[
        steps.Search("first", results=RESULTS[:1]),
        steps.Search("second", error_code="max_uses_exceeded"),
        steps.Fetch("https://kma.go.kr/weather", ok=False, error_code="url_not_accessible",
                    error_spelling="web_fetch_tool_error"),
        steps.Text("From what I found: sunny.", chunk_size=50),
    ]))

    events = await api.send(conv["id"], "weather?")

    assert names(events) == ["start", "search", "search", "search", "search", "fetch", "delta", "done"]
    assert events[4][1] == {"query": "second", "results": None, "error": "max_uses_exceeded"}
    assert events[5][1] == {"url": "https://kma.go.kr/weather", "title": None, "ok": False,
                            "error": "url_not_accessible"}
    reply = (await api.get(conv["id"]))["messages"][-1]
    assert reply["status"] == "complete"
    assert [(s["kind"], s.get("error")) for s in reply["activity"]] == [
        ("search", None), ("search", "max_uses_exceeded"), ("fetch", "url_not_accessible")]


async def test_pause_turn_resends_the_blocks_as_one_assistant_message_and_joins_the_reply(api, sim, conv):
    sim.enqueue(
        Script(steps=[steps.Reasoning("Search first."), steps.Search("q1", results=RESULTS),
                      steps.Cite(RESULTS[0]["url"], RESULTS[0]["title"]), steps.Text("Part one. ", chunk_size=50)],
               finish="pause_turn", usage=Usage(prompt=1000, completion=50, cached=800, dialect="openai")),
        Script(steps=[steps.Text("Part two.", chunk_size=50)],
               usage=Usage(prompt=1300, completion=30, cached=1000, dialect="openai")),
    )

    events = await api.send(conv["id"], "Weather?")

    assert names(events) == ["start", "reasoning", "search", "search", "delta", "delta", "done"]
    first, second = sim.requests
    assert paths(sim) == ["/v1/messages", "/v1/messages"]
    # The same request plus exactly one assistant message; no user message is added.
    assert {k: v for k, v in second.body.items() if k != "messages"} == \
        {k: v for k, v in first.body.items() if k != "messages"}
    assert second.body["messages"][:-1] == first.body["messages"]
    resent = second.body["messages"][-1]
    assert resent["role"] == "assistant"
    blocks = resent["content"]
    assert [b["type"] for b in blocks] == ["thinking", "server_tool_use", "web_search_tool_result", "text"]
    thinking, tool_use, result, text = blocks
    assert thinking["thinking"] == "Search first." and thinking["signature"]
    assert tool_use["input"] == {"query": "q1"} and result["tool_use_id"] == tool_use["id"]
    assert [r["encrypted_content"] for r in result["content"]]   # passed back unchanged
    # Trailing whitespace is stripped: Anthropic refuses a final assistant message ending in it.
    assert text["text"] == "Part one." and text["citations"][0]["url"] == RESULTS[0]["url"]
    assert text["citations"][0]["encrypted_index"]

    done = events[-1][1]
    assert (done["usage"]["input_tokens"], done["usage"]["output_tokens"]) == (2300, 80)
    assert done["usage"]["cached_tokens"] == 1800 and done["usage"]["searches"] == 1
    stored = await api.get(conv["id"])
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert stored["messages"][-1]["content"] == "Part one. Part two."
    # The bill is the sum, but the next projection starts from the last request's prompt only.
    assert stored["last_prompt_tokens"] == 1300 and stored["totals"]["input_tokens"] == 2300


async def test_pause_turn_is_continued_at_most_pause_turn_max_times(api, sim, conv):
    sim.enqueue(*[Script(steps=[steps.Text(f"Part {n}. ", chunk_size=50)], finish="pause_turn") for n in range(5)])

    events = await api.send(conv["id"], "Long research")

    # One request and PAUSE_TURN_MAX (3) continuations; the fifth script is never asked for.
    assert len(sim.requests) == 4
    assert [len(r.body["messages"]) for r in sim.requests] == [1, 2, 2, 2]
    assert names(events) == ["start", "delta", "delta", "delta", "delta", "warning", "done"]
    assert events[-2][1]["code"] == "pause_turn_limit" and "cut" in events[-2][1]["message"]
    reply = (await api.get(conv["id"]))["messages"][-1]
    assert reply["content"] == "Part 0. Part 1. Part 2. Part 3. " and reply["status"] == "complete"


def tool_rejection(message: str) -> Script:
    return Script(status=400, error_body={"type": "error", "error": {"type": "invalid_request_error",
                                                                     "message": message}})


@pytest.mark.parametrize("rejection,dropped,kept", [
    (tool_rejection("tools.1: web_fetch_20250910 is not enabled for this API key"), "web fetch", "web_search"),
    (Script(status=400, error_body={"error": {
        "message": "litellm.BadRequestError: VertexAIException - tool type web_search_20250305 is not "
                   "supported by gemini-2.5-flash-lite", "type": None, "param": None, "code": "400"}}),
     "web search", "web_fetch"),
], ids=["key-without-fetch", "model-rejects-search"])
async def test_a_rejected_tool_is_dropped_and_the_turn_retried_once(api, sim, conv, rejection, dropped, kept):
    sim.enqueue(rejection, Script(steps=[steps.Text("Answered anyway.", chunk_size=50)]))

    events = await api.send(conv["id"], "question")

    assert names(events) == ["start", "warning", "delta", "done"]
    warning = events[1][1]
    assert warning["code"] == "tool_dropped" and dropped in warning["message"]
    assert paths(sim) == ["/v1/messages", "/v1/messages"]
    assert [t["name"] for t in sim.requests[1].body["tools"]] == [kept]
    assert (await api.get(conv["id"]))["messages"][-1]["content"] == "Answered anyway."


async def test_a_tool_is_dropped_only_once_per_turn(api, sim, conv):
    sim.enqueue(tool_rejection("web_fetch is not available for this organization"),
                tool_rejection("web_search is not available for this organization"),
                Script(steps=[steps.Text("never asked")]))

    events = await api.send(conv["id"], "question")

    assert names(events) == ["start", "warning", "error"]
    assert events[-1][1]["draft"] == "question"
    assert len(sim.requests) == 2


async def test_when_every_tool_is_rejected_the_turn_falls_back_to_chat_completions(api, sim, conv):
    sim.enqueue(tool_rejection("Unknown tool types: web_search_20250305, web_fetch_20250910"),
                Script(steps=[steps.Text("Plain answer.", chunk_size=50)]))

    events = await api.send(conv["id"], "question")

    assert names(events) == ["start", "warning", "delta", "done"]
    assert "web search and web fetch" in events[1][1]["message"]
    assert paths(sim) == ["/v1/messages", "/v1/chat/completions"]
    fallback = sim.requests[1].body
    assert "tools" not in fallback
    system_text = " ".join(p["text"] for p in fallback["messages"][0]["content"])
    assert "Today's date" in system_text and BUDGET_SENTENCE not in system_text


async def test_switching_tools_off_changes_the_endpoint_and_the_declarations(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("one")]), Script(steps=[steps.Text("two")]))

    await api.patch(conv["id"], settings={"web_fetch": False})
    await api.send(conv["id"], "search only")
    await api.patch(conv["id"], settings={"web_search": False, "web_fetch": False})
    await api.send(conv["id"], "no tools")

    search_only, plain = sim.requests
    assert search_only.path == "/v1/messages"
    assert [t["name"] for t in search_only.body["tools"]] == ["web_search"]
    assert "anthropic-beta" not in search_only.headers
    assert plain.path == "/v1/chat/completions" and "tools" not in plain.body
    assert BUDGET_SENTENCE not in str(plain.body["messages"][0])


FAILURES = [
    ("auth", errors.anthropic_auth, False),
    ("auth", errors.anthropic_spend_limit, False),
    ("rate_limited", lambda: errors.anthropic_rate_limit(retry_after=7), True),
    ("rate_limited", lambda: Script(steps=[steps.StreamError(
        {"type": "rate_limit_error", "message": "Slow down"}, with_event_line=False)]), True),
    ("context_overflow", errors.anthropic_prompt_too_long, True),
    ("context_overflow", lambda: Script(steps=[], finish="model_context_window_exceeded"), True),
    ("refused", lambda: Script(steps=[], finish="refusal"), False),
    ("model_unavailable", lambda: errors.anthropic_not_found("openai/gpt-5-mini"), False),
    ("upstream", errors.anthropic_overloaded, True),
    ("upstream", lambda: Script(steps=[steps.StreamError()]), True),
    ("upstream", lambda: Script(steps=[steps.Close()]), True),
]


@pytest.mark.parametrize("kind,script,retryable", FAILURES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(FAILURES)])
async def test_failure_before_anything_arrived_returns_the_draft(api, sim, conv, kind, script, retryable):
    # Overflow self-heals once by compressing; a second overflow is what reaches the person.
    sim.enqueue(script(), script())

    events = await api.send(conv["id"], "my precious words")

    assert names(events)[0] == "start" and names(events)[-1] == "error"
    assert set(paths(sim)) == {"/v1/messages"}
    error = events[-1][1]
    assert error["kind"] == kind and error["retryable"] is retryable
    assert error["draft"] == "my precious words" and error["partial"] is False
    if kind == "rate_limited" and sim.requests[0].status == 429:
        assert error["retry_after"] == 7
    stored = await api.get(conv["id"])
    assert stored["messages"] == [] and stored["title"] == "New conversation"


PARTIAL_FAILURES = [
    ("upstream", [steps.Text("Half an ans"), steps.StreamError()], "end_turn"),
    ("rate_limited", [steps.Text("Half an ans"), steps.StreamError(
        {"type": "rate_limit_error", "message": "Slow down"}, with_event_line=False)], "end_turn"),
    ("upstream", [steps.Text("Half an ans"), steps.Close()], "end_turn"),
    ("refused", [steps.Search("q", results=RESULTS), steps.Text("Half an ans")], "refusal"),
    ("context_overflow", [steps.Text("Half an ans")], "model_context_window_exceeded"),
]


@pytest.mark.parametrize("kind,script_steps,finish", PARTIAL_FAILURES,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(PARTIAL_FAILURES)])
async def test_failure_after_output_keeps_the_partial_reply(api, sim, conv, kind, script_steps, finish):
    sim.enqueue(Script(steps=script_steps, finish=finish))

    events = await api.send(conv["id"], "question")

    error = events[-1][1]
    assert names(events)[-1] == "error" and error["kind"] == kind
    assert error["partial"] is True and "draft" not in error
    reply = (await api.get(conv["id"]))["messages"][-1]
    assert (reply["role"], reply["content"], reply["status"]) == ("assistant", "Half an ans", "interrupted")
    if any(isinstance(s, steps.Search) for s in script_steps):
        assert [s["kind"] for s in reply["activity"]] == ["search"]


def test_hang_up_stops_closes_the_upstream_socket_and_keeps_the_partial_tool_reply(hang_up_stops_server, sim):
    sim.enqueue(Script(steps=[steps.Search("long story sources", results=RESULTS),
                              steps.Text("Once upon a time ", chunk_size=4)]
                       + [steps.Text("and on and on ") if i % 2 == 0 else steps.Sleep(0.2) for i in range(60)]))
    base = hang_up_stops_server.base_url
    conv_id = httpx.post(f"{base}/api/conversations", json={}).json()["id"]
    httpx.patch(f"{base}/api/conversations/{conv_id}", json={"settings": {"web_search": True, "web_fetch": True}})

    hang_up_after_first_delta(base, conv_id)

    record = sim.wait_for_disconnect(timeout=5)
    assert record.path == "/v1/messages"
    assert not record.completed, "the provider finished the reply: the hang-up did not stop it"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        conv = httpx.get(f"{base}/api/conversations/{conv_id}").json()
        if not conv["streaming"]:
            break
        time.sleep(0.05)
    replies = [m for m in conv["messages"] if m["role"] == "assistant"]
    assert len(replies) == 1
    reply = replies[0]
    assert reply["status"] == "interrupted" and reply["content"].startswith("Once upon a time")
    assert [s["kind"] for s in reply["activity"]] == ["search"]



async def test_a_finished_tool_stream_leaves_its_connection_for_the_next_turn(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Search("weather"), steps.Text("Sunny.")]), Script(steps=[steps.Text("Again.")]))

    await api.send(conv["id"], "weather?")
    await api.send(conv["id"], "and now?")

    first, second = [r for r in sim.requests if r.path == "/v1/messages"]
    assert first.client_port == second.client_port
