"""The summarizer's title reaches the page without a reload (titles are on here, off elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect

from gateway_sim.simulator import Script, Usage, steps
from pagekit import Server, assistant_messages, conversation_id, eventually, exchange


@pytest.fixture(scope="module")
def server(tmp_path_factory, gateway):
    srv = Server(tmp_path_factory.mktemp("titles") / "data", {
        "GATEWAY_BASE_URL": gateway.base_url, "UPSTREAM_TIMEOUT": "10", "AUTO_TITLE": "true",
    })
    yield srv
    srv.stop()


def test_the_title_the_summarizer_gives_after_the_first_reply_reaches_the_list_and_header(page, server, sim):
    sim.enqueue(Script([steps.Text("Paris, on the Seine.")]), Script([steps.Sleep(1.5), steps.Text("Capital of France")]))
    exchange(page, "what is the capital of france, if you please")
    conv_id = conversation_id(page)
    # The title arrives after `done`, in the background: the page looks for it on its own.
    eventually(lambda: server.conversation(conv_id)["title_source"] == "model")
    named = server.conversation(conv_id)["title"]
    assert named != "what is the capital of france, if you please"
    entry = page.get_by_test_id("conversation-list").locator(f"li[data-id='{conv_id}'] .conv-name")
    expect(entry).to_have_text(named)
    expect(page.locator("#conv-title")).to_have_text(named)


def test_the_header_names_the_title_calls_share_so_it_agrees_with_the_reply(page, server, sim):
    """The header said "1,013 in" beside the only reply's "489 in": the title call hid in the totals."""
    server.api("PATCH", f"/api/conversations/{conversation_id(page)}",
               json={"settings": {"web_search": False, "web_fetch": False}}).raise_for_status()
    sim.enqueue(Script([steps.Text("Paris, on the Seine.")],
                       usage=Usage(prompt=489, completion=20, cost=0.0011, dialect="openrouter")),
                Script([steps.Text("Capital of France")], usage=Usage(prompt=524, completion=5, cost=0.0002,
                                                                      dialect="openrouter")))
    exchange(page, "what is the capital of france")
    conv_id = conversation_id(page)
    eventually(lambda: server.conversation(conv_id)["title_source"] == "model")

    header = page.get_by_test_id("usage-header")
    expected = ["1,013 in (replies 489, title 524)", "25 out (replies 20, title 5)", "0% cached",
                "0 searches", "0 fetches", "$0.0013", "1 turn"]
    expect(header.locator("span")).to_have_text(expected)
    expect(assistant_messages(page).locator(".stats").last).to_contain_text("489 in · 20 out")
    page.reload()
    expect(header.locator("span")).to_have_text(expected)


def test_a_cost_nobody_reported_is_never_zero_and_has_one_label(page, server, sim):
    header = page.get_by_test_id("usage-header")
    expect(header.locator("span")).to_have_text(["0 in", "0 out", "0% cached", "0 searches", "0 fetches", "0 turns"])
    expect(header).not_to_contain_text("$")  # a new conversation has spent nothing: no "$0"

    chatgpt = (Path(__file__).parent.parent / "fixtures" / "chatgpt_conversations.json").read_bytes()
    imported = server.api("POST", "/api/import", files={"file": ("conversations.json", chatgpt)})
    assert imported.status_code == 201, imported.text
    conv_id = imported.json()["imported"][0]
    page.goto(f"{server.base_url}/#{conv_id}")
    page.reload()
    expect(page.locator("#conv-title")).to_have_text(server.conversation(conv_id)["title"])
    expect(header.locator(".usage-cost")).to_have_text("cost unknown")  # the imported reply's cost is missing
    expect(header).not_to_contain_text("$0")
