"""The page end to end: a person's actions in chromium, a real server, a scripted gateway."""

from __future__ import annotations

import re
import time

from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import (
    assistant_messages,
    conversation_id,
    eventually,
    exchange,
    new_conversation,
    open_page,
    row_action,
    screenshot,
    send,
    user_messages,
)


def last_user_content(request) -> str:
    user = [m for m in request.body["messages"] if m["role"] == "user"][-1]
    content = user["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def test_reply_streams_as_markdown_and_send_turns_into_stop(page, server, sim):
    sim.enqueue(Script([steps.Text("Hello **bold** world.\n\n"), steps.Sleep(1.0),
                        steps.Text("- one\n- two\n")]))
    send(page, "Say hello")

    expect(user_messages(page)).to_have_text(["Say hello"])
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "streaming")
    expect(page.get_by_test_id("send")).to_have_text("Stop")
    expect(reply.locator("strong")).to_have_text("bold")
    expect(reply).to_have_attribute("data-status", "complete")
    expect(page.get_by_test_id("send")).to_have_text("Send")
    expect(reply.locator("li")).to_have_text(["one", "two"])
    expect(page.get_by_test_id("composer")).to_have_value("")
    # A model that streams no reasoning and uses no tools gets no trail at all.
    expect(reply.get_by_test_id("activity")).to_be_hidden()
    saved = server.conversation(conversation_id(page))
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    screenshot(page, "reply")


def test_stop_keeps_the_partial_reply_closes_upstream_and_regenerate_answers_again(page, server, sim):
    sim.enqueue(Script([steps.Text("Once upon a time"), steps.Sleep(30), steps.Text(" the end.")]))
    send(page, "Tell me a long story")
    reply = assistant_messages(page).last
    expect(reply).to_contain_text("Once upon a time")

    page.get_by_test_id("send").click()

    expect(reply).to_have_attribute("data-status", "interrupted")
    expect(page.get_by_test_id("send")).to_have_text("Send")
    # The page re-reads the stopped turn and draws it again: ask the reply shown now, not one just replaced.
    expect(reply.locator(".bubble")).to_have_css("border-top-style", "dashed")
    record = sim.wait_for_disconnect(timeout=5)
    assert not record.completed
    conv_id = conversation_id(page)
    saved = server.settled(conv_id)
    assert [(m["role"], m.get("status")) for m in saved["messages"]] == [("user", None), ("assistant", "interrupted")]
    # Once the server has saved the stopped turn the page shows its numbers too.
    expect(page.get_by_test_id("usage-header")).to_contain_text("1 turn")
    screenshot(page, "stopped")

    sim.enqueue(Script([steps.Text("A complete answer.")]))
    reply.get_by_test_id("regenerate").click()

    expect(assistant_messages(page)).to_have_count(1)
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    expect(assistant_messages(page).last).to_contain_text("A complete answer.")
    assert last_user_content(sim.requests[-1]) == "Tell me a long story"
    saved = server.conversation(conv_id)
    assert [(m["role"], m.get("status")) for m in saved["messages"]] == [("user", None), ("assistant", "complete")]


def test_a_reply_shows_as_finished_only_once_it_is_drawn_for_good(page, server, sim):
    conv_id = conversation_id(page)
    held = []
    # The re-read of the conversation after the reply is held, so the page is caught in between.
    page.route(f"**/api/conversations/{conv_id}", lambda route: held.append(route))
    sim.enqueue(Script([steps.Text("Drawn once.")]))
    with page.expect_request(lambda r: r.method == "GET" and r.url.endswith(f"/api/conversations/{conv_id}")):
        send(page, "Draw it once")
    deadline = time.monotonic() + 10
    while not held:  # the route handler runs as Playwright reads the browser's messages
        assert time.monotonic() < deadline, "the re-read never reached the route"
        page.evaluate("0")
    # The streamed copy is about to be replaced by the saved one: it must not offer itself as finished.
    expect(assistant_messages(page)).to_have_count(1)
    expect(page.locator("[data-role=assistant][data-status=complete]")).to_have_count(0)

    for route in held:
        route.continue_()
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    expect(reply).to_contain_text("Drawn once.")
    page.unroute(f"**/api/conversations/{conv_id}")


