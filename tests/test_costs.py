"""Every cent accounted for (issue 28): the person's ledger against the gateway's own bill.

The simulator bills every answered request (an aborted stream up to where it stopped), answers
OpenRouter's generation lookup and LiteLLM's spend logs, and publishes its prices; the server must
end up with the same total, every charge carrying its source, and every grouping of /api/usage
adding up to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time

import httpx
import pytest
import redis as sync_redis

from chatserver.config import Settings
from gateway_sim.simulator import GatewaySimulator, Script, Sleep, StreamError, Text, ToolCall, Usage, estimate_tokens
from support import parse_sse, serve

MODEL = "openai/gpt-5-mini"
SUMMARIZER = "openai/gpt-5-nano"
LOCAL = "local/qwen3-8b"  # a vLLM-style server: tokens in its usage, no money
# USD per million tokens (input, output, cache read, cache write): dear enough that a cent is many calls.
PRICES = {MODEL: (300.0, 1200.0, 30.0, 375.0), SUMMARIZER: (50.0, 400.0, 5.0, 60.0), LOCAL: (100.0, 100.0, 10.0, 100.0)}
GROUPS = ("day", "model", "conversation", "kind")
SUMMED = ("input_tokens", "cached_tokens", "output_tokens", "turns", "requests", "unreported")


def text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def session_responder(path: str, body: dict) -> Script | None:
    """The scripted model of the session: what each turn does is written in the person's message."""
    if not body.get("stream"):
        return None  # titles and summaries: the simulator's own canned answers, billed the same
    messages = body.get("messages") or []
    if messages and messages[-1].get("role") == "tool":
        return Script([Text("Noted, and the note is kept.")])
    said = text_of(next((m["content"] for m in reversed(messages) if m.get("role") == "user"), ""))
    reply = f"Reply to {said.split(']')[-1].strip()}: a few words of answer, then some more words."
    if "[omit]" in said:
        return Script([Text(reply)], usage="omit")
    if "[stop]" in said:
        return Script([Text("These first words arrive"), Sleep(30), Text(" and these never do.")])
    if "[fail]" in said:
        return Script([Text("Half an answer before the provider"), StreamError(openrouter=True)])
    if "[tool]" in said and body.get("tools"):
        return Script([Text("Let me note that. "), ToolCall("remember", {"fact": f"The person said {said[-20:]}"})])
    if "[local]" in said:
        return Script([Text(reply)], usage="vllm")
    return Script([Text(reply)])


def session_settings(sim: GatewaySimulator, tmp_path, **extra) -> Settings:
    options = {"auto_title": True, "context_budget_tokens": 1500, "max_completion_tokens": 200, "keep_recent_messages": 2,
               "default_tool_runtime": "local", "summarizer_model": SUMMARIZER, **extra}
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=10,
                    **options)


async def stop_after_first_delta(app, client, conv_id: str, content: str) -> None:
    """Press Stop once the turn's first delta is out, as a person reading the stream would."""
    hub = app.state.chat.hub
    deadline = time.monotonic() + 20
    while (running := hub.running(conv_id)) is None or running.turn.user_message["content"] != content:
        assert time.monotonic() < deadline, "the turn never started"
        await asyncio.sleep(0.005)
    async with asyncio.timeout(20):
        async for frame in running.log.follow(0):
            if b"event: delta" in frame:
                break
    response = await client.post(f"/api/conversations/{conv_id}/stop")
    assert response.status_code == 204, response.text


async def converse(app, client, conv_id: str, turns: list[str]) -> list[str]:
    ends = []
    for content in turns:
        sending = asyncio.ensure_future(client.post(f"/api/conversations/{conv_id}/messages", json={"content": content}))
        if "[stop]" in content:
            await stop_after_first_delta(app, client, conv_id, content)
        response = await sending
        assert response.status_code == 200, response.text
        name, data = parse_sse(response.text)[-1]
        ends.append(name if name == "error" else data["status"])
    return ends


def plan(conversation: int, turns: int) -> list[str]:
    """Each conversation's messages: most plain, the rest each kind of trouble in turn."""
    kinds = ["", "", "[omit]", "", "[stop]", "", "[fail]", "[tool]", "", "[omit]"]
    local = conversation < 2
    return [f"{'[local] ' if local else ''}{kinds[n % len(kinds)]} question {conversation}.{n}" for n in range(turns)]


