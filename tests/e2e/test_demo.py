"""Without a configured gateway the page says replies are simulated and how to connect a real one."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from pagekit import Server, assistant_messages, new_conversation, open_page, screenshot, send


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


def test_on_a_phone_the_banner_is_short_and_can_be_dismissed_for_good(browser, demo_server):
    page = open_page(browser, demo_server.base_url, viewport={"width": 390, "height": 844}, has_touch=True,
                     is_mobile=True)
    try:
        banner = page.locator("#demo-banner")
        expect(banner).to_be_visible()
        expect(banner).to_contain_text("simulated")
        screenshot(page, "phone-demo-banner")
        chrome = sum(page.locator(sel).bounding_box()["height"] for sel in ("#demo-banner", ".topbar", ".meters"))
        # Banner, title bar and meters together leave the transcript most of the screen.
        assert chrome < 844 / 4, chrome

        page.get_by_test_id("dismiss-banner").click()
        expect(banner).to_be_hidden()
        page.reload()
        expect(page.locator("body")).to_have_attribute("data-ready", "true")
        expect(banner).to_be_hidden()
        assert page.js_errors == []
    finally:
        page.context.close()


def test_a_long_demo_reply_can_be_reloaded_into_and_stopped(browser, demo_server):
    """Demo replies ended in 1.4 s, so Stop and reload could not be tried without a real model."""
    page = open_page(browser, demo_server.base_url)
    try:
        new_conversation(page)
        send(page, "Write a long story")
        reply = assistant_messages(page).last
        expect(reply).to_contain_text("SIMULATED long reply")
        page.reload()
        expect(page.locator("body")).to_have_attribute("data-ready", "true")
        reply = assistant_messages(page).last
        expect(reply).to_have_attribute("data-status", "streaming")  # re-attached: still being written
        stop = page.get_by_role("button", name="Stop")
        expect(stop).to_be_visible()
        stop.click()
        expect(reply).to_have_attribute("data-status", "interrupted", timeout=5000)
        assert "12. In " not in reply.inner_text(), "stopped before the story's end"
    finally:
        page.context.close()
