"""Working with answers in chromium against the real server (issue 27): Regenerate any reply with
another model, Continue a cut-off reply, Edit a reply, the conversation's generation parameters,
and Compare with replies side by side."""

from __future__ import annotations

import re
import threading

from playwright.sync_api import expect

from gateway_sim.simulator import Script, Usage, steps
from pagekit import assistant_messages, conversation_id, eventually, exchange, screenshot, send, user_messages

OTHER = "openai/gpt-5"
REASONING = "anthropic/claude-sonnet-4.5"


def texts_of(request) -> list[str]:
    out = []
    for m in request.body["messages"]:
        if m["role"] == "system":
            continue
        content = m["content"]
        out.append(content if isinstance(content, str) else "".join(p.get("text", "") for p in content))
    return out


def test_regenerate_the_second_of_three_replies_with_another_model_keeps_the_third(page, server, sim):
    sim.enqueue(*(Script([steps.Text(f"Answer {i}.")]) for i in (1, 2, 3)))
    exchange(page, "One?", "Two?", "Three?")

    sim.enqueue(Script([steps.Text("Answer 2, from another model.")]))
    second = assistant_messages(page).nth(1)
    second.get_by_test_id("regenerate-reply").click()
    second.get_by_test_id("regenerate-model").select_option(OTHER)
    screenshot(page, "regenerate-picker")
    second.get_by_test_id("regenerate-go").click()

    expect(user_messages(page)).to_have_text(["One?", "Two?"])
    expect(assistant_messages(page).last).to_contain_text("Answer 2, from another model.")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    assert sim.requests[-1].body["model"] == OTHER
    assert texts_of(sim.requests[-1]) == ["One?", "Answer 1.", "Two?"]
    newest = assistant_messages(page).last
    expect(newest.get_by_test_id("branch-position")).to_have_attribute("data-position", "2/2")

    newest.get_by_test_id("branch-prev").click()
    expect(user_messages(page)).to_have_text(["One?", "Two?", "Three?"])
    expect(assistant_messages(page).last).to_contain_text("Answer 3.")


def test_continue_joins_the_cut_off_reply_and_counts_both_parts(page, server, sim):
    sim.enqueue(Script([steps.Text("The first half")], finish="max_tokens", usage=Usage(900, 40, dialect="openrouter")))
    send(page, "Write a long sentence.")
    reply = assistant_messages(page).last
    expect(reply.get_by_test_id("warning")).to_be_visible()
    sim.enqueue(Script([steps.Text(" and the second half.")], usage=Usage(950, 10, dialect="openrouter")))

    reply.get_by_test_id("continue-reply").click()

    last = assistant_messages(page).last
    expect(last).to_contain_text("The first half and the second half.")
    expect(last).to_have_attribute("data-status", "complete")
    expect(last.get_by_test_id("reply-continued")).to_have_text("Continued once")
    expect(last.locator(".stats")).to_contain_text("50 out")  # 40 + 10
    expect(assistant_messages(page)).to_have_count(1)
    expect(last.get_by_test_id("continue-reply")).to_have_count(0)


def test_an_edited_reply_is_what_the_next_request_sends(page, server, sim):
    sim.enqueue(Script([steps.Text("The answer is 41.")]))
    exchange(page, "What is six times seven?")
    reply = assistant_messages(page).last
    reply.get_by_test_id("edit-reply").click()
    reply.get_by_test_id("edit-reply-input").fill("The answer is 42.")
    reply.get_by_test_id("edit-reply-save").click()

    edited = assistant_messages(page).last
    expect(edited).to_contain_text("The answer is 42.")
    expect(edited.get_by_test_id("reply-edited")).to_have_text("Edited by you")
    sim.enqueue(Script([steps.Text("Yes.")]))
    exchange(page, "Are you sure?")
    assert texts_of(sim.requests[-1]) == ["What is six times seven?", "The answer is 42.", "Are you sure?"]


def test_the_settings_panel_sets_parameters_that_reach_the_gateway_and_the_footer(page, server, sim):
    conv_id = conversation_id(page)
    page.get_by_test_id("model-picker").select_option(REASONING)
    eventually(lambda: server.conversation(conv_id)["model"] == REASONING)
    page.get_by_test_id("settings-open").click()
    dialog = page.get_by_role("dialog", name="Settings")
    expect(dialog.get_by_test_id("set-reasoning-effort")).to_be_visible()
    dialog.get_by_test_id("set-temperature").fill("0.4")
    dialog.get_by_test_id("set-max-tokens").fill("600")
    dialog.get_by_test_id("set-reasoning-effort").select_option("low")
    dialog.locator("#settings-save").click()
    expect(dialog.locator("#settings-status")).to_have_text("Saved this conversation's settings.")
    dialog.get_by_test_id("set-temperature").fill("7")
    dialog.locator("#settings-save").click()
    expect(dialog.locator("#settings-status")).to_contain_text("temperature")  # the server's own 422
    dialog.get_by_test_id("set-temperature").fill("0.4")
    dialog.get_by_role("button", name="Close settings").click()

    sim.enqueue(Script([steps.Text("Tuned.")]))
    exchange(page, "Hello")
    body = sim.requests[-1].body
    # Web tools are on in these tests: /v1/messages, reasoning effort as a thinking budget.
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048} and body["max_tokens"] == 2048 + 600
    expect(assistant_messages(page).last.get_by_test_id("reply-params")).to_have_text(
        "temperature 0.4 · max 600 tokens · low reasoning")


