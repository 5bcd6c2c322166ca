"""AUTH=password in the browser: the sign-in form, who is logged in, and logging out."""

from __future__ import annotations

import pytest
from argon2 import PasswordHasher
from playwright.sync_api import expect

from chatserver.accounts.auth import UserFile
from gateway_sim.simulator import Script, steps
from pagekit import Server, assistant_messages, exchange

# Cheap to make; the server verifies with the parameters the hash carries, then upgrades it.
FAST = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)


@pytest.fixture(scope="module")
def accounts_server(tmp_path_factory, gateway):
    data = tmp_path_factory.mktemp("accounts") / "data"
    users = UserFile(data)
    users.add("alice", FAST.hash("alice's long secret"), admin=True, now=0)
    users.add("bob", FAST.hash("bob's other secret"), admin=False, now=0)
    srv = Server(data, {"GATEWAY_BASE_URL": gateway.base_url, "AUTH": "password"})
    yield srv
    srv.stop()


def sign_in(page, username: str, password: str) -> None:
    dialog = page.get_by_role("dialog", name="Sign in")
    dialog.get_by_label("User name").fill(username)
    dialog.get_by_label("Password").fill(password)
    dialog.get_by_role("button", name="Sign in").click()


def test_log_in_see_who_is_logged_in_log_out(browser, accounts_server):
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(accounts_server.base_url)
        dialog = page.get_by_role("dialog", name="Sign in")
        expect(dialog).to_be_visible()
        expect(page.get_by_role("dialog", name="Log in")).to_have_count(0)  # not the token dialog
        page.keyboard.press("Escape")
        expect(dialog).to_be_visible()

        sign_in(page, "alice", "wrong password")
        expect(dialog.locator("#account-login-status")).to_have_text("wrong user name or password")

        sign_in(page, "alice", "alice's long secret")
        expect(page.locator("body")).to_have_attribute("data-ready", "true")
        expect(dialog).to_be_hidden()
        expect(page.get_by_test_id("account-name")).to_have_text("alice (admin)")
        assert "alice's long secret" not in str(context.cookies())

        page.get_by_role("button", name="Log out").click()
        expect(page.get_by_role("dialog", name="Sign in")).to_be_visible()
        expect(page.get_by_test_id("account-name")).to_be_hidden()
        assert not [c for c in context.cookies() if c["name"] == "chat_session"]

        sign_in(page, "bob", "bob's other secret")
        expect(page.get_by_test_id("account-name")).to_have_text("bob")
        assert errors == []
    finally:
        context.close()


def test_b_does_not_see_a_s_conversations(browser, accounts_server, gateway):
    """Logged in after A on the same browser, B lists none of A's conversations and cannot open one."""
    gateway.reset()
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(accounts_server.base_url)
        sign_in(page, "alice", "alice's long secret")
        expect(page.locator("body")).to_have_attribute("data-ready", "true")
        gateway.enqueue(Script(steps=[steps.Text("Noted, Alice.")]))
        exchange(page, "alice's private question about her leave")
        expect(assistant_messages(page).last).to_contain_text("Noted, Alice.")
        alice_id = page.evaluate("decodeURIComponent(location.hash.slice(1))")

        page.get_by_role("button", name="Log out").click()
        sign_in(page, "bob", "bob's other secret")
        expect(page.get_by_test_id("account-name")).to_have_text("bob")
        expect(page.locator("body")).to_have_attribute("data-ready", "true")
        expect(page.get_by_test_id("conversation-list")).not_to_contain_text("leave")
        expect(page.locator("#messages")).not_to_contain_text("alice's private question")
        status = page.evaluate("id => fetch('/api/conversations/' + id).then(r => r.status)", alice_id)
        assert status == 404
    finally:
        context.close()
