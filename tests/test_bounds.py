"""Memory that must not grow with use: the demo gateway's records and the token-count cache; request
bodies bounded in size and time."""

from __future__ import annotations

import gc
import socket
import time
import tracemalloc

import httpx
import pytest

from chatserver.conversations import exchange
from chatserver.turns import context
from gateway_sim.simulator import DEFAULT_KEEP_REQUESTS, GatewaySimulator, Script, steps
from support import LiveServer


def chat(sim: GatewaySimulator, text: str) -> None:
    body = {"model": "m", "stream": False, "messages": [{"role": "user", "content": text}]}
    assert httpx.post(sim.base_url + "/v1/chat/completions", json=body, timeout=5).status_code == 200


def test_simulator_keeps_only_the_last_requests_it_was_told_to():
    with GatewaySimulator(keep_requests=3) as sim:
        for i in range(7):
            chat(sim, f"question {i}")

        kept = sim.requests
        assert [r.body["messages"][0]["content"] for r in kept] == ["question 4", "question 5", "question 6"]
        # Counting still covers every request, and an index still means the n-th request ever made.
        assert len(sim.wait_for_requests(7, timeout=1)) == 3
        with pytest.raises(IndexError):
            sim.wait_for_disconnect(0, timeout=1)


def test_simulator_index_counts_every_request_once_older_ones_are_dropped():
    with GatewaySimulator(keep_requests=2) as sim:
        sim.enqueue(Script(steps=[steps.Text("a")]), Script(steps=[steps.Text("b")]),
                    Script(steps=[steps.Text("c"), steps.Sleep(5)]))
        chat(sim, "one")
        chat(sim, "two")
        with httpx.Client(timeout=5) as client:
            with client.stream("POST", sim.base_url + "/v1/chat/completions",
                               json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "3"}]}) as r:
                next(r.iter_bytes())
        record = sim.wait_for_disconnect(2, timeout=5)
        assert record.body["messages"][0]["content"] == "3"


def test_the_default_keeps_a_few_requests_not_all():
    with GatewaySimulator() as sim:
        for i in range(DEFAULT_KEEP_REQUESTS + 5):
            chat(sim, str(i))
        assert len(sim.requests) == DEFAULT_KEEP_REQUESTS
        assert sim.requests[-1].body["messages"][0]["content"] == str(DEFAULT_KEEP_REQUESTS + 4)


def test_token_count_cache_does_not_hold_the_texts_it_counted():
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(150):
            context.count_tokens(f"deleted message {i} " + "word " * 5_000)  # ~25 KB each, then dropped
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 300_000, f"{held} bytes still held after counting 3.7 MB of text"


def test_token_count_cache_is_capped_by_bytes_and_still_counts_right(monkeypatch):
    monkeypatch.setattr(context, "_token_counts", {})
    monkeypatch.setattr(context, "TOKEN_CACHE_BYTES", 50 * context.TOKEN_CACHE_ENTRY_BYTES)
    texts = [f"text number {i}" for i in range(200)]

    counts = [context.count_tokens(t) for t in texts]

    assert len(context._token_counts) == 50
    assert [context.count_tokens(t) for t in texts] == counts == [
        len(context._encoding().encode(t)) for t in texts]
    assert all(isinstance(k, tuple) and all(isinstance(x, int) for x in k) for k in context._token_counts)


def test_token_count_cache_keeps_the_recently_used(monkeypatch):
    monkeypatch.setattr(context, "_token_counts", {})
    monkeypatch.setattr(context, "TOKEN_CACHE_BYTES", 3 * context.TOKEN_CACHE_ENTRY_BYTES)
    for text in ("alpha", "beta", "gamma"):
        context.count_tokens(text)
    context.count_tokens("alpha")  # used again: "beta" is now the oldest
    context.count_tokens("delta")
    assert (hash("beta"), 4) not in context._token_counts and (hash("alpha"), 5) in context._token_counts


# --- Request bodies: bounded in size and time ----------------------------------------------------

BOUNDARY = "b0undary"
PART_HEAD = (f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"c.json\"\r\n"
             "content-type: application/json\r\n\r\n").encode()


async def test_an_import_far_over_its_limit_is_413_once_the_limit_is_read_not_spooled_whole(client, monkeypatch):
    """A 600 MiB import was written whole to a temporary file, then answered 422."""
    monkeypatch.setattr(exchange, "MAX_IMPORT_BYTES", 1 << 20)
    sent = 0

    async def six_hundred_mib():
        nonlocal sent
        yield PART_HEAD
        for _ in range(600 * 16):
            sent += 65536
            yield b" " * 65536

    response = await client.post("/api/import", content=six_hundred_mib(),
                                 headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert response.status_code == 413 and "detail" in response.json()
    assert response.headers["connection"] == "close"
    assert sent <= (1 << 20) + 2 * 65536 + 65536  # the limit, its framing room and the chunk that crossed it
    assert (await client.get("/api/conversations")).json() == []

    declared = await client.post("/api/import", content=PART_HEAD, headers={
        "content-type": f"multipart/form-data; boundary={BOUNDARY}", "content-length": str(600 << 20)})
    assert declared.status_code == 413


MAKE_RUN = "import os, sys; os.environ['PORT'] = sys.argv[1]; import server; server.main()"


def trickle(port: int, head: bytes, byte: bytes, limit: float) -> tuple[bytes, float]:
    """Send `head`, then one `byte` every 0.1 s until the server answers; its answer and when it came."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=limit)
    started = time.monotonic()
    sock.sendall(head)
    sock.setblocking(False)
    answer = b""
    while time.monotonic() - started < limit:
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            try:
                sock.send(byte)
            except OSError:
                pass
            time.sleep(0.1)  # the trickle's own pace
            continue
        except OSError:
            break
        if not chunk:
            break
        answer += chunk
    sock.close()
    return answer, time.monotonic() - started


def test_a_trickling_body_is_cut_with_408_after_body_timeout(tmp_path, sim):
    """Slow login bodies held their connections for as long as they liked, until MAX_CONNECTIONS was full."""
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "BODY_TIMEOUT": "1.5"}, launch=MAKE_RUN)
    try:
        login = (b"POST /api/login HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"content-length: 1000\r\n\r\n{\"token\": \"")
        upload = (f"POST /api/import HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: multipart/form-data; "
                  f"boundary={BOUNDARY}\r\ntransfer-encoding: chunked\r\n\r\n{len(PART_HEAD):x}\r\n").encode() \
            + PART_HEAD + b"\r\n"
        for head, byte in ((login, b"a"), (upload, b"1\r\n \r\n")):
            answer, took = trickle(server.port, head, byte, limit=10)
            status, _, rest = answer.partition(b"\r\n")
            assert status == b"HTTP/1.1 408 Request Timeout", answer
            assert b"connection: close" in rest.lower() and b'"detail"' in rest
            assert 1.5 <= took < 5, took  # cut at BODY_TIMEOUT, and the connection closed with the answer
        assert httpx.get(f"{server.base_url}/healthz").status_code == 200
    finally:
        server.stop()
