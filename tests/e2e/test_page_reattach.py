"""Turns that outlive the page: a switch, a reload, or Stop after a reload, in chromium against the
real server (hang-up does not stop a turn there; only Stop does)."""

from __future__ import annotations

from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import assistant_messages, conversation_id, new_conversation, open_page, screenshot, send

PIECES = [f"Part {n} of the long answer. " for n in range(1, 8)]


def long_reply() -> Script:
    """A reply that keeps growing for a few seconds, piece by piece."""
    script = [steps.Text(PIECES[0])]
    for piece in PIECES[1:]:
        script += [steps.Sleep(0.7), steps.Text(piece)]
    return Script(script)


def whole() -> str:
    return "".join(PIECES).strip()


def said_once(reply) -> None:
    """Every piece that has arrived shows exactly once: nothing replayed twice."""
    text = reply.locator(".bubble").inner_text()
    for piece in PIECES:
        assert text.count(piece.strip()) <= 1, text


def test_a_reply_goes_on_while_another_conversation_is_open_and_is_followed_on_return(page, server, sim):
    sim.enqueue(long_reply())
    send(page, "Tell me a long story")
    first = conversation_id(page)
    expect(assistant_messages(page).last).to_contain_text(PIECES[0].strip())

    other = new_conversation(page)
    assert other != first
    running = page.get_by_test_id("conversation-list").locator(f"li[data-id='{first}']")
    expect(running.get_by_test_id("conversation-running")).to_have_count(1)
    screenshot(page, "running-elsewhere")
    assert server.conversation(first)["streaming"] is True

    running.locator(".conv-open").click()
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "streaming")
    expect(page.get_by_test_id("send")).to_have_text("Stop")
    grown = len(reply.locator(".bubble").inner_text())
    expect(reply).to_contain_text(PIECES[-1].strip())
    assert len(reply.locator(".bubble").inner_text()) > grown
    said_once(reply)
    expect(reply).to_have_attribute("data-status", "complete")
    assert reply.locator(".bubble").inner_text().strip() == whole()
    saved = server.settled(first)
    assert saved["messages"][-1]["content"].strip() == whole()
    assert saved["messages"][-1]["status"] == "complete"
    # Hang-up stopped nothing: the gateway's one request ran to its end.
    assert len(sim.requests) == 1 and sim.requests[0].completed
    expect(running.get_by_test_id("conversation-running")).to_have_count(0)


def test_a_reload_in_the_middle_of_a_reply_follows_it_to_the_end(page, server, sim):
    sim.enqueue(long_reply())
    send(page, "Tell me a long story")
    conv_id = conversation_id(page)
    expect(assistant_messages(page).last).to_contain_text(PIECES[1].strip())

    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    assert conversation_id(page) == conv_id
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "streaming")
    expect(reply).to_contain_text(PIECES[0].strip())
    expect(reply).to_contain_text(PIECES[-1].strip())
    said_once(reply)
    expect(reply).to_have_attribute("data-status", "complete")
    expect(assistant_messages(page)).to_have_count(1)
    assert reply.locator(".bubble").inner_text().strip() == whole()
    assert server.settled(conv_id)["messages"][-1]["status"] == "complete"
    assert sim.requests[0].completed


def test_stop_after_a_reload_stops_the_turn_on_the_server(page, server, sim):
    sim.enqueue(Script([steps.Text("Once upon a time"), steps.Sleep(30), steps.Text(" the end.")]))
    send(page, "Tell me a very long story")
    conv_id = conversation_id(page)
    expect(assistant_messages(page).last).to_contain_text("Once upon a time")

    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "streaming")
    expect(page.get_by_test_id("send")).to_have_text("Stop")
    page.get_by_test_id("send").click()

    record = sim.wait_for_disconnect(timeout=5)
    assert not record.completed
    expect(reply).to_have_attribute("data-status", "interrupted")
    expect(reply).to_contain_text("Once upon a time")
    expect(page.get_by_test_id("send")).to_have_text("Send")
    saved = server.settled(conv_id)
    assert [(m["role"], m.get("status")) for m in saved["messages"]] == [("user", None), ("assistant", "interrupted")]
    assert saved["messages"][-1]["content"] == "Once upon a time"


def test_a_second_tab_sending_during_a_reply_shows_that_reply_with_a_stop_that_works(browser, page, server, sim):
    """On the 409 for a running turn the second tab retried silently for 3.3 s, then showed an error
    without the reply it was about."""
    conv_id = conversation_id(page)
    other = open_page(browser, f"{server.base_url}/#{conv_id}")
    try:
        sim.enqueue(Script([steps.Text("Once upon a time"), steps.Sleep(30), steps.Text(" the end.")]))
        send(page, "Tell me a very long story")
        expect(assistant_messages(page).last).to_contain_text("Once upon a time")

        send(other, "And then what happened?")
        reply = assistant_messages(other).last
        expect(reply).to_have_attribute("data-status", "streaming")
        expect(reply).to_contain_text("Once upon a time")
        expect(other.get_by_test_id("send")).to_have_text("Stop")
        expect(other.get_by_test_id("composer")).to_have_value("And then what happened?")
        expect(other.get_by_test_id("error")).to_have_count(0)

        other.get_by_test_id("send").click()
        record = sim.wait_for_disconnect(timeout=5)
        assert not record.completed
        expect(reply).to_have_attribute("data-status", "interrupted")
        expect(assistant_messages(page).last).to_have_attribute("data-status", "interrupted")
        expect(other.get_by_test_id("send")).to_have_text("Send")
        expect(other.get_by_test_id("composer")).to_have_value("And then what happened?")
        saved = server.settled(conv_id)
        assert [(m["role"], m["content"]) for m in saved["messages"]] == [
            ("user", "Tell me a very long story"), ("assistant", "Once upon a time")]
        assert other.js_errors == []
    finally:
        other.context.close()
