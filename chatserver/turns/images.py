"""Images as a turn sends them upstream, and what they cost in tokens.

Promises:
- `Scaler.scaled` gives an image with its long edge at most IMAGE_MAX_EDGE, in the prompt's
  neutral shape (`Scaled.part`). An image already small enough goes as stored (its bytes are the
  upload's clean re-encode) and is never parsed here; a larger one is drawn smaller by the caller's
  `shrink` (the attachments' limited child, like a thumbnail: no decoder of an uploaded file runs
  in the server), at most SCALE_AT_ONCE at a time. Results are kept by attachment id (ids are never
  reused) up to CACHE_BYTES, so an image is scaled once per process, not on every turn.
- `image_tokens` estimates what a model is billed for an image, by its provider's published rule:
  Anthropic's (width x height / 750, after its own resize to at most 1568 px and 1.15 MP), else
  OpenAI's high-detail tiles (fit in 2048², shortest side to 768, 85 + 170 per 512-px tile). The
  estimate only stands until the gateway measures the prompt (context.py's loop).

Nothing here reads who owns an image: callers pass the bytes they were allowed to read.
"""

from __future__ import annotations

import asyncio
import base64
import math
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

SCALE_AT_ONCE = 2
CACHE_BYTES = 48 * 1024 * 1024

ANTHROPIC_MAX_EDGE = 1568
ANTHROPIC_MAX_PIXELS = 1_150_000
ANTHROPIC_PIXELS_PER_TOKEN = 750
OPENAI_FIT = 2048
OPENAI_SHORT_SIDE = 768
OPENAI_TILE = 512
OPENAI_BASE_TOKENS = 85
OPENAI_TILE_TOKENS = 170


@dataclass(frozen=True, slots=True)
class Scaled:
    """An image as it goes upstream: base64 of its bytes, and its size."""

    media_type: str
    data: str  # base64
    width: int
    height: int

    def part(self, tokens: int) -> dict:
        """The prompt's neutral image part; each wire format's module gives it its own shape."""
        return {"type": "image", "media_type": self.media_type, "data": self.data, "tokens": tokens}


def fitted(width: int, height: int, max_edge: int) -> tuple[int, int]:
    """The size of an image scaled (never up) so its long edge is at most `max_edge`."""
    scale = min(1.0, max_edge / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def is_anthropic(model: str) -> bool:
    name = model.lower()
    return name.startswith("anthropic/") or "claude" in name


def image_tokens(model: str, width: int, height: int) -> int:
    """The provider's published estimate for an image of this size (as sent) given to `model`."""
    if width < 1 or height < 1:
        return 0
    if is_anthropic(model):
        scale = min(1.0, ANTHROPIC_MAX_EDGE / max(width, height), math.sqrt(ANTHROPIC_MAX_PIXELS / (width * height)))
        return math.ceil((width * scale) * (height * scale) / ANTHROPIC_PIXELS_PER_TOKEN)
    w, h = float(width), float(height)
    if max(w, h) > OPENAI_FIT:
        w, h = w * OPENAI_FIT / max(w, h), h * OPENAI_FIT / max(w, h)
    if min(w, h) > OPENAI_SHORT_SIDE:
        w, h = w * OPENAI_SHORT_SIDE / min(w, h), h * OPENAI_SHORT_SIDE / min(w, h)
    tiles = math.ceil(w / OPENAI_TILE) * math.ceil(h / OPENAI_TILE)
    return OPENAI_BASE_TOKENS + OPENAI_TILE_TOKENS * tiles


# (bytes, media type, width, height) of a stored image; the bytes scaled down: (bytes, {"media_type", "width", "height"}).
Load = Callable[[], Awaitable[tuple[bytes, str, int, int]]]
Shrink = Callable[[bytes, int], Awaitable[tuple[bytes, dict]]]


def _encoded(data: bytes, media_type: str, width: int, height: int) -> Scaled:
    return Scaled(media_type, base64.b64encode(data).decode("ascii"), width, height)


class Scaler:
    """Scaled images by attachment id, each scaled once, SCALE_AT_ONCE at a time."""

    def __init__(self, cache_bytes: int = CACHE_BYTES) -> None:
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[str, int], Scaled] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self._working: asyncio.Semaphore | None = None
        self._pending: dict[tuple[str, int], asyncio.Future] = {}

    async def scaled(self, key: str, load: Load, shrink: Shrink, max_edge: int) -> Scaled:
        """The image `key` at `max_edge`: `load()` reads it when it is not cached, `shrink` draws it
        smaller when it is larger than that."""
        slot = (key, max_edge)
        with self._lock:
            if (hit := self._cache.get(slot)) is not None:
                self._cache.move_to_end(slot)
                return hit
        if (pending := self._pending.get(slot)) is not None:
            return await asyncio.shield(pending)
        future = asyncio.get_running_loop().create_future()
        self._pending[slot] = future
        try:
            data, media_type, width, height = await load()
            if max(width, height) <= max_edge:
                result = await anyio.to_thread.run_sync(_encoded, data, media_type, width, height)
            else:
                if self._working is None:
                    self._working = asyncio.Semaphore(SCALE_AT_ONCE)
                async with self._working:
                    small, info = await shrink(data, max_edge)
                result = await anyio.to_thread.run_sync(_encoded, small, info["media_type"], info["width"],
                                                        info["height"])
            self._keep(slot, result)
            future.set_result(result)
            return result
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a waiter may be gone
            raise
        finally:
            del self._pending[slot]

    def _keep(self, slot: tuple[str, int], result: Scaled) -> None:
        with self._lock:
            self._cache[slot] = result
            self._size += len(result.data)
            while self._size > self.cache_bytes and self._cache:
                _, gone = self._cache.popitem(last=False)
                self._size -= len(gone.data)
