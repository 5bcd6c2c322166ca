"""Numbers an operator can scrape: `GET /metrics` in the Prometheus text format (issue 30).

One `Metrics` per process, made by `create_app` and reached as `metrics.active` from the few
places that count (the turn hub, the tool loop, the gateway client, the store wrapper, the turn
stream): turns by outcome and failure kind, time to the first token and to the end of a turn,
turn streams open, tool calls and tool errors by tool, tokens and cost by model, store and
gateway latency.

With WORKERS above 1 every worker writes its numbers to files in one directory the parent made
for this start (prometheus-client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`), and whichever
worker answers a scrape adds them all up; the parent removes the directory when it stops.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a few ms (a cached first token) to minutes (a long reply with tool rounds).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.directory = os.environ.get(MULTIPROC_ENV) or None
        if self.directory:
            # Chosen per process, now: the module may have been imported before the parent set the directory.
            values.ValueClass = values.MultiProcessValue()
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("chat_turns", "Turns ended, by outcome (complete, interrupted, failed) and failure kind",
                             ["outcome", "kind"], registry=r)
        self.first_token = Histogram("chat_turn_first_token_seconds", "From a turn's start to its first reply text",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.turn_seconds = Histogram("chat_turn_seconds", "From a turn's start to its end, whatever the outcome",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.streams_open = Gauge("chat_streams_open", "Turn streams open to readers", registry=r,
                                  multiprocess_mode="livesum")
        self.tool_calls = Counter("chat_tool_calls", "Tool calls run by the server, by tool", ["tool"], registry=r)
        self.tool_errors = Counter("chat_tool_errors", "Tool calls that ended in a [tool error], by tool", ["tool"],
                                   registry=r)
        self.tokens = Counter("chat_tokens", "Tokens of settled replies, by model and kind (input, output, cached)",
                              ["model", "kind"], registry=r)
        self.cost = Counter("chat_cost", "Cost the gateway reported for settled replies, by model", ["model"],
                            registry=r)
        self.store_seconds = Histogram("chat_store_seconds", "Store calls a turn waits for, by operation",
                                       ["operation"], buckets=STORE_BUCKETS, registry=r)
        self.gateway_seconds = Histogram("chat_gateway_response_seconds",
                                         "From sending a request to the gateway to its response headers",
                                         buckets=LATENCY_BUCKETS, registry=r)

    def turn_ended(self, outcome: str, kind: str, seconds: float) -> None:
        self.turns.labels(outcome, kind).inc()
        self.turn_seconds.observe(seconds)

    def usage(self, model: str, usage: dict | None) -> None:
        if not usage:
            return
        for kind, key in (("input", "input_tokens"), ("output", "output_tokens"), ("cached", "cached_tokens")):
            if count := usage.get(key):
                self.tokens.labels(model, kind).inc(count)
        if cost := usage.get("cost"):
            self.cost.labels(model).inc(cost)

    def exposition(self) -> bytes:
        """Every counter of this server (of all its workers in multiprocess mode), as text."""
        if self.directory:
            merged = CollectorRegistry()
            MultiProcessCollector(merged, self.directory)
            return generate_latest(merged)
        return generate_latest(self.registry)


active = Metrics()


def start() -> Metrics:
    """This process's metrics, fresh (`create_app`; in a worker, in the directory the parent made)."""
    global active
    active = Metrics()
    return active


def worker_gone(pid: int) -> None:
    """A dead worker's live gauges (streams open) stop counting; its counters stay in the sums."""
    if directory := os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, directory)


def token_matches(header: str | None, token: str | None) -> bool:
    """`Authorization: Bearer <METRICS_TOKEN>`, compared in constant time."""
    if not token or not header or not header.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())


def fresh_directory(parent: Path | None = None) -> Path:
    """A directory of its own for one start of a multi-worker server (removed when it stops)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="chat-metrics-", dir=parent))