def test_only_the_last_reply_offers_regenerate(page, sim):
    sim.enqueue(Script([steps.Text("First.")]), Script([steps.Text("Second.")]))
    exchange(page, "one", "two")

    expect(page.get_by_test_id("regenerate")).to_have_count(1)
    expect(assistant_messages(page).last.get_by_test_id("regenerate")).to_be_visible()


def test_switching_model_mid_conversation_names_the_new_model_upstream(page, server, sim):
    picker = page.get_by_test_id("model-picker")
    tiers = server.models()["tiers"]
    labels = picker.locator("optgroup").evaluate_all("groups => groups.map(g => g.label)")
    assert labels == ["Fast", "Balanced", "Frontier"]
    values = picker.locator("option").evaluate_all("options => options.map(o => o.value)")
    assert values == [m["id"] for tier in tiers for m in tier["models"]]
    first_model = picker.input_value()
    other = next(v for v in values if v != first_model)

    sim.enqueue(Script([steps.Text("From the first model.")]), Script([steps.Text("From the other model.")]))
    send(page, "Question one")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    assert sim.requests[-1].body["model"] == first_model

    picker.select_option(other)
    conv_id = conversation_id(page)
    eventually(lambda: server.conversation(conv_id)["model"] == other)
    send(page, "Question two")
    expect(assistant_messages(page)).to_have_count(2)
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    assert sim.requests[-1].body["model"] == other

    page.reload()
    expect(picker).to_have_value(other)


def test_enter_while_composing_hangul_never_sends_half_a_syllable(page, sim):
    composer = page.get_by_test_id("composer")
    composer.fill("인사: ")
    # Each guard on its own: Chrome's isComposing, then Safari's keyCode 229 after compositionend.
    composer.dispatch_event("keydown", {"key": "Enter", "isComposing": True})
    composer.dispatch_event("keydown", {"key": "Enter", "keyCode": 229})
    # A real composition through the browser's IME path, Enter pressed mid-syllable.
    cdp = page.context.new_cdp_session(page)
    cdp.send("Input.imeSetComposition", {"text": "안녕하", "selectionStart": 3, "selectionEnd": 3})
    page.keyboard.press("Enter")
    cdp.send("Input.insertText", {"text": "안녕하세요"})
    expect(user_messages(page)).to_have_count(0)

    sim.enqueue(Script([steps.Text("네, 안녕하세요!")]))
    composer.press("End")
    composer.press("Enter")

    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    expect(user_messages(page)).to_have_count(1)
    expect(user_messages(page).first).to_contain_text("인사: 안녕하세요")
    assert len(sim.requests) == 1


def test_shift_enter_adds_a_line_instead_of_sending(page):
    composer = page.get_by_test_id("composer")
    composer.fill("first line")
    composer.press("Shift+Enter")
    composer.press_sequentially("second line")
    expect(composer).to_have_value("first line\nsecond line")
    expect(user_messages(page)).to_have_count(0)


