"""Whether the configured gateway answers at all: one short GET, its result cached for a few seconds.

Any HTTP answer counts as reachable (a 401 or a 404 still proves a server listens there); a
refused, reset or timed-out connection, or a TLS failure, reads as unreachable. Probes of one
address share one in-flight request, so a burst of health checks costs one GET. The key is not
sent: the probe asks "is anything there", not "will it serve us". This module knows nothing of
models, keys or routes.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx2

log = logging.getLogger("chat.gateway_probe")

PROBE_PATH = "/v1/models"
PROBE_TIMEOUT = 2.0  # seconds; a gateway slower than this to answer a GET is as good as down
PROBE_TTL = 5.0  # seconds a result is reused


class _Entry:
    __slots__ = ("checked_at", "reachable", "lock", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.checked_at = float("-inf")
        self.reachable = False
        self.lock = asyncio.Lock()
        self.loop = loop  # an asyncio.Lock serves one event loop; a new loop gets a new entry


_entries: dict[str, _Entry] = {}


async def gateway_reachable(base_url: str | None, client: httpx2.AsyncClient, *,
                            timeout: float = PROBE_TIMEOUT, ttl: float = PROBE_TTL) -> bool | None:
    """True when something answers HTTP at `base_url`, False when nothing does; None without a gateway."""
    if base_url is None:
        return None
    loop = asyncio.get_running_loop()
    entry = _entries.get(base_url)
    if entry is None or entry.loop is not loop:
        entry = _entries[base_url] = _Entry(loop)
    if time.monotonic() - entry.checked_at < ttl:
        return entry.reachable
    async with entry.lock:
        if time.monotonic() - entry.checked_at < ttl:  # another caller probed while we waited
            return entry.reachable
        reachable = await _probe(base_url, client, timeout)
        if reachable != entry.reachable or entry.checked_at == float("-inf"):
            log.log(logging.INFO if reachable else logging.WARNING, "gateway at %s %s", base_url,
                    "answers" if reachable else "does not answer")
        entry.reachable, entry.checked_at = reachable, time.monotonic()
        return reachable


async def _probe(base_url: str, client: httpx2.AsyncClient, timeout: float) -> bool:
    try:
        async with client.stream("GET", base_url + PROBE_PATH, timeout=timeout):
            return True  # the status line arrived; the body is not needed
    except httpx2.HTTPError:
        return False
