"""Projects, shared copies and people in the browser (AUTH=password): a project made on the page
shows as a folder and a conversation moves into it with one action (the ⋯ menu, or dragged); a
shared link opens in a fresh browser context without logging in, shows no memory and runs no
script, and is 404 once revoked in Settings; an admin adds a person in Settings and that person
logs in."""

from __future__ import annotations

import json
import re

import pytest
from argon2 import PasswordHasher
from playwright.sync_api import expect

from chatserver.accounts.auth import UserFile
from gateway_sim.simulator import Script, steps
from pagekit import Server, assistant_messages, conversation_id, eventually, exchange, new_conversation, open_page

FAST = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
ALICE = ("alice", "alice's long secret")
MEMORY = "- keeps bees on the roof"


@pytest.fixture(scope="module")
def accounts_server(tmp_path_factory, gateway):
    data = tmp_path_factory.mktemp("projects") / "data"
    UserFile(data).add(ALICE[0], FAST.hash(ALICE[1]), admin=True, now=0)
    srv = Server(data, {"GATEWAY_BASE_URL": gateway.base_url, "AUTH": "password"})
    yield srv
    srv.stop()


def signed_in(browser, server, username: str, password: str):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.js_errors = []
    page.on("pageerror", lambda exc: page.js_errors.append(str(exc)))
    page.goto(server.base_url)
    dialog = page.get_by_role("dialog", name="Sign in")
    dialog.get_by_label("User name").fill(username)
    dialog.get_by_label("Password").fill(password)
    dialog.get_by_role("button", name="Sign in").click()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    return page


def api_as(page, method: str, path: str, body=None) -> dict:
    """A request with the page's own session (its cookie), as the page would send it."""
    return page.evaluate("""async ([method, path, body]) => {
        const res = await fetch(path, {method, headers: {"Content-Type": "application/json"},
                                       body: body === null ? undefined : JSON.stringify(body)});
        return {status: res.status, body: await res.text()};
    }""", [method, path, body])


def test_a_project_is_a_folder_and_a_conversation_moves_in_with_one_action(browser, accounts_server, gateway):
    gateway.reset()
    page = signed_in(browser, accounts_server, *ALICE)
    try:
        page.get_by_test_id("project-new").click()
        dialog = page.get_by_test_id("project-dialog")
        dialog.get_by_test_id("project-name").fill("Harbour Survey")
        dialog.get_by_test_id("project-instructions").fill("Answer in metric units.")
        dialog.get_by_test_id("project-save").click()
        expect(dialog.get_by_test_id("project-status")).to_contain_text("Created")
        dialog.locator("#project-close").click()
        folder = page.get_by_test_id("project-folder").filter(has_text="Harbour Survey")
        expect(folder).to_be_visible()

        gateway.enqueue(Script([steps.Text("First answer.")]), Script([steps.Text("Second answer.")]))
        exchange(page, "a question about the harbour")
        first = conversation_id(page)
        page.get_by_test_id("conversation-menu").click()
        page.get_by_test_id("menu-project").select_option(label="Harbour Survey")
        expect(folder.locator(f".conv-item[data-id='{first}']")).to_be_visible()
        expect(page.locator(f"#conversation-list .conv-item[data-id='{first}']")).to_have_count(0)
        projects = eventually(lambda: api_as(page, "GET", "/api/projects"))
        project_id = json.loads(projects["body"])[0]["id"]
        assert json.loads(api_as(page, "GET", f"/api/conversations/{first}")["body"])[
            "project_id"] == project_id

        # A second conversation is dragged onto the folder.
        new_conversation(page)
        exchange(page, "another question")
        second = conversation_id(page)
        page.locator(f"#conversation-list .conv-item[data-id='{second}']").drag_to(folder.locator("summary"))
        expect(folder.locator(f".conv-item[data-id='{second}']")).to_be_visible()
        # And dragged out again onto the list.
        folder.locator(f".conv-item[data-id='{second}']").drag_to(page.get_by_test_id("conversation-list"))
        expect(page.locator(f"#conversation-list .conv-item[data-id='{second}']")).to_be_visible()
        assert page.js_errors == []
    finally:
        page.context.close()