def test_markup_in_a_reply_or_a_message_runs_nothing(page, server, sim):
    hostile = (
        'Look: <img src=x onerror="window.__pwned=1"> and <script>window.__pwned=2</script>\n\n'
        "[click me](javascript:window.__pwned=3) <a href=\"javascript:window.__pwned=4\">a</a>\n\n"
        '<svg onload="window.__pwned=5"></svg><iframe src="javascript:window.__pwned=6"></iframe>\n\n'
        "![pic](javascript:window.__pwned=7) [ok](https://example.com/safe)\n"
    )
    sim.enqueue(Script([steps.Text(hostile, chunk_size=2)]))
    send(page, '<img src=x onerror="window.__pwned=8"> hi')
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")

    def assert_inert():
        transcript = page.locator("#transcript")
        assert page.evaluate("window.__pwned") is None
        for tag in ("img", "script", "svg", "iframe"):
            expect(page.locator(f"#app {tag}")).to_have_count(0)
        hrefs = transcript.locator("a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
        assert hrefs == ["https://example.com/safe"]
        expect(reply).to_contain_text("<script>window.__pwned=2</script>")
        expect(user_messages(page).first).to_have_text('<img src=x onerror="window.__pwned=8"> hi')

    assert_inert()
    # Saved history renders through the same path on reload.
    page.reload()
    expect(reply).to_have_attribute("data-status", "complete")
    assert_inert()
    expect(page.get_by_test_id("conversation-list")).to_contain_text("<img src=x")


FENCE_WATCH = """
() => {
  window.__layout = {problems: [], sawPending: false};
  const check = () => {
    for (const bubble of document.querySelectorAll('[data-role=assistant] .bubble')) {
      if (bubble.querySelector('.code-block.pending')) window.__layout.sawPending = true;
      if (bubble.querySelector('h1')) window.__layout.problems.push('code line rendered as a heading');
      const walker = document.createTreeWalker(bubble, NodeFilter.SHOW_TEXT);
      for (let n = walker.nextNode(); n; n = walker.nextNode()) {
        const inCode = n.parentElement.closest('pre');
        if (!inCode && n.data.includes('``')) window.__layout.problems.push('fence shown as text: ' + n.data);
        if (!inCode && n.data.includes('print(')) window.__layout.problems.push('code shown as prose');
      }
    }
  };
  new MutationObserver(check).observe(document.getElementById('messages'),
    {subtree: true, childList: true, characterData: true});
}
"""


def test_a_code_fence_arriving_in_pieces_never_breaks_layout_and_gets_copy(page, server, sim):
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.base_url)
    page.evaluate(FENCE_WATCH)
    code = "# not a heading\nprint('<b>hi</b>')\n    indented = {'a': 1}"
    pieces = ["Here is code:\n``", "`pyt", "hon\n# not a ", "heading\nprint('<b>hi</b>')\n",
              "    indented = {'a': 1}\n`", "``\n", "Done."]
    script_steps = []
    for piece in pieces:
        script_steps += [steps.Text(piece, chunk_size=1000), steps.Sleep(0.15)]
    sim.enqueue(Script(script_steps))
    send(page, "Show me code")

    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    layout = page.evaluate("window.__layout")
    assert layout["problems"] == []
    assert layout["sawPending"], "the open fence was never shown as code while it streamed"
    expect(reply.locator("pre > code")).to_have_count(1)
    assert reply.locator("pre > code").text_content() == code
    expect(reply.locator("p").last).to_have_text("Done.")

    copy = reply.locator(".code-block").get_by_role("button", name="Copy")
    copy.click()
    expect(reply.locator(".code-block").get_by_role("button", name="Copied")).to_be_visible()
    assert page.evaluate("navigator.clipboard.readText()") == code
    screenshot(page, "code-block")


SEARCH_RESULTS = [
    {"url": "https://docs.python.org/3/library/asyncio.html", "title": "asyncio — Asynchronous I/O"},
    {"url": "https://peps.python.org/pep-0492/", "title": "PEP 492"},
]


def test_search_turn_shows_a_live_trail_that_collapses_and_numbered_citations(page, sim):
    sim.enqueue(Script([
        steps.Search("python asyncio tutorial", SEARCH_RESULTS),
        steps.Fetch(SEARCH_RESULTS[0]["url"], SEARCH_RESULTS[0]["title"]),
        steps.Sleep(1.0),
        steps.Cite(SEARCH_RESULTS[0]["url"], SEARCH_RESULTS[0]["title"]),
        steps.Text("asyncio is Python's framework for async I/O."),
        steps.Cite(SEARCH_RESULTS[1]["url"], SEARCH_RESULTS[1]["title"]),
        steps.Text(" Coroutines came with PEP 492."),
    ]))
    send(page, "How does asyncio work?")
    reply = assistant_messages(page).last
    trail = reply.get_by_test_id("activity")

    expect(trail).to_have_attribute("open", "")
    expect(trail.locator(".timeline")).to_contain_text("python asyncio tutorial")
    expect(reply).to_have_attribute("data-status", "streaming")

    expect(reply).to_have_attribute("data-status", "complete")
    expect(trail).not_to_have_attribute("open", "")
    expect(trail.locator("summary")).to_have_text("Searched the web · Read 1 page")
    chips = reply.get_by_test_id("citation")
    expect(chips).to_have_count(2)
    assert chips.evaluate_all("cs => cs.map(c => c.href)") == [r["url"] for r in SEARCH_RESULTS]
    expect(chips).to_have_text(["1docs.python.org", "2peps.python.org"])

    trail.locator("summary").click()
    timeline = trail.locator(".timeline")
    expect(timeline).to_be_visible()
    expect(timeline).to_contain_text("python asyncio tutorial")
    expect(timeline.locator(".result-domains a")).to_have_text(["docs.python.org", "peps.python.org"])
    expect(timeline).to_contain_text("Read asyncio — Asynchronous I/O")
    screenshot(page, "search-trail")

    # The trail and the chips are saved with the message and drawn again from history.
    page.reload()
    expect(reply.get_by_test_id("activity").locator("summary")).to_have_text("Searched the web · Read 1 page")
    expect(reply.get_by_test_id("citation")).to_have_count(2)