async def usage(client, **params) -> dict:
    response = await client.get("/api/usage", params=params)
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_500_turn_session_adds_up_to_the_gateways_bill(tmp_path):
    sim = GatewaySimulator(billing="openrouter", prices=PRICES, responder=session_responder)
    with sim:
        async with serve(session_settings(sim, tmp_path)) as (app, client):
            costs = app.state.chat.turns.costs
            costs.delays = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)
            assert (await client.post("/api/models", json={"id": LOCAL, "tier": "fast"})).status_code == 201
            # The local server publishes no price: an admin enters it (the same the simulator bills).
            local = dict(zip(("input", "output", "cache_read", "cache_write"), PRICES[LOCAL], strict=True))
            assert (await client.put(f"/api/prices/{LOCAL}", json=local)).status_code == 200
            conversations = []
            for n in range(10):
                body = {"model": LOCAL} if n < 2 else {}
                conversations.append((await client.post("/api/conversations", json=body)).json()["id"])
            started = time.monotonic()
            ends = await asyncio.gather(*(converse(app, client, conv_id, plan(n, 50))
                                          for n, conv_id in enumerate(conversations)))
            await app.state.chat.turns.idle()  # titles
            await costs.idle()                 # reconciliations
            took = time.monotonic() - started

            assert sum(len(e) for e in ends) == 500
            flat = [e for each in ends for e in each]
            assert flat.count("interrupted") >= 50 and flat.count("error") >= 50, "stops and failures happened"
            by_kind = {row["key"]: row for row in (await usage(client, group="kind"))["rows"]}
            assert by_kind["title"]["requests"] == 10
            assert by_kind["summary"]["requests"] >= 20, "compressions happened"
            assert by_kind["tool"]["requests"] >= 40, "tool rounds happened"

            day = await usage(client, group="day")
            total = day["total"]
            billed = sim.billed_total()
            assert billed > 1, "dear enough that cents matter"
            assert round(total["cost"], 2) == round(billed, 2)
            assert total["cost"] == pytest.approx(billed, abs=1e-6)
            assert total["unreported"] == 0
            assert set(total["cost_by_source"]) == {"reported", "reconciled", "priced"}, total["cost_by_source"]
            assert sum(total["cost_by_source"].values()) == pytest.approx(total["cost"], abs=1e-6)
            if total["turns"] != 500:
                month = dt.datetime.now(dt.UTC).strftime("%Y-%m")
                charges = [c for o in await costs.ledger.owners() for c in await costs.ledger.month(o, month)]
                odd = [c for c in charges if c["message"] is None or (c["kind"] == "reply" and not c["turn"])]
                raise AssertionError((total["turns"], odd))
            for group in GROUPS:
                answer = await usage(client, group=group)
                assert answer["total"]["cost"] == pytest.approx(total["cost"], abs=1e-9), group
                assert sum(r["cost"] for r in answer["rows"]) == pytest.approx(total["cost"], abs=1e-6), group
                for name in SUMMED:
                    assert sum(r[name] for r in answer["rows"]) == total[name], (group, name)

            # The conversations say the same: every reply's cost has a source, and their totals add up.
            conv_total = 0.0
            for conv_id in conversations:
                conv = (await client.get(f"/api/conversations/{conv_id}")).json()
                for message in conv["messages"] + conv.get("archive", []):
                    if message["role"] == "assistant":
                        assert message["usage"]["cost_source"] in ("reported", "reconciled", "priced"), message
                assert conv["totals"]["cost_unreported"] == 0
                conv_total += conv["totals"]["cost"]
            assert conv_total == pytest.approx(billed, abs=1e-6)
            print(f"500 turns and their reconciliation took {took:.1f} s")


