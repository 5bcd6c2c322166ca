"""Browser: a turn with tool calls shows each call live in the activity trail (running, then done
or failed, with its arguments and result summary) and draws the same trail from the stored reply
after a reload; attachment citations are chips naming file and place."""

from __future__ import annotations

from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import assistant_messages, conversation_id, send


def test_tool_calls_show_live_and_after_reload_with_file_page_chips(page, server, sim):
    conv_id = conversation_id(page)
    uploaded = server.api("POST", f"/api/conversations/{conv_id}/attachments",
                          files={"file": ("plan.txt", b"The launch moves to Thursday after the safety review.",
                                          "text/plain")})
    assert uploaded.status_code == 201, uploaded.text
    sim.enqueue(
        Script([steps.Text("Checking your file. "),
                steps.ToolCall("search_attachments", {"query": "launch day"}),
                steps.ToolCall("remember", '{"fact": broken')]),
        Script([steps.Sleep(1.5), steps.Text("The launch is on Thursday.")]),
    )

    send(page, "When is the launch?")
    reply = assistant_messages(page).last
    trail = reply.get_by_test_id("activity")
    calls = trail.get_by_test_id("tool-step")

    # While the answer is still coming, both calls are in the open trail, one done and one failed.
    expect(reply).to_have_attribute("data-status", "streaming")
    expect(trail).to_have_attribute("open", "")
    expect(calls).to_have_count(2)
    expect(calls.nth(0)).to_have_attribute("data-status", "done")
    expect(calls.nth(0)).to_contain_text("Ran search_attachments")
    expect(calls.nth(0)).to_contain_text('query: "launch day"')
    expect(calls.nth(0)).to_contain_text("plan.txt")
    expect(calls.nth(1)).to_have_attribute("data-status", "error")
    expect(calls.nth(1)).to_contain_text("remember failed")
    expect(calls.nth(1)).to_contain_text("not valid JSON")

    expect(reply).to_have_attribute("data-status", "complete")
    expect(trail.locator("summary")).to_have_text("Used 2 tools · 1 failed")
    chip = reply.get_by_test_id("citation")
    expect(chip).to_have_text(["1plan.txt line 1"])

    page.reload()
    reply = assistant_messages(page).last
    trail = reply.get_by_test_id("activity")
    expect(trail.locator("summary")).to_have_text("Used 2 tools · 1 failed")
    trail.locator("summary").click()
    expect(trail.get_by_test_id("tool-step")).to_have_count(2)
    expect(trail.get_by_test_id("tool-step").nth(0)).to_contain_text("Ran search_attachments")
    expect(reply.get_by_test_id("citation")).to_have_text(["1plan.txt line 1"])
