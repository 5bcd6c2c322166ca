"""The load generator: many concurrent SSE streams over raw loopback sockets, timed event by event.

Run as its own process (`python bench/load.py < spec.json > records.json`) so that its event
loop never shares a core-limited loop with the server it measures. It speaks just enough
HTTP/1.1 (request, status line, chunked or length-delimited body) and SSE (records split on a
blank line, CRLF or LF) to time what a browser would see, with as little client-side work per
event as possible: a slow client would inflate every percentile it reports.

Two stream dialects are understood:
- "turn": this server's turn stream. A content event is `event: delta`; `done` or `error` ends it.
- "chat": an OpenAI chat-completions stream (the simulator, the bare relay, LiteLLM). A content
  event is a chunk whose first choice carries non-empty `delta.content`; `data: [DONE]` ends it.

It knows nothing about conversations or scripts: each request is bytes to send and a dialect.
All times are `time.monotonic()`, the clock the simulator stamps its records with.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time

import orjson

EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
HEAD_END = b"\r\n\r\n"


class Stream(asyncio.Protocol):
    """One request on one fresh connection; fills `record` and resolves `finished` when it is over."""

    def __init__(self, request: bytes, dialect: str, stop_after: int | None, keep_gaps: bool,
                 finished: asyncio.Future, stop=None) -> None:
        self.request = request
        self.dialect = dialect
        self.stop_after = stop_after
        self.stop = stop  # None: Stop closes the socket; else it is called and the stream is read to its end
        self.keep_gaps = keep_gaps
        self.finished = finished
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.head_done = False
        self.chunked = False
        self.remaining: int | None = None  # bytes left in the current chunk (or the whole body)
        self.raw = b""  # undecoded transfer bytes
        self.body = b""  # decoded SSE bytes not yet split into records
        self.body_done = False  # the last chunk (or the last byte of a sized body) has arrived
        self.last_content: float | None = None
        self.record: dict = {"status": None, "first": None, "end": None, "events": 0, "ok": False,
                             "error": None, "stopped": None}
        if keep_gaps:
            self.record["gaps"] = []

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.head_done:
            self.head += data
            if HEAD_END not in self.head:
                return
            head, _, data = self.head.partition(HEAD_END)
            self._parse_head(head)
            if self.finished.done():
                return
        self.raw += data
        self._dechunk()
        self._split(now)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.finished.done():
            if self.record["error"] is None and not self.record["ok"]:
                self.record["error"] = f"connection closed early ({exc or 'EOF'})"
            self.finished.set_result(self.record)

    def _parse_head(self, head: bytes) -> None:
        self.head_done = True
        lines = head.split(b"\r\n")
        self.record["status"] = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        self.chunked = headers.get(b"transfer-encoding") == b"chunked"
        if not self.chunked and b"content-length" in headers:
            self.remaining = int(headers[b"content-length"])
        if self.record["status"] != 200:
            self.record["error"] = f"HTTP {self.record['status']}"

    def _dechunk(self) -> None:
        if not self.chunked:
            self.body += self.raw
            if self.remaining is not None:
                self.remaining -= len(self.raw)
                self.body_done = self.remaining <= 0
            self.raw = b""
            return
        while True:
            if self.remaining is None:
                line_end = self.raw.find(b"\r\n")
                if line_end < 0:
                    return
                size = int(self.raw[:line_end].split(b";")[0], 16)
                self.raw = self.raw[line_end + 2:]
                if size == 0:
                    self.body_done = True
                    return
                self.remaining = size
            if len(self.raw) < self.remaining + 2:
                # Take what there is of the chunk now, so an event is timed when it arrives.
                take = min(len(self.raw), self.remaining)
                self.body += self.raw[:take]
                self.raw = self.raw[take:]
                self.remaining -= take
                return
            self.body += self.raw[:self.remaining]
            self.raw = self.raw[self.remaining + 2:]
            self.remaining = None

    def _split(self, now: float) -> None:
        while self.body and not self.finished.done():
            match = EVENT_END.search(self.body)
            if match is None:
                break
            block, self.body = self.body[:match.start()], self.body[match.end():]
            self._event(block, now)
        if self.body_done:
            self._finish()

    def _event(self, block: bytes, now: float) -> None:
        name, data = b"", b""
        for line in block.splitlines():
            if line.startswith(b"event:"):
                name = line[6:].strip()
            elif line.startswith(b"data:"):
                data = line[5:].strip()
        content = end = False
        if self.dialect == "turn":
            content = name == b"delta"
            if name == b"done":
                end = True
                self.record["ok"] = True
            elif name == b"error":
                end = True
                self.record["error"] = "error event: " + data.decode("utf-8", "replace")[:200]
        elif data == b"[DONE]":
            end = True
            self.record["ok"] = True
        elif data:
            chunk = orjson.loads(data)
            if chunk.get("error"):
                end = True
                self.record["error"] = "stream error: " + data.decode("utf-8", "replace")[:200]
            else:
                choices = chunk.get("choices") or [{}]
                content = bool((choices[0].get("delta") or {}).get("content"))
        if content:
            self._content(now)
        if end:
            # The stream is over, but the connection is closed only when the body ends: a
            # server may still be finishing the turn (our server releases the conversation then).
            self.record["end"] = now

    def _content(self, now: float) -> None:
        rec = self.record
        rec["events"] += 1
        if rec["first"] is None:
            rec["first"] = now
        elif self.keep_gaps:
            rec["gaps"].append(now - self.last_content)
        self.last_content = now
        if self.stop_after is not None and rec["events"] >= self.stop_after and rec["stopped"] is None:
            rec["stopped"] = time.monotonic()
            if self.stop is not None:
                self.stop()  # the page's Stop button: the stop route; this stream then ends with `done`
            else:
                self._finish()  # what a browser's abort does to an HTTP/1.1 stream: the socket closes

    def _finish(self) -> None:
        if not self.finished.done():
            self.finished.set_result(self.record)
        if self.transport is not None:
            self.transport.close()


def http_request(host: str, port: int, path: str, body: bytes, token: str) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nAuthorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def post_and_close(host: str, port: int, request: bytes) -> None:
    """One short request on a connection of its own; its answer's head is read, the rest ignored."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await reader.readuntil(HEAD_END)
    finally:
        writer.close()


