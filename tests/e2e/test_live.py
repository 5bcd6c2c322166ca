"""The page is told, not polling (`GET /api/events`): what one tab does shows in another without a
reload, and a page makes no requests of its own while nothing happens in it."""

from __future__ import annotations

import threading

import httpx
from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import assistant_messages, conversation_id, exchange, new_conversation, open_page, row_action

QUIET_WINDOW_MS = 10_000


def listed(page, conv_id: str):
    return page.get_by_test_id("conversation-list").locator(f"li[data-id='{conv_id}']")


def live(page) -> None:
    expect(page.locator("body")).to_have_attribute("data-live", "true")


def test_a_rename_a_new_conversation_and_a_turn_in_one_tab_show_in_another(page, browser, server, sim):
    sim.enqueue(Script([steps.Text("First answer.")]))
    exchange(page, "a first question")
    first = conversation_id(page)
    other_tab = open_page(browser, f"{server.base_url}/#{first}")  # another window, or another device
    live(other_tab)

    # A rename in the first tab: the second tab's row and header follow.
    row_action(listed(page, first), "Rename").click()
    field = page.get_by_label("Conversation title")
    field.fill("Renamed in tab one")
    field.press("Enter")
    expect(listed(other_tab, first).locator(".conv-name")).to_have_text("Renamed in tab one")
    expect(other_tab.locator("#conv-title")).to_have_text("Renamed in tab one")

    # A reply asked for in the first tab streams in the second, which has the conversation open.
    sim.enqueue(Script([steps.Text("Slowly "), steps.Sleep(1.0), steps.Text("arriving "), steps.Sleep(1.0),
                        steps.Text("answer.")]))
    page.get_by_test_id("composer").fill("a second question")
    page.get_by_test_id("composer").press("Enter")
    expect(listed(other_tab, first).get_by_test_id("conversation-running")).to_have_count(1)
    expect(assistant_messages(other_tab)).to_have_count(2)
    expect(assistant_messages(other_tab).last).to_contain_text("answer.")
    expect(assistant_messages(other_tab).last).to_have_attribute("data-status", "complete")
    expect(listed(other_tab, first).get_by_test_id("conversation-running")).to_have_count(0)

    # A new conversation made in the first tab is listed in the second once it holds a message
    # (an empty one is listed only where it is open, so others' lists do not fill with them).
    made = new_conversation(page)
    assert made != first
    sim.enqueue(Script([steps.Text("A new thread.")]))
    exchange(page, "start something new")
    expect(listed(other_tab, made)).to_have_count(1)
    assert other_tab.js_errors == [], other_tab.js_errors
    other_tab.context.close()


def test_the_page_makes_no_requests_while_idle_or_while_a_turn_runs_elsewhere(page, server, sim):
    live(page)
    elsewhere = httpx.post(f"{server.base_url}/api/conversations", json={}, timeout=10).json()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    # A turn of several seconds in another conversation (another device's) inside the window, then nothing.
    sim.enqueue(Script([steps.Text("Elsewhere "), steps.Sleep(5.0), steps.Text("and done.")]))
    turn = threading.Thread(target=lambda: httpx.post(
        f"{server.base_url}/api/conversations/{elsewhere['id']}/messages",
        json={"content": "a turn on another device"}, timeout=30))
    turn.start()
    expect(listed(page, elsewhere["id"]).get_by_test_id("conversation-running")).to_have_count(1)
    page.wait_for_timeout(QUIET_WINDOW_MS)  # the window the requests are counted over
    turn.join(20)
    expect(listed(page, elsewhere["id"]).get_by_test_id("conversation-running")).to_have_count(0)
    assert requests == [], requests


def test_a_change_told_by_another_tab_updates_its_row_in_place(page, browser, server, sim):
    sim.enqueue(Script([steps.Text("One.")]))
    exchange(page, "a first thread")
    first = conversation_id(page)
    second = new_conversation(page)
    sim.enqueue(Script([steps.Text("Two.")]))
    exchange(page, "a second thread")
    other_tab = open_page(browser, f"{server.base_url}/#{first}")
    live(other_tab)
    expect(listed(other_tab, second)).to_have_count(1)
    # Each row's element is marked: a list drawn again would hold new elements without the mark.
    rows = "ids => ids.map((id) => document.querySelector(`#conversation-list li[data-id='${id}']`))"
    other_tab.evaluate(f"ids => ({rows})(ids).forEach((li, i) => {{ li.mark = ids[i]; }})", [first, second])

    server.api("PATCH", f"/api/conversations/{second}", json={"title": "Renamed elsewhere"}).raise_for_status()
    expect(listed(other_tab, second).locator(".conv-name")).to_have_text("Renamed elsewhere")
    marks = other_tab.evaluate(f"ids => ({rows})(ids).map((li) => li.mark ?? null)", [first, second])
    assert marks == [first, second]
    assert other_tab.js_errors == [], other_tab.js_errors
    other_tab.context.close()