async def test_a_litellm_header_cost_is_used_and_spend_logs_reconcile(tmp_path):
    """LiteLLM: the whole answer's `x-litellm-response-cost` is the title's cost (`reported`);
    a stream without usage is reconciled from the proxy's spend logs by its `x-litellm-call-id`."""
    sim = GatewaySimulator(billing="litellm", prices=PRICES)
    with sim:
        sim.enqueue(Script([Text("An answer with no usage at all.")], usage="omit"))
        async with serve(session_settings(sim, tmp_path, cost_reconcile="auto")) as (app, client):
            app.state.chat.turns.costs.delays = (0.05, 0.1, 0.2, 0.4, 0.8)
            conv = (await client.post("/api/conversations", json={})).json()
            response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hello"})
            assert parse_sse(response.text)[-1][0] == "done"
            await app.state.chat.turns.idle()
            await app.state.chat.turns.costs.idle()
            rows = {r["key"]: r for r in (await usage(client, group="kind"))["rows"]}
            title_bill = next(b for b in sim.bills if not b.streamed)
            assert rows["title"]["cost_by_source"] == {"reported": title_bill.cost}
            reply_bill = next(b for b in sim.bills if b.streamed)
            assert rows["reply"]["cost_by_source"] == {"reconciled": reply_bill.cost}
            conv = (await client.get(f"/api/conversations/{conv['id']}")).json()
            assert conv["messages"][-1]["usage"]["cost_source"] == "reconciled"
            assert conv["totals"]["cost_sources"] == {"reported": title_bill.cost, "reconciled": reply_bill.cost}


async def test_a_priced_model_without_a_gateway_cost_gets_a_priced_cost(tmp_path):
    """vLLM reports tokens and no money, and keeps no bill to ask: our price table prices it."""
    with GatewaySimulator() as sim:
        sim.enqueue(Script([Text("Priced by the table.")],
                           usage=Usage(prompt=1000, completion=200, cached=400, dialect="vllm")))
        async with serve(session_settings(sim, tmp_path, auto_title=False)) as (app, client):
            conv = (await client.post("/api/conversations", json={})).json()
            price = {"input": 2.0, "output": 8.0, "cache_read": 0.5}
            assert (await client.put(f"/api/prices/{MODEL}", json=price)).status_code == 200
            entry = next(m for t in (await client.get("/api/models")).json()["tiers"] for m in t["models"]
                         if m["id"] == MODEL)
            assert entry["price"] == {**price, "cache_write": None} and entry["price_source"] == "admin"
            response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hi"})
            done = parse_sse(response.text)[-1][1]
            expected = (600 * 2.0 + 400 * 0.5 + 200 * 8.0) / 1e6
            assert done["usage"]["cost"] == pytest.approx(expected) and done["usage"]["cost_source"] == "priced"
            # Without a price the same silence is unreported, never zero.
            assert (await client.delete(f"/api/prices/{MODEL}")).status_code == 204
            sim.enqueue(Script([Text("Not priced.")], usage=Usage(prompt=1000, completion=200, dialect="vllm")))
            response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "again"})
            done = parse_sse(response.text)[-1][1]
            assert done["usage"]["cost"] is None and done["usage"]["cost_source"] == "unreported"
            totals = (await usage(client, group="model"))["total"]
            assert totals["unreported"] == 1 and totals["cost_by_source"] == {"priced": pytest.approx(expected)}


async def test_prices_come_from_the_gateways_model_list(tmp_path):
    with GatewaySimulator(billing="openrouter", prices={MODEL: (3.0, 15.0, 0.3, 3.75)}) as sim:
        async with serve(session_settings(sim, tmp_path, auto_title=False)) as (_, client):
            prices = (await client.get("/api/prices")).json()
            assert prices[MODEL] == {"input": 3.0, "output": 15.0, "cache_read": 0.3, "cache_write": 3.75,
                                     "source": "gateway"}
            bad = await client.put(f"/api/prices/{MODEL}", json={"input": -1, "output": 1})
            assert bad.status_code == 422
            assert (await client.get("/api/prices")).json()[MODEL]["source"] == "gateway"


