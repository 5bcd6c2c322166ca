"""Issue 27, working with answers, through the real app and the gateway simulator: regenerate any
reply (with another model), continue a cut-off reply, edit a reply, per-conversation generation
parameters on both wire formats, and Compare."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from chatserver.config import Settings
from chatserver.turns.sampling import Sampling
from chatserver.turns.toolloop import CONTINUE_INSTRUCTION
from chatserver.upstream import chat
from gateway_sim.simulator import MESSAGES_PATH, Script, Usage, errors, steps
from support import parse_sse

REASONING = "anthropic/claude-sonnet-4.5"
PLAIN = "openai/gpt-5-mini"
OTHER = "openai/gpt-5"


_databases = itertools.count(1)


@pytest.fixture(params=["files", "redis"])
def settings(request, tmp_path, sim) -> Settings:
    """Every test on the file store and on Redis (a real redis-server, its hub mirroring turns)."""
    store = {}
    if request.param == "redis":
        store = {"store": "redis", "redis_url": f"{request.getfixturevalue('redis_server').url[:-2]}/"
                                                f"{next(_databases) % 16}"}
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5,
                    **store)


@pytest.fixture
async def conv(api):
    created = await api.new()
    await api.patch(created["id"], settings={"web_search": False, "web_fetch": False})
    return created


def reply(text: str, prompt: int = 1000, completion: int = 20, cost: float | None = None, **kw) -> Script:
    return Script(steps=[steps.Text(text)], usage=Usage(prompt=prompt, completion=completion, cost=cost,
                                                       dialect="openrouter"), **kw)


def turns_sent(sim) -> list:
    return [r for r in sim.requests if r.body.get("stream")]


def history_of(body: dict) -> list[str]:
    out = []
    for m in body["messages"]:
        if m["role"] == "system":
            continue
        content = m["content"]
        out.append(content if isinstance(content, str) else "".join(p.get("text", "") for p in content))
    return out


def texts(conv: dict) -> list[str]:
    return [m["content"] for m in conv["messages"] if m["role"] != "notice"]


async def talk(api, sim, conv_id: str, n: int) -> None:
    for i in range(1, n + 1):
        sim.enqueue(reply(f"answer {i}"))
        assert (await api.send(conv_id, f"question {i}"))[-1][0] == "done"


async def post(client, conv_id: str, action: str, **body):
    return await client.post(f"/api/conversations/{conv_id}/{action}", json=body)


# --- Regenerate any reply ----------------------------------------------------------------------------

async def test_regenerating_the_second_of_three_replies_keeps_the_third_on_the_old_branch(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 3)
    before = await api.get(cid)
    second = before["messages"][3]
    assert second["content"] == "answer 2"

    sim.enqueue(reply("answer 2, again"))
    response = await post(client, cid, "regenerate", message_id=second["id"], model=OTHER)

    assert response.status_code == 200 and parse_sse(response.text)[-1][0] == "done"
    sent = turns_sent(sim)[-1].body
    assert sent["model"] == OTHER
    assert history_of(sent) == ["question 1", "answer 1", "question 2"]  # nothing below the regenerated reply
    after = await api.get(cid)
    assert texts(after) == ["question 1", "answer 1", "question 2", "answer 2, again"]
    new = after["messages"][3]
    assert new["model"] == OTHER and new["parent_id"] == second["parent_id"]
    assert after["branches"][new["id"]] == [second["id"], new["id"]]
    assert after["model"] == conv["model"]  # a one-off: the conversation keeps its model

    old = (await client.post(f"/api/conversations/{cid}/branch", json={"message_id": second["id"]})).json()
    assert texts(old) == texts(before)  # the third exchange is still there, on the old branch


async def test_regenerating_a_message_that_is_no_reply_of_the_path_or_with_an_unknown_model_is_422(api, client, sim,
                                                                                                   conv):
    cid = conv["id"]
    await talk(api, sim, cid, 2)
    before = await api.get(cid)
    for body in ({"message_id": before["messages"][0]["id"]}, {"message_id": "nope"},
                 {"message_id": before["messages"][1]["id"], "model": "vendor/not-in-lineup"}):
        response = await post(client, cid, "regenerate", **body)
        assert response.status_code == 422, (body, response.text)
    assert (await api.get(cid))["messages"] == before["messages"]
    assert len(turns_sent(sim)) == 2


# --- Continue -----------------------------------------------------------------------------------------

async def test_continue_joins_two_parts_into_one_reply_with_both_usages_summed(api, client, sim, conv):
    cid = conv["id"]
    sim.enqueue(reply("Once upon a time ", prompt=1000, completion=50, cost=0.002, finish="length"))
    events = await api.send(cid, "tell me a story")
    assert ("warning", {"code": "max_tokens", "message": events[-2][1]["message"]}) in events
    cut = (await api.get(cid))["messages"][-1]
    assert cut["warnings"][0]["code"] == "max_tokens"

    sim.enqueue(reply(" there was a cat.", prompt=1060, completion=30, cost=0.001))
    response = await post(client, cid, "continue")

    assert response.status_code == 200
    events = parse_sse(response.text)
    names = [name for name, _ in events]
    assert names[0] == "start" and names[-1] == "done" and set(names[1:-1]) == {"delta"}
    assert events[0][1]["assistant_message_id"] == cut["id"]
    sent = turns_sent(sim)[-1].body
    # Chat completions has no prefill: the saved part, then the instruction to go on.
    assert history_of(sent)[-2:] == ["Once upon a time ", CONTINUE_INSTRUCTION]
    after = await api.get(cid)
    assert len(after["messages"]) == 2
    joined = after["messages"][-1]
    assert joined["id"] == cut["id"] and joined["content"] == "Once upon a time there was a cat."
    assert joined["usage"]["input_tokens"] == 2060 and joined["usage"]["output_tokens"] == 80
    assert joined["usage"]["cost"] == pytest.approx(0.003)
    assert events[-1][1]["usage"] == joined["usage"]
    assert "warnings" not in joined and joined["continued"] == 1 and joined["status"] == "complete"
    assert after["totals"]["output_tokens"] == 80 and after["totals"]["cost"] == pytest.approx(0.003)


async def test_continue_on_messages_prefills_the_saved_text(api, client, sim):
    cid = (await api.new())["id"]
    await api.patch(cid, settings={"web_search": True})  # the gateway's web search: /v1/messages
    sim.enqueue(reply("The list: one, two,", finish="max_tokens"))
    await api.send(cid, "count")
    sim.enqueue(reply(" three."))

    response = await post(client, cid, "continue")

    assert parse_sse(response.text)[-1][0] == "done"
    request = turns_sent(sim)[-1]
    assert request.path == MESSAGES_PATH
    assert history_of(request.body)[-2:] == ["count", "The list: one, two,"]  # the saved text as the prefill
    assert request.body["messages"][-1]["role"] == "assistant"
    assert (await api.get(cid))["messages"][-1]["content"] == "The list: one, two, three."


async def test_a_stopped_reply_continued_is_one_complete_reply(app, api, client, sim, conv):
    cid = conv["id"]
    release = threading.Event()
    sim.enqueue(Script(steps=[steps.Text("Half of it,"), steps.Hold(release), steps.Text(" never sent")]))
    try:
        sending = asyncio.create_task(api.send(cid, "go"))
        await asyncio.to_thread(sim.wait_for_requests, 1, 10)
        log = await _log_of(app, cid)
        async with asyncio.timeout(10):
            while b"event: delta" not in b"".join(log.frames):
                await log.wait_past(len(log.frames))
        assert (await client.post(f"/api/conversations/{cid}/stop", json={})).status_code == 204
        await sending
    finally:
        release.set()
    stopped = (await api.get(cid))["messages"][-1]
    assert (stopped["status"], stopped["content"]) == ("interrupted", "Half of it,")

    sim.enqueue(reply(" and the rest."))
    assert parse_sse((await post(client, cid, "continue", message_id=stopped["id"])).text)[-1][0] == "done"
    joined = (await api.get(cid))["messages"][-1]
    assert (joined["id"], joined["status"], joined["content"]) == (stopped["id"], "complete", "Half of it, and the rest.")


async def test_only_the_reply_that_ends_the_path_can_be_continued(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 2)
    first_reply = (await api.get(cid))["messages"][1]
    assert (await post(client, cid, "continue", message_id=first_reply["id"])).status_code == 422
    assert len(turns_sent(sim)) == 2


# --- Edit a reply -------------------------------------------------------------------------------------

async def test_an_edited_reply_is_what_the_next_request_sends(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 2)
    before = await api.get(cid)
    first = before["messages"][1]

    response = await client.post(f"/api/conversations/{cid}/messages/{first['id']}/edit",
                                 json={"content": "answer 1, as I would have put it"})

    assert response.status_code == 200
    edited = response.json()
    assert texts(edited) == ["question 1", "answer 1, as I would have put it"]
    mine = edited["messages"][-1]
    assert mine["edited"] is True and mine["edited_from"] == first["id"] and mine["id"] != first["id"]
    assert edited["branches"][mine["id"]] == [first["id"], mine["id"]]
    sim.enqueue(reply("answer 3"))
    await api.send(cid, "question 3")
    assert history_of(turns_sent(sim)[-1].body) == ["question 1", "answer 1, as I would have put it", "question 3"]
    old = (await client.post(f"/api/conversations/{cid}/branch", json={"message_id": first["id"]})).json()
    assert texts(old) == texts(before)  # the original and what followed it, kept


async def test_editing_what_is_not_a_reply_of_the_path_or_to_nothing_changes_nothing(api, client, sim, conv):
    cid = conv["id"]
    await talk(api, sim, cid, 1)
    before = await api.get(cid)
    question, answer = before["messages"]
    assert (await client.post(f"/api/conversations/{cid}/messages/{question['id']}/edit",
                              json={"content": "x"})).status_code == 404
    assert (await client.post(f"/api/conversations/{cid}/messages/{answer['id']}/edit",
                              json={"content": "   "})).status_code == 422
    assert (await api.get(cid))["messages"] == before["messages"]


# --- Parameters ---------------------------------------------------------------------------------------

async def test_parameters_appear_in_the_recorded_chat_completions_request(api, client, sim):
    conv = await api.new(model=REASONING)
    cid = conv["id"]
    await api.patch(cid, settings={"web_search": False, "web_fetch": False, "temperature": 0.3, "top_p": 0.9,
                                   "max_tokens": 500, "reasoning_effort": "high"})
    sim.enqueue(reply("ok"))
    await api.send(cid, "hi")

    body = turns_sent(sim)[-1].body
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["reasoning_effort"]) == (0.3, 0.9, 500, "high")
    stored = (await api.get(cid))["messages"][-1]
    assert stored["params"] == {"temperature": 0.3, "top_p": 0.9, "max_tokens": 500, "reasoning_effort": "high"}


async def test_parameters_appear_in_the_recorded_messages_request_in_its_own_form(api, client, sim):
    conv = await api.new(model=REASONING)
    cid = conv["id"]
    await api.patch(cid, settings={"web_search": True, "temperature": 0.3, "max_tokens": 500})  # /v1/messages
    sim.enqueue(reply("ok"))
    await api.send(cid, "hi")
    plain = turns_sent(sim)[-1]
    assert plain.path == MESSAGES_PATH
    assert (plain.body["temperature"], plain.body["max_tokens"]) == (0.3, 500) and "thinking" not in plain.body

    await api.patch(cid, settings={"reasoning_effort": "medium"})
    sim.enqueue(reply("ok again"))
    await api.send(cid, "and now think")
    thinking = turns_sent(sim)[-1].body
    # Thinking's budget counts inside max_tokens, and Anthropic refuses a changed temperature with it.
    assert thinking["thinking"] == {"type": "enabled", "budget_tokens": 8192}
    assert thinking["max_tokens"] == 8192 + 500 and "temperature" not in thinking


def test_openrouter_is_sent_its_own_reasoning_form():
    effort = Sampling(reasoning_effort="low")
    assert chat.sampling_fields(effort, openrouter=True) == {"reasoning": {"effort": "low"}}
    assert chat.sampling_fields(effort, openrouter=False) == {"reasoning_effort": "low"}
    assert Settings(_env_file=None, gateway_base_url="https://openrouter.ai/api").gateway_is_openrouter


async def test_invalid_parameters_are_a_clear_422_that_changes_nothing(api, client, sim, conv):
    cid = conv["id"]
    await api.patch(cid, settings={"temperature": 0.5})
    before = await api.get(cid)
    for settings, named in (({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"),
                            ({"max_tokens": 0}, "max_tokens"), ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                            ({"temperature": "hot"}, "temperature"),
                            ({"reasoning_effort": "low"}, "not a reasoning model")):
        response = await client.patch(f"/api/conversations/{cid}", json={"settings": settings})
        assert response.status_code == 422 and named in response.text, (settings, response.text)
    assert (await api.get(cid))["settings"] == before["settings"]

    cleared = await api.patch(cid, settings={"temperature": None})
    assert "temperature" not in cleared["settings"]
    sim.enqueue(reply("defaults"))
    await api.send(cid, "hi")
    body = turns_sent(sim)[-1].body
    assert "temperature" not in body and "params" not in (await api.get(cid))["messages"][-1]


async def test_a_preset_carries_parameters_into_its_new_conversations(api, client):
    response = await client.post("/api/presets", json={"name": "precise", "text": "Be exact.",
                                                       "params": {"temperature": 0.1, "max_tokens": 800}})
    assert response.status_code == 201 and response.json()["params"] == {"temperature": 0.1, "max_tokens": 800}
    assert (await client.post("/api/presets", json={"name": "wild", "text": "x",
                                                    "params": {"temperature": 9}})).status_code == 422
    conv = await api.new(preset="precise")
    assert (conv["settings"]["temperature"], conv["settings"]["max_tokens"]) == (0.1, 800)


# --- Compare ------------------------------------------------------------------------------------------

MODELS = [PLAIN, OTHER, "anthropic/claude-haiku-4.5"]


async def test_compare_streams_three_replies_and_stop_on_one_leaves_the_others_running(app, api, client, sim, conv):
    cid = conv["id"]
    release = threading.Event()
    for i, model in enumerate(MODELS):
        sim.enqueue_for(model, Script(steps=[steps.Text(f"reply {i} begins. "), steps.Hold(release),
                                             steps.Text(f"reply {i} ends.")],
                                      usage=Usage(prompt=1000, completion=10 * (i + 1), cost=0.001 * (i + 1),
                                                  dialect="openrouter")))
    try:
        comparing = asyncio.create_task(post(client, cid, "compare", content="which is best?", models=MODELS))
        # Every model is asked at once: all three requests are open together.
        await asyncio.to_thread(sim.wait_for_requests, 3, 10)
        assert [r["model"] for r in (await api.get(cid))["turn"]["compare"]] == MODELS
        models_of = {r.body["model"]: r for r in turns_sent(sim)}
        assert set(models_of) == set(MODELS)

        ids = await _reply_ids(api, cid)
        await _streaming(app, cid, ids)  # every reply has sent text: three streams at once
        stopped = await client.post(f"/api/conversations/{cid}/stop", json={"assistant_message_id": ids[1]})
        assert stopped.status_code == 204
        sim.wait_for_disconnect(list(sim.requests).index(models_of[MODELS[1]]), timeout=10)
        assert models_of[MODELS[0]].disconnected_at is None and models_of[MODELS[2]].disconnected_at is None
        assert not comparing.done()  # the other two are still streaming
    finally:
        release.set()
    response = await asyncio.wait_for(comparing, 30)

    events = parse_sse(response.text)
    start = events[0][1]
    assert [r["model"] for r in start["compare"]] == MODELS
    ends = {d["assistant_message_id"]: d["status"] for name, d in events[:-1] if name == "done"}
    assert ends == {ids[0]: "complete", ids[1]: "interrupted", ids[2]: "complete"}
    assert events[-1][0] == "done" and events[-1][1]["assistant_message_id"] is None
    deltas = [d["assistant_message_id"] for name, d in events if name == "delta"]
    assert set(deltas) == set(ids)
    assert [d["text"] for name, d in events if name == "delta" and d["assistant_message_id"] == ids[1]] and \
        "ends" not in "".join(d["text"] for name, d in events if name == "delta" and d["assistant_message_id"] == ids[1])
    # Each reply carries its own usage (tokens and cost).
    usages = {d["assistant_message_id"]: d["usage"] for name, d in events if name == "done" and d["usage"]}
    assert usages[ids[0]]["output_tokens"] == 10 and usages[ids[2]]["cost"] == pytest.approx(0.003)

    after = await api.get(cid)
    question, current = after["messages"]
    assert current["id"] == ids[0] and current["content"] == "reply 0 begins. reply 0 ends."
    assert set(after["branches"][current["id"]]) == set(ids)
    chosen = ids[2]
    picked = (await client.post(f"/api/conversations/{cid}/branch", json={"message_id": chosen})).json()
    assert picked["messages"][-1]["id"] == chosen and picked["messages"][-1]["parent_id"] == question["id"]
    assert set(picked["branches"][chosen]) == set(ids)  # the others kept as its siblings
    assert [m["id"] for m in picked["messages"]] == [question["id"], chosen]
    stopped_reply = (await client.post(f"/api/conversations/{cid}/branch", json={"message_id": ids[1]})).json()
    assert stopped_reply["messages"][-1]["status"] == "interrupted"
    assert stopped_reply["messages"][-1]["content"] == "reply 1 begins. "


async def _streaming(app, cid: str, ids: list[str]) -> None:
    """Wait (bounded) until the running comparison has sent a delta of each reply."""
    log = await _log_of(app, cid)
    async with asyncio.timeout(10):
        while not set(ids) <= {data["assistant_message_id"] for name, data in parse_sse(b"".join(log.frames).decode())
                               if name == "delta"}:
            await log.wait_past(len(log.frames))


async def _log_of(app, cid: str):
    """The event log of the conversation's running turn, once the request has begun it."""
    hub = app.state.chat.hub
    hub = getattr(hub, "local", hub)  # with Redis, the turns of this process
    async with asyncio.timeout(10):
        while (running := hub.running(cid)) is None:
            await asyncio.sleep(0)  # the request has not begun its turn yet: let it run
    return running.log


