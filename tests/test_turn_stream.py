"""`TurnResponse` (chatserver/api/sse.py) as the ASGI server sees it: frames in order then an end,
SSE headers, pings after silence, and a stream that ends (its frames closed, `closed` run once) when
the client leaves, the reader stalls, the server stops, the frames fail, or the request is a HEAD.

Driven as an ASGI app with a scripted server side (`Peer`) on the test's own event loop; the
server stopping through a real uvicorn is in test_person_events.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
from sse_starlette.sse import AppStatus

from chatserver.api import sse
from chatserver.api.sse import TurnResponse

PING = b": ping\r\n\r\n"
BOUND = 1.5  # seconds anything here may take; each expected wait is a fraction of it


class Peer:
    """The server's side of one response: records what is sent, when; `leave` is a hang-up and
    `stall` a reader that stops accepting bytes."""

    def __init__(self, method: str = "GET") -> None:
        self.scope = {"type": "http", "method": method, "path": "/stream", "headers": []}
        self.sent: list[tuple[float, dict]] = []
        self._changed = asyncio.Condition()
        self._left = asyncio.Event()
        self._accepting = asyncio.Event()
        self._accepting.set()
        self._asked = False

    async def receive(self) -> dict:
        # The (empty) request body first, as a server gives it; then nothing until the client leaves.
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        await self._accepting.wait()
        async with self._changed:
            self.sent.append((asyncio.get_running_loop().time(), message))
            self._changed.notify_all()

    def leave(self) -> None:
        self._left.set()

    def stall(self) -> None:
        self._accepting.clear()

    async def until(self, seen: Callable[[list[dict]], bool]) -> None:
        """Waits (bounded) until the messages sent so far satisfy `seen`."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: seen(self.messages)), BOUND)

    @property
    def messages(self) -> list[dict]:
        return [message for _, message in self.sent]

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]

    def times_of(self, body: bytes) -> list[float]:
        return [at for at, m in self.sent if m["type"] == "http.response.body" and m["body"] == body]


class Source:
    """A turn's frames as the test feeds them (`None` ends them, an exception is raised); notes
    whether they were ever iterated, whether their `finally` ran, and in which tasks."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self.iterated = False
        self.finished = False
        self.ran_in: asyncio.Task | None = None
        self.finished_in: asyncio.Task | None = None
        self.frames = self._frames()

    async def _frames(self):
        self.iterated, self.ran_in = True, asyncio.current_task()
        try:
            while (item := await self.queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.finished, self.finished_in = True, asyncio.current_task()

    def feed(self, *items: bytes | BaseException | None) -> None:
        for item in items:
            self.queue.put_nowait(item)


class Closed:
    """The `closed` callback; counts the times it was awaited (its body runs only then)."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1


def start(peer: Peer, source: Source, closed: Closed, send_timeout: float | None = None) -> asyncio.Task:
    response = TurnResponse(source.frames, closed, send_timeout=send_timeout)
    return asyncio.ensure_future(response(peer.scope, peer.receive, peer.send))


def frames(n: int) -> list[bytes]:
    return [sse.frame("delta", {"text": f"piece {i}"}, seq=i + 1) for i in range(n)]


