"""The summarizer's title reaches the page without a reload (titles are on here, off elsewhere)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from pagekit import Server, conversation_id, eventually, exchange
from simulator import Script, steps


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
