"""How the server meets the network: uvicorn's options, a connection cap, a request-head timeout.

Exposed to a network, idle or trickling sockets must not lock people out: uvicorn (0.54) never
times out a connection that has not finished sending its request head (its keep-alive timer
starts only after a first response), and its `limit_concurrency` counts connections only once a
head is complete, then answers every request 503 while the table is full. So the HTTP protocol
here is uvicorn's own with three additions:

- a head timer: a connection that has not sent a complete request head within `header_timeout`
  seconds of opening (or of the first byte of its next request) is closed;
- a cap on open connections: at the cap, the idle connection (no request in progress: still
  sending its head, or kept alive after a response) that has been idle longest is closed to
  make room (a person's request completes its head in milliseconds, a trickling socket never
  does); only when every connection is busy with a real request does the newcomer get a 503;
- one log line per interval saying how many connections were shed and why.

The open-file soft limit is raised to the hard limit at start, and the cap kept below it, so
the process does not run out of descriptors before the cap is reached. This module knows
nothing of routes; a reverse proxy in front (README) is still the answer for an exposed server.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from chatserver.config import Settings

log = logging.getLogger("chat.serving")

SHED_LOG_INTERVAL = 10.0  # seconds between two "connections shed" log lines
# Descriptors kept for everything but client sockets: the store's files, logs, the event loop.
RESERVED_FILES = 64
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
         b"connection: close\r\ncontent-length: 32\r\n\r\ntoo many connections, try again\n")


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # some containers refuse; the cap below still fits
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


def connection_cap(wanted: int, open_files: int) -> int:
    """`wanted`, lowered so that each connection and its upstream socket fit in the open-file limit."""
    if open_files == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (open_files - RESERVED_FILES) // 2))


class _Shed:
    """Counts connections closed by the guard; logs the counts at most once per interval."""

    def __init__(self) -> None:
        self.counts = {"head_timeout": 0, "evicted": 0, "refused": 0}
        self.logged_at = float("-inf")

    def note(self, reason: str, cap: int, timeout: float) -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now - self.logged_at < SHED_LOG_INTERVAL:
            return
        c = self.counts
        log.warning(
            "shed connections: %d sent no complete request head within %gs, %d closed to make room at the "
            "cap of %d connections, %d refused with 503 (all busy). Put a reverse proxy in front (README).",
            c["head_timeout"], timeout, c["evicted"], cap, c["refused"])
        self.counts = dict.fromkeys(c, 0)
        self.logged_at = now


def guarded_protocol(max_connections: int, header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with a request-head timeout and a connection cap, for one server."""
    idle: dict[Any, None] = {}  # connections with no request in progress, longest idle first
    shed = _Shed()

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_head()
            if len(self.connections) > max_connections:
                self._make_room()

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:
                self._head_done()  # a request head completed: the app owns the pace from here
            elif self._head_timer is None and (before is None or before.response_complete):
                self._await_head()  # the first bytes of a next request on a kept-alive connection

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                idle[self] = None  # kept alive for a next request: uvicorn's keep-alive timer bounds it

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_done()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            idle[self] = None
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _head_done(self) -> None:
            idle.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            idle.pop(self, None)
            if not self.transport.is_closing():
                shed.note("head_timeout", max_connections, header_timeout)
                self.transport.close()

        def _make_room(self) -> None:
            oldest = next((c for c in idle if c is not self), None)
            if oldest is not None:
                shed.note("evicted", max_connections, header_timeout)
                oldest._head_done()
                oldest.transport.close()
                self.connections.discard(oldest)  # closing is not instant; the slot is free now
                return
            shed.note("refused", max_connections, header_timeout)
            self._head_done()
            self.transport.write(_BUSY)
            self.transport.close()

    return GuardedHTTPProtocol


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Every option `make run` gives uvicorn.run, so tests can start the server the same way."""
    cap = connection_cap(settings.max_connections, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    return {
        "host": settings.host,
        "port": settings.port,
        "http": guarded_protocol(cap, settings.header_timeout),
        # No access log: a line per request and per stream is noise beside our own log, and costs CPU.
        "access_log": False,
        # uvicorn would otherwise take the client address and scheme from X-Forwarded-For/-Proto of any
        # loopback peer; the app believes them from TRUSTED_PROXIES alone (auth.request_origin).
        "proxy_headers": False,
        "log_level": "info",
        # JSON lines: uvicorn's own loggers then go through the root logger's JSON handler (logs.py).
        **({"log_config": None} if settings.log_format == "json" else {}),
        # The seconds an idle kept-alive connection is held after a response (uvicorn's default, said here).
        "timeout_keep_alive": 5,
    }
