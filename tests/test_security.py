"""Localhost is not a wall: Host allow-list, Origin check, no CORS, access token, secret hygiene, limits.

A page on any site the person has open can send requests to 127.0.0.1 (cross-site requests),
and any name that resolves to 127.0.0.1 reaches the server too (DNS rebinding). Each test here
checks one protection and fails without it.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from chatserver.config import Settings
from gateway_sim.simulator import Script, errors, steps
from support import LiveServer, free_port, names, parse_sse, serve

ROOT = Path(__file__).resolve().parent.parent


def snapshot(data_dir: Path) -> dict[str, bytes]:
    """Every file under DATA_DIR with its bytes: 'nothing changed' means this is equal."""
    return {str(p.relative_to(data_dir)): p.read_bytes() for p in sorted(data_dir.rglob("*")) if p.is_file()}


def cors_headers(response: httpx.Response) -> list[str]:
    return [k for k in response.headers if k.lower().startswith("access-control-")]


async def conversation_with_one_exchange(client: httpx.AsyncClient, sim) -> str:
    conv = (await client.post("/api/conversations", json={})).json()
    await client.patch(f"/api/conversations/{conv['id']}", json={"settings": {"web_search": False, "web_fetch": False}})
    sim.enqueue(Script(steps=[steps.Text("First answer.")]))
    events = parse_sse((await client.post(f"/api/conversations/{conv['id']}/messages",
                                          json={"content": "first question"})).text)
    assert names(events)[-1] == "done"
    return conv["id"]


# --- Host allow-list (DNS rebinding) ----------------------------------------------------------

EVERY_KIND_OF_ROUTE = [
    ("GET", "/"), ("GET", "/healthz"), ("GET", "/api/models"), ("GET", "/api/conversations"),
    ("GET", "/api/memory"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/static/app.js"),
    ("GET", "/no/such/route"), ("POST", "/api/conversations"), ("PUT", "/api/memory"),
    ("OPTIONS", "/api/conversations"),
]

FOREIGN_HOSTS = [
    "evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io:8000",
    "[::1]evil.example", "[::1].evil.example:80", "localhost:8000@evil.example", "127.0.0.1:80:80",
    "localhost:http", "", "0.0.0.0:8000",
]


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
async def test_foreign_host_header_is_400_on_every_route_and_changes_nothing(client, settings, host):
    before = snapshot(settings.data_dir)
    for method, path in EVERY_KIND_OF_ROUTE:
        body = {"text": "rebound"} if path == "/api/memory" else ({} if method == "POST" else None)
        response = await client.request(method, path, json=body, headers={"host": host})
        assert response.status_code == 400, (method, path, response.status_code)
        assert response.json()["detail"], (method, path)
    assert snapshot(settings.data_dir) == before


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "LOCALHOST:1", "127.0.0.1", "127.0.0.1:65535",
                                  "[::1]", "[::1]:8000"])
async def test_loopback_names_with_any_port_are_served(client, host):
    for method, path in [("GET", "/"), ("GET", "/healthz"), ("GET", "/api/conversations")]:
        response = await client.request(method, path, headers={"host": host})
        assert response.status_code == 200, (method, path, host)
    assert (await client.post("/api/conversations", json={}, headers={"host": host})).status_code == 201


async def test_allowed_hosts_extends_the_loopback_names(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        allowed_hosts="chat.internal, Box.LAN")
    async with serve(settings) as (_, client):
        for host in ("chat.internal", "chat.internal:8443", "box.lan", "localhost:8000"):
            assert (await client.get("/healthz", headers={"host": host})).status_code == 200, host
        for host in ("evil.example", "chat.internal.evil.example", "sub.chat.internal"):
            assert (await client.get("/healthz", headers={"host": host})).status_code == 400, host


async def test_the_bound_address_is_an_allowed_host(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", host="127.0.0.2")
    async with serve(settings) as (_, client):
        assert (await client.get("/healthz", headers={"host": "127.0.0.2:8000"})).status_code == 200
        assert (await client.get("/healthz", headers={"host": "127.0.0.3:8000"})).status_code == 400


# --- Origin check (cross-site requests) --------------------------------------------------------

def state_changing_requests(conv_id: str) -> list[tuple[str, str, dict | None]]:
    base = f"/api/conversations/{conv_id}"
    return [
        ("POST", "/api/conversations", {}),
        ("PATCH", base, {"title": "pwned", "settings": {"system_prompt": "pwned"}}),
        ("POST", f"{base}/messages", {"content": "pwned"}),
        ("POST", f"{base}/regenerate", {}),
        ("POST", f"{base}/rewind", {}),
        ("POST", f"{base}/compress", {}),
        ("DELETE", base, None),
        ("PUT", "/api/memory", {"text": "pwned"}),
        ("POST", "/api/models", {"id": "evil/model", "tier": "fast"}),
        ("DELETE", "/api/models/custom/model", None),
        ("POST", "/api/login", {"token": "guess"}),
    ]


@pytest.mark.parametrize("origin", [
    "http://evil.example", "null", "http://127.0.0.1:9999", "http://localhost",
    "https://127.0.0.1.evil.example", "http://127.0.0.1@evil.example", "file://", "chrome-extension://abc",
])
async def test_foreign_or_null_origin_is_403_and_nothing_changes(client, settings, sim, origin):
    await client.post("/api/models", json={"id": "custom/model", "tier": "fast"})
    conv_id = await conversation_with_one_exchange(client, sim)
    before, upstream_before = snapshot(settings.data_dir), len(sim.requests)

    for method, path, body in state_changing_requests(conv_id):
        response = await client.request(method, path, json=body, headers={"origin": origin})
        assert response.status_code == 403, (method, path, response.status_code)
        assert response.json()["detail"]

    assert snapshot(settings.data_dir) == before
    assert len(sim.requests) == upstream_before


async def test_same_origin_and_no_origin_are_allowed(client, sim):
    # The page's own requests carry its origin; curl and scripts send none.
    created = await client.post("/api/conversations", json={}, headers={"origin": "http://127.0.0.1"})
    assert created.status_code == 201
    conv_id = created.json()["id"]
    response = await client.patch(f"/api/conversations/{conv_id}", json={"title": "mine"},
                                  headers={"host": "localhost:8000", "origin": "http://localhost:8000"})
    assert response.status_code == 200 and response.json()["title"] == "mine"
    assert (await client.put("/api/memory", json={"text": "- likes tea\n"})).status_code == 200
    deleted = await client.delete(f"/api/conversations/{conv_id}", headers={"origin": "http://127.0.0.1"})
    assert deleted.status_code == 204


async def test_a_form_shaped_body_is_not_read_as_json(client, settings):
    # A cross-site <form> can send text/plain without a preflight; it must not pass as a JSON body.
    before = snapshot(settings.data_dir)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        response = await client.put("/api/memory", content=b'{"text": "forged"}',
                                    headers={"content-type": content_type})
        assert response.status_code == 422, content_type
    assert snapshot(settings.data_dir) == before


async def test_no_cors_headers_are_ever_sent(client, sim):
    conv_id = await conversation_with_one_exchange(client, sim)
    foreign = {"origin": "http://evil.example"}
    preflight = {**foreign, "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type, authorization"}
    responses = [
        await client.options("/api/conversations", headers=preflight),
        await client.options(f"/api/conversations/{conv_id}/messages", headers=preflight),
        await client.options("/", headers=preflight),
        await client.get("/api/conversations", headers=foreign),
        await client.get(f"/api/conversations/{conv_id}", headers=foreign),
        await client.get("/api/memory", headers=foreign),
        await client.get("/", headers=foreign),
        await client.get("/healthz", headers=foreign),
        await client.post("/api/conversations", json={}, headers=foreign),
        await client.post("/api/conversations", json={}, headers={"origin": "http://127.0.0.1"}),
    ]
    sim.enqueue(Script(steps=[steps.Text("streamed")]))
    responses.append(await client.post(f"/api/conversations/{conv_id}/messages", json={"content": "again"},
                                       headers={"origin": "http://127.0.0.1"}))
    assert names(parse_sse(responses[-1].text))[-1] == "done"
    for response in responses:
        assert cors_headers(response) == [], (response.request.method, response.request.url, response.headers)
    # A failed preflight is what makes the browser refuse the cross-site call.
    assert responses[0].status_code >= 400


async def test_the_page_cannot_be_framed_by_another_site(client):
    # Clickjacking: a foreign page framing ours would make the person click our buttons.
    for path in ("/", "/api/conversations", "/healthz"):
        response = await client.get(path)
        assert response.headers.get("x-frame-options") == "DENY", path
        assert "frame-ancestors 'none'" in response.headers.get("content-security-policy", ""), path
        assert response.headers.get("x-content-type-options") == "nosniff", path


# --- Binding off loopback needs an access token ------------------------------------------------

@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.20", "my-box.lan"])
def test_non_loopback_bind_without_access_token_is_refused(host, tmp_path):
    with pytest.raises(ValidationError) as refused:
        Settings(_env_file=None, host=host, data_dir=tmp_path)
    assert "ACCESS_TOKEN" in str(refused.value)
    assert Settings(_env_file=None, host=host, access_token=secrets.token_urlsafe(24), data_dir=tmp_path).access_token


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_bind_needs_no_token(host, tmp_path):
    assert Settings(_env_file=None, host=host, data_dir=tmp_path).access_token is None


def test_server_refuses_to_start_on_0_0_0_0_without_token(tmp_path):
    # The check runs before binding; a port that is free and unused keeps a regression harmless.
    env = {k: v for k, v in os.environ.items() if k not in ("ACCESS_TOKEN", "GATEWAY_BASE_URL")}
    env.update(HOST="0.0.0.0", PORT=str(free_port()), DATA_DIR=str(tmp_path / "data"))
    try:
        result = subprocess.run([sys.executable, str(ROOT / "server.py")], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the server started on 0.0.0.0 without ACCESS_TOKEN")
    assert result.returncode != 0
    assert "ACCESS_TOKEN" in result.stderr


TOKEN = "tok-" + secrets.token_urlsafe(24)


@pytest.fixture
async def guarded(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        access_token=TOKEN)
    async with serve(settings) as (app, client):
        yield settings, client


async def test_with_a_token_every_api_route_needs_it(guarded, sim):
    settings, client = guarded
    before = snapshot(settings.data_dir)
    for method, path, body in [("GET", "/api/conversations", None), ("GET", "/api/models", None),
                               ("GET", "/api/memory", None), ("GET", "/openapi.json", None), ("GET", "/docs", None),
                               ("POST", "/api/conversations", {}), ("PUT", "/api/memory", {"text": "x"}),
                               ("GET", "/api/conversations/abcdefgh12345", None)]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {TOKEN[:-1]}"},
                        {"authorization": f"Bearer {TOKEN}x"}, {"authorization": f"Basic {TOKEN}"},
                        {"cookie": "chat_token=wrong"}):
            response = await client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.status_code)
            assert response.json()["detail"]
    assert snapshot(settings.data_dir) == before
    assert sim.requests == []


async def test_with_a_token_the_page_health_and_static_files_stay_public(guarded):
    _, client = guarded
    for path in ("/", "/healthz", "/static/app.js"):
        assert (await client.get(path)).status_code != 401, path


async def test_bearer_token_opens_the_api(guarded, sim):
    _, client = guarded
    auth = {"authorization": f"Bearer {TOKEN}"}
    created = await client.post("/api/conversations", json={}, headers=auth)
    assert created.status_code == 201
    conv_id = created.json()["id"]
    assert (await client.patch(f"/api/conversations/{conv_id}", headers=auth,
                               json={"settings": {"web_search": False, "web_fetch": False}})).status_code == 200
    sim.enqueue(Script(steps=[steps.Text("Authorised reply.")]))
    response = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": "hi"}, headers=auth)
    assert names(parse_sse(response.text))[-1] == "done"
    # The token is ours, never forwarded to the gateway.
    assert all(TOKEN not in str(r.headers) for r in sim.requests)


async def test_login_sets_a_strict_httponly_cookie_that_opens_the_api(guarded):
    _, client = guarded
    wrong = await client.post("/api/login", json={"token": "not-the-token"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    assert (await client.post("/api/login", json={"token": TOKEN[:-1]})).status_code == 401
    assert (await client.post("/api/login", json={})).status_code == 422
    # Login CSRF: a foreign page must not log the person in (or out).
    assert (await client.post("/api/login", json={"token": TOKEN},
                              headers={"origin": "http://evil.example"})).status_code == 403
    assert "chat_token" not in client.cookies

    login = await client.post("/api/login", json={"token": TOKEN})

    assert login.status_code == 204
    cookie = login.headers["set-cookie"]
    attributes = [a.strip().lower() for a in cookie.split(";")]
    assert cookie.startswith("chat_token=")
    assert "httponly" in attributes and "samesite=strict" in attributes and "path=/" in attributes
    assert TOKEN not in cookie  # a stolen cookie jar does not hand over the token itself
    assert (await client.get("/api/conversations")).status_code == 200
    assert (await client.post("/api/conversations", json={})).status_code == 201
    client.cookies.clear()
    assert (await client.get("/api/conversations")).status_code == 401


# --- The gateway key never leaves the server ---------------------------------------------------

LAUNCH = (
    "import logging, sys, uvicorn\n"
    "logging.basicConfig(level=logging.DEBUG, format='%(levelname)s %(name)s: %(message)s')\n"
    "uvicorn.run('server:app', host='127.0.0.1', port=int(sys.argv[1]), log_level='debug')\n"
)


def test_the_gateway_key_never_appears_in_responses_logs_or_files(tmp_path, sim):
    key = "sk-live-" + secrets.token_hex(20)
    fragment = key[8:18]  # catches an echo cut short as well as the whole key
    data_dir = tmp_path / "data"
    server = LiveServer(data_dir, launch=LAUNCH, env={"GATEWAY_BASE_URL": sim.base_url, "GATEWAY_API_KEY": key,
                                    "KEEP_RECENT_MESSAGES": "2"})
    seen: list[str] = []
    error_messages: list[str] = []

    def record(response: httpx.Response) -> httpx.Response:
        seen.append(f"{response.status_code} {response.headers}\n{response.text}")
        return response

    def turn(conv_id: str, content: str, path: str = "messages") -> list[tuple[str, dict]]:
        body = {"content": content} if path == "messages" else {}
        events = parse_sse(record(http.post(f"/api/conversations/{conv_id}/{path}", json=body)).text)
        error_messages.extend(d["message"] for n, d in events if n in ("error", "warning"))
        return events

    echoed = {"error": {"message": f"Invalid header: Authorization: Bearer {key}", "type": "invalid_request_error"}}
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            for path in ("/", "/healthz", "/api/models", "/api/presets", "/api/memory", "/openapi.json", "/docs",
                         "/static/app.js", "/api/conversations", "/no/such/route"):
                record(http.get(path))
            conv_id = record(http.post("/api/conversations", json={})).json()["id"]
            record(http.patch(f"/api/conversations/{conv_id}",
                              json={"title": "t", "settings": {"web_search": False, "web_fetch": False}}))
            sim.enqueue(Script(steps=[steps.Text("Hello.")]))
            assert names(turn(conv_id, "hello"))[-1] == "done"

            failures = [
                Script(status=400, error_body=echoed),
                Script(status=401, error_body={"error": {"message": f"Incorrect API key provided: {key}",
                                                         "code": "invalid_api_key"}}),
                errors.openai_invalid_key(),
                # A proxy page echoing the request, with the key across the 500-character cut.
                Script(status=502, headers={"content-type": "text/html"},
                       error_body="<html><pre>" + "x" * 447 + f"Authorization: Bearer {key}</pre></html>"),
                Script(status=403, error_body=f"forbidden: {key}"),
                Script(steps=[steps.Text("Partial "), steps.StreamError(
                    {"error": {"message": f"upstream refused key {key}", "type": "server_error"}})]),
                Script(steps=[steps.StreamError({"error": {"message": f"rate limited for {key}",
                                                           "type": "rate_limit_error", "code": "429"}})]),
            ]
            for n, script in enumerate(failures):
                sim.enqueue(script)
                assert names(turn(conv_id, f"question {n}"))[-1] == "error"
            kinds = {d["kind"] for n, d in turn_log(seen) if n == "error"}
            assert {"auth", "upstream"} <= kinds

            sim.enqueue(Script(steps=[steps.Text("Again.")]))
            turn(conv_id, "", "regenerate")
            record(http.post(f"/api/conversations/{conv_id}/rewind", json={}))
            sim.enqueue(Script(steps=[steps.Text("Third.")]))
            turn(conv_id, "third")
            # The summarizer's failure reason lands in the transcript notice.
            sim.enqueue(Script(status=400, error_body=echoed))
            compressed = record(http.post(f"/api/conversations/{conv_id}/compress", json={})).json()
            assert compressed["failed"] is True
            record(http.get(f"/api/conversations/{conv_id}"))

            # A tool turn: a gateway rejecting a tool (naming the key) turns into a warning.
            tool_conv = record(http.post("/api/conversations", json={})).json()["id"]
            record(http.patch(f"/api/conversations/{tool_conv}", json={"settings": {"web_search": True,
                                                                                   "web_fetch": True}}))
            sim.enqueue(Script(status=400, error_body={"type": "error", "error": {
                "type": "invalid_request_error", "message": f"web_fetch is not enabled for key {key}"}}),
                        Script(steps=[steps.Text("Answered without fetch.")]))
            events = turn(tool_conv, "look it up")
            assert "warning" in names(events) and names(events)[-1] == "done"
            sim.enqueue(Script(status=401, error_body={"type": "error", "error": {
                "type": "authentication_error", "message": f"invalid x-api-key {key}"}}))
            assert turn(tool_conv, "again")[-1][1]["kind"] == "auth"

            record(http.get("/api/conversations"))
            record(http.put("/api/memory", json={"text": "- fact\n"}))
            record(http.post("/api/models", json={"id": "x/y", "tier": "fast"}))
            record(http.delete("/api/models/x/y"))
            record(http.delete(f"/api/conversations/{tool_conv}"))
    finally:
        server.stop()

    # Not vacuous: the gateway got the key, and the echoes reached the error path.
    chat = [r for r in sim.requests if r.path == "/v1/chat/completions"]
    tool = [r for r in sim.requests if r.path == "/v1/messages"]
    assert chat and all(r.headers.get("authorization") == f"Bearer {key}" for r in chat)
    assert tool and all(r.headers.get("x-api-key") == key for r in tool)
    assert any("Invalid header: Authorization" in m for m in error_messages)
    assert any("web_fetch is not enabled" in m for m in error_messages)

    for text in seen:
        assert fragment not in text, text[:2000]
    log = server.log()
    assert "turn on" in log  # the failures were logged
    assert fragment not in log, [line for line in log.splitlines() if fragment in line]
    for name, content in snapshot(data_dir).items():
        assert fragment.encode() not in content, name


def turn_log(seen: list[str]) -> list[tuple[str, dict]]:
    """Every SSE event among the recorded responses."""
    out = []
    for text in seen:
        body = text.split("\n", 1)[1]
        if body.startswith("event:") or "\nevent:" in body:
            out += parse_sse(body)
    return out


# --- Size limits and ids -----------------------------------------------------------------------

@pytest.fixture
async def small_limits(tmp_path, sim):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                        max_request_bytes=4096, max_message_chars=1000)
    async with serve(settings) as (app, client):
        yield settings, client


async def test_bodies_over_the_limit_are_413_with_or_without_content_length(small_limits, sim):
    settings, client = small_limits
    conv_id = (await client.post("/api/conversations", json={})).json()["id"]
    before = snapshot(settings.data_dir)
    big = b'{"content": "' + b"x" * 5000 + b'"}'

    def chunked():  # no Content-Length: the body arrives in pieces of unknown total size
        async def pieces():
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]
        return pieces()

    for method, path in [("POST", f"/api/conversations/{conv_id}/messages"), ("PUT", "/api/memory"),
                         ("PATCH", f"/api/conversations/{conv_id}"), ("POST", "/api/conversations")]:
        for content in (big, chunked()):
            response = await client.request(method, path, content=content, headers={"content-type": "application/json"})
            assert response.status_code == 413, (method, path, response.status_code)
            assert "detail" in response.json()
    # A Content-Length that announces too much is refused before the body is read.
    response = await client.post("/api/conversations", content=b"{}",
                                 headers={"content-type": "application/json", "content-length": "999999999"})
    assert response.status_code == 413
    assert snapshot(settings.data_dir) == before and sim.requests == []


def test_a_chunked_body_over_the_limit_is_413_through_a_real_socket(live_server):
    limit = 2_097_152

    def body():
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536

    response = httpx.put(f"{live_server.base_url}/api/memory", content=body(),
                         headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 413 and "detail" in response.json()
    assert httpx.get(f"{live_server.base_url}/api/memory").json() == {"text": ""}


async def test_content_over_max_message_chars_is_422_and_never_sent(small_limits, sim):
    settings, client = small_limits
    conv_id = (await client.post("/api/conversations", json={})).json()["id"]
    await client.patch(f"/api/conversations/{conv_id}", json={"settings": {"web_search": False, "web_fetch": False}})

    response = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": "é" * 1001})

    assert response.status_code == 422
    assert response.json()["detail"].startswith("the message is 1,001 characters, over the 1,000 one message may be "
                                                "(the server's MAX_MESSAGE_CHARS setting")
    assert (await client.get(f"/api/conversations/{conv_id}")).json()["messages"] == [] and sim.requests == []
    sim.enqueue(Script(steps=[steps.Text("ok")]))
    at_limit = await client.post(f"/api/conversations/{conv_id}/messages", json={"content": "é" * 1000})
    assert names(parse_sse(at_limit.text))[-1] == "done"


HOSTILE_IDS = [
    "..%2F..%2Fmemory", "..%252F..%252Fmemory", "%2e%2e%2fmemory", "..%5C..%5Cmemory", "....%2F%2Fmemory",
    "..", "%2e%2e", "memory.md%00abcdefgh", "abcdefgh%00", "%00", "..%c0%afmemory", "abcdefgh%2F..%2F..%2Fmemory",
    "abcdefghij.json", "ABCDEFGH%20IJ", "%EF%BC%8E%EF%BC%8E%EF%BC%8Fmemory",
]


async def test_path_shaped_ids_never_reach_a_file(client, settings):
    await client.put("/api/memory", json={"text": "keep me"})
    (settings.data_dir / "conversations" / "abcdefghij.json.json").write_text("{}")
    before = snapshot(settings.data_dir)
    for conv_id in HOSTILE_IDS:
        for method, suffix, body in [("GET", "", None), ("PATCH", "", {"title": "x"}), ("DELETE", "", None),
                                     ("POST", "/messages", {"content": "hi"}), ("POST", "/rewind", {}),
                                     ("POST", "/regenerate", {}), ("POST", "/compress", {})]:
            response = await client.request(method, f"/api/conversations/{conv_id}{suffix}", json=body)
            assert response.status_code in (404, 405, 422), (conv_id, method, suffix, response.status_code)
    assert snapshot(settings.data_dir) == before


@pytest.mark.parametrize("path", ["/static/../server.py", "/static/..%2fserver.py", "/static/%2e%2e/config.py",
                                  "/static/..%5cserver.py", "/static/....//server.py", "/static//etc/passwd"])
async def test_static_files_cannot_reach_outside_static(client, path):
    response = await client.get(path)
    assert response.status_code in (400, 404), response.status_code
    assert "import" not in response.text and "root:" not in response.text


async def test_a_key_echoed_in_a_fetch_error_reply_or_reasoning_never_leaves_or_is_stored(tmp_path, sim):
    """A gateway echoed its key in a fetch result's error code, and the model in its text: all redacted."""
    key = "sk-live-" + secrets.token_hex(20)
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, gateway_api_key=key,
                        data_dir=tmp_path / "data", default_web_search=True, default_web_fetch=True)
    half = len(key) // 2
    sim.enqueue(Script(steps=[
        steps.Reasoning(f"the key is {key}, careful", chunk_size=7),
        steps.Fetch("https://example.com/a", ok=False, error_code=f"url_not_accessible:{key}"),
        steps.Text(f"Your key is {key[:half]}", chunk_size=100), steps.Text(f"{key[half:]} indeed.", chunk_size=100),
    ]))
    async with serve(settings) as (app, client):
        conv = (await client.post("/api/conversations", json={})).json()
        body = (await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hi"})).text
        stored = (await client.get(f"/api/conversations/{conv['id']}")).text
        await app.state.chat.store.flush()

    on_disk = "".join(p.read_text() for p in (tmp_path / "data").rglob("*.json"))
    for seen in (body, stored, on_disk):
        assert key not in seen and key[:half] + key[half:] not in seen.replace('"', "")
    reply = json.loads(stored)["messages"][-1]
    assert reply["content"] == "Your key is [redacted] indeed."
    assert "[redacted]" in reply["activity"][0]["text"] and reply["activity"][1]["error"].endswith("[redacted]")


# --- Trust comes from the TCP peer alone ----------------------------------------------------------

# `make run` (`python server.py`), and `uvicorn server:app` as an operator may run it, whose uvicorn
# rewrites the peer from X-Forwarded-For of any loopback peer before the app sees the request.
MAKE_RUN = "import os, sys; os.environ['PORT'] = sys.argv[1]; import server; server.main()"
LAUNCHES = [pytest.param(MAKE_RUN, id="make-run"), pytest.param(None, id="uvicorn-server-app")]
PROXY = "10.0.0.5"


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_local_process_naming_the_trusted_proxy_in_x_forwarded_for_is_nobody(tmp_path, sim, launch):
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "AUTH": "header",
                                            "TRUSTED_PROXIES": PROXY, "ADMIN_USERS": "boss"}, launch=launch)
    try:
        for spoof in (PROXY, f"198.51.100.7, {PROXY}", f"{PROXY}:443"):
            headers = {"x-forwarded-for": spoof, "x-forwarded-user": "boss", "x-forwarded-proto": "https"}
            me = httpx.get(f"{server.base_url}/api/auth/me", headers=headers)
            assert me.status_code == 401 and me.json()["login"] == "header", spoof
            assert httpx.get(f"{server.base_url}/api/conversations", headers=headers).status_code == 401
        assert not (tmp_path / "data" / "users.json").exists()  # boss was never created, let alone an admin
    finally:
        server.stop()


