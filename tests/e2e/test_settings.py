"""Settings, memory, the model lineup, and the header's numbers, through the page."""

from __future__ import annotations

import re
import time

from playwright.sync_api import expect

from gateway_sim.simulator import Script, Usage, steps
from pagekit import assistant_messages, conversation_id, exchange, screenshot, send


def open_settings(page):
    page.get_by_test_id("settings-open").click()
    dialog = page.get_by_role("dialog", name="Settings")
    expect(dialog).to_be_visible()
    return dialog


def system_text(request) -> str:
    """Every system text the gateway received, whichever wire format carried it."""
    body = request.body
    parts = body.get("system") or [
        part for m in body["messages"] if m["role"] == "system"
        for part in (m["content"] if isinstance(m["content"], list) else [{"text": m["content"]}])
    ]
    return "\n".join(p["text"] for p in parts)


def test_conversation_settings_apply_persist_and_reach_the_gateway(page, server, sim):
    dialog = open_settings(page)
    dialog.get_by_label("System prompt").fill("You are a terse pirate.")
    dialog.get_by_label("Context budget (tokens)").fill("50000")
    dialog.get_by_label("Web search").uncheck()
    dialog.get_by_label("Web fetch").uncheck()
    dialog.get_by_role("button", name="Save").click()
    expect(dialog.locator("#settings-status")).to_have_text("Saved this conversation's settings.")
    screenshot(page, "settings")
    dialog.get_by_role("button", name="Close settings").click()
    expect(page.get_by_test_id("context-bar")).to_contain_text("/ 50,000 tokens")

    sim.enqueue(Script([steps.Text("Arr.")]))
    send(page, "Hello")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    request = sim.requests[-1]
    assert request.path == "/v1/chat/completions"  # no web tools: the plain chat transport
    assert "You are a terse pirate." in system_text(request)

    page.reload()
    dialog = open_settings(page)
    expect(dialog.get_by_label("System prompt")).to_have_value("You are a terse pirate.")
    expect(dialog.get_by_label("Preset")).to_have_value("")  # an edited prompt is no preset's
    expect(dialog.get_by_label("Context budget (tokens)")).to_have_value("50000")
    expect(dialog.get_by_label("Web search")).not_to_be_checked()
    expect(dialog.get_by_label("Web fetch")).not_to_be_checked()


def test_invalid_settings_show_the_servers_own_message(page, server):
    conv_id = conversation_id(page)
    dialog = open_settings(page)
    status = dialog.locator("#settings-status")

    dialog.get_by_label("Compression prompt").fill("Summarise the conversation.")
    dialog.get_by_role("button", name="Save").click()
    expected = server.api("PATCH", f"/api/conversations/{conv_id}",
                          json={"settings": {"compression_prompt": "Summarise the conversation."}}).json()["detail"]
    assert expected.startswith("settings.compression_prompt: Value error, ")
    expect(status).to_have_text("Compression prompt: " + expected.split("Value error, ", 1)[1])
    expect(status).to_contain_text("{transcript}")

    dialog.get_by_label("Compression prompt").fill("Fold this: {transcript}")
    dialog.get_by_label("Context budget (tokens)").fill("-5")
    dialog.get_by_role("button", name="Save").click()
    refused = server.api("PATCH", f"/api/conversations/{conv_id}", json={"settings": {"context_budget": -5}}).json()
    # The field is named as the panel labels it, not by its JSON path, and it has the focus.
    assert refused["detail"].startswith("settings.context_budget: ")
    expect(status).to_have_text(f"Context budget (tokens): {refused['errors'][0]['msg']}")
    expect(dialog.get_by_label("Context budget (tokens)")).to_be_focused()
    # Nothing was half-applied: the rejected request changed nothing.
    assert server.conversation(conv_id)["settings"]["compression_prompt"] != "Fold this: {transcript}"


def test_a_preset_fills_the_system_prompt(page, server):
    presets = server.api("GET", "/api/presets").json()
    chosen = presets[-1]
    dialog = open_settings(page)
    dialog.get_by_label("Preset").select_option(chosen["name"])
    expect(dialog.get_by_label("System prompt")).to_have_value(chosen["text"])
    dialog.get_by_role("button", name="Save").click()
    expect(dialog.locator("#settings-status")).to_have_text("Saved this conversation's settings.")
    settings = server.conversation(conversation_id(page))["settings"]
    assert (settings["preset"], settings["system_prompt"]) == (chosen["name"], chosen["text"])


def test_memory_edits_persist_and_are_sent_to_the_model(page, server, sim):
    dialog = open_settings(page)
    editor = page.get_by_test_id("memory-editor")
    editor.fill("- Prefers Python\n- Lives in Seoul (서울)\n")
    dialog.get_by_role("button", name="Save").click()
    expect(dialog.locator("#settings-status")).to_have_text("Saved memory.")
    assert server.api("GET", "/api/memory").json()["text"] == "- Prefers Python\n- Lives in Seoul (서울)\n"

    page.reload()
    open_settings(page)
    expect(page.get_by_test_id("memory-editor")).to_have_value("- Prefers Python\n- Lives in Seoul (서울)\n")
    page.keyboard.press("Escape")

    sim.enqueue(Script([steps.Text("Noted.")]))
    send(page, "What do you know about me?")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    assert "Lives in Seoul (서울)" in system_text(sim.requests[-1])


