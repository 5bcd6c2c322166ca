"""Without a configured gateway the page says replies are simulated and how to connect a real one."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from pagekit import Server, assistant_messages, new_conversation, open_page, send


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    # Blank means unset, so a GATEWAY_BASE_URL in a developer's .env cannot leak into this test.
    srv = Server(tmp_path_factory.mktemp("demo") / "data", {"GATEWAY_BASE_URL": ""})
    yield srv
    srv.stop()


def test_the_demo_gateway_is_announced_and_still_answers(browser, demo_server):
    page = open_page(browser, demo_server.base_url)
    try:
        banner = page.locator("#demo-banner")
        expect(banner).to_be_visible()
        expect(banner).to_contain_text("simulated")
        expect(banner).to_contain_text("GATEWAY_BASE_URL")
        expect(banner).to_contain_text("GATEWAY_API_KEY")
        expect(banner).to_contain_text(".env")

        new_conversation(page)
        send(page, "Is anyone there?")
        reply = assistant_messages(page).last
        expect(reply).to_have_attribute("data-status", "complete")
        expect(reply).to_contain_text("SIMULATED")
    finally:
        page.context.close()