def rotating(i: int) -> dict[str, str]:
    return {"x-forwarded-for": f"198.51.100.{i}", "content-type": "application/json"}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_rotating_x_forwarded_for_neither_escapes_the_login_throttle_nor_reaches_the_log(tmp_path, sim, launch):
    from argon2 import PasswordHasher

    from chatserver.accounts.auth import FAILURES_PER_USER, UserFile

    UserFile(tmp_path / "data").add("alice", PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1).hash(
        "alice's long secret"), admin=True, now=0)
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "AUTH": "password",
                                            "TRUSTED_PROXIES": PROXY}, launch=launch)
    try:
        statuses = [httpx.post(f"{server.base_url}/api/auth/login", headers=rotating(i),
                               json={"username": "alice", "password": f"guess {i}"}).status_code
                    for i in range(FAILURES_PER_USER + 3)]
        assert statuses == [401] * FAILURES_PER_USER + [429] * 3
        log = server.log()
        assert "failed login for user 'alice'" in log and "198.51.100." not in log
    finally:
        server.stop()


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_rotating_x_forwarded_for_does_not_escape_the_access_token_throttle(tmp_path, sim, launch):
    from chatserver.accounts.auth import FAILURES_PER_ADDRESS

    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "ACCESS_TOKEN": "tok-" + "x1y2z3" * 5,
                                            "TRUSTED_PROXIES": PROXY}, launch=launch)
    try:
        statuses = [httpx.post(f"{server.base_url}/api/login", headers=rotating(i),
                               json={"token": f"guess-{i}"}).status_code for i in range(FAILURES_PER_ADDRESS + 2)]
        assert statuses == [401] * FAILURES_PER_ADDRESS + [429] * 2
        bearer = httpx.get(f"{server.base_url}/api/conversations",
                           headers={**rotating(99), "authorization": "Bearer another-guess"})
        assert bearer.status_code == 429
        log = server.log()
        assert "wrong access token" in log and "198.51.100." not in log
    finally:
        server.stop()


