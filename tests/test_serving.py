"""Idle and trickling connections cannot lock people out of a real uvicorn started as `make run` starts it."""

from __future__ import annotations

import contextlib
import json
import resource
import select
import socket
import subprocess
import sys
import time

import httpx

from chatserver import serving
from gateway_sim.simulator import Script, steps
from support import ROOT, LiveServer

# `make run` is `python server.py`, i.e. server.main(); the port comes from PORT like any setting.
MAKE_RUN = "import os, sys; os.environ['PORT'] = sys.argv[1]; import server; server.main()"


def open_slow_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    # A request head that never completes: a header value that grows by one byte at a time.
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
    sock.setblocking(False)
    return sock


def is_closed(sock: socket.socket) -> bool:
    """True once the server acted on the socket: EOF, a reset, or the 503 that comes before the close."""
    return bool(select.select([sock], [], [], 0)[0])


def test_trickling_sockets_beyond_the_cap_do_not_lock_out_healthz_and_are_closed(tmp_path, sim):
    cap, timeout = 8, 4.0
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "MAX_CONNECTIONS": str(cap),
                                            "HEADER_TIMEOUT": str(timeout)}, launch=MAKE_RUN)
    slow: list[socket.socket] = []
    try:
        opened = time.monotonic()
        slow = [open_slow_socket(server.port) for _ in range(3 * cap)]

        asked = time.monotonic()
        health = httpx.get(f"{server.base_url}/healthz", timeout=timeout)
        answered = time.monotonic()
        assert health.status_code == 200 and health.json()["ok"] is True
        # Answered before any head timer could fire: room was made by closing the oldest slow socket.
        assert answered - opened < timeout, (answered - asked, answered - opened)

        closed_at: dict[int, float] = {}

        def sweep() -> None:
            for i, sock in enumerate(slow):
                if i not in closed_at and is_closed(sock):
                    closed_at[i] = time.monotonic()

        # The cap holds: all but the newest `cap` slow sockets were closed at once, long before the timeout.
        while len(closed_at) < len(slow) - cap and time.monotonic() < opened + timeout - 0.5:
            sweep()
            time.sleep(0.05)
        assert len(closed_at) >= len(slow) - cap, f"{len(slow) - len(closed_at)} open at a cap of {cap}"

        deadline = opened + timeout + 5
        while len(closed_at) < len(slow) and time.monotonic() < deadline:
            for i, sock in enumerate(slow):
                if i in closed_at:
                    continue
                if is_closed(sock):
                    closed_at[i] = time.monotonic()
                    continue
                try:
                    sock.send(b"a")  # one more byte: trickling must not keep a connection alive
                except (BrokenPipeError, ConnectionResetError, BlockingIOError):
                    closed_at[i] = time.monotonic()
            time.sleep(0.25)
        assert len(closed_at) == len(slow), f"{len(slow) - len(closed_at)} slow sockets still open"
        assert max(closed_at.values()) - opened < timeout + 5

        log = server.log()
        assert log.count("shed connections") == 1, log  # once per interval, not once per socket
        assert "closed to make room at the cap of 8 connections" in log
        assert httpx.get(f"{server.base_url}/healthz", timeout=5).status_code == 200
    finally:
        for sock in slow:
            sock.close()
        server.stop()


def test_open_file_soft_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    code = ("import resource; from chatserver import serving; raised = serving.raise_open_file_limit(); "
            "print(raised, *resource.getrlimit(resource.RLIMIT_NOFILE))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    raised, now_soft, now_hard = map(int, result.stdout.split())
    assert raised == now_soft == now_hard == hard


def test_connection_cap_fits_each_connection_and_its_upstream_socket_in_the_file_limit():
    assert serving.connection_cap(1000, 1024) == (1024 - serving.RESERVED_FILES) // 2
    assert serving.connection_cap(100, 20_000) == 100
    assert serving.connection_cap(1000, resource.RLIM_INFINITY) == 1000


def test_when_every_connection_is_busy_a_newcomer_gets_503_and_is_served_once_one_frees(tmp_path, sim):
    sim.enqueue(*[Script(steps=[steps.Text("first words"), steps.Sleep(20), steps.Text("never")])] * 2)
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "MAX_CONNECTIONS": "2",
                                            "UPSTREAM_TIMEOUT": "30"}, launch=MAKE_RUN)
    try:
        conv_ids = []
        for _ in range(2):
            conv_id = httpx.post(f"{server.base_url}/api/conversations", json={}).json()["id"]
            httpx.patch(f"{server.base_url}/api/conversations/{conv_id}",
                        json={"settings": {"web_search": False, "web_fetch": False}})
            conv_ids.append(conv_id)
        with contextlib.ExitStack() as streams:
            readers = []  # kept: dropping a half-read line iterator closes its connection
            for conv_id in conv_ids:  # two replies streaming: both connections busy with real requests
                response = streams.enter_context(httpx.stream(
                    "POST", f"{server.base_url}/api/conversations/{conv_id}/messages",
                    json={"content": "tell me"}, timeout=10))
                readers.append(response.iter_lines())
                assert any(line.startswith("event: delta") for line in readers[-1])

            busy = httpx.get(f"{server.base_url}/healthz", timeout=5)
            assert busy.status_code == 503 and "too many connections" in busy.text

        # The streams closed: room again.
        assert eventually_ok(lambda: httpx.get(f"{server.base_url}/healthz", timeout=5).status_code == 200)
        assert "refused with 503" in server.log()
    finally:
        server.stop()


def eventually_ok(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response with a content-length body, so nothing of it is left to read."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def read_json(sock: socket.socket) -> dict:
    """The JSON body of one whole HTTP response read off the socket."""
    return json.loads(read_response(sock).partition(b"\r\n\r\n")[2])


def test_at_the_cap_an_idle_kept_alive_connection_makes_room_for_a_newcomer(tmp_path, sim):
    server = LiveServer(tmp_path / "data", {"GATEWAY_BASE_URL": sim.base_url, "MAX_CONNECTIONS": "2"},
                        launch=MAKE_RUN)
    kept: list[socket.socket] = []
    try:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 "), "a newcomer was refused while others sat idle"
            kept.append(sock)  # answered and kept alive: idle until uvicorn's keep-alive timer ends it
        kept[0].settimeout(5)
        assert kept[0].recv(1) == b"", "the longest idle connection was not the one closed"
        assert "closed to make room at the cap of 2 connections" in server.log()
    finally:
        for sock in kept:
            sock.close()
        server.stop()