STOPPING: set[asyncio.Task] = set()  # the stop requests in flight (a task nobody holds may be collected)


def stop_route(loop: asyncio.AbstractEventLoop, spec: dict, req: dict):
    """What Stop does with `stop_via: "route"`: POST {conversation}/stop from another connection."""
    if spec.get("stop_via") != "route":
        return None
    path = req["path"].rsplit("/", 1)[0] + "/stop"
    # `stop_port`: Stop sent to another server process than the one streaming (the cross-process Stop).
    port = spec.get("stop_port") or spec["port"]
    request = http_request(spec["host"], port, path, b"{}", spec["token"])

    def stop() -> None:
        task = loop.create_task(post_and_close(spec["host"], port, request))
        STOPPING.add(task)
        task.add_done_callback(STOPPING.discard)

    return stop


async def one(loop: asyncio.AbstractEventLoop, spec: dict, req: dict, timeout: float) -> dict:
    """Send one request and wait for its stream to end (or the per-request timeout)."""
    finished = loop.create_future()
    port = req.get("port") or spec["port"]  # a request may name its own server (streams spread over processes)
    request = http_request(spec["host"], port, req["path"], req["body"].encode(), spec["token"])
    stop = stop_route(loop, spec, req)
    start = time.monotonic()
    try:
        transport, _ = await asyncio.wait_for(loop.create_connection(
            lambda: Stream(request, spec["dialect"], spec.get("stop_after"), spec.get("keep_gaps", False), finished,
                           stop),
            spec["host"], port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        return {"start": start, "status": None, "first": None, "end": None, "events": 0, "ok": False,
                "error": f"connect: {exc!r}", "stopped": None, "tag": req.get("tag")}
    try:
        record = await asyncio.wait_for(asyncio.shield(finished), timeout)
    except asyncio.TimeoutError:
        transport.close()
        record = finished.result() if finished.done() else {
            "status": None, "first": None, "end": None, "events": 0, "ok": False, "stopped": None}
        record["error"] = record.get("error") or f"timed out after {timeout}s"
    return {**record, "start": start, "tag": req.get("tag")}


async def client(loop, spec: dict, requests: list[dict], delay: float, deadline: float, out: list) -> None:
    """One simulated person: their requests back to back, after a start offset."""
    await asyncio.sleep(delay)
    for req in requests:
        left = deadline - time.monotonic()
        if left <= 0:
            out.append({"tag": req.get("tag"), "ok": False, "error": "phase deadline passed before start",
                        "start": None, "first": None, "end": None, "events": 0, "stopped": None})
            continue
        out.append(await one(loop, spec, req, min(spec["request_timeout"], left)))


async def run(spec: dict) -> list[dict]:
    """`spec["clients"]` is a list of request lists; client i starts at i/len * spread seconds."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + spec["phase_timeout"]
    clients = spec["clients"]
    out: list[dict] = []
    spread = spec.get("spread", 0.0)
    await asyncio.gather(*(client(loop, spec, reqs, spread * i / len(clients), deadline, out)
                           for i, reqs in enumerate(clients)))
    return out


def main() -> None:
    spec = orjson.loads(sys.stdin.buffer.read())
    sys.stdout.buffer.write(orjson.dumps(asyncio.run(run(spec))))


if __name__ == "__main__":
    main()