def test_a_reasoning_model_gets_a_thinking_panel(page, server, sim):
    reasoning_model = next(m["id"] for tier in server.models()["tiers"] for m in tier["models"] if m["reasoning"])
    page.get_by_test_id("model-picker").select_option(reasoning_model)
    conv_id = conversation_id(page)
    eventually(lambda: server.conversation(conv_id)["model"] == reasoning_model)
    sim.enqueue(Script([steps.Sleep(1.0), steps.Reasoning("Weighing both options carefully."),
                        steps.Text("Take the second one.")]))
    send(page, "Which one?")
    reply = assistant_messages(page).last
    trail = reply.get_by_test_id("activity")

    # Before any thought arrives the panel already says the model is thinking.
    expect(trail.locator("summary")).to_have_text("Thinking…")
    expect(reply).to_have_attribute("data-status", "streaming")

    expect(reply).to_have_attribute("data-status", "complete")
    expect(trail.locator("summary")).to_have_text(re.compile(r"^Thought (for \d+s|briefly)$"))
    trail.locator("summary").click()
    expect(trail.locator(".thinking-text")).to_have_text("Weighing both options carefully.")
    expect(reply.locator(".markdown")).to_have_text("Take the second one.")


def test_each_conversation_keeps_its_draft_across_reloads(page):
    composer = page.get_by_test_id("composer")
    first = conversation_id(page)
    composer.fill("half-written 생각")
    page.reload()
    expect(composer).to_have_value("half-written 생각")

    new_conversation(page)
    expect(composer).to_have_value("")
    composer.fill("another draft")
    page.get_by_test_id("conversation-list").locator(f"li[data-id='{first}'] .conv-open").click()
    expect(composer).to_have_value("half-written 생각")


def test_sidebar_lists_newest_first_and_opens_renames_and_deletes(page, server, sim):
    sim.enqueue(Script([steps.Text("A.")]), Script([steps.Text("B.")]))
    first = conversation_id(page)
    send(page, "Alpha question")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    second = new_conversation(page)
    send(page, "Beta question")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")

    entries = page.get_by_test_id("conversation-list").locator("li.conv-item")
    expect(entries.nth(0).locator(".conv-name")).to_have_text("Beta question")
    expect(entries.nth(1).locator(".conv-name")).to_have_text("Alpha question")

    entries.nth(1).get_by_text("Alpha question").click()
    expect(user_messages(page)).to_have_text(["Alpha question"])
    assert conversation_id(page) == first

    alpha = page.get_by_test_id("conversation-list").locator(f"li[data-id='{first}']")
    row_action(alpha, "Rename").click()
    title = alpha.get_by_role("textbox", name="Conversation title")
    title.fill("Renamed 대화")
    title.press("Enter")
    expect(alpha.locator(".conv-name")).to_have_text("Renamed 대화")
    expect(page.locator("#conv-title")).to_have_text("Renamed 대화")
    assert server.conversation(first)["title"] == "Renamed 대화"

    delete = row_action(alpha, "Delete")
    delete.click()
    expect(delete).to_have_text("Delete?")
    delete.click()
    expect(page.get_by_test_id("conversation-list").locator(f"li[data-id='{first}']")).to_have_count(0)
    assert server.api("GET", f"/api/conversations/{first}").status_code == 404
    assert server.conversation(second)["title"] == "Beta question"


