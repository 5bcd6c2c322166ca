"""The prompt cache: what our layout earns from an explicit-marker provider (the simulator's
accounting), with the marker on the system blocks only and with the rolling history breakpoint."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest

from chatserver.app import create_app
from chatserver.config import Settings
from chatserver.turns import context
from chatserver.upstream import chat
from gateway_sim.simulator import LOOKBACK_BLOCKS, Script, cache_account, steps

PERSONA = "You are a careful assistant. " + " ".join(f"Rule {i}: answer plainly and cite sources." for i in range(150))


def body_for(messages: list[dict], *, rolling: bool) -> dict:
    conv = {"settings": {"system_prompt": PERSONA}, "summary": "", "messages": messages}
    prompt = context.build_prompt(conv, "", Settings(_env_file=None, cache_history_breakpoint=rolling),
                                  today=dt.date(2026, 1, 1))
    return chat.build_body("m", prompt.system, prompt.messages, max_tokens=100, params={})


def exchange(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i} " + "detail " * 120},
            {"role": "assistant", "content": f"answer {i} " + "explanation " * 200}]


def test_last_turns_marked_message_is_read_back_when_it_is_sent_as_plain_text():
    history = exchange(1) + exchange(2)
    first = cache_account(body_for(history[:3], rolling=True), now=0.0)
    # Next turn the marked question is a plain string two messages before the new marker.
    second = cache_account(body_for(history + [{"role": "user", "content": "question 3"}], rolling=True),
                           now=1.0, cache=first.entries)

    assert first.write > 0 and second.read == first.write


def test_lookback_stops_at_twenty_blocks():
    history = exchange(1)
    first = cache_account(body_for(history[:1], rolling=True), now=0.0)
    # Each message is two blocks (its head and its text): 10 exchanges put the hit out of reach.
    far = history + [m for i in range(2, 2 + LOOKBACK_BLOCKS // 4 + 1) for m in exchange(i)]
    near = history + exchange(2)

    def read(after: list[dict]) -> int:
        body = body_for(after + [{"role": "user", "content": "next"}], rolling=True)
        # Only the history marker may look back: drop the system marker, which would hit anyway.
        del body["messages"][0]["content"][0]["cache_control"]
        return cache_account(body, now=1.0, cache=first.entries).read

    assert read(near) == first.write and read(far) == 0


@pytest.mark.parametrize("rolling", [True, False])
async def test_history_is_served_from_cache_only_with_the_rolling_breakpoint(tmp_path, sim, rolling):
    settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path,
                        cache_history_breakpoint=rolling)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            cid = (await client.post("/api/conversations", json={})).json()["id"]
            await client.patch(f"/api/conversations/{cid}", json={"settings": {
                "system_prompt": PERSONA, "web_search": False, "web_fetch": False}})
            for i in range(1, 5):
                sim.enqueue(Script(steps=[steps.Text(f"answer {i} " + "explanation " * 200)]))
                await client.post(f"/api/conversations/{cid}/messages",
                                  json={"content": f"question {i} " + "detail " * 120})
            stored = (await client.get(f"/api/conversations/{cid}")).json()

    usages = [m["usage"] for m in stored["messages"] if m["role"] == "assistant"]
    cached = [u["cached_tokens"] for u in usages]
    if rolling:
        # Each turn reads everything the last one sent: the prefix grows with the history.
        assert cached[0] == 0 and cached[1] < cached[2] < cached[3]
        assert cached[3] > 0.8 * usages[3]["input_tokens"]
    else:
        # Only persona (+ memory + summary) is ever read, however long the history grows.
        assert cached[0] == 0 and cached[1] == cached[2] == cached[3] == usages[0]["cache_write_tokens"] > 0
        assert cached[3] < 0.6 * usages[3]["input_tokens"]