# --- Error answers and headers -------------------------------------------------------------------

def test_an_unexpected_fault_is_a_json_500_with_the_security_headers(live_server, tmp_path):
    """Starlette's plain-text "Internal Server Error" used to answer, without the page's headers."""
    (tmp_path / "data" / "memory.md").mkdir()  # a real fault: a directory where memory is replaced
    response = httpx.put(f"{live_server.base_url}/api/memory", json={"text": "kept?"})
    assert response.status_code == 500, response.text
    assert response.headers["content-type"] == "application/json"
    assert set(response.json()) == {"detail"} and "log" in response.json()["detail"]
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    deadline = time.monotonic() + 10  # uvicorn writes the traceback after the answer has gone
    while "IsADirectoryError" not in live_server.log():
        assert time.monotonic() < deadline, "the fault never reached the log"
        time.sleep(0.05)


async def test_docs_viewers_are_off_since_the_pages_policy_blocks_them_and_the_schema_stays(client):
    """/docs answered a page whose CDN scripts and inline script the Content-Security-Policy refuses."""
    for path in ("/docs", "/redoc"):
        response = await client.get(path)
        assert response.status_code == 404 and set(response.json()) == {"detail"}, path
    assert "/api/conversations" in (await client.get("/openapi.json")).json()["paths"]


async def test_each_security_header_is_sent_once_downloads_included(client, api):
    """Downloads set X-Content-Type-Options themselves and the Guard added it a second time."""
    conv = await api.new()
    uploaded = await client.post(f"/api/conversations/{conv['id']}/attachments",
                                 files={"file": ("notes.txt", b"plain notes\n", "text/plain")})
    assert uploaded.status_code == 201, uploaded.text
    for path in (f"/api/conversations/{conv['id']}/attachments/{uploaded.json()['id']}",
                 f"/api/conversations/{conv['id']}/export?format=md", "/", "/api/conversations"):
        response = await client.get(path)
        assert response.status_code == 200, path
        for name in ("x-content-type-options", "x-frame-options", "content-security-policy", "referrer-policy"):
            assert len(response.headers.get_list(name)) == 1, (path, name, response.headers.get_list(name))
