"""Prices per model, USD per million tokens, for gateways that report tokens but no money (vLLM,
Ollama): an admin's entry wins over what the gateway's model list publishes (OpenRouter's
`/api/v1/models` `pricing`, USD per token as strings)."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

log = logging.getLogger("chat.costs")

FIELDS = ("input", "output", "cache_read", "cache_write")
# The most a price may be: far above any model's, low enough that a typo cannot bill millions.
MAX_PER_MILLION = 10_000.0


@dataclass(frozen=True, slots=True)
class Price:
    input: float
    output: float
    cache_read: float | None = None   # None: as input
    cache_write: float | None = None  # None: as input

    def cost(self, usage: dict) -> float:
        """USD for a usage record (whose `input_tokens` holds the cached and written parts)."""
        cached = usage.get("cached_tokens") or 0
        written = usage.get("cache_write_tokens") or 0
        plain = max(0, (usage.get("input_tokens") or 0) - cached - written)
        read_price = self.input if self.cache_read is None else self.cache_read
        write_price = self.input if self.cache_write is None else self.cache_write
        total = plain * self.input + cached * read_price + written * write_price \
            + (usage.get("output_tokens") or 0) * self.output
        return round(total / 1e6, 10)

    def as_json(self) -> dict:
        return asdict(self)


def price_from(value: object) -> Price | None:
    """A stored or submitted price (`{"input", "output", "cache_read"?, "cache_write"?}`), checked."""
    if not isinstance(value, dict):
        return None
    numbers: dict[str, float | None] = {}
    for name in FIELDS:
        raw = value.get(name)
        if raw is None and name in ("cache_read", "cache_write"):
            numbers[name] = None
            continue
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) \
                or not 0 <= raw <= MAX_PER_MILLION:
            return None
        numbers[name] = float(raw)
    return Price(**numbers)  # type: ignore[arg-type]


def published_prices(models: object) -> dict[str, Price]:
    """OpenRouter's model list (`{"data": [{"id", "pricing": {"prompt", "completion",
    "input_cache_read"?, "input_cache_write"?}}]}`, USD per token as strings) as our prices."""
    data = models.get("data") if isinstance(models, dict) else None
    out: dict[str, Price] = {}
    for model in data if isinstance(data, list) else []:
        if not isinstance(model, dict) or not isinstance(model.get("id"), str):
            continue
        pricing = model.get("pricing")
        if not isinstance(pricing, dict):
            continue

        def per_million(key: str) -> float | None:
            try:
                value = float(pricing[key]) * 1e6
            except (KeyError, TypeError, ValueError):
                return None
            return round(value, 6) if math.isfinite(value) and 0 <= value <= MAX_PER_MILLION else None

        price = price_from({"input": per_million("prompt"), "output": per_million("completion"),
                            "cache_read": per_million("input_cache_read"),
                            "cache_write": per_million("input_cache_write")})
        if price is not None:
            out[model["id"]] = price
    return out