def test_a_shared_link_opens_without_login_shows_no_memory_and_is_404_once_revoked(browser, accounts_server,
                                                                                   gateway):
    gateway.reset()
    page = signed_in(browser, accounts_server, *ALICE)
    reader = browser.new_context()
    try:
        assert api_as(page, "PUT", "/api/memory", {"text": MEMORY})["status"] == 200
        new_conversation(page)
        gateway.enqueue(Script([steps.Text('A reply with <img src=x onerror="window.ran=1"> in it.')]))
        exchange(page, "what about the bees?")
        expect(assistant_messages(page).last).to_contain_text("A reply with")
        page.get_by_test_id("conversation-menu").click()
        page.get_by_test_id("menu-share").click()
        page.get_by_test_id("share-create").click()
        url = page.get_by_test_id("share-url")
        expect(url).to_have_value(re.compile(r"/s/[A-Za-z0-9_-]{32}$"))
        link = url.input_value()
        page.locator("#share-close").click()

        shared = reader.new_page()
        errors: list[str] = []
        shared.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        shared.goto(link)
        expect(shared.locator("#shared-title")).to_have_text("what about the bees?")
        expect(shared.locator("article[data-role=assistant]")).to_contain_text('<img src=x onerror="window.ran=1">')
        expect(shared.locator("article[data-role=user]")).to_have_text(re.compile("what about the bees"))
        assert "bees on the roof" not in shared.content()
        assert shared.evaluate("window.ran === undefined") and shared.locator("script").count() == 0
        assert shared.locator("meta[name=robots]").get_attribute("content") == "noindex, nofollow"
        assert errors == [], errors

        page.get_by_test_id("settings-open").click()
        settings = page.get_by_role("dialog", name="Settings")
        row = settings.get_by_test_id("share-list").locator("li")
        expect(row).to_have_count(1)
        row.get_by_test_id("share-revoke").click()
        expect(settings.get_by_test_id("share-list").locator("li")).to_have_count(0)

        response = shared.goto(link)
        assert response.status == 404
        expect(shared.locator("body")).to_contain_text("does not exist or was revoked")
        assert page.js_errors == []
    finally:
        reader.close()
        page.context.close()


def test_an_admin_adds_a_person_in_settings_and_that_person_logs_in(browser, accounts_server):
    page = signed_in(browser, accounts_server, *ALICE)
    try:
        page.get_by_test_id("settings-open").click()
        settings = page.get_by_role("dialog", name="Settings")
        section = settings.get_by_test_id("people-section")
        expect(section).to_be_visible()
        section.get_by_test_id("person-name").fill("carol")
        section.get_by_test_id("person-password").fill("carol's new secret")
        section.get_by_test_id("person-add-button").click()
        expect(section.get_by_test_id("people-status")).to_have_text("Added carol.")
        expect(section.locator("li[data-name=carol]")).to_be_visible()
        assert page.js_errors == []
    finally:
        page.context.close()
    carol = signed_in(browser, accounts_server, "carol", "carol's new secret")
    try:
        expect(carol.get_by_test_id("account-name")).to_have_text("carol")
        carol.get_by_test_id("settings-open").click()
        expect(carol.get_by_role("dialog", name="Settings").get_by_test_id("people-section")).to_be_hidden()
        assert carol.js_errors == []
    finally:
        carol.context.close()


def test_with_sharing_off_the_page_offers_no_share(browser, tmp_path_factory, gateway):
    srv = Server(tmp_path_factory.mktemp("no-sharing") / "data",
                 {"GATEWAY_BASE_URL": gateway.base_url, "ALLOW_SHARING": "false"})
    try:
        page = open_page(browser, srv.base_url)
        try:
            page.get_by_test_id("conversation-menu").click()
            expect(page.get_by_test_id("menu-pin")).to_be_visible()  # the menu is open, for a conversation
            expect(page.get_by_test_id("menu-share")).to_be_hidden()
            page.keyboard.press("Escape")
            page.get_by_test_id("settings-open").click()
            expect(page.get_by_role("dialog", name="Settings").get_by_test_id("shares-section")).to_be_hidden()
            assert page.js_errors == []
        finally:
            page.context.close()
    finally:
        srv.stop()


def test_a_project_made_in_one_tab_shows_in_the_other_without_a_reload(browser, accounts_server):
    first = signed_in(browser, accounts_server, *ALICE)
    second = signed_in(browser, accounts_server, *ALICE)
    try:
        expect(second.locator("body")).to_have_attribute("data-live", "true")
        made = api_as(first, "POST", "/api/projects", {"name": "Told, not polled"})
        assert made["status"] == 201
        folder = second.get_by_test_id("project-folder").filter(has_text="Told, not polled")
        expect(folder).to_be_visible()
        assert api_as(first, "DELETE", f"/api/projects/{json.loads(made['body'])['id']}")["status"] == 204
        expect(folder).to_have_count(0)
        assert first.js_errors == [] and second.js_errors == []
    finally:
        first.context.close()
        second.context.close()