def test_compare_shows_three_replies_side_by_side_stop_one_and_choose_one(page, server, sim):
    models = ["openai/gpt-5-mini", OTHER, "anthropic/claude-haiku-4.5"]
    release = threading.Event()
    for i, model in enumerate(models):
        sim.enqueue_for(model, Script([steps.Text(f"Reply {i} starts. "), steps.Hold(release, 20),
                                       steps.Text(f"Reply {i} ends.")],
                                      usage=Usage(800, 5 * (i + 1), cost=0.001 * (i + 1), dialect="openrouter")))
    page.get_by_test_id("compare-toggle").click()
    for model in models:
        page.get_by_test_id("compare-models").locator(f"input[value='{model}']").check()
    try:
        send(page, "Which is best?")
        expect(page.get_by_test_id("compare-lane")).to_have_count(3)
        lanes = [page.locator(f"[data-test=compare-lane][data-model='{model}']") for model in models]
        for i, lane in enumerate(lanes):
            expect(lane).to_contain_text(f"Reply {i} starts.")
        boxes = [lane.bounding_box() for lane in lanes]
        assert len({round(b["y"]) for b in boxes}) == 1 and len({round(b["x"]) for b in boxes}) == 3  # one row
        screenshot(page, "compare")
        lanes[1].get_by_test_id("compare-stop").click()
        expect(lanes[1].get_by_role("article")).to_have_attribute("data-status", "interrupted")
        expect(lanes[0].get_by_role("article")).to_have_attribute("data-status", "streaming")
        expect(lanes[2].get_by_role("article")).to_have_attribute("data-status", "streaming")
    finally:
        release.set()
    for i in (0, 2):
        expect(lanes[i]).to_contain_text(f"Reply {i} ends.")
        expect(lanes[i].locator(".stats").first).to_contain_text(f"{5 * (i + 1)} out")
        expect(lanes[i].get_by_test_id("compare-time")).to_be_visible()
    expect(lanes[1]).not_to_contain_text("Reply 1 ends.")
    expect(lanes[2].get_by_test_id("compare-choose")).to_be_visible()

    lanes[2].get_by_test_id("compare-choose").click()
    expect(page.get_by_test_id("compare")).to_have_count(0)
    expect(assistant_messages(page).last).to_contain_text("Reply 2 ends.")
    chosen = assistant_messages(page).last
    expect(chosen.get_by_test_id("branch-position")).to_have_attribute("data-position", re.compile(r"^[1-3]/3$"))
    conv = server.conversation(conversation_id(page))
    assert [m["content"] for m in conv["messages"]][-1] == "Reply 2 starts. Reply 2 ends."


def test_a_reload_during_a_comparison_shows_it_side_by_side_again(page, server, sim):
    models = ["openai/gpt-5-mini", OTHER]
    release = threading.Event()
    for i, model in enumerate(models):
        sim.enqueue_for(model, Script([steps.Text(f"Lane {i} so far. "), steps.Hold(release, 20),
                                       steps.Text(f"Lane {i} done.")]))
    page.get_by_test_id("compare-toggle").click()
    for model in models:
        page.get_by_test_id("compare-models").locator(f"input[value='{model}']").check()
    try:
        send(page, "Compare after a reload")
        expect(page.get_by_test_id("compare-lane")).to_have_count(2)
        expect(page.get_by_test_id("compare-lane").nth(1)).to_contain_text("so far.")
        page.reload()
        lanes = [page.locator(f"[data-test=compare-lane][data-model='{model}']") for model in models]
        for i, lane in enumerate(lanes):
            expect(lane).to_contain_text(f"Lane {i} so far.")
        expect(page.get_by_test_id("send")).to_have_text("Stop")
    finally:
        release.set()
    for i, lane in enumerate(lanes):
        expect(lane).to_contain_text(f"Lane {i} done.")
    expect(lanes[1].get_by_test_id("compare-choose")).to_be_visible()
    lanes[1].get_by_test_id("compare-choose").click()
    expect(assistant_messages(page).last).to_contain_text("Lane 1 so far. Lane 1 done.")
