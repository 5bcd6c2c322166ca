"""Each failure kind shows its own line and its own way back, and never loses the person's message."""

from __future__ import annotations

from playwright.sync_api import expect

from gateway_sim.simulator import Script, errors, steps
from pagekit import assistant_messages, conversation_id, screenshot, send, user_messages

MESSAGE = "My carefully written question"
SUCCESS = Script([steps.Text("Here is the answer after all.")])


def error_line(page, kind: str):
    line = page.get_by_test_id("error")
    expect(line).to_have_attribute("data-kind", kind)
    return line


def assert_rolled_back(page, server):
    """A failure before the first event: the message left the transcript and is back in the composer."""
    expect(user_messages(page)).to_have_count(0)
    expect(page.get_by_test_id("composer")).to_have_value(MESSAGE)
    assert server.settled(conversation_id(page))["messages"] == []


def assert_answered(page, server):
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    expect(reply).to_contain_text("Here is the answer after all.")
    expect(user_messages(page)).to_have_text([MESSAGE])
    expect(page.get_by_test_id("error")).to_have_count(0)
    expect(page.get_by_test_id("composer")).to_have_value("")
    saved = server.conversation(conversation_id(page))
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]


def test_auth_failure_offers_settings(page, server, sim):
    sim.enqueue(errors.openai_invalid_key())
    send(page, MESSAGE)
    line = error_line(page, "auth")
    assert_rolled_back(page, server)
    screenshot(page, "failure-auth")

    line.get_by_role("button", name="Open settings").click()
    expect(page.get_by_role("dialog", name="Settings")).to_be_visible()
    expect(page.locator("#gateway-section")).to_be_focused()


def test_rate_limit_counts_down_and_retries_by_itself(page, server, sim):
    sim.enqueue(errors.openai_rate_limit(retry_after=1), SUCCESS)
    send(page, MESSAGE)
    line = error_line(page, "rate_limited")
    expect(line).to_contain_text("Retrying in 1s")
    assert_answered(page, server)
    assert len(sim.requests) == 2


def test_context_overflow_compresses_then_retries(page, server, sim):
    sim.enqueue(errors.openai_context_overflow(), SUCCESS)
    send(page, MESSAGE)
    line = error_line(page, "context_overflow")
    assert_rolled_back(page, server)

    with page.expect_response(lambda r: r.url.endswith("/compress") and r.request.method == "POST") as compress:
        line.get_by_role("button", name="Compress and retry").click()
    assert compress.value.ok
    assert_answered(page, server)


def test_refusal_before_any_text_returns_the_message_for_editing(page, server, sim):
    sim.enqueue(errors.azure_content_filter())
    send(page, MESSAGE)
    line = error_line(page, "refused")
    assert_rolled_back(page, server)
    page.get_by_test_id("model-picker").focus()

    line.get_by_role("button", name="Edit message").click()
    expect(page.get_by_test_id("composer")).to_be_focused()


def test_refusal_after_partial_text_rewinds_the_message_into_the_composer(page, server, sim):
    sim.enqueue(Script([steps.Text("I started to answer but")], finish="content_filter"))
    send(page, MESSAGE)
    line = error_line(page, "refused")
    # The partial reply stays, and the question with it, until the person rewinds.
    expect(assistant_messages(page).last).to_contain_text("I started to answer but")
    expect(user_messages(page)).to_have_text([MESSAGE])
    expect(page.get_by_test_id("composer")).to_have_value("")

    line.get_by_role("button", name="Rewind and edit").click()
    expect(page.get_by_test_id("composer")).to_have_value(MESSAGE)
    expect(user_messages(page)).to_have_count(0)
    expect(assistant_messages(page)).to_have_count(0)
    expect(page.get_by_test_id("error")).to_have_count(0)
    assert server.conversation(conversation_id(page))["messages"] == []


def test_unavailable_model_points_at_the_model_picker(page, server, sim):
    sim.enqueue(errors.openai_model_not_found())
    send(page, MESSAGE)
    line = error_line(page, "model_unavailable")
    assert_rolled_back(page, server)

    line.get_by_role("button", name="Choose another model").click()
    expect(page.get_by_test_id("model-picker")).to_be_focused()


def test_upstream_failure_retries_on_request(page, server, sim):
    sim.enqueue(errors.server_error_502())
    send(page, MESSAGE)
    line = error_line(page, "upstream")
    assert_rolled_back(page, server)

    sim.enqueue(SUCCESS)
    line.get_by_role("button", name="Retry").click()
    assert_answered(page, server)


def test_a_stream_broken_mid_reply_keeps_the_partial_text_and_retry_answers_again(page, server, sim):
    sim.enqueue(Script([steps.Text("Half an answer"), steps.Close(reset=True)]))
    send(page, MESSAGE)
    line = error_line(page, "upstream")
    partial = assistant_messages(page).last
    expect(partial).to_contain_text("Half an answer")
    expect(partial).to_have_attribute("data-status", "interrupted")
    expect(user_messages(page)).to_have_text([MESSAGE])
    expect(page.get_by_test_id("composer")).to_have_value("")
    screenshot(page, "failure-partial")

    sim.enqueue(SUCCESS)
    line.get_by_role("button", name="Retry").click()
    expect(assistant_messages(page)).to_have_count(1)
    assert_answered(page, server)


def test_a_returned_draft_survives_a_reload(page, sim):
    sim.enqueue(errors.openai_invalid_key())
    send(page, MESSAGE)
    expect(page.get_by_test_id("error")).to_be_visible()
    page.reload()
    expect(page.get_by_test_id("composer")).to_have_value(MESSAGE)
    expect(user_messages(page)).to_have_count(0)


def test_a_message_the_server_refuses_comes_back_with_the_servers_reason(page, server):
    too_long = "x" * 2001
    send(page, too_long)
    line = error_line(page, "request")
    expected = server.api("POST", f"/api/conversations/{conversation_id(page)}/messages",
                          json={"content": too_long}).json()["detail"]
    expect(line).to_contain_text(expected)
    expect(page.get_by_test_id("composer")).to_have_value(too_long)
    expect(user_messages(page)).to_have_count(0)
    expect(assistant_messages(page)).to_have_count(0)
    expect(page.get_by_test_id("send")).to_have_text("Send")
