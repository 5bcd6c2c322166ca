"""Hang-up-stops (ON_DISCONNECT=stop) through a real uvicorn server: the upstream socket closes and
the partial reply is kept. The default, where a turn outlives its page, is in test_reattach.py."""

from __future__ import annotations

import time

import httpx

from gateway_sim.simulator import Script, steps
from support import hang_up_after_first_delta


def start_conversation(server) -> str:
    conv = httpx.post(f"{server.base_url}/api/conversations", json={}).json()
    httpx.patch(f"{server.base_url}/api/conversations/{conv['id']}",
                json={"settings": {"web_search": False, "web_fetch": False}})
    return conv["id"]


def settled(server, conv_id: str) -> dict:
    """The conversation once the server has finished with the aborted turn."""
    deadline = time.monotonic() + 5
    while True:
        conv = httpx.get(f"{server.base_url}/api/conversations/{conv_id}").json()
        if not conv["streaming"] or time.monotonic() > deadline:
            return conv
        time.sleep(0.05)


def test_stop_closes_upstream_and_saves_partial_once(hang_up_stops_server, sim):
    sim.enqueue(Script(steps=[steps.Text("Once upon a time ", chunk_size=4), steps.Sleep(0.2)]
                       + [steps.Text("and on and on ") if i % 2 == 0 else steps.Sleep(0.2) for i in range(60)]))
    conv_id = start_conversation(hang_up_stops_server)

    hang_up_after_first_delta(hang_up_stops_server.base_url, conv_id)

    record = sim.wait_for_disconnect(timeout=5)
    assert not record.completed, "the provider finished the reply: the hang-up did not stop it"
    conv = settled(hang_up_stops_server, conv_id)
    replies = [m for m in conv["messages"] if m["role"] == "assistant"]
    assert len(replies) == 1
    assert replies[0]["status"] == "interrupted" and replies[0]["content"].startswith("Once upon a time")
    assert replies[0]["usage"]["estimated"] is True and replies[0]["usage"]["output_tokens"] > 0
    assert conv["totals"]["turns"] == 1

    # The conversation is free again: the next turn runs.
    sim.enqueue(Script(steps=[steps.Text("Fine.")]))
    response = httpx.post(f"{hang_up_stops_server.base_url}/api/conversations/{conv_id}/messages",
                          json={"content": "shorter please"}, timeout=10)
    assert "event: done" in response.text


def test_stop_before_any_text_keeps_the_question_and_its_billed_usage(hang_up_stops_server, sim):
    sim.enqueue(Script(steps=[steps.Sleep(3), steps.Text("too late")]))
    conv_id = start_conversation(hang_up_stops_server)

    with httpx.stream("POST", f"{hang_up_stops_server.base_url}/api/conversations/{conv_id}/messages",
                      json={"content": "are you there?"}, timeout=10) as response:
        # A dropped httpx iterator closes the response, so hold it until the upstream call is made.
        chunks = response.iter_raw()
        assert b"event: start" in next(chunks)
        sim.wait_for_requests(1)
    sim.wait_for_disconnect(timeout=5)

    conv = settled(hang_up_stops_server, conv_id)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    stopped = conv["messages"][1]
    assert (stopped["content"], stopped["status"]) == ("", "interrupted"), "stopped before the answer began"
    assert stopped["usage"]["estimated"] is True and stopped["usage"]["input_tokens"] > 0
    assert conv["totals"]["turns"] == 1, "the provider billed the prompt it read"

    # The empty reply never goes upstream: the next request holds the two questions only.
    sim.enqueue(Script(steps=[steps.Text("Yes.")]))
    httpx.post(f"{hang_up_stops_server.base_url}/api/conversations/{conv_id}/messages", json={"content": "hello?"}, timeout=10)
    sent = sim.requests[-1].body["messages"]
    assert [m["role"] for m in sent if m["role"] != "system"] == ["user", "user"]