def answered_conversation(page, sim, question: str):
    """Send `question`, wait for the reply; the conversation's id and its sidebar entry."""
    sim.enqueue(Script([steps.Text("Noted.")]))
    send(page, question)
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    conv_id = conversation_id(page)
    return conv_id, page.get_by_test_id("conversation-list").locator(f"li[data-id='{conv_id}']")


def change_model_without_moving_focus(page) -> str:
    """Pick another model as a script would: the list is read again while the focus stays where it
    was, as when a title arrives or a turn elsewhere runs. The model's label."""
    picker = page.get_by_test_id("model-picker")
    values = picker.locator("option").evaluate_all("options => options.map(o => o.value)")
    other = next(v for v in values if v != picker.input_value())
    picker.evaluate("(select, value) => { select.value = value; select.dispatchEvent(new Event('change')); }", other)
    return picker.locator(f"option[value='{other}']").inner_text()


def test_an_armed_delete_stays_armed_when_the_list_is_read_again(page, server, sim):
    conv_id, item = answered_conversation(page, sim, "Keep me for a moment")
    delete = row_action(item, "Delete")
    delete.click()
    expect(delete).to_have_text("Delete?")

    label = change_model_without_moving_focus(page)
    expect(item.locator(".conv-meta")).to_contain_text(label)

    expect(delete).to_have_text("Delete?")
    delete.click()
    expect(item).to_have_count(0)
    assert server.api("GET", f"/api/conversations/{conv_id}").status_code == 404


def test_a_title_being_typed_in_the_list_stays_when_the_list_is_read_again(page, server, sim):
    conv_id, item = answered_conversation(page, sim, "Name me later")
    row_action(item, "Rename").click()
    title = item.get_by_role("textbox", name="Conversation title")
    title.fill("Half typ")

    item.evaluate("li => { li.dataset.drawnBefore = 'true'; }")
    with page.expect_response(lambda response: response.url.endswith("/api/conversations")):
        change_model_without_moving_focus(page)
    # The list was read again and its row updated in place: the same element, the field in it.
    expect(page.locator(f"li[data-id='{conv_id}'][data-drawn-before]")).to_have_count(1)

    expect(title).to_be_focused()
    expect(title).to_have_value("Half typ")
    assert server.conversation(conv_id)["title"] == "Name me later", "nothing was saved half typed"
    page.keyboard.type("ed title")
    page.keyboard.press("Enter")
    expect(item.locator(".conv-name")).to_have_text("Half typed title")
    assert server.conversation(conv_id)["title"] == "Half typed title"


def test_no_demo_banner_when_a_gateway_is_configured(page):
    expect(page.locator("#demo-banner")).to_be_hidden()


def test_phone_width_collapses_the_sidebar_and_dark_mode_applies(browser, server, sim):
    page = open_page(browser, server.base_url, viewport={"width": 390, "height": 800}, color_scheme="dark")
    try:
        sim.enqueue(Script([steps.Text("다크 모드에서도 잘 보입니다. `code` and **bold**.")]))
        send(page, "Phone test: 한국어 / 日本語")
        expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
        sidebar = page.locator("#sidebar")
        expect(sidebar).not_to_be_in_viewport()
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(21, 23, 27)"
        # Hangul is drawn with a real CJK face, not a fallback box or a random system font.
        cdp = page.context.new_cdp_session(page)
        cdp.send("DOM.enable")
        cdp.send("CSS.enable")
        root = cdp.send("DOM.getDocument")["root"]["nodeId"]
        # The page opens on the newest conversation, which may hold earlier replies: this one is the last.
        paragraphs = cdp.send("DOM.querySelectorAll", {"nodeId": root, "selector": "[data-role=assistant] .bubble p"})
        fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": paragraphs["nodeIds"][-1]})["fonts"]
        assert any(f["familyName"].startswith("Noto Sans CJK") for f in fonts), fonts
        screenshot(page, "phone-dark")

        page.get_by_role("button", name="Conversations").click()
        expect(sidebar).to_be_in_viewport()
        expect(page.get_by_test_id("new-conversation")).to_be_visible()
        screenshot(page, "phone-sidebar")
        page.keyboard.press("Escape")
        expect(sidebar).not_to_be_in_viewport()
    finally:
        page.context.close()
