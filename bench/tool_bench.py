"""Tool-round benchmark: what the tool loop adds between a round's last result and the next request.

The real app runs in this process over ASGI against the simulator on loopback; each of TURNS
turns makes one tool round and then answers. The round calls `stamp`, a tool this benchmark
registers that notes when it returns and does nothing else, so no tool's own work is timed.
`tool_round_added_ms_p50` (and p99) is the time from that return to the simulator receiving the
request that carries the result: the safety wrapper, the trail's step, building the body,
encoding it and sending it over a kept-alive connection. Both ends read `time.monotonic()` in
one process.

    .venv/bin/python bench/tool_bench.py      # prints JSON; writes bench/results_tools.json
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from chatserver.config import Settings  # noqa: E402
from chatserver.tools import registry as tools  # noqa: E402
from gateway_sim.simulator import GatewaySimulator, Script, steps  # noqa: E402
from support import serve  # noqa: E402

TURNS = 60
WARMUP = 5
RESULTS = Path(__file__).resolve().parent / "results_tools.json"
RETURNED: list[float] = []


async def stamp() -> str:
    """Answer at once (a benchmark's tool: it notes when it returned)."""
    RETURNED.append(time.monotonic())
    return "stamped"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(turns: int) -> dict:
    if "stamp" not in tools.registry:
        tools.registry.register(stamp)
    with GatewaySimulator(keep_requests=4 * turns) as sim, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=Path(tmp) / "data",
                            default_tool_runtime="local")
        gaps = []
        async with serve(settings) as (_, client):
            preset = await client.post("/api/presets", json={"name": "bench", "text": "Benchmark.", "tools": ["stamp"]})
            assert preset.status_code == 201, preset.text
            conv = (await client.post("/api/conversations", json={"preset": "bench"})).json()
            for n in range(turns + WARMUP):
                before = len(sim.requests)
                sim.enqueue(Script([steps.ToolCall("stamp", {})]),
                            Script([steps.Text("Done.")]))
                response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": f"q{n}"})
                assert "event: done" in response.text, response.text[-500:]
                carrying = sim.requests[before + 1]
                if n >= WARMUP:
                    gaps.append((carrying.started_at - RETURNED[-1]) * 1000)
    return {"tool_round_added_ms_p50": round(statistics.median(gaps), 3),
            "tool_round_added_ms_p99": round(pct(gaps, 0.99), 3), "tool_rounds_measured": len(gaps)}


def main() -> None:
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else TURNS
    results = asyncio.run(measure(turns))
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