async def test_the_turn_that_crosses_the_budget_finishes_and_the_next_is_refused(tmp_path):
    with GatewaySimulator() as sim:
        cost = 0.6
        for _ in range(2):
            sim.enqueue(Script([Text("A dear answer.")], usage=Usage(prompt=100, completion=10, cost=cost,
                                                                    dialect="openrouter")))
        async with serve(session_settings(sim, tmp_path, auto_title=False, default_monthly_budget=1.0)) as (_, client):
            conv = (await client.post("/api/conversations", json={})).json()
            standing = (await client.get("/api/usage/budget")).json()
            assert standing["budget"] == 1.0 and not standing["warning"]
            first = parse_sse((await client.post(f"/api/conversations/{conv['id']}/messages",
                                                 json={"content": "one"})).text)
            assert first[-1][0] == "done"
            standing = (await client.get("/api/usage/budget")).json()
            assert standing["spent"] == pytest.approx(0.6) and not standing["warning"]
            # Under budget when it starts: it runs to its end, and its cost counts.
            second = parse_sse((await client.post(f"/api/conversations/{conv['id']}/messages",
                                                  json={"content": "two"})).text)
            assert second[-1][0] == "done"
            standing = (await client.get("/api/usage/budget")).json()
            assert standing["spent"] == pytest.approx(1.2) and standing["warning"] and standing["exceeded"]
            third = parse_sse((await client.post(f"/api/conversations/{conv['id']}/messages",
                                                 json={"content": "three"})).text)
            name, data = third[-1]
            assert name == "error" and data["kind"] == "budget" and data["retryable"] is False
            reset = (dt.datetime.now(dt.UTC).replace(day=28) + dt.timedelta(days=4)).strftime("%Y-%m-01")
            assert "$1.20 of $1.00" in data["message"] and reset in data["message"]
            assert data["draft"] == "three"
            assert len(sim.requests) == 2, "the refused turn sent nothing upstream"
            conv = (await client.get(f"/api/conversations/{conv['id']}")).json()
            assert [m["content"] for m in conv["messages"] if m["role"] == "user"] == ["one", "two"]


async def test_budgets_and_other_peoples_usage_are_for_admins(tmp_path):
    """AUTH=header: the admin sets a person's budget and sees their usage; the person sees only theirs."""
    with GatewaySimulator() as sim:
        settings = session_settings(sim, tmp_path, auto_title=False, auth="header", admin_users="boss",
                                    trusted_proxies="127.0.0.1")
        async with serve(settings) as (_, client):
            boss, ann = {"X-Forwarded-User": "boss"}, {"X-Forwarded-User": "ann"}
            me = (await client.get("/api/auth/me", headers=ann)).json()
            assert me["admin"] is False
            conv = (await client.post("/api/conversations", json={}, headers=ann)).json()
            sim.enqueue(Script([Text("Hi Ann.")], usage=Usage(prompt=10, completion=5, cost=0.25, dialect="openrouter")))
            await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hi"}, headers=ann)
            people = (await client.get("/api/usage/people", headers=boss)).json()
            ann_id = next(p["person"] for p in people if p["name"] == "ann")
            assert (await client.get("/api/usage/people", headers=ann)).status_code == 403
            assert (await client.get("/api/usage", params={"group": "person"}, headers=ann)).status_code == 403
            assert (await client.put(f"/api/usage/budgets/{ann_id}", json={"budget": 0.3}, headers=ann)).status_code == 403
            standing = (await client.put(f"/api/usage/budgets/{ann_id}", json={"budget": 0.3}, headers=boss)).json()
            assert standing["budget"] == 0.3 and standing["warning"] and not standing["exceeded"]
            assert (await client.get("/api/usage/budget", headers=ann)).json()["warning"]
            by_person = (await client.get("/api/usage", params={"group": "person"}, headers=boss)).json()
            assert [(r["label"], r["cost"]) for r in by_person["rows"]] == [("ann", 0.25)]
            theirs = (await client.get("/api/usage", params={"person": ann_id}, headers=boss)).json()
            assert theirs["total"]["cost"] == 0.25
            assert (await client.get("/api/usage", params={"person": ann_id}, headers=boss)).status_code == 200
            mine = (await client.get("/api/usage", headers=boss)).json()
            assert mine["total"]["cost"] == 0 and mine["rows"] == []
            assert (await client.get("/api/usage", params={"from": "2026-13-01"}, headers=ann)).status_code == 422


