"""A server with ACCESS_TOKEN: the page asks for the token once and works with the login cookie."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from pagekit import Server


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory, gateway):
    srv = Server(tmp_path_factory.mktemp("login") / "data",
                 {"GATEWAY_BASE_URL": gateway.base_url, "ACCESS_TOKEN": "correct horse battery staple"})
    yield srv
    srv.stop()


def test_the_page_asks_for_the_access_token_and_then_works(browser, guarded_server):
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(guarded_server.base_url)
        dialog = page.get_by_role("dialog", name="Log in")
        expect(dialog).to_be_visible()
        page.keyboard.press("Escape")
        expect(dialog).to_be_visible()

        dialog.get_by_label("Access token").fill("wrong")
        dialog.get_by_role("button", name="Log in").click()
        expect(dialog.locator("#login-status")).to_have_text("wrong access token")

        dialog.get_by_label("Access token").fill("correct horse battery staple")
        dialog.get_by_role("button", name="Log in").click()
        expect(page.locator("body")).to_have_attribute("data-ready", "true")
        expect(dialog).to_be_hidden()
        expect(page.get_by_test_id("conversation-list").locator("li.conv-item")).to_have_count(1)
        assert "correct horse" not in str(context.cookies())
    finally:
        context.close()

