"""Edit and branch in chromium against the real server: edit and resend, the ‹ i/n › switcher,
regenerate keeping the earlier answer."""

from __future__ import annotations

from playwright.sync_api import expect

from gateway_sim.simulator import Script, errors, steps
from pagekit import assistant_messages, conversation_id, exchange, screenshot, user_messages


def user_texts(request) -> list[str]:
    out = []
    for m in request.body["messages"]:
        if m["role"] != "user":
            continue
        content = m["content"]
        out.append(content if isinstance(content, str) else "".join(p.get("text", "") for p in content))
    return out


def position(message):
    return message.get_by_test_id("branch-position")


def test_edit_and_resend_starts_a_branch_and_the_arrows_switch_between_them(page, server, sim):
    sim.enqueue(Script([steps.Text("Paris.")]), Script([steps.Text("About two million.")]))
    exchange(page, "What is the capital of France?", "How many people live there?")
    conv_id = conversation_id(page)
    second = user_messages(page).nth(1)
    expect(second.get_by_test_id("branch-switcher")).to_have_count(0)

    sim.enqueue(Script([steps.Text("Paris has many museums.")]))
    second.get_by_test_id("edit-message").click()
    editor = second.get_by_test_id("edit-input")
    expect(editor).to_have_value("How many people live there?")
    editor.fill("What museums are there?")
    second.get_by_test_id("edit-send").click()

    expect(assistant_messages(page).last).to_contain_text("Paris has many museums.")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    expect(user_messages(page)).to_have_text(["What is the capital of France?", "What museums are there?"])
    # The gateway saw only the new path.
    assert user_texts(sim.requests[-1]) == ["What is the capital of France?", "What museums are there?"]
    edited = user_messages(page).nth(1)
    expect(position(edited)).to_have_attribute("data-position", "2/2")
    expect(edited.get_by_test_id("branch-next")).to_be_disabled()
    screenshot(page, "branches")
    page.set_viewport_size({"width": 390, "height": 844})
    expect(edited.get_by_test_id("branch-prev")).to_be_visible()
    screenshot(page, "branches-phone")
    page.set_viewport_size({"width": 1280, "height": 860})

    edited.get_by_test_id("branch-prev").click()
    expect(user_messages(page)).to_have_text(["What is the capital of France?", "How many people live there?"])
    expect(assistant_messages(page).last).to_contain_text("About two million.")
    expect(position(user_messages(page).nth(1))).to_have_attribute("data-position", "1/2")
    saved = server.conversation(conv_id)
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"][-1] == "How many people live there?"

    user_messages(page).nth(1).get_by_test_id("branch-next").click()
    expect(user_messages(page)).to_have_text(["What is the capital of France?", "What museums are there?"])
    expect(assistant_messages(page).last).to_contain_text("Paris has many museums.")


def test_editing_the_first_message_answers_from_the_start_and_a_failed_edit_returns_its_draft(page, server, sim):
    sim.enqueue(Script([steps.Text("Hello there.")]))
    exchange(page, "Hi")
    conv_id = conversation_id(page)

    sim.enqueue(errors.server_error_502())
    first = user_messages(page).first
    first.get_by_test_id("edit-message").click()
    first.get_by_test_id("edit-input").fill("Good morning")
    first.get_by_test_id("edit-send").click()
    # Nothing arrived: the old branch is back on screen and the edit waits in the composer.
    expect(page.get_by_test_id("error")).to_be_visible()
    expect(page.get_by_test_id("composer")).to_have_value("Good morning")
    expect(user_messages(page)).to_have_text(["Hi"])
    expect(assistant_messages(page)).to_have_count(1)
    expect(assistant_messages(page).first.locator(".bubble")).to_have_text("Hello there.")

    sim.enqueue(Script([steps.Text("Good morning to you.")]))
    page.get_by_test_id("composer").fill("")
    first = user_messages(page).first
    first.get_by_test_id("edit-message").click()
    first.get_by_test_id("edit-input").fill("Good morning")
    first.get_by_test_id("edit-input").press("Enter")
    expect(assistant_messages(page).last).to_contain_text("Good morning to you.")
    assert user_texts(sim.requests[-1]) == ["Good morning"]
    expect(position(user_messages(page).first)).to_have_attribute("data-position", "2/2")
    saved = server.conversation(conv_id)
    assert saved["messages"][0]["parent_id"] is None and saved["messages"][0]["content"] == "Good morning"


