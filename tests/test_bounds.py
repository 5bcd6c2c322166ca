"""Memory that must not grow with use: the demo gateway's records and the token-count cache."""

from __future__ import annotations

import gc
import tracemalloc

import httpx
import pytest

import context
from simulator import DEFAULT_KEEP_REQUESTS, GatewaySimulator, Script, steps


def chat(sim: GatewaySimulator, text: str) -> None:
    body = {"model": "m", "stream": False, "messages": [{"role": "user", "content": text}]}
    assert httpx.post(sim.base_url + "/v1/chat/completions", json=body, timeout=5).status_code == 200


def test_simulator_keeps_only_the_last_requests_it_was_told_to():
    with GatewaySimulator(keep_requests=3) as sim:
        for i in range(7):
            chat(sim, f"question {i}")

        kept = sim.requests
        assert [r.body["messages"][0]["content"] for r in kept] == ["question 4", "question 5", "question 6"]
        # Counting still covers every request, and an index still means the n-th request ever made.
        assert len(sim.wait_for_requests(7, timeout=1)) == 3
        with pytest.raises(IndexError):
            sim.wait_for_disconnect(0, timeout=1)


def test_simulator_index_counts_every_request_once_older_ones_are_dropped():
    with GatewaySimulator(keep_requests=2) as sim:
        sim.enqueue(Script(steps=[steps.Text("a")]), Script(steps=[steps.Text("b")]),
                    Script(steps=[steps.Text("c"), steps.Sleep(5)]))
        chat(sim, "one")
        chat(sim, "two")
        with httpx.Client(timeout=5) as client:
            with client.stream("POST", sim.base_url + "/v1/chat/completions",
                               json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "3"}]}) as r:
                next(r.iter_bytes())
        record = sim.wait_for_disconnect(2, timeout=5)
        assert record.body["messages"][0]["content"] == "3"


def test_the_default_keeps_a_few_requests_not_all():
    with GatewaySimulator() as sim:
        for i in range(DEFAULT_KEEP_REQUESTS + 5):
            chat(sim, str(i))
        assert len(sim.requests) == DEFAULT_KEEP_REQUESTS
        assert sim.requests[-1].body["messages"][0]["content"] == str(DEFAULT_KEEP_REQUESTS + 4)


def test_token_count_cache_does_not_hold_the_texts_it_counted():
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(150):
            context.count_tokens(f"deleted message {i} " + "word " * 5_000)  # ~25 KB each, then dropped
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 300_000, f"{held} bytes still held after counting 3.7 MB of text"


def test_token_count_cache_is_capped_by_bytes_and_still_counts_right(monkeypatch):
    monkeypatch.setattr(context, "_token_counts", {})
    monkeypatch.setattr(context, "TOKEN_CACHE_BYTES", 50 * context.TOKEN_CACHE_ENTRY_BYTES)
    texts = [f"text number {i}" for i in range(200)]

    counts = [context.count_tokens(t) for t in texts]

    assert len(context._token_counts) == 50
    assert [context.count_tokens(t) for t in texts] == counts == [
        len(context._encoding().encode(t)) for t in texts]
    assert all(isinstance(k, tuple) and all(isinstance(x, int) for x in k) for k in context._token_counts)


def test_token_count_cache_keeps_the_recently_used(monkeypatch):
    monkeypatch.setattr(context, "_token_counts", {})
    monkeypatch.setattr(context, "TOKEN_CACHE_BYTES", 3 * context.TOKEN_CACHE_ENTRY_BYTES)
    for text in ("alpha", "beta", "gamma"):
        context.count_tokens(text)
    context.count_tokens("alpha")  # used again: "beta" is now the oldest
    context.count_tokens("delta")
    assert (hash("beta"), 4) not in context._token_counts and (hash("alpha"), 5) in context._token_counts
