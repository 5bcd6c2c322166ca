"""Costs benchmark (issue 28): what charging adds to a turn, and what the usage report and the
budget check take over a month of charges.

The real app runs in this process over ASGI against the billing simulator on loopback (files
store, so each charge is an fsynced append). `charge_ms_p50`/`p99`: the time a turn spends in the
cost module (its requests charged to the ledger, priced, queued for reconciliation), timed around
the module's own calls. `usage_report_ms_*`: `GET /api/usage` over CHARGES charges spread over 30
days, by day and by conversation. `budget_check_ms_p50`: the check a turn makes before it starts,
with those charges in the month.

    .venv/bin/python bench/costs_bench.py      # prints JSON; writes bench/results_costs.json
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from chatserver.config import Settings  # noqa: E402
from chatserver.costs.service import Costs  # noqa: E402
from gateway_sim.simulator import GatewaySimulator, Script, Text  # noqa: E402
from support import serve  # noqa: E402

TURNS = 100
CHARGES = 10_000
RESULTS = Path(__file__).resolve().parent / "results_costs.json"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(spent: list[float], method):
    async def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return await method(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - began)
    return wrapper


async def measure() -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, GatewaySimulator(billing="openrouter") as sim:
        settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=Path(tmp), auto_title=False)
        async with serve(settings) as (app, client):
            costs: Costs = app.state.chat.turns.costs
            per_turn: list[float] = []
            costs.reply = timed(per_turn, costs.reply)  # type: ignore[method-assign]
            conv = (await client.post("/api/conversations", json={})).json()
            for n in range(TURNS):
                sim.enqueue(Script([Text(f"Answer {n}, short.")], usage="omit" if n % 3 == 0 else None))
                await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": f"question {n}"})
            await costs.idle()
            out["charge_ms_p50"] = round(1000 * statistics.median(per_turn), 3)
            out["charge_ms_p99"] = round(1000 * pct(per_turn, 0.99), 3)

            now = dt.datetime.now(dt.UTC)
            conversations = [secrets.token_urlsafe(16) for _ in range(200)]
            for n in range(CHARGES):
                at = now - dt.timedelta(days=n % min(30, now.day), minutes=n % 60)
                await costs.ledger.put("local", {
                    "id": f"{at.strftime('%Y-%m')}.{secrets.token_urlsafe(12)}", "owner": "local",
                    "at": at.isoformat(timespec="seconds"), "conversation": conversations[n % 200], "message": None,
                    "model": ("openai/gpt-5-mini", "anthropic/claude-sonnet-4.5")[n % 2], "kind": "reply",
                    "turn": True, "input_tokens": 1200, "cached_tokens": 800, "cache_write_tokens": 0,
                    "output_tokens": 300, "cost": 0.0012, "source": "reported", "generation": None,
                    "request": None})
            for group in ("day", "conversation"):
                times = []
                for _ in range(10):
                    began = time.perf_counter()
                    response = await client.get("/api/usage", params={"group": group})
                    times.append(time.perf_counter() - began)
                    assert response.status_code == 200
                out[f"usage_report_ms_{group}_p50"] = round(1000 * statistics.median(times), 1)
            checks = []
            for _ in range(50):
                began = time.perf_counter()
                await costs.admit("local")
                checks.append(time.perf_counter() - began)
            out["budget_check_ms_p50"] = round(1000 * statistics.median(checks), 3)
    out["usage_report_charges"] = CHARGES
    return out


def main() -> None:
    results = asyncio.run(measure())
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
