"""Compare benchmark: three models answering one message at once, beside the same three replies
asked one after another.

The real app runs in this process over ASGI; the simulator runs in a process of its own (its demo
replies, streamed a few words at a time), so this process's CPU time is the server's alone. Each
round alternates the two ways (the machine is shared and noisy: alternating keeps drift out of
the comparison) and times, per way:

- `compare_wall_ms_p50` / `sequential_wall_ms_p50`: from the request to the last event of all
  three replies;
- `compare_cpu_ms_per_reply_p50` / `sequential_cpu_ms_per_reply_p50`: the server's CPU time
  (`time.process_time`) per reply: what the lanes, their merged stream and sibling saves cost;
- `compare_first_delta_spread_ms_p50`: between the first and the last reply's first text, a
  measure of how side by side the three really stream.

    .venv/bin/python bench/answers_bench.py      # prints JSON; writes bench/results_answers.json
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from chatserver.config import Settings  # noqa: E402
from support import parse_sse, serve  # noqa: E402

ROUNDS = 12
WARMUP = 2
MODELS = ["openai/gpt-5-mini", "openai/gpt-5", "anthropic/claude-haiku-4.5"]
RESULTS = Path(__file__).resolve().parent / "results_answers.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_simulator(port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "gateway_sim", "--port", str(port)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            if process.poll() is not None:
                raise RuntimeError("the simulator did not start") from None
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("the simulator did not answer within 30 s")


async def compare_once(client, conv_id: str, n: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.monotonic()
    response = await client.post(f"/api/conversations/{conv_id}/compare",
                                 json={"content": f"Question {n}: compare these.", "models": MODELS})
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    events = parse_sse(response.text)
    assert events[-1][0] == "done" and events[-1][1]["assistant_message_id"] is None, events[-1]
    return wall, cpu / len(MODELS)


async def sequential_once(client, conv_ids: list[str], n: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.monotonic()
    for conv_id in conv_ids:
        response = await client.post(f"/api/conversations/{conv_id}/messages",
                                     json={"content": f"Question {n}: compare these."})
        assert parse_sse(response.text)[-1][0] == "done"
    return time.monotonic() - wall, (time.process_time() - cpu) / len(conv_ids)


async def first_delta_spread(app, client, conv_id: str) -> float:
    """Run one comparison and note, from the turn's own event log, when each reply's first text came."""
    firsts: dict[str, float] = {}
    posting = asyncio.create_task(client.post(f"/api/conversations/{conv_id}/compare",
                                              json={"content": "Which is best?", "models": MODELS}))
    hub = app.state.chat.hub
    while (running := hub.running(conv_id)) is None:
        await asyncio.sleep(0)  # the POST has not begun the turn yet: let it run
    log, seen = running.log, 0
    while len(firsts) < len(MODELS) and not log.ended:
        await log.wait_past(seen)
        for name, data in parse_sse(b"".join(log.frames[seen:]).decode()):
            if name == "delta":
                firsts.setdefault(data["assistant_message_id"], time.monotonic())
        seen = len(log.frames)
    await posting
    return (max(firsts.values()) - min(firsts.values())) * 1000


async def measure() -> dict:
    port = free_port()
    simulator = start_simulator(port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            settings = Settings(_env_file=None, gateway_base_url=f"http://127.0.0.1:{port}",
                                data_dir=Path(tmp) / "data", auto_title=False)
            async with serve(settings) as (app, client):
                async def new(model: str) -> str:
                    conv = (await client.post("/api/conversations", json={"model": model})).json()
                    await client.patch(f"/api/conversations/{conv['id']}",
                                       json={"settings": {"web_search": False, "web_fetch": False}})
                    return conv["id"]

                compared, singles = await new(MODELS[0]), [await new(m) for m in MODELS]
                spread_conv = await new(MODELS[0])
                out: dict[str, list[float]] = {k: [] for k in ("cw", "cc", "sw", "sc", "spread")}
                for n in range(ROUNDS + WARMUP):
                    wall_c, cpu_c = await compare_once(client, compared, n)
                    wall_s, cpu_s = await sequential_once(client, singles, n)
                    spread = await first_delta_spread(app, client, spread_conv)
                    if n >= WARMUP:
                        out["cw"].append(wall_c * 1000)
                        out["cc"].append(cpu_c * 1000)
                        out["sw"].append(wall_s * 1000)
                        out["sc"].append(cpu_s * 1000)
                        out["spread"].append(spread)
    finally:
        simulator.terminate()
        simulator.wait(timeout=10)
    p50 = statistics.median
    return {
        "answers_rounds": ROUNDS,
        "compare_wall_ms_p50": round(p50(out["cw"]), 1),
        "sequential_wall_ms_p50": round(p50(out["sw"]), 1),
        "compare_wall_ratio": round(p50(out["sw"]) / p50(out["cw"]), 2),
        "compare_cpu_ms_per_reply_p50": round(p50(out["cc"]), 2),
        "sequential_cpu_ms_per_reply_p50": round(p50(out["sc"]), 2),
        "compare_first_delta_spread_ms_p50": round(p50(out["spread"]), 1),
    }


def main() -> None:
    results = asyncio.run(measure())
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
