"""Prompt-cache benchmark: one scripted 60-turn conversation through the real app, against the
gateway simulator, whose explicit-marker accounting (`simulator.cache_account`) decides what each
request reads from and writes to the provider's prompt cache.

The same conversation runs twice: with the cache marker on the system blocks only
(CACHE_HISTORY_BREAKPOINT=false) and with the rolling history breakpoint (the default). For each
it reports the share of the chat model's prompt tokens served from cache, the prompt cost
relative to sending everything uncached (cache write 1.25x, read 0.1x, uncached 1x), and how many
compressions the budget caused. Replies and summaries are scripted so both runs see the same
text; the usage numbers are the simulator's, recorded by the app exactly as a gateway's would be.

It measures the prompt layout and the compression loop, not a vendor: the simulator's tokens are
tiktoken counts, and there are no idle gaps longer than the cache TTL.

    .venv/bin/python bench/cache_bench.py      # writes bench/results_cache.json
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chatserver.app import create_app  # noqa: E402
from chatserver.config import Settings  # noqa: E402
from chatserver.turns import context  # noqa: E402
from gateway_sim.simulator import GatewaySimulator, Script, Usage, steps  # noqa: E402

TURNS = 60
SEED = 7
# A person who lowered the budget (as the article suggests, to see compression work): at the
# default 102,400 tokens a 60-turn chat of this size never compresses.
BUDGET = 16_000
WRITE, READ = 1.25, 0.1

WORDS = ("cache prefix token budget summary memory python request reply stream model gateway turn "
         "window history marker cost latency vendor schema test server page event usage error retry "
         "compress fold fact person preset prompt layer date anchor byte identical provider").split()


def prose(rng: random.Random, words: int, opening: str) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"{opening} {body}."


def persona() -> str:
    """A detailed persona, about 450 tokens, as long-lived presets tend to become."""
    rng = random.Random(SEED)
    rules = [prose(rng, 22, f"Rule {i}: when asked about") for i in range(1, 15)]
    return "You are a senior engineer pairing with the person.\n" + "\n".join(rules)


def memory() -> str:
    """A memory file of about 450 tokens of durable facts."""
    rng = random.Random(SEED + 1)
    return "".join(f"- {prose(rng, 16, f'Fact {i}: the person')}\n" for i in range(1, 22))


def script() -> list[tuple[str, str]]:
    """(question, answer) for every turn: short questions, replies of a few hundred tokens."""
    rng = random.Random(SEED + 2)
    return [(prose(rng, rng.randint(20, 70), f"Question {i}: how does the"),
             prose(rng, rng.randint(220, 480), f"Answer {i}: the"))
            for i in range(1, TURNS + 1)]


def summary_reply(n: int) -> Script:
    rng = random.Random(SEED + 100 + n)
    text = prose(rng, 180, f"Rolling summary {n}: so far the conversation covered")
    return Script(steps=[steps.Text(json.dumps({"summary": text, "facts": [f"Summary {n} noted a durable fact."]}))],
                  usage=Usage(prompt=3000, completion=260, dialect="openrouter"))


async def run(rolling: bool) -> dict:
    """One pass of the conversation; totals of the chat model's prompt tokens by cache outcome."""
    turns = script()
    with tempfile.TemporaryDirectory() as tmp, GatewaySimulator() as sim:
        settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=Path(tmp),
                            cache_history_breakpoint=rolling, upstream_timeout=30)
        (Path(tmp) / "memory.md").write_text(memory())
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
                conv = (await client.post("/api/conversations", json={})).json()
                cid = conv["id"]
                await client.patch(f"/api/conversations/{cid}", json={"settings": {
                    "system_prompt": persona(), "context_budget": BUDGET, "web_search": False, "web_fetch": False}})
                totals = {"input": 0, "cached": 0, "written": 0, "compressions": 0, "failed_compressions": 0}
                for question, answer in turns:
                    # The gateway answers in request order, so a turn that will compress needs the
                    # summarizer's reply queued ahead of the chat reply: ask the same projection.
                    stored = (await client.get(f"/api/conversations/{cid}")).json()
                    pending = {**stored, "messages": stored["messages"] + [{"role": "user", "content": question}]}
                    mem = (await client.get("/api/memory")).json()["text"]
                    compresses = context.project(pending, mem, settings) > context.budget_of(pending, settings)
                    if compresses:
                        sim.enqueue(summary_reply(totals["compressions"] + 1))
                    sim.enqueue(Script(steps=[steps.Text(answer, chunk_size=40)]))
                    response = await client.post(f"/api/conversations/{cid}/messages", json={"content": question})
                    events = parse(response.text)
                    if ("compression" in events) != compresses:
                        raise RuntimeError("the server's compression decision differed from the projection")
                    if compresses:
                        totals["compressions"] += 1
                        totals["failed_compressions"] += events["compression"]["failed"]
                    usage = events["done"]["usage"]
                    totals["input"] += usage["input_tokens"]
                    totals["cached"] += usage["cached_tokens"]
                    totals["written"] += usage["cache_write_tokens"]
    uncached = totals["input"] - totals["cached"] - totals["written"]
    cost = uncached + WRITE * totals["written"] + READ * totals["cached"]
    return {**totals, "cache_share": totals["cached"] / totals["input"], "cost_ratio": cost / totals["input"]}


def parse(body: str) -> dict[str, dict]:
    """Event name -> data of one turn stream (each event occurs once per turn here)."""
    out = {}
    for block in body.replace("\r\n", "\n").split("\n\n"):
        lines = block.split("\n")
        name = next((ln[6:].strip() for ln in lines if ln.startswith("event:")), None)
        data = "\n".join(ln[5:].lstrip() for ln in lines if ln.startswith("data:"))
        if name and data:
            out[name] = json.loads(data)
    if "done" not in out:
        raise RuntimeError(f"a turn did not finish: {out.get('error')}")
    return out


async def main() -> None:
    system_only = await run(rolling=False)
    rolling = await run(rolling=True)
    results = {
        "cache_share_rolling": round(rolling["cache_share"], 4),
        "cache_share_system_only": round(system_only["cache_share"], 4),
        "cost_ratio_rolling": round(rolling["cost_ratio"], 4),
        "cost_ratio_system_only": round(system_only["cost_ratio"], 4),
        "compressions_60": rolling["compressions"],
        "scenario": {"turns": TURNS, "budget": BUDGET,
                     "keep_recent_messages": Settings(_env_file=None).keep_recent_messages,
                     "persona_tokens": context.count_tokens(persona()),
                     "memory_tokens": context.count_tokens(memory()), "prices": {"write": WRITE, "read": READ}},
        "runs": {"rolling": rolling, "system_only": system_only},
    }
    (ROOT / "bench" / "results_cache.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'marker placement':<24}{'from cache':>12}{'cost vs uncached':>18}{'compressions':>14}")
    for label, r in (("system blocks only", system_only), ("+ rolling history", rolling)):
        print(f"{label:<24}{r['cache_share']:>11.1%}{r['cost_ratio']:>17.1%}{r['compressions']:>14}")


if __name__ == "__main__":
    asyncio.run(main())
