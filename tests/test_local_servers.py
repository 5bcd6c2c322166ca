"""A local model server that takes only plain-text content (llama-cpp-python's OpenAI-compatible
server): the first refusal of the layered system prompt is learned, the turn is sent again as
plain text, later turns go plain at once, and the usage it never sends is estimated and flagged."""

from __future__ import annotations

import pytest

from chatserver.config import Settings
from gateway_sim.simulator import GatewaySimulator, Script, errors, steps
from support import names, parse_sse, serve


@pytest.fixture
def llamacpp():
    with GatewaySimulator(string_system_only=True) as simulator:
        yield simulator


def system_contents(request) -> list:
    return [m["content"] for m in request.body["messages"] if m["role"] == "system"]


async def test_a_refused_system_layout_is_learned_and_the_turn_still_answers(tmp_path, llamacpp):
    settings = Settings(_env_file=None, gateway_base_url=llamacpp.base_url, data_dir=tmp_path / "data")
    llamacpp.enqueue(Script(steps=[steps.Text("Hello from a small model.")], usage="omit"),
                     Script(steps=[steps.Text("Again.")], usage="omit"))
    async with serve(settings) as (app, client):
        conv = (await client.post("/api/conversations", json={})).json()

        first = (await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hi"})).text
        second = (await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "and?"})).text
        stored = (await client.get(f"/api/conversations/{conv['id']}")).json()
        lineup = (await client.get("/api/models")).json()

    refused, retried, plain = llamacpp.requests
    assert isinstance(system_contents(refused)[0], list), "the first request had the layered blocks"
    assert isinstance(system_contents(retried)[0], str) and "cache_control" not in str(retried.body)
    assert isinstance(system_contents(plain)[0], str), "the next turn went plain at once"
    assert "event: done" in first and "event: done" in second and "event: error" not in first
    replies = [m for m in stored["messages"] if m["role"] == "assistant"]
    assert [r["content"] for r in replies] == ["Hello from a small model.", "Again."]
    assert all(r["usage"]["estimated"] for r in replies), "the server sent no usage: estimated, flagged"
    model = next(m for t in lineup["tiers"] for m in t["models"] if m["id"] == conv["model"])
    assert model["cache_markers"] is False


async def test_a_model_configured_as_plain_text_never_sends_layered_blocks(tmp_path, llamacpp):
    settings = Settings(_env_file=None, gateway_base_url=llamacpp.base_url, data_dir=tmp_path / "data",
                        plain_text_models="openai/gpt-5-mini")
    llamacpp.enqueue(Script(steps=[steps.Text("Fine.")], usage="omit"))
    async with serve(settings) as (app, client):
        conv = (await client.post("/api/conversations", json={})).json()
        events = (await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hi"})).text

    assert "event: done" in events
    (request,) = llamacpp.requests
    assert isinstance(system_contents(request)[0], str)


async def test_a_second_refusal_is_shown_readable_and_not_retryable(tmp_path):
    with GatewaySimulator(string_system_only=True) as llamacpp:
        settings = Settings(_env_file=None, gateway_base_url=llamacpp.base_url, data_dir=tmp_path / "data",
                            plain_text_models="openai/gpt-5-mini")
        llamacpp.enqueue(errors.llamacpp_validation_500({"messages": []}))
        async with serve(settings) as (app, client):
            conv = (await client.post("/api/conversations", json={})).json()
            events = parse_sse((await client.post(f"/api/conversations/{conv['id']}/messages",
                                                  json={"content": "hi"})).text)

    assert names(events) == ["start", "error"]
    error = events[-1][1]
    assert error["retryable"] is False and len(error["message"]) <= 300 and error["draft"] == "hi"
    assert error["message"].startswith("The gateway rejected the request as malformed (HTTP 500)")
    assert "\n" not in error["message"]
