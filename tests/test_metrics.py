"""Issue 30: GET /metrics (Prometheus text format) and LOG_FORMAT=json.

Who may read it (an admin, or a scraper holding METRICS_TOKEN), what scripted turns leave in it (a
reply, a failure, a tool error), that WORKERS=2 adds both workers' counts up, and that JSON logs
are one object a line with no secret in them.
"""

from __future__ import annotations

import gc

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatserver import metrics
from chatserver.config import Settings
from gateway_sim.simulator import Script, Usage, errors, steps
from support import LiveServer, parse_sse
from test_serving import MAKE_RUN
from test_workers import pinned, workers_env

METRICS_TOKEN = "scrape-" + "m3tr1c5-t0ken-for-tests"
ACCESS_TOKEN = "access-" + "t0ken-0f-the-local-person"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a scrape."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def settings(tmp_path, sim) -> Settings:
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5,
                    default_tool_runtime="local")


async def talk(client, conv_id: str, content: str) -> list[tuple[str, dict]]:
    response = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": content})
    assert response.status_code == 200, response.text
    return parse_sse(response.text)


async def test_scripted_turns_show_in_the_counters_and_histograms(api, client, sim):
    before = samples((await client.get("/metrics")).text)
    conv = await api.new()
    model = conv["model"]
    await api.patch(conv["id"], settings={"web_search": False, "web_fetch": False})
    sim.enqueue(Script([steps.Text("Hello there.")], usage=Usage(prompt=120, completion=7, cost=0.002, dialect="openrouter")))
    sim.enqueue(errors.openai_rate_limit(retry_after=1))
    # The model calls `remember` with arguments that are not JSON: a [tool error], then it answers.
    sim.enqueue(Script([steps.ToolCall("remember", '{"fact": "half')]), Script([steps.Text("Noted anyway.")]))

    first = await talk(client, conv["id"], "hi")
    failed = await talk(client, conv["id"], "again")
    tooled = await talk(client, conv["id"], "remember this")

    assert first[-1][0] == "done" and failed[-1][0] == "error" and tooled[-1][0] == "done"
    after = samples((await client.get("/metrics")).text)

    def added(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert added("chat_turns_total", outcome="complete", kind="") == 2
    assert added("chat_turns_total", outcome="failed", kind="rate_limited") == 1
    assert added("chat_turn_seconds_count") == 3
    assert added("chat_turn_first_token_seconds_count") == 2  # the failed turn had no first token
    assert added("chat_tool_calls_total", tool="remember") == 1
    assert added("chat_tool_errors_total", tool="remember") == 1
    assert added("chat_tokens_total", model=model, kind="input") >= 120
    assert added("chat_tokens_total", model=model, kind="output") >= 7
    assert added("chat_cost_total", model=model) == pytest.approx(0.002)
    assert added("chat_store_seconds_count", operation="update") >= 3
    assert added("chat_gateway_response_seconds_count") == 4  # a reply, a refusal, a tool round and its answer
    assert value(after, "chat_streams_open") == 0


def test_metrics_are_refused_without_the_token_or_an_admin(tmp_path, sim):
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "ACCESS_TOKEN": ACCESS_TOKEN,
                                            "METRICS_TOKEN": METRICS_TOKEN})
    try:
        url = server.base_url + "/metrics"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer not-" + METRICS_TOKEN}).status_code == 401
        assert httpx.get(url, headers={"Authorization": METRICS_TOKEN}).status_code == 401  # not a bearer token
        scraped = httpx.get(url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
        assert "chat_turns_total" in scraped.text or "# TYPE chat_turns counter" in scraped.text
        # The local person (AUTH=none, holding ACCESS_TOKEN) is this server's admin.
        assert httpx.get(url, headers={"Authorization": f"Bearer {ACCESS_TOKEN}"}).status_code == 200
    finally:
        server.stop()


async def test_a_person_who_is_not_an_admin_is_refused(tmp_path, sim):
    from chatserver.app import create_app

    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", auth="header",
                        trusted_proxies=["127.0.0.1"], admin_users=["boss"], metrics_token=METRICS_TOKEN)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            assert (await client.get("/metrics", headers={"X-Forwarded-User": "someone"})).status_code == 403
            assert (await client.get("/metrics", headers={"X-Forwarded-User": "boss"})).status_code == 200
            assert (await client.get("/metrics")).status_code == 401


