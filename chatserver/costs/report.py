"""The usage report: the person's charges over a span of days, grouped one way, each group with
the same sums (tokens, cost by source, turns), so every grouping adds up to the same total."""

from __future__ import annotations

import csv
import datetime as dt
import io

from chatserver.costs.charges import KINDS

GROUPS = ("day", "model", "conversation", "kind", "person")
SUMS = ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens")


def empty_row(key: str) -> dict:
    return {"key": key, **dict.fromkeys(SUMS, 0), "cost": 0.0, "cost_by_source": {}, "unreported": 0,
            "requests": 0, "turns": 0}


def add(row: dict, charge: dict) -> None:
    """One charge into a row; costs are summed unrounded (`finish` rounds them once)."""
    for name in SUMS:
        row[name] += charge.get(name) or 0
    row["requests"] += 1
    if charge.get("turn"):
        row["turns"] += 1
    cost = charge.get("cost")
    if cost is None:
        row["unreported"] += 1
    else:
        row["cost"] += cost
        sources = row["cost_by_source"]
        sources[charge["source"]] = sources.get(charge["source"], 0) + cost


def finish(row: dict) -> dict:
    row["cost"] = round(row["cost"], 10)
    row["cost_by_source"] = {k: round(v, 10) for k, v in row["cost_by_source"].items()}
    if "by_model" in row:
        row["by_model"] = {k: round(v, 10) for k, v in row["by_model"].items()}
    return row


def key_of(charge: dict, group: str) -> str:
    match group:
        case "day":
            return charge["at"][:10]
        case "model":
            return charge["model"]
        case "conversation":
            return charge.get("conversation") or ""
        case "kind":
            return charge["kind"]
        case _:
            return charge["owner"]


def in_span(charges: list[dict], start: dt.date, end: dt.date) -> list[dict]:
    first, last = start.isoformat(), end.isoformat()
    return [c for c in charges if first <= c["at"][:10] <= last]


def report(charges: list[dict], group: str) -> dict:
    """`{"rows": [...], "total": row}`; day rows also split their cost by model (`by_model`)."""
    rows: dict[str, dict] = {}
    if group == "kind":
        rows = {kind: empty_row(kind) for kind in KINDS}
    total = empty_row("total")
    for charge in charges:
        key = key_of(charge, group)
        row = rows.setdefault(key, empty_row(key))
        add(row, charge)
        add(total, charge)
        if group == "day" and charge.get("cost") is not None:
            by_model = row.setdefault("by_model", {})
            by_model[charge["model"]] = by_model.get(charge["model"], 0) + charge["cost"]
    done = [finish(row) for row in rows.values()]
    ordered = sorted(done, key=lambda r: r["key"]) if group == "day" \
        else sorted(done, key=lambda r: (-r["cost"], r["key"])) if group != "kind" else done
    return {"rows": ordered, "total": finish(total)}


def _cell(value: object) -> str:
    """A spreadsheet never runs a cell: text that opens like a formula is quoted (CSV injection)."""
    text = "" if value is None else str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def as_csv(answer: dict, group: str) -> str:
    sources = ("reported", "reconciled", "priced", "estimated")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow([group, "label", "input_tokens", "cached_tokens", "output_tokens", "cost_usd",
                     *(f"cost_{s}" for s in sources), "unreported", "turns"])
    for row in answer["rows"]:
        writer.writerow([_cell(row["key"]), _cell(row.get("label", "")), row["input_tokens"], row["cached_tokens"],
                         row["output_tokens"], f"{row['cost']:.6f}",
                         *(f"{row['cost_by_source'].get(s, 0):.6f}" for s in sources),
                         row["unreported"], row["turns"]])
    return out.getvalue()
