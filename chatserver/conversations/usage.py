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
    if usage.get("cost") is None:
        totals["cost_unreported"] = totals.get("cost_unreported", 0) + 1
    else:
        totals["cost"] = round(totals.get("cost", 0) + usage["cost"], 10)


def count_reply(totals: dict, usage: dict) -> None:
    """A settled reply in the totals: its usage and one more turn."""
    add_usage(totals, usage)
    totals["turns"] = totals.get("turns", 0) + 1