def test_with_two_workers_the_counts_add_up(tmp_path, sim, redis_server):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    server = LiveServer(tmp_path / "data", workers_env(sim, redis_server, METRICS_TOKEN=METRICS_TOKEN,
                                                       TMPDIR=str(scratch)), launch=MAKE_RUN)
    auth = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    try:
        for worker in (1, 2):
            client, _ = pinned(server, worker)
            try:
                for _ in range(2):
                    conv = client.post("/api/conversations", json={}).json()
                    client.patch(f"/api/conversations/{conv['id']}",
                                 json={"settings": {"web_search": False, "web_fetch": False}})
                    sim.enqueue(Script([steps.Text("Hi.")]))
                    events = parse_sse(client.post(f"/api/conversations/{conv['id']}/messages",
                                                   json={"content": "hello"}).text)
                    assert events[-1][0] == "done"
            finally:
                client.close()
        for worker in (1, 2):  # whichever worker answers the scrape sees both workers' turns
            client, _ = pinned(server, worker)
            try:
                scrape = samples(client.get("/metrics", headers=auth).text)
            finally:
                client.close()
            assert value(scrape, "chat_turns_total", outcome="complete", kind="") == 4
            assert value(scrape, "chat_turn_seconds_count") == 4
            assert value(scrape, "chat_streams_open") == 0
        assert any(p.name.startswith("chat-metrics-") for p in scratch.iterdir())  # this start's own directory
    finally:
        server.stop()
    assert not any(p.name.startswith("chat-metrics-") for p in scratch.iterdir())  # removed when it stopped


def test_json_logs_are_one_object_a_line_without_secrets(tmp_path, sim):
    key = "sk-" + "gateway-key-never-logged-0123456789"
    sim.enqueue(errors.openai_invalid_key())
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "GATEWAY_API_KEY": key,
                                            "LOG_FORMAT": "json", "METRICS_TOKEN": METRICS_TOKEN}, launch=MAKE_RUN)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            conv = client.post("/api/conversations", json={}).json()
            client.patch(f"/api/conversations/{conv['id']}", json={"settings": {"web_search": False, "web_fetch": False}})
            events = parse_sse(client.post(f"/api/conversations/{conv['id']}/messages",
                                           json={"content": f"my key is {key}"}).text)
            assert events[-1][0] == "error"
    finally:
        server.stop()
    lines = [line for line in server.log().splitlines() if line.strip()]
    parsed = [orjson.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= p.keys() for p in parsed)
    assert any(p["logger"] == "chat.turns" and "ended with" in p["message"] for p in parsed), lines
    assert any(p["logger"].startswith("uvicorn") for p in parsed)  # uvicorn's own lines are JSON too
    assert key not in server.log() and METRICS_TOKEN not in server.log()


async def test_a_scrape_says_what_its_render_cost_the_server_apart_from_a_garbage_collection(client, monkeypatch):
    """`Server-Timing: render;dur=<ms>, gc;dur=<ms>`: the CPU a scrape took, apart from any wait behind a
    busy loop (the bench reads it), and apart from a collection that fell due inside it."""
    def timings(answer) -> dict[str, float]:
        assert answer.status_code == 200
        parts = [part.strip().partition(";dur=") for part in answer.headers["server-timing"].split(",")]
        return {name: float(duration) for name, _, duration in parts}

    quiet = timings(await client.get("/metrics"))
    assert quiet.keys() == {"render", "gc"} and 0 <= quiet["render"] < 1000 and quiet["gc"] >= 0

    garbage = []
    for _ in range(200_000):  # cycles only the collector frees: a collection with something to walk
        node: list = []
        node.append(node)
        garbage.append(node)
    render = metrics.active.exposition

    def collecting_render() -> bytes:
        gc.collect()
        return render()

    monkeypatch.setattr(metrics.active, "exposition", collecting_render)
    del garbage, node
    loud = timings(await client.get("/metrics"))
    assert loud["gc"] > 5 * max(loud["render"], 0.5), loud  # the collection is counted apart, not as the render