def test_the_lineup_takes_a_custom_model_and_lets_it_go(page, server):
    dialog = open_settings(page)
    dialog.get_by_label("Gateway model id").fill("acme/custom-model-1")
    dialog.get_by_label("Tier").select_option("fast")
    dialog.get_by_role("button", name="Add model").click()
    expect(dialog.locator("#models-status")).to_have_text("Added acme/custom-model-1.")
    fast = page.get_by_test_id("model-picker").locator("optgroup[label=Fast] option")
    expect(fast.last).to_have_attribute("value", "acme/custom-model-1")

    dialog.get_by_role("button", name="Remove acme/custom-model-1").click()
    expect(dialog.locator("#models-status")).to_have_text("Removed acme/custom-model-1.")
    expect(page.get_by_test_id("model-picker").locator("option[value='acme/custom-model-1']")).to_have_count(0)
    ids = [m["id"] for tier in server.models()["tiers"] for m in tier["models"]]
    assert "acme/custom-model-1" not in ids


def test_ask_before_keeping_facts_is_the_conversations_approve_facts(page, server):
    conv_id = conversation_id(page)
    assert server.conversation(conv_id)["settings"]["approve_facts"] is False
    dialog = open_settings(page)
    box = dialog.get_by_label("Ask before keeping facts")
    expect(box).not_to_be_checked()
    box.check()
    dialog.get_by_role("button", name="Save").click()
    expect(dialog.locator("#settings-status")).to_have_text("Saved this conversation's settings.")
    assert server.conversation(conv_id)["settings"]["approve_facts"] is True

    page.reload()
    dialog = open_settings(page)
    expect(dialog.get_by_label("Ask before keeping facts")).to_be_checked()
    dialog.get_by_label("Ask before keeping facts").uncheck()
    dialog.get_by_role("button", name="Save").click()
    expect(dialog.locator("#settings-status")).to_have_text("Saved this conversation's settings.")
    assert server.conversation(conv_id)["settings"]["approve_facts"] is False


def test_a_model_added_with_a_tool_runtime_keeps_it(page, server):
    dialog = open_settings(page)
    dialog.get_by_label("Gateway model id").fill("acme/local-tools-1")
    dialog.get_by_label("Tool runtime").select_option("local")
    dialog.get_by_role("button", name="Add model").click()
    expect(dialog.locator("#models-status")).to_have_text("Added acme/local-tools-1.")
    entry = next(m for tier in server.models()["tiers"] for m in tier["models"] if m["id"] == "acme/local-tools-1")
    assert entry["tool_runtime"] == "local"
    dialog.get_by_role("button", name="Remove acme/local-tools-1").click()
    expect(dialog.locator("#models-status")).to_have_text("Removed acme/local-tools-1.")


def test_info_markers_peek_on_hover_and_pin_on_click(page):
    dialog = open_settings(page)
    marker = dialog.locator(".field", has=page.get_by_label("System prompt")).get_by_role(
        "button", name="What this costs")
    tip = page.get_by_role("tooltip").filter(has_text="one cold, full-price turn")
    expect(tip).to_be_hidden()
    marker.hover()
    expect(tip).to_be_visible()
    dialog.locator("h2").hover()
    expect(tip).to_be_hidden()

    marker.click()
    dialog.locator("h2").click()
    expect(tip).to_be_visible()
    expect(marker).to_have_attribute("aria-expanded", "true")


def test_usage_header_stats_line_and_context_bar_show_the_servers_numbers(page, server, sim):
    # Chat transport (no web tools) in OpenRouter's dialect, which reports cost; then a turn without.
    server.api("PATCH", f"/api/conversations/{conversation_id(page)}",
               json={"settings": {"web_search": False, "web_fetch": False}}).raise_for_status()
    sim.enqueue(
        Script([steps.Text("First answer.")],
               usage=Usage(prompt=2000, completion=300, cached=1500, cost=0.0042, dialect="openrouter")),
        Script([steps.Text("Second answer.")], usage=Usage(prompt=2500, completion=100, cached=2000)),
    )
    send(page, "First")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    send(page, "Second")
    expect(assistant_messages(page)).to_have_count(2)
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")

    conv = server.conversation(conversation_id(page))
    totals = conv["totals"]
    assert (totals["input_tokens"], totals["output_tokens"], totals["cached_tokens"]) == (4500, 400, 3500)
    assert (totals["cost"], totals["cost_unreported"], totals["turns"]) == (0.0042, 1, 2)
    header = page.get_by_test_id("usage-header")
    expect(header.locator("span")).to_have_text(
        ["4,500 in", "400 out", "78% cached", "0 searches", "0 fetches", "cost unknown for 1 of 2 replies; $0.0042 for the rest", "2 turns"])  # noqa: E501

    stats = assistant_messages(page).locator(".stats")
    expect(stats.first).to_contain_text("2,000 in · 300 out · 75% cached · $0.0042")
    expect(stats.last).to_contain_text("2,500 in · 100 out · 80% cached · cost unknown")

    context = conv["context"]
    # The reserve for the reply counts against the budget like the prompt (shown once the server sends it).
    parts = [k for k in ("persona", "memory", "summary", "history", "reserve") if k in context]
    used = sum(context[k] for k in parts)
    bar = page.get_by_test_id("context-bar")
    approx = "" if context.get("measured", True) else "≈ "
    expect(bar.locator(".context-label")).to_have_text(f"{approx}{used:,} / {context['budget']:,} tokens")
    segments = bar.locator("[data-segment]").evaluate_all(
        "segs => Object.fromEntries(segs.map(s => [s.dataset.segment, Number(s.dataset.tokens)]))")
    assert segments == {k: context[k] for k in parts}
    screenshot(page, "usage")