async def _reply_ids(api, cid: str) -> list[str]:
    """The compared replies' ids, in the order the models were given, from the running turn."""
    return [r["assistant_message_id"] for r in (await api.get(cid))["turn"]["compare"]]


async def test_stop_without_a_reply_stops_every_compared_reply(app, api, client, sim, conv):
    cid = conv["id"]
    release = threading.Event()
    for model in MODELS:
        sim.enqueue_for(model, Script(steps=[steps.Text(f"{model} says "), steps.Hold(release), steps.Text("more")]))
    try:
        comparing = asyncio.create_task(post(client, cid, "compare", content="go", models=MODELS))
        await asyncio.to_thread(sim.wait_for_requests, 3, 10)
        ids = await _reply_ids(api, cid)
        await _streaming(app, cid, ids)
        assert (await client.post(f"/api/conversations/{cid}/stop", json={})).status_code == 204
        response = await asyncio.wait_for(comparing, 30)
    finally:
        release.set()
    events = parse_sse(response.text)
    assert {d["assistant_message_id"]: d["status"] for name, d in events if name == "done" and
            d["assistant_message_id"]} == dict.fromkeys(ids, "interrupted")
    assert events[-1][0] == "done" and events[-1][1]["status"] == "interrupted"
    after = await api.get(cid)
    assert after["streaming"] is False and after["messages"][-1]["status"] == "interrupted"


