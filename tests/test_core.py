"""The core turn: streaming, usage, Regenerate, Rewind, model switch, failures, ids and bodies."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from chatserver.turns import context, pipeline
from gateway_sim.simulator import Script, Usage, errors, steps
from support import names, parse_sse


def chat_requests(sim):
    return [r for r in sim.requests if r.path == "/v1/chat/completions"]


@pytest.fixture
async def conv(api):
    # Chat-completions turns: the web tools would route to /v1/messages.
    created = await api.new()
    await api.patch(created["id"], settings={"web_search": False, "web_fetch": False})
    return created


async def test_reply_streams_reasoning_then_text_and_is_saved(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Reasoning("Think about greetings."), steps.Text("Hello there, friend.")]))

    events = await api.send(conv["id"], "Say hello")

    kinds = names(events)
    assert kinds[0] == "start" and kinds[-1] == "done"
    assert kinds.index("reasoning") < kinds.index("delta")
    assert "".join(d["text"] for n, d in events if n == "delta") == "Hello there, friend."
    assert "".join(d["text"] for n, d in events if n == "reasoning") == "Think about greetings."
    stored = await api.get(conv["id"])
    user, reply = stored["messages"]
    assert (user["role"], user["content"]) == ("user", "Say hello")
    assert reply["content"] == "Hello there, friend." and reply["status"] == "complete"
    assert reply["activity"][0]["kind"] == "thinking"
    assert stored["title"] == "Say hello"


async def test_reasoning_field_named_reasoning_is_read_too(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Reasoning("vLLM style.", field="reasoning"), steps.Text("Ok.")]))

    events = await api.send(conv["id"], "hi")

    assert [d["text"] for n, d in events if n == "reasoning"] == ["vLLM style."]


async def test_usage_is_recorded_per_message_and_in_totals(api, sim, conv):
    sim.enqueue(
        Script(steps=[steps.Text("One.")], usage=Usage(prompt=1200, completion=7, cached=1024, cost=0.0021,
                                                       dialect="openrouter")),
        Script(steps=[steps.Text("Two.")], usage=Usage(prompt=1300, completion=9, cached=1100, dialect="openai")),
    )

    first = await api.send(conv["id"], "first")
    await api.send(conv["id"], "second")

    done = dict(first)["done"]
    assert done["usage"]["input_tokens"] == 1200 and done["usage"]["cached_tokens"] == 1024
    stored = await api.get(conv["id"])
    usages = [m["usage"] for m in stored["messages"] if m["role"] == "assistant"]
    assert [u["output_tokens"] for u in usages] == [7, 9]
    assert [u["cost"] for u in usages] == [0.0021, None]
    totals = stored["totals"]
    assert (totals["input_tokens"], totals["cached_tokens"], totals["turns"]) == (2500, 2124, 2)
    assert totals["cost"] == pytest.approx(0.0021) and totals["cost_unreported"] == 1
    assert stored["last_prompt_tokens"] == 1300


async def test_regenerate_replaces_the_last_reply_with_the_current_model(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("First answer.")]), Script(steps=[steps.Text("Better answer.")]))
    await api.send(conv["id"], "Question?")
    await api.patch(conv["id"], model="anthropic/claude-sonnet-4.5")

    events = await api.regenerate(conv["id"])

    assert names(events)[0] == "start" and "user_message_id" not in events[0][1]
    assert events[0][1]["model"] == "anthropic/claude-sonnet-4.5"
    stored = await api.get(conv["id"])
    assert [(m["role"], m["content"]) for m in stored["messages"]] == [
        ("user", "Question?"), ("assistant", "Better answer.")]
    last_request = chat_requests(sim)[-1].body
    assert last_request["model"] == "anthropic/claude-sonnet-4.5"
    assert [m["role"] for m in last_request["messages"] if m["role"] != "system"] == ["user"]


async def test_regenerate_with_nothing_to_answer_is_409(api, client, conv):
    response = await client.post(f"/api/conversations/{conv['id']}/regenerate", json={})
    assert response.status_code == 409


async def test_rewind_returns_the_last_message_and_removes_it(api, client, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("A.")]), Script(steps=[steps.Text("B.")]))
    await api.send(conv["id"], "keep me")
    await api.send(conv["id"], "edit me")

    response = await client.post(f"/api/conversations/{conv['id']}/rewind", json={})

    assert response.status_code == 200 and response.json() == {"content": "edit me"}
    stored = await api.get(conv["id"])
    assert [m["content"] for m in stored["messages"]] == ["keep me", "A."]


async def test_model_switch_applies_to_the_next_turn_with_history_intact(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("from mini")]), Script(steps=[steps.Text("from sonnet")]))
    await api.send(conv["id"], "one")
    patched = await api.patch(conv["id"], model="anthropic/claude-sonnet-4.5")
    assert patched["model"] == "anthropic/claude-sonnet-4.5"

    await api.send(conv["id"], "two")

    first, second = (r.body for r in chat_requests(sim))
    assert first["model"] == "openai/gpt-5-mini" and second["model"] == "anthropic/claude-sonnet-4.5"
    history = [(m["role"], m["content"] if isinstance(m["content"], str) else m["content"][0]["text"])
               for m in second["messages"] if m["role"] != "system"]
    assert history == [("user", "one"), ("assistant", "from mini"), ("user", "two")]
    stored = await api.get(conv["id"])
    assert [m.get("model") for m in stored["messages"] if m["role"] == "assistant"] == [
        "openai/gpt-5-mini", "anthropic/claude-sonnet-4.5"]


FAILURES = [
    ("auth", errors.openai_invalid_key, False),
    ("auth", errors.openai_insufficient_quota, False),
    ("rate_limited", lambda: errors.openai_rate_limit(retry_after=7), True),
    ("context_overflow", errors.openai_context_overflow, True),
    ("refused", errors.openrouter_moderation, False),
    ("model_unavailable", lambda: errors.openai_model_not_found("openai/gpt-5-mini"), False),
    ("model_unavailable", lambda: errors.openrouter_no_endpoints("openai/gpt-5-mini"), False),
    ("upstream", errors.server_error_502, True),
]


@pytest.mark.parametrize("kind,script,retryable", FAILURES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(FAILURES)])
async def test_failure_before_first_event_rolls_back_and_returns_the_draft(api, sim, conv, kind, script, retryable):
    # Overflow self-heals once by compressing; a second overflow is what reaches the person.
    sim.enqueue(script(), script())

    events = await api.send(conv["id"], "my precious words")

    assert names(events)[0] == "start" and names(events)[-1] == "error"
    error = events[-1][1]
    assert error["kind"] == kind and error["retryable"] is retryable
    assert error["draft"] == "my precious words" and error["partial"] is False
    if kind == "rate_limited":
        assert error["retry_after"] == 7
    stored = await api.get(conv["id"])
    assert stored["messages"] == [] and stored["title"] == "New conversation"

    sim.reset()
    sim.enqueue(Script(steps=[steps.Text("Now it works.")]))
    await api.send(conv["id"], error["draft"])
    stored = await api.get(conv["id"])
    assert [m["content"] for m in stored["messages"]] == ["my precious words", "Now it works."]


@pytest.mark.parametrize("finish,kind", [("content_filter", "refused"), ("error", "upstream"), ("banana", "upstream")])
async def test_bad_finish_reason_is_a_failure_not_a_reply(api, sim, conv, finish, kind):
    sim.enqueue(Script(steps=[], finish=finish))

    events = await api.send(conv["id"], "hello")

    assert events[-1][0] == "error" and events[-1][1]["kind"] == kind


async def test_break_after_text_keeps_the_partial_reply(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("Half an ans"), steps.StreamError(
        {"error": {"message": "Provider disconnected unexpectedly", "type": "server_error"}})]))

    events = await api.send(conv["id"], "question")

    assert names(events) == ["start", "delta", "error"]
    error = events[-1][1]
    assert error["kind"] == "upstream" and error["partial"] is True and "draft" not in error
    stored = await api.get(conv["id"])
    reply = stored["messages"][-1]
    assert (reply["content"], reply["status"]) == ("Half an ans", "interrupted")
    assert reply["usage"]["estimated"] is True


async def test_stream_cut_without_finish_is_upstream_failure(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("Trunc"), steps.Close()]))

    events = await api.send(conv["id"], "question")

    assert events[-1][0] == "error" and events[-1][1]["kind"] == "upstream"
    assert (await api.get(conv["id"]))["messages"][-1]["status"] == "interrupted"


async def test_finish_without_done_marker_is_complete(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("All here.")], send_done=False))

    events = await api.send(conv["id"], "question")

    assert names(events)[-1] == "done"


async def test_no_empty_assistant_message_is_stored_or_sent(api, sim, conv):
    sim.enqueue(Script(steps=[], finish="stop"), Script(steps=[steps.Text("Real answer.")]))

    await api.send(conv["id"], "first")
    stored = await api.get(conv["id"])
    assert [m["role"] for m in stored["messages"]] == ["user"]

    await api.send(conv["id"], "second")
    sent = [m for m in chat_requests(sim)[-1].body["messages"] if m["role"] != "system"]
    assert all((m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]).strip()
               for m in sent)
    assert [m["role"] for m in sent] == ["user", "user"]


async def test_second_turn_while_streaming_is_409(api, client, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("slow "), steps.Sleep(1.0), steps.Text("reply")]))
    first = asyncio.create_task(api.send(conv["id"], "one"))
    await asyncio.to_thread(sim.wait_for_requests, 1)

    for path, body in [("messages", {"content": "two"}), ("regenerate", {}), ("rewind", {})]:
        response = await client.post(f"/api/conversations/{conv['id']}/{path}", json=body)
        assert response.status_code == 409, path

    assert names(await first)[-1] == "done"
    stored = await api.get(conv["id"])
    assert [m["content"] for m in stored["messages"]] == ["one", "slow reply"]


@pytest.mark.parametrize("conv_id", ["nonexistent-id-123", "..%2F..%2Fetc%2Fpasswd", "....", "a.json",
                                     "%2e%2e", "x" * 65, "short"])
async def test_unknown_and_path_shaped_ids_are_404_or_422(client, conv_id):
    for method, suffix, body in [("GET", "", None), ("PATCH", "", {"title": "x"}), ("DELETE", "", None),
                                 ("POST", "/messages", {"content": "hi"}), ("POST", "/rewind", {})]:
        response = await client.request(method, f"/api/conversations/{conv_id}{suffix}", json=body)
        assert response.status_code in (404, 422), (method, suffix, response.status_code)


@pytest.mark.parametrize("raw,why", [
    (b'{"content": ', "truncated JSON"),
    (b'{"content": NaN}', "NaN"),
    (b'{"content": "\\ud800"}', "lone surrogate"),
    (b'{"content": 5}', "wrong type"),
    (b'{}', "missing content"),
    (b'{"content": "   \\n "}', "whitespace only"),
    (b'{"content": "hi", "extra": 1}', "unknown field"),
    (b'', "no body"),
])
async def test_malformed_message_bodies_are_422_and_change_nothing(api, client, conv, raw, why):
    response = await client.post(f"/api/conversations/{conv['id']}/messages", content=raw,
                                 headers={"content-type": "application/json"})
    assert response.status_code == 422, why
    assert "detail" in response.json()
    assert (await api.get(conv["id"]))["messages"] == []


async def test_oversized_message_is_422(api, client, app, conv):
    limit = app.state.chat.settings.max_message_chars
    response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "x" * (limit + 1)})
    assert response.status_code == 422


@pytest.mark.parametrize("patch", [
    {"settings": {"context_budget": 0}}, {"settings": {"context_budget": "1000"}},
    {"settings": {"context_budget": 1.5}}, {"settings": {"compression_prompt": "no placeholder"}},
    {"settings": {"web_search": "yes"}}, {"model": "has space"}, {"nonsense": 1},
])
async def test_invalid_settings_are_422_with_a_message(api, client, conv, patch):
    before = await api.get(conv["id"])
    response = await client.patch(f"/api/conversations/{conv['id']}", json=patch)
    assert response.status_code == 422 and response.json()["detail"]
    after = await api.get(conv["id"])
    assert after["settings"] == before["settings"] and after["model"] == before["model"]


async def test_conversation_list_is_ordered_by_last_message_not_by_last_edit(api, client, sim):
    first = await api.new()
    second = await api.new()
    await api.patch(first["id"], title="renamed", settings={"preset": "coder"})

    listing = (await client.get("/api/conversations")).json()

    assert [c["id"] for c in listing] == [second["id"], first["id"]], "a rename must not move a conversation up"
    assert listing[1]["title"] == "renamed" and listing[1]["message_count"] == 0
    sim.enqueue(Script(steps=[steps.Text("Hi.")]))
    await api.send(first["id"], "hello")
    listing = (await client.get("/api/conversations")).json()
    assert [c["id"] for c in listing] == [first["id"], second["id"]]
    assert listing[0]["message_count"] == 2 and listing[0]["streaming"] is False


async def test_the_message_count_leaves_out_compression_notices(api, client, app, conv):
    notice = {"id": "notice-0001", "role": "notice", "content": "Folded 2 messages.", "created_at": "2026-01-01T00:00:00.000Z"}
    store = app.state.chat.store.for_owner("local")
    await store.update(conv["id"], lambda c: c["messages"].append(notice))

    (entry,) = (await client.get("/api/conversations")).json()

    assert entry["message_count"] == 0


async def test_delete_removes_the_file(api, client, app):
    conv = await api.new()
    assert (await client.delete(f"/api/conversations/{conv['id']}")).status_code == 204
    assert (await client.get(f"/api/conversations/{conv['id']}")).status_code == 404
    assert not list((app.state.chat.store.conversations_dir).glob("*.json"))


async def test_models_lineup_and_custom_models(client, app):
    lineup = (await client.get("/api/models")).json()
    assert [t["tier"] for t in lineup["tiers"]] == ["fast", "balanced", "frontier"]
    assert sum(len(t["models"]) for t in lineup["tiers"]) == 7
    assert any(m["reasoning"] for t in lineup["tiers"] for m in t["models"])

    added = await client.post("/api/models", json={"id": "qwen/qwen3-coder", "tier": "fast"})
    assert added.status_code == 201
    assert (app.state.chat.store.models_path).exists()
    fast = (await client.get("/api/models")).json()["tiers"][0]["models"]
    assert {"id": "qwen/qwen3-coder", "custom": True}.items() <= fast[-1].items()

    assert (await client.delete("/api/models/qwen/qwen3-coder")).status_code == 204
    assert (await client.delete("/api/models/openai/gpt-5")).status_code == 400


async def test_a_turn_may_use_only_a_model_of_the_lineup(api, client, sim):
    # Any id used to go upstream as is: on the person's gateway key, whatever the admin allowed.
    for body in ({"model": "vendor/not-listed"}, {"model": "gpt-4o"}):
        refused = await client.post("/api/conversations", json=body)
        assert refused.status_code == 422 and repr(body["model"]) in refused.json()["detail"]
    assert (await client.get("/api/conversations")).json() == []
    assert (await client.post("/api/models", json={"id": "vendor/for-a-while", "tier": "fast"})).status_code == 201
    conv = await api.new(model="vendor/for-a-while")
    await api.patch(conv["id"], settings={"web_search": False, "web_fetch": False})
    sim.enqueue(Script(steps=[steps.Text("Fine.")]))
    await api.send(conv["id"], "hello")
    patched = await client.patch(f"/api/conversations/{conv['id']}", json={"model": "vendor/not-listed"})
    assert patched.status_code == 422 and "'vendor/not-listed' is not in the model lineup" in patched.json()["detail"]
    before = await api.get(conv["id"])
    assert before["model"] == "vendor/for-a-while"

    assert (await client.delete("/api/models/vendor/for-a-while")).status_code == 204
    sent = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "again"})
    again = await client.post(f"/api/conversations/{conv['id']}/regenerate", json={})

    for response in (sent, again):
        assert response.status_code == 422 and "'vendor/for-a-while' is not in" in response.json()["detail"]
    assert len(chat_requests(sim)) == 1 and (await api.get(conv["id"]))["messages"] == before["messages"]
    await api.patch(conv["id"], model="openai/gpt-5")
    sim.enqueue(Script(steps=[steps.Text("Back.")]))
    assert names(await api.send(conv["id"], "again"))[-1] == "done"
    assert chat_requests(sim)[-1].body["model"] == "openai/gpt-5"


async def test_memory_and_presets(client, app):
    assert (await client.put("/api/memory", json={"text": "- prefers Python\n"})).json() == {"text": "- prefers Python\n"}
    assert app.state.chat.store.memory_path("local").read_text() == "- prefers Python\n"
    assert (await client.get("/api/memory")).json()["text"] == "- prefers Python\n"
    presets = (await client.get("/api/presets")).json()
    assert "default" in [p["name"] for p in presets] and all(p["text"] for p in presets)


async def test_healthz_names_the_configured_gateway(client):
    health = (await client.get("/healthz")).json()
    assert {k: health[k] for k in ("ok", "gateway_configured", "gateway", "gateway_reachable")} == {
        "ok": True, "gateway_configured": True, "gateway": "configured", "gateway_reachable": True}


async def test_demo_gateway_answers_without_configuration(tmp_path):
    from chatserver.app import create_app
    from chatserver.config import Settings

    app = create_app(Settings(_env_file=None, data_dir=tmp_path / "demo"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            health = (await c.get("/healthz")).json()
            assert health["gateway_configured"] is False and health["gateway"] == "demo"
            conv = (await c.post("/api/conversations", json={})).json()
            events = parse_sse((await c.post(f"/api/conversations/{conv['id']}/messages",
                                             json={"content": "What are you?"})).text)
    text = "".join(d["text"] for n, d in events if n == "delta")
    assert names(events)[-1] == "done"
    assert "simulated" in text.lower() and "```" in text


async def test_the_request_goes_upstream_while_the_message_is_still_being_written(api, app, sim, conv, settings):
    landed = []

    def slow_opening(path, data):
        if b"written slowly" in data and not landed:
            # The write is held until the request has reached the gateway (bounded: a send that waited
            # for this write never arrives, and the write fails with TimeoutError).
            sim.wait_for_requests(1, timeout=10)
            landed.append(time.monotonic())

    app.state.chat.store.before_write = slow_opening
    sim.enqueue(Script(steps=[steps.Text("Fine.")]))

    events = await api.send(conv["id"], "written slowly")

    assert names(events)[-1] == "done"
    assert chat_requests(sim)[-1].started_at < landed[0]
    on_disk = json.loads((settings.data_dir / "conversations" / f"{conv['id']}.json").read_text())
    assert [(m["role"], m["content"]) for m in on_disk["messages"]] == [("user", "written slowly"),
                                                                       ("assistant", "Fine.")]


async def test_a_message_that_cannot_be_written_comes_back_as_a_draft_with_no_reply_shown(api, app, sim, conv):
    def disk_full(path, data):
        if b"doomed" in data:
            raise OSError(28, "No space left on device")

    app.state.chat.store.before_write = disk_full
    sim.enqueue(Script(steps=[steps.Text("Never shown.")]), Script(steps=[steps.Text("Back.")]))

    events = await api.send(conv["id"], "doomed")

    assert names(events) == ["start", "error"]
    error = events[-1][1]
    assert error["draft"] == "doomed" and error["partial"] is False and "No space left" in error["message"]
    assert error["kind"] == "storage", "a disk failure is not the gateway's"
    assert (await api.get(conv["id"]))["messages"] == []
    assert names(await api.send(conv["id"], "again"))[-1] == "done"
    assert [m["content"] for m in (await api.get(conv["id"]))["messages"]] == ["again", "Back."]


async def test_a_finished_stream_leaves_its_connection_for_the_next_turn(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("One.")]), Script(steps=[steps.Text("Two.")]))

    await api.send(conv["id"], "first")
    await api.send(conv["id"], "second")

    first, second = chat_requests(sim)
    assert first.client_port == second.client_port


async def test_a_gateway_slow_to_end_its_body_neither_holds_the_reply_nor_keeps_the_connection(api, sim, conv):
    sim.enqueue(Script(steps=[steps.Text("Lingering.")], end_delay=60), Script(steps=[steps.Text("Next.")]))

    events = await asyncio.wait_for(api.send(conv["id"], "first"), 10)

    assert names(events)[-1] == "done"
    assert sim.wait_for_disconnect(0).completed is False
    await api.send(conv["id"], "second")
    first, second = chat_requests(sim)
    assert first.client_port != second.client_port


async def test_counting_the_prompt_does_not_hold_up_other_requests(client, api, sim, conv, monkeypatch):
    started, release, counted = threading.Event(), threading.Event(), threading.Event()
    real = context.Prompt.tokens

    def slow_first_count(self):
        # The first count of a long conversation tokenizes every message: hundreds of ms.
        started.set()
        release.wait(5)
        total = real(self)
        counted.set()
        return total

    monkeypatch.setattr(context.Prompt, "tokens", slow_first_count)
    sim.enqueue(Script(steps=[steps.Text("Counted.")]))
    # Over what is counted on the loop (a few thousand characters, well under a millisecond).
    long_text = "count me " * (pipeline.INLINE_COUNT_CHARS // 9 + 1)
    turn = asyncio.create_task(api.send(conv["id"], long_text))
    await asyncio.to_thread(started.wait, 5)

    health = await client.get("/healthz")

    assert health.status_code == 200 and not counted.is_set()
    release.set()
    events = await turn
    assert names(events)[-1] == "done" and events[-1][1]["usage"]["input_tokens"] > 0


async def test_a_new_conversation_starts_with_web_tools_off_so_hello_runs_no_search(api, sim):
    conv = await api.new()
    sim.enqueue(Script(steps=[steps.Text("Hello!")]))

    await api.send(conv["id"], "hello")

    assert (conv["settings"]["web_search"], conv["settings"]["web_fetch"]) == (False, False)
    declared = [t["function"]["name"] for t in sim.requests[0].body.get("tools", [])]
    # The default preset's local tools (remember) may be offered; no web tool is.
    assert [r.path for r in sim.requests] == ["/v1/chat/completions"]
    assert not {"web_search", "web_fetch"} & set(declared)


def test_the_example_settings_file_loads_as_it_is():
    """A person copies .env.example to .env: every line in it must be a setting the server accepts."""
    from chatserver.config import ROOT, Settings

    settings = Settings(_env_file=ROOT / ".env.example")

    assert settings.store == "files" and settings.auth == "none" and settings.conversation_ttl_days is None
    names = {line.split("=", 1)[0].lstrip("# ").strip() for line in (ROOT / ".env.example").read_text().splitlines()
             if "=" in line and line.split("=", 1)[0].lstrip("# ").strip().isupper()}
    assert {n.lower() for n in names} <= set(Settings.model_fields), "a line names no setting"
