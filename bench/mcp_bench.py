"""MCP tool-round benchmark: what one round through an MCP server adds over a round through a
local tool.

The real app runs in this process over ASGI against the simulator on loopback, with two real MCP
servers (tests/mcp_server.py, the `mcp` SDK): one over Streamable HTTP on a free loopback port, one
over stdio. Turns alternate between three tools that answer at once: `stamp` (local, as in
tool_bench.py), `http__echo` and `stdio__echo`. A round is timed from the simulator receiving the
request whose answer makes the call to it receiving the request that carries the result (the same
simulator stream, wrapper, trail and resend in all three), so the difference of the medians is
what the MCP call costs. The machine is shared and noisy, so each turn's CPU time in this process
(`time.process_time`: the app, the SDK's client side and the in-process simulator, the same for
every kind) is kept too: `*_added_cpu_ms_p50` is our side's own cost of a call, load or not.
`mcp_sdk_call_ms_p50` is the bare SDK's own round trip to the HTTP server (a `Client.call_tool`
in a loop), the floor under the HTTP figure.

    .venv/bin/python bench/mcp_bench.py      # prints JSON; writes bench/results_mcp.json
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

from mcp import Client  # noqa: E402
from tool_bench import pct, stamp  # noqa: E402

from chatserver.config import Settings  # noqa: E402
from chatserver.tools import registry as tools  # noqa: E402
from gateway_sim.simulator import GatewaySimulator, Script, steps  # noqa: E402
from mcp_support import SERVER, McpServer  # noqa: E402
from support import free_port, serve  # noqa: E402

TURNS = 40  # per tool
WARMUP = 3
SDK_CALLS = 200
RESULTS = Path(__file__).resolve().parent / "results_mcp.json"
TOOLS = {"local": ("stamp", {}), "http": ("http__echo", {"text": "hi"}), "stdio": ("stdio__echo", {"text": "hi"})}


async def connected(client) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = (await client.get("/api/tools/servers")).json()["servers"]
        if len(states) == 2 and all(s["connected"] for s in states):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the MCP servers did not connect: {states}")


async def sdk_calls(url: str, calls: int) -> list[float]:
    times = []
    async with Client(url, cache=None) as client:
        for n in range(calls + WARMUP):
            began = time.perf_counter()
            await client.call_tool("echo", {"text": "hi"})
            if n >= WARMUP:
                times.append((time.perf_counter() - began) * 1000)
    return times


async def measure(turns: int) -> dict:
    if "stamp" not in tools.registry:
        tools.registry.register(stamp)
    http = McpServer(free_port())
    try:
        with GatewaySimulator(keep_requests=2 * len(TOOLS) * (turns + WARMUP)) as sim, tempfile.TemporaryDirectory() as tmp:
            listing = Path(tmp) / "mcp.json"
            listing.write_text(json.dumps([{"name": "http", "url": http.url},
                                           {"name": "stdio", "command": sys.executable, "args": [str(SERVER), "stdio"]}]))
            settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=Path(tmp) / "data",
                                default_tool_runtime="local", mcp_servers=listing,
                                auto_title=False)  # a title call would land among the requests timed
            rounds: dict[str, list[float]] = {kind: [] for kind in TOOLS}
            cpu: dict[str, list[float]] = {kind: [] for kind in TOOLS}
            async with serve(settings) as (_, client):
                await connected(client)
                preset = await client.post("/api/presets", json={
                    "name": "bench", "text": "Benchmark.", "tools": [name for name, _ in TOOLS.values()]})
                assert preset.status_code == 201, preset.text
                conv = (await client.post("/api/conversations", json={"preset": "bench"})).json()
                for n in range(turns + WARMUP):
                    for kind, (name, arguments) in TOOLS.items():  # alternating: the machine's noise falls on all
                        before, cpu_before = len(sim.requests), time.process_time()
                        sim.enqueue(Script([steps.ToolCall(name, arguments)]), Script([steps.Text("Done.")]))
                        response = await client.post(f"/api/conversations/{conv['id']}/messages",
                                                     json={"content": f"{kind} {n}"})
                        assert "event: done" in response.text, response.text[-500:]
                        cpu_used = (time.process_time() - cpu_before) * 1000
                        assert len(sim.requests) == before + 2, response.text[-800:]
                        calling, carrying = sim.requests[-2:]
                        assert "[tool error]" not in json.dumps(carrying.body["messages"][-1]), carrying.body["messages"][-1]
                        if n >= WARMUP:
                            rounds[kind].append((carrying.started_at - calling.started_at) * 1000)
                            cpu[kind].append(cpu_used)
        sdk = await sdk_calls(http.url, SDK_CALLS)
    finally:
        http.stop()
    p50 = {kind: statistics.median(times) for kind, times in rounds.items()}
    out = {f"mcp_round_ms_p50_{kind}": round(p50[kind], 3) for kind in TOOLS}
    out.update({f"mcp_round_ms_p99_{kind}": round(pct(rounds[kind], 0.99), 3) for kind in TOOLS})
    out["mcp_http_round_added_ms_p50"] = round(p50["http"] - p50["local"], 3)
    out["mcp_stdio_round_added_ms_p50"] = round(p50["stdio"] - p50["local"], 3)
    cpu50 = {kind: statistics.median(times) for kind, times in cpu.items()}
    out["mcp_turn_cpu_ms_p50_local"] = round(cpu50["local"], 3)
    out["mcp_http_round_added_cpu_ms_p50"] = round(cpu50["http"] - cpu50["local"], 3)
    out["mcp_stdio_round_added_cpu_ms_p50"] = round(cpu50["stdio"] - cpu50["local"], 3)
    out["mcp_sdk_call_ms_p50"] = round(statistics.median(sdk), 3)
    out["mcp_rounds_measured"] = sum(len(t) for t in rounds.values())
    return out


def main() -> None:
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else TURNS
    results = asyncio.run(measure(turns))
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