async def test_a_cost_one_server_left_waiting_is_reconciled_by_another(tmp_path, redis_server):
    """STORE=redis: the gateway's record is late, the server that ran the turn stops; the next
    server to start takes the waiting charge up and corrects the ledger and the conversation."""
    url = f"{redis_server.url[:-2]}/7"
    with contextlib.closing(sync_redis.Redis.from_url(url)) as r:
        r.flushdb()
    with GatewaySimulator(billing="openrouter", prices=PRICES, generation_delay=3600) as sim:
        sim.enqueue(Script([Text("An answer whose usage never came.")], usage="omit"))
        first = session_settings(sim, tmp_path / "a", auto_title=False, store="redis", redis_url=url)
        async with serve(first) as (app, client):
            costs = app.state.chat.turns.costs
            costs.delays = (0.05, 0.05)  # gives up at once: the record is not there yet
            conv = (await client.post("/api/conversations", json={})).json()
            response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hi"})
            assert parse_sse(response.text)[-1][0] == "done"
            await costs.idle()
            usage_before = (await client.get(f"/api/conversations/{conv['id']}")).json()["messages"][-1]["usage"]
            assert usage_before["cost_source"] == "estimated"
        sim.generation_delay = 0  # the gateway has written its record meanwhile
        (bill,) = sim.bills
        second = session_settings(sim, tmp_path / "b", auto_title=False, store="redis", redis_url=url)
        async with serve(second) as (app, client):
            await app.state.chat.turns.costs.idle()
            after = (await client.get(f"/api/conversations/{conv['id']}")).json()
            assert after["messages"][-1]["usage"]["cost_source"] == "reconciled"
            assert after["messages"][-1]["usage"]["cost"] == bill.cost
            assert after["totals"]["cost"] == bill.cost and after["totals"]["cost_sources"] == {"reconciled": bill.cost}
            total = (await usage(client, group="model"))["total"]
            assert total["cost_by_source"] == {"reconciled": bill.cost}
            assert await app.state.chat.turns.costs.ledger.waiting() == []


async def test_a_ledger_that_cannot_be_written_does_not_cost_the_reply(tmp_path, caplog):
    with GatewaySimulator() as sim:
        sim.enqueue(Script([Text("Kept all the same.")], usage=Usage(prompt=10, completion=4, cost=0.01,
                                                                     dialect="openrouter")))
        async with serve(session_settings(sim, tmp_path, auto_title=False)) as (app, client):
            async def full_disk(owner: str, charge: dict) -> None:
                raise OSError(28, "No space left on device")

            app.state.chat.turns.costs.ledger.put = full_disk
            conv = (await client.post("/api/conversations", json={})).json()
            response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hi"})
            assert parse_sse(response.text)[-1][0] == "done"
            stored = (await client.get(f"/api/conversations/{conv['id']}")).json()["messages"][-1]
            assert stored["content"] == "Kept all the same." and stored["usage"]["cost"] == 0.01
            assert "could not be written to the ledger" in caplog.text


async def test_the_usage_page_opens_without_a_session_and_its_data_does_not(tmp_path):
    with GatewaySimulator() as sim:
        async with serve(session_settings(sim, tmp_path, auth="password")) as (_, client):
            page = await client.get("/usage")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "default-src 'self'" in page.headers["content-security-policy"]
            for path in ("/api/usage", "/api/usage/budget", "/api/usage/people", "/api/prices"):
                assert (await client.get(path)).status_code == 401, path


def test_the_simulator_bills_an_aborted_stream_up_to_where_it_stopped():
    price = (2.0, 10.0, 0.2, 2.5)
    with GatewaySimulator(billing="openrouter", prices={MODEL: price}, generation_delay=0.2) as sim:
        sim.enqueue(Script([Text("one two three four five six"), Sleep(30), Text(" never sent")]))
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "count"}]}
        with httpx.stream("POST", f"{sim.base_url}/v1/chat/completions", json=body, timeout=10) as response:
            for line in response.iter_lines():
                if "six" in line:
                    generation = json.loads(line.removeprefix("data: "))["id"]
                    break  # hang up mid-stream, as Stop does
        sim.wait_for_disconnect(0)
        lookup = f"{sim.base_url}/api/v1/generation"
        deadline = time.monotonic() + 10
        while (answer := httpx.get(lookup, params={"id": generation})).status_code == 404:
            assert time.monotonic() < deadline, "the record never appeared"
            time.sleep(0.05)
        (bill,) = sim.bills
        sent = estimate_tokens("one two three four five six")
        assert bill.cancelled and bill.completion == sent
        data = answer.json()["data"]
        assert data["id"] == generation and data["cancelled"] is True and data["tokens_completion"] == sent
        assert data["total_cost"] == pytest.approx((bill.prompt * price[0] + sent * price[1]) / 1e6)
        assert httpx.get(lookup, params={"id": "gen-unknown"}).status_code == 404
        models = httpx.get(f"{sim.base_url}/api/v1/models").json()["data"]
        listed = {m["id"]: m for m in models}
        assert listed[MODEL]["pricing"] == {
            "prompt": "0.000002", "completion": "0.00001", "input_cache_read": "0.0000002",
            "input_cache_write": "0.0000025", "request": "0", "image": "0"}
        assert all("pricing" not in m for model, m in listed.items() if model != MODEL)