async def ended(response: asyncio.Task) -> float:
    """Waits (bounded) for the response to end; how long that took."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(response, BOUND)
    return loop.time() - began


def assert_torn_down(source: Source, closed: Closed) -> None:
    assert source.finished, "the frames' finally never ran"
    assert source.frames.ag_frame is None, "the frames were never closed"
    # A turn's frames may hold task-bound contexts (a cancel scope, a lock): they close in their task.
    assert source.finished_in is source.ran_in
    assert closed.calls == 1


@pytest.fixture
def quick_pings(monkeypatch) -> float:
    monkeypatch.setattr(sse, "PING_SECONDS", 0.4)
    return 0.4


# --- A whole stream ---

async def test_frames_arrive_in_order_as_more_body_then_an_empty_end_under_sse_headers():
    peer, source, closed = Peer(), Source(), Closed()
    sent = frames(3)
    source.feed(*sent, None)
    await ended(start(peer, source, closed, send_timeout=5))

    head, *bodies = peer.messages
    assert head["type"] == "http.response.start" and head["status"] == 200
    headers = {name.decode(): value.decode() for name, value in head["headers"]}
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["cache-control"] == "no-store"
    assert headers["x-accel-buffering"] == "no"
    assert "content-length" not in headers
    assert [(m["type"], m["body"], m["more_body"]) for m in bodies] == \
        [("http.response.body", chunk, True) for chunk in sent] + [("http.response.body", b"", False)]
    assert_torn_down(source, closed)


# --- Pings ---

async def test_a_ping_follows_each_ping_interval_of_silence_counted_from_the_last_frame(quick_pings):
    """Regression: the handler waited a whole interval at a time, so a frame sent soon after it began
    to wait put the next ping off to nearly twice the interval of silence."""
    peer, source, closed = Peer(), Source(), Closed()
    first = frames(1)[0]
    response = start(peer, source, closed)
    await asyncio.sleep(quick_pings / 8)  # the scenario: a first frame a moment in, then silence
    source.feed(first)
    await peer.until(lambda sent: sum(m.get("body") == PING for m in sent) >= 2)

    [sent_first] = peer.times_of(first)
    pinged = peer.times_of(PING)
    silences = [pinged[0] - sent_first, pinged[1] - pinged[0]]
    for silence in silences:
        assert quick_pings * 0.95 <= silence < quick_pings * 1.5, silences
    assert all(m.get("more_body") for m in peer.messages[1:])

    source.feed(None)
    await ended(response)
    assert peer.bodies()[-1] == b"" and peer.messages[-1]["more_body"] is False
    assert_torn_down(source, closed)


async def test_no_ping_while_frames_come_faster_than_the_ping_interval(quick_pings):
    peer, source, closed = Peer(), Source(), Closed()
    response = start(peer, source, closed, send_timeout=5)
    sent = frames(20)
    for chunk in sent:  # a frame every eighth of the interval, for two and a half intervals
        source.feed(chunk)
        await asyncio.sleep(quick_pings / 8)
    source.feed(None)
    await ended(response)
    assert peer.bodies() == [*sent, b""]


# --- Ways a stream ends early ---

async def test_the_client_leaving_ends_the_stream_closes_the_frames_and_runs_closed_once():
    peer, source, closed = Peer(), Source(), Closed()
    first = frames(1)[0]
    source.feed(first)  # then no more frames: only the hang-up can end it
    response = start(peer, source, closed, send_timeout=5)
    await peer.until(lambda sent: any(m.get("body") == first for m in sent))

    peer.leave()
    assert await ended(response) < 0.5
    assert_torn_down(source, closed)


async def test_a_reader_that_accepts_nothing_for_send_timeout_is_dropped(caplog):
    peer, source, closed = Peer(), Source(), Closed()
    first, second = frames(2)
    source.feed(first)
    response = start(peer, source, closed, send_timeout=0.2)
    await peer.until(lambda sent: any(m.get("body") == first for m in sent))

    peer.stall()
    with caplog.at_level(logging.INFO, logger="chat.streaming"):
        source.feed(second)
        took = await ended(response)
    assert 0.2 <= took < 0.8, took
    assert peer.bodies() == [first]
    assert "dropped a turn stream whose reader accepted nothing for 0.2s" in caplog.text
    assert_torn_down(source, closed)


async def test_a_stalled_reader_is_dropped_when_only_pings_are_being_sent(monkeypatch):
    """Regression: the handler awaited the ping's send with no bound, so a reader that stopped
    reading during a silent stretch (a person's events stream is mostly silence) held the stream,
    unwatched for a hang-up or a stopping server, as long as the socket lived."""
    monkeypatch.setattr(sse, "PING_SECONDS", 0.1)
    peer, source, closed = Peer(), Source(), Closed()
    response = start(peer, source, closed, send_timeout=0.3)
    await peer.until(lambda sent: any(m.get("body") == PING for m in sent))

    peer.stall()
    took = await ended(response)
    assert took < 1.0, took
    assert_torn_down(source, closed)


async def test_silence_between_frames_is_not_a_stalled_reader():
    """Only a send counts toward send_timeout: a turn may produce nothing for longer than it."""
    peer, source, closed = Peer(), Source(), Closed()
    first, second = frames(2)
    source.feed(first)
    response = start(peer, source, closed, send_timeout=0.1)
    await peer.until(lambda sent: any(m.get("body") == first for m in sent))

    await asyncio.sleep(0.35)  # the scenario: over three send timeouts of silence from the turn
    assert not response.done()
    source.feed(second, None)
    await ended(response)
    assert peer.bodies() == [first, second, b""]
    assert_torn_down(source, closed)


@pytest.fixture
def server_status(monkeypatch):
    """AppStatus.should_exit is process-wide: whatever a test sets, the next one starts from False."""
    monkeypatch.setattr(sse, "EXIT_POLL_SECONDS", 0.05)
    AppStatus.should_exit = False
    try:
        yield AppStatus
    finally:
        AppStatus.should_exit = False


async def test_the_server_stopping_ends_an_open_stream(server_status):
    # Each test runs on an event loop of its own, so this one gets its own stop watcher (sse._stopping).
    assert asyncio.get_running_loop() not in sse._stopping
    peer, source, closed = Peer(), Source(), Closed()
    first = frames(1)[0]
    source.feed(first)
    response = start(peer, source, closed, send_timeout=5)
    await peer.until(lambda sent: any(m.get("body") == first for m in sent))
    assert not response.done()

    server_status.should_exit = True  # what uvicorn's exit signal sets, through sse-starlette's hook
    assert await ended(response) < 0.5
    assert_torn_down(source, closed)


async def test_an_error_from_the_frames_reaches_the_server_and_closed_still_runs():
    peer, source, closed = Peer(), Source(), Closed()
    first = frames(1)[0]
    source.feed(first, RuntimeError("the turn broke"))
    with pytest.raises(RuntimeError, match="the turn broke"):
        await ended(start(peer, source, closed, send_timeout=5))
    assert peer.bodies() == [first]
    assert_torn_down(source, closed)


# --- HEAD ---

async def test_head_gets_the_headers_and_an_empty_body_and_never_starts_the_frames():
    peer, source, closed = Peer("HEAD"), Source(), Closed()
    source.feed(*frames(2), None)
    await ended(start(peer, source, closed, send_timeout=5))

    head, body = peer.messages
    assert head["type"] == "http.response.start"
    assert dict(head["headers"])[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert (body["type"], body["body"], body["more_body"]) == ("http.response.body", b"", False)
    assert not source.iterated
    assert source.frames.ag_frame is None, "the frames were never closed"
    assert closed.calls == 1
