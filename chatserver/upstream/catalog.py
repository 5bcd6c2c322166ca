"""What the gateway's own model list (`GET /v1/models`) says about the models: which take images.

OpenRouter lists each model with `architecture.input_modalities` (`["text", "image"]` for one
that reads images); other gateways list bare ids, which say nothing, so nothing is learned from
them. The list is read once at start and again when it is older than CATALOG_TTL; readers get
the last answer at once (the first one waits for it, at most CATALOG_TIMEOUT), and a gateway that
does not answer leaves what was known. The key is sent (OpenRouter lists without it, others may
not). This module knows nothing of the lineup or of turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx2
import orjson

from chatserver.upstream.chat import auth_headers
from chatserver.upstream.client import Gateway

log = logging.getLogger("chat.catalog")

PATH = "/v1/models"
CATALOG_TTL = 600.0  # seconds a model list is reused
RETRY_AFTER = 60.0  # seconds before a failed read is tried again
CATALOG_TIMEOUT = 3.0
CATALOG_MAX_BYTES = 8 * 1024 * 1024  # OpenRouter's whole list is about 1.5 MB


def vision_ids_of(listing: object) -> frozenset[str]:
    """The ids a `/v1/models` answer marks as taking image input."""
    data = listing.get("data") if isinstance(listing, dict) else None
    out = set()
    for entry in data if isinstance(data, list) else ():
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        architecture = entry.get("architecture")
        modalities = architecture.get("input_modalities") if isinstance(architecture, dict) else None
        if isinstance(modalities, list) and "image" in modalities:
            out.add(entry["id"])
    return frozenset(out)


class GatewayCatalog:
    """The gateway's model list, cached; only what it says about image input is kept."""

    def __init__(self, gateway: Gateway, *, ttl: float = CATALOG_TTL, timeout: float = CATALOG_TIMEOUT) -> None:
        self.gateway = gateway
        self.ttl = ttl
        self.timeout = timeout
        self._vision: frozenset[str] | None = None
        self._fresh_until = float("-inf")
        self._refreshing: asyncio.Task | None = None

    def start(self) -> None:
        """Read the list now, in the background, so the first person to ask does not wait for it."""
        self._refresh_soon()

    async def vision_ids(self) -> frozenset[str]:
        """The ids the gateway says take images (empty when it says nothing or cannot be reached)."""
        if time.monotonic() >= self._fresh_until:
            task = self._refresh_soon()
            if self._vision is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(task), self.timeout)
        return self._vision or frozenset()

    def _refresh_soon(self) -> asyncio.Task:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._refresh())
        return self._refreshing

    async def _refresh(self) -> None:
        try:
            listing = await self._read()
        except (httpx2.HTTPError, ValueError, RuntimeError) as exc:  # RuntimeError: the client closed at shutdown
            log.info("the gateway's model list could not be read (%s); retrying in %gs",
                     type(exc).__name__, RETRY_AFTER)
            self._fresh_until = time.monotonic() + RETRY_AFTER
            return
        self._vision = vision_ids_of(listing)
        self._fresh_until = time.monotonic() + self.ttl

    async def _read(self) -> object:
        async with self.gateway.client.stream("GET", self.gateway.url(PATH), timeout=self.timeout,
                                              headers=auth_headers(self.gateway.api_key)) as response:
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > CATALOG_MAX_BYTES:
                    raise ValueError("the model list is too large")
        return orjson.loads(bytes(body))

    async def close(self) -> None:
        self._fresh_until = float("inf")  # a turn still ending asks no more: the client is about to close
        if self._refreshing is not None and not self._refreshing.done():
            self._refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refreshing
