"""What the browser tests share besides fixtures: the server process, opening the page, and small
verbs over the page's data-test hooks so tests read as what a person does."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
from playwright.sync_api import Browser, Page, expect

from support import LiveServer

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"

expect.set_options(timeout=10_000)


class Server(LiveServer):
    """The real server in a child process, with verbs the browser tests check it by."""

    def api(self, method: str, path: str, **kwargs) -> httpx.Response:
        return httpx.request(method, f"{self.base_url}{path}", timeout=10, **kwargs)

    def conversation(self, conv_id: str) -> dict:
        response = self.api("GET", f"/api/conversations/{conv_id}")
        response.raise_for_status()
        return response.json()

    def settled(self, conv_id: str) -> dict:
        """The conversation once no turn is streaming on it (a stopped turn saves on its own time)."""
        return eventually(lambda: (conv := self.conversation(conv_id)) and not conv["streaming"] and conv)

    def models(self) -> dict:
        return self.api("GET", "/api/models").json()


def open_page(browser: Browser, base_url: str, **context_options) -> Page:
    context = browser.new_context(**{"viewport": {"width": 1280, "height": 860}, **context_options})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # Anything the Content-Security-Policy blocked is a fault of the page, in every test.
    page.on("console", lambda msg: errors.append(msg.text)
            if msg.type == "error" and "Content Security Policy" in msg.text else None)
    page.js_errors = errors
    page.goto(base_url)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    return page


def new_conversation(page: Page) -> str:
    """Click "+ New" and wait until it is done: a new empty conversation, or an untouched one reused."""
    before = page.evaluate("Number(document.body.dataset.newCount || 0)")
    page.get_by_test_id("new-conversation").click()
    page.wait_for_function("before => Number(document.body.dataset.newCount || 0) > before", arg=before)
    return conversation_id(page)


def conversation_id(page: Page) -> str:
    return page.evaluate("decodeURIComponent(location.hash.slice(1))")


def send(page: Page, text: str) -> None:
    page.get_by_test_id("composer").fill(text)
    page.get_by_test_id("composer").press("Enter")


def exchange(page: Page, *texts: str) -> None:
    """Send each text and wait for its reply to complete, as a person chatting would."""
    for text in texts:
        replies = assistant_messages(page).count()
        send(page, text)
        expect(assistant_messages(page)).to_have_count(replies + 1)
        expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")


def assistant_messages(page: Page):
    return page.locator("[data-test=message][data-role=assistant]")


def user_messages(page: Page):
    return page.locator("[data-test=message][data-role=user]")


def row_action(row, name: str):
    """Open a sidebar row's ⋯ menu and return its item whose name starts with `name` (Rename, Pin,
    Unpin, Archive, Unarchive, Export as …, Delete)."""
    row.get_by_test_id("conversation-actions").click()
    item = row.get_by_role("menuitem", name=re.compile(f"^{re.escape(name)}"))
    expect(item).to_be_visible()
    return item


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # Transitions are finished first, so a sliding sidebar is photographed where it ends up.
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), animations="disabled")


def eventually(check, timeout: float = 10.0):
    """Poll `check` until it returns something truthy (server state settling after an action)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"still not true after {timeout}s: {check}")
        time.sleep(0.05)
