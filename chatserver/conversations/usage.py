"""A reply's usage record and the conversation totals it adds to: summed the same way whether the
reply was saved at its end or recovered from a checkpoint after a crash."""

from __future__ import annotations

TOTAL_KEYS = ("input_tokens", "output_tokens", "cached_tokens", "searches", "fetches")


def combined(reports: list[dict]) -> dict:
    """Usage records of one reply's requests, summed; a cost missing from any is unreported."""
    if len(reports) == 1:
        return reports[0]
    total = dict(reports[0])
    for report in reports[1:]:
        for key in ("input_tokens", "output_tokens", "cached_tokens", "cache_write_tokens", "searches", "fetches"):
            total[key] += report[key]
        total["cost"] = None if total["cost"] is None or report["cost"] is None else total["cost"] + report["cost"]
        total["estimated"] = total["estimated"] or report["estimated"]
    return total


def add_usage(totals: dict, usage: dict) -> None:
    """Conversation totals; a missing cost is counted as unreported, never as zero."""
    for key in TOTAL_KEYS:
        totals[key] = totals.get(key, 0) + (usage.get(key) or 0)
    _add_cost(totals, usage, 1)


def _source_parts(usage: dict) -> list[tuple[str, float]]:
    """(source, cost) of each known part of a usage's cost; a record older than sources says `reported`."""
    parts = usage.get("charges")
    if not parts:
        parts = [{"cost": usage.get("cost"),
                  "source": usage.get("cost_source") or ("estimated" if usage.get("estimated") else "reported")}]
    return [(p["source"], p["cost"]) for p in parts if p.get("cost") is not None]


def _add_cost(totals: dict, usage: dict, sign: int) -> None:
    if usage.get("cost") is None:
        totals["cost_unreported"] = max(0, totals.get("cost_unreported", 0) + sign)
    else:
        totals["cost"] = round(totals.get("cost", 0) + sign * usage["cost"], 10)
    # `cost_sources`: how much of `cost` is of each source (issue 28).
    sources = totals.setdefault("cost_sources", {})
    for source, cost in _source_parts(usage):
        sources[source] = round(sources.get(source, 0) + sign * cost, 10)
        if abs(sources[source]) < 1e-12:
            del sources[source]


def replace_cost(totals: dict, old: dict, new: dict, *, apart: str | None = None) -> None:
    """The totals after one usage's cost was corrected (reconciled with the gateway's bill);
    `apart`: the call's own running cost (`title_cost`, `compression_cost`) moves with it."""
    _add_cost(totals, old, -1)
    _add_cost(totals, new, 1)
    if apart is not None:
        totals[apart] = round(totals.get(apart, 0) + (new.get("cost") or 0) - (old.get("cost") or 0), 10)


def count_reply(totals: dict, usage: dict) -> None:
    """A settled reply in the totals: its usage and one more turn."""
    add_usage(totals, usage)
    totals["turns"] = totals.get("turns", 0) + 1