async def test_when_the_first_model_fails_the_first_reply_stored_is_current(api, client, sim, conv):
    cid = conv["id"]
    sim.enqueue_for(MODELS[0], errors.openai_model_not_found(MODELS[0]))
    sim.enqueue_for(MODELS[1], reply("second model's answer"))
    sim.enqueue_for(MODELS[2], reply("third model's answer"))

    events = parse_sse((await post(client, cid, "compare", content="hello", models=MODELS)).text)

    failed = [d for name, d in events if name == "error"]
    assert len(failed) == 1 and failed[0]["kind"] == "model_unavailable" and "draft" not in failed[0]
    statuses = {r["model"]: r["status"] for r in events[-1][1]["compare"]}
    assert statuses == {MODELS[0]: "failed", MODELS[1]: "saved", MODELS[2]: "saved"}
    after = await api.get(cid)
    assert texts(after)[0] == "hello" and texts(after)[1] in ("second model's answer", "third model's answer")
    assert len(after["branches"][after["messages"][1]["id"]]) == 2


async def test_compare_refuses_a_model_outside_the_lineup_or_one_model_and_changes_nothing(api, client, sim, conv):
    cid = conv["id"]
    for models in ([PLAIN, "vendor/unknown"], [PLAIN], [PLAIN, PLAIN], [PLAIN, OTHER, MODELS[2], REASONING]):
        response = await post(client, cid, "compare", content="hi", models=models)
        assert response.status_code == 422, (models, response.text)
    assert (await api.get(cid))["messages"] == [] and turns_sent(sim) == []
