"""The gateway simulator in a process of its own, scripted from the benchmark runner over a pipe.

The simulator's scripting (`enqueue`) and its records (`requests`) live in the simulator's own
process, and a benchmark must not run the simulator on the load generator's or the server's
event loop (two cores: a shared loop would measure contention, not overhead). So this process
hosts one `GatewaySimulator` and answers a few commands from the runner:

- `("enqueue", reply, count)`: queue `count` copies of the reply `reply` describes
  (`{"words", "delay"}`: that many one-word text chunks, each after `delay` seconds).
- `("records", wait)`: what the simulator recorded, one small dict per request, after waiting up
  to `wait` seconds for every request to end (a hang-up is recorded a moment after it happens).
  A request is tagged with the `bench-tag-N` marker found in its last message, so the runner
  can pair it with the client request that caused it (the simulator's times are
  `time.monotonic()`, the same clock as the runner's and the load generator's on Linux).
- `("reset",)`: forget scripts and records between phases. `("stop",)`: exit.

It knows the simulator's public API and nothing about the chat server.
"""

from __future__ import annotations

import re
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = re.compile(r"bench-tag-\d+")


def reply_script(reply: dict):
    """A Script of `words` one-word chunks, `delay` seconds before each."""
    from gateway_sim.simulator import Script, Usage, steps

    words = " ".join(f"w{i}" for i in range(reply["words"]))
    # Fixed usage, so the simulator does not count tokens per request on the benchmark's time.
    return Script([steps.Text(words, chunk_size=1)], chunk_delay=reply["delay"],
                  usage=Usage(prompt=1000, completion=reply["words"]))


def tag_of(body: dict) -> str | None:
    """The tag of a turn's request; a call that is not streamed (a title, a summary) names none."""
    if not body.get("stream"):
        return None
    messages = body.get("messages") or []
    if not messages:
        return None
    content = messages[-1].get("content")
    text = content if isinstance(content, str) else " ".join(
        p.get("text", "") for p in content or [] if isinstance(p, dict))
    match = TAG.search(text)
    return match.group(0) if match else None


def serve(conn: Connection, port: int) -> None:
    """Process entry point: start the simulator on `port`, send its base URL, then obey commands."""
    sys.path.insert(0, str(ROOT))
    from gateway_sim.simulator import GatewaySimulator

    sim = GatewaySimulator(keep_requests=100_000).start(port=port)  # every stream of a phase is reported
    conn.send(sim.base_url)
    while True:
        command, *args = conn.recv()
        if command == "enqueue":
            reply, count = args
            sim.enqueue(*[reply_script(reply) for _ in range(count)])
            conn.send(count)
        elif command == "records":
            deadline = time.monotonic() + args[0]
            for r in sim.requests:
                r.ended.wait(max(0.0, deadline - time.monotonic()))
            conn.send([{
                "tag": tag_of(r.body), "path": r.path, "status": r.status, "started_at": r.started_at,
                "first_byte_at": r.first_byte_at, "finished_at": r.finished_at,
                "disconnected_at": r.disconnected_at, "completed": r.completed, "error": r.error,
            } for r in sim.requests])
        elif command == "reset":
            sim.reset()
            conn.send(True)
        elif command == "stop":
            sim.stop()
            conn.send(True)
            return
