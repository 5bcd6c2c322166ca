"""What chat users expect, in the page: attaching files (button, drop), the Files panel and the
library, search from the keyboard, export and import, the keyboard shortcuts, the presets editor,
pin and archive where the server keeps them, and no empty conversations left behind."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

from fpdf import FPDF
from playwright.sync_api import expect

from gateway_sim.simulator import Script, errors, steps
from pagekit import (
    assistant_messages,
    conversation_id,
    eventually,
    exchange,
    new_conversation,
    row_action,
    screenshot,
    send,
    user_messages,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def make_pdf(pages: int) -> bytes:
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for n in range(1, pages + 1):
        pdf.add_page()
        pdf.cell(text=f"Quarterly report, page {n}: the harbour tunnel opens in spring.")
    return bytes(pdf.output())


def drop_file(page, selector: str, name: str, data: bytes, mime: str) -> None:
    """Drag a file onto `selector` as a person would from the desktop: dragenter, dragover, drop."""
    page.evaluate(
        """([selector, name, bytes, mime]) => {
          const dt = new DataTransfer();
          dt.items.add(new File([new Uint8Array(bytes)], name, { type: mime }));
          const target = document.querySelector(selector);
          for (const type of ["dragenter", "dragover", "drop"]) {
            target.dispatchEvent(new DragEvent(type, { dataTransfer: dt, bubbles: true, cancelable: true }));
          }
        }""",
        [selector, name, list(data), mime],
    )


def attachments(server, conv_id: str) -> list[dict]:
    return server.api("GET", f"/api/conversations/{conv_id}/attachments").json()


def test_files_dropped_or_picked_show_as_chips_in_the_panel_and_download_and_delete(page, server, sim):
    conv_id = conversation_id(page)
    pdf = make_pdf(3)
    drop_file(page, "#transcript", "report.pdf", pdf, "application/pdf")
    chips = page.locator("#composer-files [data-test=attachment-chip]")
    expect(chips).to_have_count(1)
    expect(chips.first).to_have_attribute("data-state", "ready")
    expect(chips.first).to_contain_text("report.pdf")
    expect(chips.first).to_contain_text("3 pages")

    # A crafted name is only ever text.
    hostile = "<img src=x onerror=alert(1)>.txt"
    page.get_by_test_id("attach-input").set_input_files(
        files=[{"name": hostile, "mimeType": "text/plain", "buffer": b"tunnel notes"}])
    expect(chips).to_have_count(2)
    expect(chips.nth(1)).to_have_attribute("data-state", "ready")
    expect(chips.nth(1).locator(".file-chip-name")).to_have_text(hostile)
    assert page.locator("img[src=x]").count() == 0
    # A file pasted into the message box is attached the same way.
    page.evaluate("""() => {
      const dt = new DataTransfer();
      dt.items.add(new File(["pasted words"], "clip.txt", { type: "text/plain" }));
      document.getElementById("composer").dispatchEvent(
        new ClipboardEvent("paste", { clipboardData: dt, bubbles: true, cancelable: true }));
    }""")
    expect(chips).to_have_count(3)
    expect(chips.nth(2)).to_have_attribute("data-state", "ready")
    chips.nth(2).get_by_role("button", name="Remove clip.txt").click()
    expect(chips).to_have_count(2)
    eventually(lambda: len(attachments(server, conv_id)) == 2)
    stored = attachments(server, conv_id)
    assert sorted(a["name"] for a in stored) == sorted(["report.pdf", hostile])
    screenshot(page, "attachments-composer")

    sim.enqueue(Script([steps.Text("The tunnel opens in spring.")]))
    send(page, "When does the tunnel open?")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    expect(chips).to_have_count(0)
    saved = server.conversation(conv_id)["messages"][0]
    # The server keeps which files went with the message: the chips come from the saved message.
    assert sorted(saved["attachment_ids"]) == sorted(a["id"] for a in stored)
    page.reload()
    expect(user_messages(page).first.locator("[data-test=attachment-chip]")).to_have_count(2)

    page.get_by_test_id("files-open").click()
    panel = page.get_by_test_id("files")
    expect(panel).to_be_visible()
    entries = panel.get_by_test_id("files-list").get_by_test_id("file-entry")
    expect(entries).to_have_count(2)
    report = entries.filter(has_text="report.pdf")
    expect(report).to_contain_text("3 pages")
    link = report.get_by_test_id("file-download")
    report_id = next(a["id"] for a in stored if a["name"] == "report.pdf")
    assert link.get_attribute("href") == f"/api/conversations/{conv_id}/attachments/{report_id}"
    assert link.get_attribute("download") is not None
    with page.expect_download() as info:
        link.click()
    download = info.value
    assert download.suggested_filename == "report.pdf"
    assert Path(download.path()).read_bytes() == pdf
    screenshot(page, "attachments-panel")

    report.get_by_test_id("file-delete").click()
    expect(entries).to_have_count(1)
    assert [a["name"] for a in attachments(server, conv_id)] == [hostile]
    expect(page.get_by_test_id("files-count")).to_have_text("1")


def test_the_library_lists_uploads_and_the_conversation_setting_follows_the_server(page, server):
    conv_id = conversation_id(page)
    page.get_by_test_id("files-open").click()
    page.get_by_test_id("library-input").set_input_files(
        files=[{"name": "glossary.md", "mimeType": "text/markdown", "buffer": b"# Glossary\n\nbollard: a post"}])
    library = page.get_by_test_id("library-list").get_by_test_id("file-entry")
    expect(library.filter(has_text="glossary.md")).to_have_count(1)
    entry = next(a for a in server.api("GET", "/api/library").json() if a["name"] == "glossary.md")
    assert library.filter(has_text="glossary.md").get_by_test_id("file-download").get_attribute("href") == \
        f"/api/library/{entry['id']}"

    page.get_by_test_id("library-toggle").check()
    status = page.get_by_test_id("files-status")
    expect(status).not_to_be_empty()
    eventually(lambda: server.conversation(conv_id)["settings"].get("library") is True)
    expect(page.get_by_test_id("library-toggle")).to_be_checked()
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    page.get_by_test_id("files-open").click()
    expect(page.get_by_test_id("library-toggle")).to_be_checked()

    library.filter(has_text="glossary.md").get_by_test_id("file-delete").click()
    expect(library.filter(has_text="glossary.md")).to_have_count(0)
    assert all(a["id"] != entry["id"] for a in server.api("GET", "/api/library").json())


def test_a_message_rolled_back_takes_its_files_back_to_the_composer(page, server, sim):
    page.get_by_test_id("attach-input").set_input_files(
        files=[{"name": "plan.md", "mimeType": "text/markdown", "buffer": b"# Plan\n\nbuild the bridge"}])
    chips = page.locator("#composer-files [data-test=attachment-chip]")
    expect(chips).to_have_attribute("data-state", "ready")
    sim.enqueue(errors.server_error_502())
    send(page, "Summarise the plan")
    expect(page.get_by_test_id("error")).to_have_attribute("data-kind", "upstream")
    expect(page.get_by_test_id("composer")).to_have_value("Summarise the plan")
    expect(chips).to_have_count(1)
    expect(chips).to_contain_text("plan.md")


def test_a_file_the_server_refuses_shows_its_reason_and_stores_nothing(page, server):
    conv_id = conversation_id(page)
    page.get_by_test_id("attach-input").set_input_files(
        files=[{"name": "tool.bin", "mimeType": "application/octet-stream", "buffer": b"MZ\x00\x01\x02"}])
    chip = page.locator("#composer-files [data-test=attachment-chip]")
    expect(chip).to_have_attribute("data-state", "error")
    expect(chip.get_by_test_id("attachment-error")).to_contain_text("not supported")
    assert attachments(server, conv_id) == []
    chip.get_by_role("button", name="Remove tool.bin").click()
    expect(chip).to_have_count(0)


def test_search_from_the_keyboard_opens_the_conversation_at_the_message(page, server, sim):
    target = conversation_id(page)
    sim.enqueue(Script([steps.Text("Noted.")]), Script([steps.Text("Fine.")]))
    exchange(page, "Where did the <b>walrus</b> go on holiday?", "Something else entirely")
    new_conversation(page)
    page.get_by_test_id("composer").press("Control+k")
    box = page.get_by_test_id("search-input")
    expect(box).to_be_focused()
    box.type("walrus")
    hits = page.get_by_test_id("search-result")
    # The title matches too (a hit with no message); the message's own hit opens at the message.
    hit = page.locator("[data-test=search-result][data-message]").filter(has=page.locator("mark")).first
    expect(hit.locator("mark").first).to_have_text(re.compile("walrus", re.I))
    # The snippet's escaped text stays text: the <b> the person typed shows as written.
    expect(hit.locator(".search-snippet")).to_contain_text("<b>walrus</b>")
    assert hit.locator(".search-snippet b").count() == 0
    screenshot(page, "search")
    message_id = hit.get_attribute("data-message")
    index = [h.get_attribute("data-message") for h in hits.all()].index(message_id)
    for _ in range(index):
        box.press("ArrowDown")
    box.press("Enter")

    expect(page.get_by_test_id("search")).to_be_hidden()
    eventually(lambda: conversation_id(page) == target)
    highlighted = page.locator("[data-test=message][data-highlighted=true]")
    expect(highlighted).to_have_attribute("data-id", message_id)
    expect(highlighted).to_contain_text("walrus")


def test_export_downloads_the_conversation_as_markdown_and_json(page, server, sim):
    sim.enqueue(Script([steps.Text("Exported answer.")]))
    exchange(page, "Export this exchange")
    page.get_by_test_id("conversation-menu").click()
    with page.expect_download() as info:
        page.get_by_test_id("export-md").click()
    markdown = Path(info.value.path()).read_text(encoding="utf-8")
    assert info.value.suggested_filename.endswith(".md")
    assert "Export this exchange" in markdown and "Exported answer." in markdown

    page.get_by_test_id("conversation-menu").click()
    with page.expect_download() as info:
        page.get_by_test_id("export-json").click()
    exported = json.loads(Path(info.value.path()).read_text(encoding="utf-8"))
    assert "Export this exchange" in json.dumps(exported)
    assert info.value.suggested_filename.endswith(".json")


def test_an_imported_zip_says_what_it_left_out_and_imported_reasoning_shows_as_a_trail(page, server, tmp_path):
    # ChatGPT's zip download: one broken conversation and three images no message shows are named
    # in the import line.
    download = tmp_path / "chatgpt-export.zip"
    with zipfile.ZipFile(download, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("conversations.json", (FIXTURES / "librechat_chatgpt_modern_export.json").read_bytes())
        for name in ("file-A1-photo.png", "file-B2-chart.png", "dalle-generations/file-C3.webp"):
            archive.writestr(name, b"\x89PNG\r\n\x1a\n")
    page.get_by_test_id("import-input").set_input_files(str(download))
    status = page.get_by_test_id("import-status")
    expect(status).to_contain_text("Imported 2 conversations.")
    expect(status).to_contain_text("Skipped 1: conversation 2 (“Corrupted entry”): it has no `mapping` of messages.")
    expect(status).to_contain_text("3 images of the archive were not imported")

    # Open WebUI's reasoning and tool blocks: shown in the reply's trail as our own are, not as HTML.
    page.get_by_test_id("import-input").set_input_files(str(FIXTURES / "librechat_openwebui_export.json"))
    expect(status).to_contain_text("Imported 3 conversations.")
    chats = {c["title"]: c["id"] for c in server.api("GET", "/api/conversations").json()}
    page.goto(f"{server.base_url}/#{chats['Chat with reasoning']}")
    reply = assistant_messages(page).last
    expect(reply.locator(".bubble")).to_have_text("255")
    trail = reply.get_by_test_id("activity")
    expect(trail.locator("summary")).to_have_text("Thought for 3s")
    trail.locator("summary").click()
    expect(trail.locator(".thinking-text")).to_have_text("Let me break this down...")
    page.goto(f"{server.base_url}/#{chats['Chat with tool call']}")
    reply = assistant_messages(page).last
    expect(reply.locator(".bubble")).to_have_text("The weather in Paris is 18C with rain.")
    expect(reply.get_by_test_id("activity").locator("summary")).to_have_text("Used 1 tool")
    expect(page.locator("details[type]")).to_have_count(0)


def test_import_a_chatgpt_export_shows_progress_and_the_result_then_lists_it(page, server):
    before = {c["id"] for c in server.api("GET", "/api/conversations").json()}
    page.get_by_test_id("import-input").set_input_files(str(FIXTURES / "chatgpt_conversations.json"))
    status = page.get_by_test_id("import-status")
    expect(status).to_have_text(re.compile(r"Imported 2 conversations"))
    # Upload progress arrived from the browser's own upload events, up to the whole file.
    assert page.get_by_test_id("import-progress").evaluate("el => el.value") == 1
    after = server.api("GET", "/api/conversations").json()
    new = [c for c in after if c["id"] not in before]
    assert len(new) == 2
    expect(page.get_by_test_id("conversation-list").locator(f"li[data-id='{new[0]['id']}']")).to_have_count(1)

    page.get_by_test_id("import-input").set_input_files(
        files=[{"name": "notes.json", "mimeType": "application/json", "buffer": b"not json at all"}])
    expect(status).to_have_text(re.compile("^Not imported: the file is not JSON; Import takes this server's JSON export"))
    expect(status).to_have_class(re.compile("error-text"))
    assert len(server.api("GET", "/api/conversations").json()) == len(after)


def test_shortcuts_list_stop_new_and_copy(page, server, sim):
    page.locator("#conv-title").click()
    page.keyboard.press("?")
    dialog = page.get_by_test_id("shortcuts")
    expect(dialog).to_be_visible()
    for words in ("Search conversations", "New conversation", "Copy the last reply", "Stop the reply"):
        expect(dialog).to_contain_text(words)
    screenshot(page, "shortcuts")
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()
    # Typed in the message box, "?" is just a character.
    page.get_by_test_id("composer").press("?")
    expect(dialog).to_be_hidden()
    expect(page.get_by_test_id("composer")).to_have_value("?")
    page.get_by_test_id("composer").fill("")

    sim.enqueue(Script([steps.Text("Copy me **exactly**.")]))
    exchange(page, "Say something to copy")
    page.evaluate("navigator.clipboard.writeText = async (text) => { window.__copied = text; }")
    page.keyboard.press("Control+Shift+C")
    eventually(lambda: page.evaluate("window.__copied") == "Copy me **exactly**.")

    sim.enqueue(Script([steps.Text("A long tale"), steps.Sleep(30), steps.Text(" never finished.")]))
    send(page, "Tell me a long tale")
    reply = assistant_messages(page).last
    expect(reply).to_contain_text("A long tale")
    page.keyboard.press("Escape")
    expect(reply).to_have_attribute("data-status", "interrupted")
    expect(page.get_by_test_id("send")).to_have_text("Send")
    assert not sim.wait_for_disconnect(timeout=5).completed

    first = conversation_id(page)
    server.settled(first)
    page.keyboard.press("Control+Shift+O")
    eventually(lambda: conversation_id(page) != first)
    expect(user_messages(page)).to_have_count(0)


def test_presets_editor_creates_edits_and_deletes_and_keeps_built_ins_read_only(page, server):
    page.get_by_test_id("settings-open").click()
    presets = page.get_by_test_id("preset-list").get_by_test_id("preset-entry")
    expect(presets.first).to_be_visible()
    builtin = page.locator("[data-test=preset-entry][data-name=default]")
    expect(builtin).to_contain_text("built-in")
    expect(builtin.get_by_test_id("preset-edit")).to_have_count(0)

    page.get_by_test_id("preset-new").click()
    page.get_by_test_id("preset-name").fill("Harbour pilot")
    page.get_by_test_id("preset-text").fill("You guide ships into the harbour.")
    page.get_by_test_id("preset-form").locator("input[value=remember]").check()
    page.get_by_test_id("preset-save").click()
    mine = page.locator("[data-test=preset-entry][data-name='Harbour pilot']")
    expect(mine).to_contain_text("remember")
    saved = next(p for p in server.api("GET", "/api/presets").json() if p["name"] == "Harbour pilot")
    assert saved["text"] == "You guide ships into the harbour." and saved["tools"] == ["remember"]
    assert saved["builtin"] is False
    screenshot(page, "presets-editor")

    mine.get_by_test_id("preset-edit").click()
    expect(page.get_by_test_id("preset-text")).to_have_value("You guide ships into the harbour.")
    page.get_by_test_id("preset-text").fill("You guide ships, briefly.")
    page.get_by_test_id("preset-form").locator("input[value=remember]").uncheck()
    page.get_by_test_id("preset-form").locator("input[value=web_fetch]").check()
    page.get_by_test_id("preset-save").click()
    expect(mine).to_contain_text("web_fetch")
    saved = next(p for p in server.api("GET", "/api/presets").json() if p["name"] == "Harbour pilot")
    assert saved["text"] == "You guide ships, briefly." and saved["tools"] == ["web_fetch"]

    # The server's own reason for a name it refuses.
    page.get_by_test_id("preset-new").click()
    page.get_by_test_id("preset-name").fill("bad/name")
    page.get_by_test_id("preset-text").fill("x")
    page.get_by_test_id("preset-save").click()
    expect(page.get_by_test_id("presets-status")).to_have_class(re.compile("error-text"))
    expect(page.get_by_test_id("presets-status")).to_contain_text("name")
    assert all(p["name"] != "bad/name" for p in server.api("GET", "/api/presets").json())

    # The new preset is offered for the conversation.
    expect(page.locator("#set-preset option[value='Harbour pilot']")).to_have_count(1)

    delete = mine.get_by_test_id("preset-delete")
    delete.click()
    expect(delete).to_have_text("Delete?")
    delete.click()
    expect(mine).to_have_count(0)
    assert all(p["name"] != "Harbour pilot" for p in server.api("GET", "/api/presets").json())


def test_the_conversation_chooses_among_its_presets_tools(page, server):
    conv_id = conversation_id(page)
    settings = server.conversation(conv_id)["settings"]
    page.get_by_test_id("settings-open").click()
    box = page.get_by_test_id("conversation-tools")
    expect(box).to_be_visible()
    allowed = next(p for p in server.api("GET", "/api/presets").json() if p["name"] == settings["preset"])["tools"]
    checks = box.get_by_test_id("tool-checkbox")
    assert [c.get_attribute("value") for c in checks.all()] == allowed
    for check in checks.all():
        assert check.is_checked() == (check.get_attribute("value") in settings["tools"])

    dropped = settings["tools"][0]
    box.locator(f"input[value={dropped}]").uncheck()
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.locator("#settings-status")).not_to_be_empty()
    now = eventually(lambda: (tools := server.conversation(conv_id)["settings"]["tools"]) != settings["tools"] and tools)
    assert now == [t for t in settings["tools"] if t != dropped]
    expect(box.locator(f"input[value={dropped}]")).not_to_be_checked()


def test_pin_and_archive_follow_the_server(page, server, sim):
    sim.enqueue(Script([steps.Text("Kept.")]))
    exchange(page, "Pin me")
    conv_id = conversation_id(page)
    entry = page.get_by_test_id("conversation-list").locator(f"li[data-id='{conv_id}']")
    row_action(entry, "Pin").click()
    eventually(lambda: server.conversation(conv_id)["pinned"] is True)
    expect(page.get_by_test_id("conversation-list").locator("li.conv-item").first).to_have_attribute("data-id", conv_id)
    row_action(entry, "Archive").click()
    eventually(lambda: server.conversation(conv_id)["archived"] is True)
    expect(entry).to_have_count(0)
    page.get_by_test_id("show-archived").click()
    archived = page.get_by_test_id("conversation-list").locator(f"li[data-id='{conv_id}']")
    expect(archived).to_have_count(1)
    row_action(archived, "Unarchive").click()
    eventually(lambda: server.conversation(conv_id)["archived"] is False)
    expect(archived).to_have_count(0)
    page.get_by_test_id("show-archived").click()
    expect(page.get_by_test_id("conversation-list").locator(f"li[data-id='{conv_id}']")).to_have_count(1)


def test_an_untouched_new_conversation_is_deleted_when_another_is_opened(page, server, sim):
    sim.enqueue(Script([steps.Text("Here.")]))
    exchange(page, "A conversation worth keeping")
    kept = conversation_id(page)
    empty = new_conversation(page)
    assert empty != kept
    page.get_by_test_id("conversation-list").locator(f"li[data-id='{kept}'] .conv-open").click()
    eventually(lambda: server.api("GET", f"/api/conversations/{empty}").status_code == 404)
    expect(page.get_by_test_id("conversation-list").locator(f"li[data-id='{empty}']")).to_have_count(0)

    # One holding a draft or a file is the person's work: it stays.
    drafted = new_conversation(page)
    page.get_by_test_id("composer").fill("half a thought")
    page.get_by_test_id("conversation-list").locator(f"li[data-id='{kept}'] .conv-open").click()
    eventually(lambda: conversation_id(page) == kept)
    with_file = new_conversation(page)
    assert with_file != drafted
    page.get_by_test_id("attach-input").set_input_files(
        files=[{"name": "a.txt", "mimeType": "text/plain", "buffer": b"some text"}])
    expect(page.locator("#composer-files [data-state=ready]")).to_have_count(1)
    page.get_by_test_id("conversation-list").locator(f"li[data-id='{kept}'] .conv-open").click()
    eventually(lambda: conversation_id(page) == kept)
    assert server.api("GET", f"/api/conversations/{drafted}").status_code == 200
    assert server.api("GET", f"/api/conversations/{with_file}").status_code == 200