def test_regenerate_keeps_the_earlier_answer_as_a_sibling(page, server, sim):
    sim.enqueue(Script([steps.Text("First answer.")]))
    exchange(page, "Give me an answer")
    sim.enqueue(Script([steps.Text("Second answer.")]))
    assistant_messages(page).last.get_by_test_id("regenerate").click()

    reply = assistant_messages(page).last
    expect(reply).to_contain_text("Second answer.")
    expect(reply).to_have_attribute("data-status", "complete")
    expect(position(reply)).to_have_attribute("data-position", "2/2")
    expect(position(reply)).to_have_attribute("aria-label", "Version 2 of 2")

    reply.get_by_test_id("branch-prev").click()
    expect(assistant_messages(page)).to_have_count(1)
    expect(assistant_messages(page).last).to_contain_text("First answer.")
    expect(position(assistant_messages(page).last)).to_have_attribute("data-position", "1/2")


def test_a_search_hit_on_another_branch_opens_that_branch(page, server, sim):
    sim.enqueue(Script([steps.Text("Noted.")]), Script([steps.Text("Fine.")]))
    exchange(page, "Tell me about the narwhal tusk")
    conv_id = conversation_id(page)
    first = user_messages(page).first
    first.get_by_test_id("edit-message").click()
    first.get_by_test_id("edit-input").fill("Tell me about otters")
    first.get_by_test_id("edit-send").click()
    expect(assistant_messages(page).last).to_contain_text("Fine.")
    expect(user_messages(page)).to_have_text(["Tell me about otters"])

    page.get_by_test_id("search-open").click()
    page.get_by_test_id("search-input").type("narwhal")
    hit = page.locator("[data-test=search-result][data-message]").first
    expect(hit).to_be_visible()
    message_id = hit.get_attribute("data-message")
    hit.click()

    highlighted = page.locator("[data-test=message][data-highlighted=true]")
    expect(highlighted).to_have_attribute("data-id", message_id)
    expect(user_messages(page)).to_have_text(["Tell me about the narwhal tusk"])
    assert server.conversation(conv_id)["messages"][0]["content"] == "Tell me about the narwhal tusk"


def edit(message, text: str) -> None:
    message.get_by_test_id("edit-message").click()
    message.get_by_test_id("edit-input").fill(text)
    message.get_by_test_id("edit-send").click()


def test_going_back_to_version_1_returns_to_the_thread_last_viewed_under_it(page, server, sim):
    """Version 1 of a message showed the most recent child at each level below it, so a thread
    continued under an older version of a later message seemed lost."""
    sim.enqueue(*(Script([steps.Text(f"Answer {n}.")]) for n in range(1, 6)))
    exchange(page, "First question", "Second question")
    edit(user_messages(page).nth(1), "Second question, asked again")
    expect(assistant_messages(page).last).to_contain_text("Answer 3.")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    user_messages(page).nth(1).get_by_test_id("branch-prev").click()
    expect(user_messages(page).nth(1)).to_have_text("Second question")
    exchange(page, "Third question")
    edit(user_messages(page).first, "First question, asked again")
    expect(assistant_messages(page).last).to_contain_text("Answer 5.")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")

    user_messages(page).first.get_by_test_id("branch-prev").click()

    expect(user_messages(page)).to_have_text(["First question", "Second question", "Third question"])
    expect(assistant_messages(page).last).to_contain_text("Answer 4.")
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    expect(user_messages(page)).to_have_text(["First question", "Second question", "Third question"])
