"""The viewer behind a file citation chip (issue 24): click the chip under a reply and a side panel
shows the file's name, the passage's label, the passage the model was given with the words it
searched for marked, and for a PDF the page itself; Esc or ✕ closes it; it works after a reload;
on a phone it covers the screen."""

from __future__ import annotations

import io

import docx
from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import assistant_messages, conversation_id, new_conversation, send
from test_attachment_flow import report_pdf
from test_everyday import drop_file

IMAGE_LOADED = """() => {
  const img = document.querySelector('[data-test="viewer-image"]');
  return !!img && !img.hidden && img.complete && img.naturalWidth > 0;
}"""


def notes_docx() -> bytes:
    document = docx.Document()
    for heading, body in (("Introduction", "The project started in spring."),
                          ("Budget", "The budget for the pilot is 40,000 euros.")):
        document.add_heading(heading, level=1)
        document.add_paragraph(body)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def test_a_pdf_chip_opens_the_page_and_the_passage_with_the_searched_words_marked(page, server, sim):
    drop_file(page, "#transcript", "report.pdf", report_pdf(), "application/pdf")
    chip = page.get_by_test_id("composer-attachments").get_by_test_id("attachment-chip")
    expect(chip).to_have_attribute("data-state", "ready")
    sim.enqueue(Script([steps.ToolCall("search_attachments", {"query": "harbour tunnel opens"})]),
                Script([steps.Text("It opens on the ninth of March [report.pdf p. 7].")]))
    send(page, "When does the tunnel open?")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    viewer = page.get_by_test_id("viewer")
    expect(viewer).to_be_hidden()

    for attempt in ("live", "after reload"):
        reply.get_by_test_id("citation").click()

        expect(viewer).to_be_visible()
        expect(viewer.get_by_test_id("viewer-name")).to_have_text("report.pdf")
        expect(viewer.get_by_test_id("viewer-label")).to_have_text("p. 7")
        passage = viewer.get_by_test_id("viewer-passage")
        expect(passage).to_have_count(1)
        expect(passage).to_contain_text("The harbour tunnel opens on the ninth of March.")
        expect(passage.locator("mark")).to_have_text(["harbour", "tunnel", "opens"])
        page.wait_for_function(IMAGE_LOADED, timeout=15_000)
        expect(viewer.get_by_test_id("viewer-image")).to_have_attribute("alt", "Page 7 of report.pdf")
        width = page.evaluate("document.querySelector('[data-test=viewer-image]').naturalWidth")
        assert 0 < width <= 1000, attempt

        page.keyboard.press("Escape")
        expect(viewer).to_be_hidden()
        if attempt == "live":
            page.reload()
            expect(page.locator("body")).to_have_attribute("data-ready", "true")
            reply = assistant_messages(page).last
            expect(reply.get_by_test_id("citation")).to_have_text(["1report.pdf p. 7"])


def test_a_docx_chip_shows_its_section_label_and_covers_a_phone_screen(page, server, sim):
    conv_id = conversation_id(page)
    uploaded = server.api("POST", f"/api/conversations/{conv_id}/attachments",
                          files={"file": ("notes.docx", notes_docx(), "application/octet-stream")})
    assert uploaded.status_code == 201, uploaded.text
    sim.enqueue(Script([steps.ToolCall("search_attachments", {"query": "pilot budget"})]),
                Script([steps.Text("Forty thousand euros [notes.docx § Budget].")]))
    send(page, "What is the pilot's budget?")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    chip = reply.get_by_test_id("citation")
    expect(chip).to_have_text(["1notes.docx § Budget"])
    page.set_viewport_size({"width": 390, "height": 780})

    chip.click()

    viewer = page.get_by_test_id("viewer")
    expect(viewer).to_be_visible()
    expect(viewer.get_by_test_id("viewer-name")).to_have_text("notes.docx")
    expect(viewer.get_by_test_id("viewer-label")).to_have_text("§ Budget")
    passage = viewer.get_by_test_id("viewer-passage")
    expect(passage).to_contain_text("The budget for the pilot is 40,000 euros.")
    expect(passage.locator("mark")).to_have_text(["Budget", "budget", "pilot"])
    expect(viewer.get_by_test_id("viewer-image")).to_be_hidden()
    box = viewer.bounding_box()
    assert box is not None and (box["x"], box["width"]) == (0, 390), box

    viewer.get_by_test_id("viewer-close").click()
    expect(viewer).to_be_hidden()

    # A passage belongs to its conversation: opening another one closes the viewer.
    page.set_viewport_size({"width": 1280, "height": 860})
    chip.click()
    expect(viewer).to_be_visible()
    new_conversation(page)
    expect(viewer).to_be_hidden()