def test_compress_now_folds_old_messages_into_a_notice(page, server, sim):
    sim.enqueue(Script([steps.Text("One.")]), Script([steps.Text("Two.")]))
    exchange(page, "First topic", "Second topic")

    sim.enqueue(Script([steps.Text('{"summary": "They covered two topics.", "facts": []}')]))
    page.get_by_role("button", name="Compress now").click()

    notice = page.locator("[data-test=message][data-role=notice]")
    expect(notice).to_have_count(1)
    saved = server.conversation(conversation_id(page))
    expect(notice).to_have_text(next(m["content"] for m in saved["messages"] if m["role"] == "notice"))
    assert saved["summary"]
    expect(page.get_by_test_id("context-bar").locator("[data-segment=summary]")).not_to_have_attribute(
        "data-tokens", "0")


def test_a_turn_over_budget_announces_its_compression_live(page, server, sim):
    sim.enqueue(Script([steps.Text("One.")]), Script([steps.Text("Two.")]))
    exchange(page, "First topic", "Second topic")
    conv_id = conversation_id(page)
    refused = server.api("PATCH", f"/api/conversations/{conv_id}", json={"settings": {"context_budget": 1}})
    smallest = int(re.search(r"at least (\d+)", refused.json()["detail"])[1])
    server.api("PATCH", f"/api/conversations/{conv_id}",
               json={"settings": {"context_budget": smallest}}).raise_for_status()

    sim.enqueue(Script([steps.Text('{"summary": "Two topics so far.", "facts": []}')]),
                Script([steps.Sleep(1.0), steps.Text("Three.")]))
    send(page, "Third topic " + "lorem " * 300)  # with the reply reserve, over the smallest budget
    notice = page.locator("[data-test=message][data-role=notice]")
    expect(notice).to_have_count(1)
    expect(assistant_messages(page).last).to_have_attribute("data-status", "streaming")

    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    saved = server.conversation(conv_id)
    roles = page.locator("[data-test=message]").evaluate_all("ms => ms.map(m => m.dataset.role)")
    assert roles == [m["role"] for m in saved["messages"]]
    assert roles[-3:] == ["notice", "user", "assistant"]


def test_settings_work_from_the_keyboard(page):
    opener = page.get_by_test_id("settings-open")
    opener.focus()
    page.keyboard.press("Enter")
    dialog = page.get_by_role("dialog", name="Settings")
    expect(dialog).to_be_visible()
    page.keyboard.press("Tab")
    focused = page.evaluate("document.activeElement.closest('dialog') !== null")
    assert focused, "focus stays inside the open dialog"
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()
    expect(opener).to_be_focused()
    assert opener.evaluate("el => getComputedStyle(el).outlineStyle") == "solid"


def test_settings_show_the_persons_files_and_conversations_against_their_quotas(page, server):
    dialog = open_settings(page)
    quota = server.api("GET", "/api/quota").json()
    line = dialog.get_by_test_id("quota")
    expect(line).to_have_text(re.compile(
        rf"^Files: [0-9.]+ (bytes|KB|MB) of 1 GB; conversations: {quota['conversations']:,} of 10,000$"))


def test_settings_opened_before_the_conversation_arrives_fill_in_when_it_does(page, server):
    """After a reload the dialog can open before the conversation's answer: it shows that
    conversation's settings once it arrives, instead of staying empty and disabled."""
    conv_id = conversation_id(page)
    patched = server.api("PATCH", f"/api/conversations/{conv_id}", json={"settings": {"system_prompt": "Speak like a sailor."}})
    assert patched.status_code == 200, patched.text
    held = []
    page.route(f"**/api/conversations/{conv_id}", lambda route: held.append(route))
    page.reload()
    dialog = open_settings(page)
    prompt = dialog.get_by_label("System prompt")
    expect(prompt).to_be_disabled()
    deadline = time.monotonic() + 10
    while not held:  # Playwright hands over the held request while the test waits in one of its calls
        assert time.monotonic() < deadline, "the page did not ask for the conversation"
        page.wait_for_timeout(50)
    held[0].continue_()
    expect(prompt).to_have_value("Speak like a sailor.")
    expect(prompt).to_be_enabled()
