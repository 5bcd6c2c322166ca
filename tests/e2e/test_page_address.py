"""The address is the conversation, in chromium against the real server: a pasted #id opens what it
names and the next message goes there, Back and Forward move between conversations, and an id that
names none of the person's conversations says so."""

from __future__ import annotations

from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import conversation_id, exchange, new_conversation, user_messages


def user_texts(server, conv_id: str) -> list[str]:
    return [m["content"] for m in server.conversation(conv_id)["messages"] if m["role"] == "user"]


def test_a_pasted_address_opens_its_conversation_and_the_next_message_goes_there(page, server, sim):
    """Setting #B changed the address but not the page, and the next message was saved in A."""
    sim.enqueue(*(Script([steps.Text(f"Reply {n}.")]) for n in range(1, 4)))
    exchange(page, "About apples")
    a = conversation_id(page)
    b = new_conversation(page)
    exchange(page, "About bananas")
    page.get_by_test_id("conversation-list").locator(f"li[data-id='{a}'] .conv-open").click()
    expect(user_messages(page)).to_have_text(["About apples"])
    assert conversation_id(page) == a

    page.evaluate("id => { location.hash = id; }", b)
    expect(user_messages(page)).to_have_text(["About bananas"])
    expect(page.locator("#conv-title")).to_have_text(server.conversation(b)["title"])
    exchange(page, "More about bananas")
    assert user_texts(server, b) == ["About bananas", "More about bananas"]
    assert user_texts(server, a) == ["About apples"]

    page.go_back()
    assert conversation_id(page) == a
    expect(user_messages(page)).to_have_text(["About apples"])
    page.go_back()  # the list click before it was an entry too
    assert conversation_id(page) == b
    expect(user_messages(page)).to_have_text(["About bananas", "More about bananas"])
    page.go_forward()
    expect(user_messages(page)).to_have_text(["About apples"])
    assert conversation_id(page) == a


def test_an_address_that_names_no_conversation_of_yours_says_not_found(page, server, sim):
    """An unknown id (or another person's) silently opened the latest conversation instead."""
    sim.enqueue(Script([steps.Text("Noted.")]), Script([steps.Text("Still noted.")]))
    exchange(page, "Something to keep")
    a = conversation_id(page)
    page.evaluate("() => { location.hash = 'Zq3nNoSuchConversation0'; }")

    expect(page.get_by_test_id("not-found")).to_be_visible()
    expect(page.locator("#conv-title")).to_have_text("Conversation not found")
    expect(user_messages(page)).to_have_count(0)
    expect(page.get_by_test_id("composer")).to_be_disabled()
    assert conversation_id(page) == "Zq3nNoSuchConversation0"
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    expect(page.get_by_test_id("not-found")).to_be_visible()
    assert user_texts(server, a) == ["Something to keep"]

    page.go_back()
    expect(page.get_by_test_id("not-found")).to_be_hidden()
    expect(user_messages(page)).to_have_text(["Something to keep"])
    expect(page.get_by_test_id("composer")).to_be_enabled()
    exchange(page, "Still here")
    assert user_texts(server, a) == ["Something to keep", "Still here"]
