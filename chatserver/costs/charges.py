"""Charges: one per upstream request, with tokens, a cost and where that cost came from.

A cost is `reported` (the gateway said it with the answer: the usage's `cost`, or LiteLLM's
`x-litellm-response-cost` header), `reconciled` (asked of the gateway's own record afterwards),
`priced` (measured tokens times our price table), `estimated` (estimated tokens times it: a
stream cut before its usage), or `unreported` (no figure at all; never counted as zero).
"""

from __future__ import annotations

import datetime as dt

from chatserver.costs.ledger import new_charge_id
from chatserver.costs.prices import Price

# From the least to the most certain: a sum is as certain as its least certain part.
CERTAINTY = ("unreported", "estimated", "priced", "reconciled", "reported")
# Sources whose figure the gateway's own record should replace, when it keeps one: a figure the
# gateway did not say (our price table's is a stand-in for a gateway that keeps no bill).
TO_RECONCILE = frozenset({"unreported", "estimated", "priced"})
KINDS = ("reply", "tool", "vision", "title", "summary")


def new_charge(*, owner: str, conv_id: str, message_id: str | None, model: str, kind: str, usage: dict,
               call: dict | None, price: Price | None, counts_turn: bool = False) -> dict:
    """The ledger record of one request, its cost settled from what is known now."""
    now = dt.datetime.now(dt.UTC)
    call = call or {}
    cost, source = usage.get("cost"), "reported"
    if cost is None and call.get("header_cost") is not None:
        cost = call["header_cost"]
    if cost is None:
        if price is not None:
            cost, source = price.cost(usage), "estimated" if usage.get("estimated") else "priced"
        else:
            source = "unreported"
    return {
        "id": new_charge_id(now), "owner": owner, "at": now.isoformat(timespec="seconds"),
        "conversation": conv_id, "message": message_id, "model": model, "kind": kind,
        "turn": counts_turn,
        "input_tokens": usage.get("input_tokens") or 0, "cached_tokens": usage.get("cached_tokens") or 0,
        "cache_write_tokens": usage.get("cache_write_tokens") or 0, "output_tokens": usage.get("output_tokens") or 0,
        "cost": None if cost is None else round(float(cost), 10), "source": source,
        "generation": call.get("generation"), "request": call.get("request"),
    }


def entry(charge: dict) -> dict:
    """What a message's usage keeps of a charge: enough to correct its figure later."""
    return {"id": charge["id"], "cost": charge["cost"], "source": charge["source"]}


def summed(entries: list[dict]) -> tuple[float | None, str]:
    """A usage's cost and source from its charges' entries: unknown if any part is."""
    source = min((e["source"] for e in entries), key=CERTAINTY.index, default="unreported")
    if not entries or any(e["cost"] is None for e in entries):
        return None, "unreported"
    return round(sum(e["cost"] for e in entries), 10), source


def set_cost(usage: dict, entries: list[dict]) -> dict:
    """`usage` (in place) with its charges and the cost and source they add up to."""
    usage["charges"] = entries
    usage["cost"], usage["cost_source"] = summed(entries)
    return usage
