"""The whole attachment flow in the page: drop a PDF in, ask about it, watch the model search it in
the activity trail, and see the answer cite the file and page, also after a reload."""

from __future__ import annotations

import json

from fpdf import FPDF
from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import assistant_messages, conversation_id, send
from test_everyday import drop_file


def report_pdf() -> bytes:
    """Eight pages; only page 7 says when the tunnel opens."""
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for n in range(1, 9):
        pdf.add_page()
        text = "The harbour tunnel opens on the ninth of March." if n == 7 else f"Budget tables, part {n}."
        pdf.cell(text=text)
    return bytes(pdf.output())


def test_drop_a_pdf_ask_about_it_and_see_the_search_and_the_page_chip(page, server, sim):
    conv_id = conversation_id(page)
    drop_file(page, "#transcript", "report.pdf", report_pdf(), "application/pdf")
    chip = page.get_by_test_id("composer-attachments").get_by_test_id("attachment-chip")
    expect(chip).to_have_attribute("data-state", "ready")
    expect(chip).to_contain_text("report.pdf")
    sim.enqueue(Script([steps.ToolCall("search_attachments", {"query": "harbour tunnel opens"})]),
                Script([steps.Text("It opens on the ninth of March [report.pdf p. 7].")]))

    send(page, "When does the tunnel open?")

    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    step = reply.get_by_test_id("activity").get_by_test_id("tool-step")
    expect(step).to_have_count(1)
    expect(step).to_contain_text("Ran search_attachments")
    expect(reply.get_by_test_id("citation")).to_have_text(["1report.pdf p. 7"])
    sent = server.conversation(conv_id)["messages"]
    assert sent[-2]["attachment_ids"], "the question carries its file"
    # The request after the tool call carries its result (a `tool_result` block on /v1/messages).
    result = json.dumps(sim.requests[1].body["messages"][-1])
    assert "tool_result" in result and "ninth of March" in result, "the tool found page 7's passage"

    page.reload()
    reply = assistant_messages(page).last
    expect(reply.get_by_test_id("citation")).to_have_text(["1report.pdf p. 7"])


def test_sending_while_a_chip_shows_an_error_says_so_and_keeps_the_message(page, server, sim):
    """The message went out and the file that failed to upload was dropped without a word."""
    conv_id = conversation_id(page)
    drop_file(page, "#transcript", "tool.exe", b"MZ\x90\x00\x03binary", "application/octet-stream")
    chip = page.get_by_test_id("composer-attachments").get_by_test_id("attachment-chip")
    expect(chip).to_have_attribute("data-state", "error")

    send(page, "What does the file say?")

    expect(page.get_by_test_id("toast")).to_contain_text("tool.exe could not be attached")
    expect(page.get_by_test_id("composer")).to_have_value("What does the file say?")
    expect(chip).to_have_attribute("data-state", "error")
    assert server.conversation(conv_id)["messages"] == [] and sim.requests == []


def test_a_text_file_is_cited_by_its_lines_not_as_a_page(page, server, sim):
    """Every attachment chip said "p. N", also for a text file's lines and a DOCX section."""
    drop_file(page, "#transcript", "notes.txt", b"Shopping list.\nThe ferry leaves at noon.\n", "text/plain")
    chip = page.get_by_test_id("composer-attachments").get_by_test_id("attachment-chip")
    expect(chip).to_have_attribute("data-state", "ready")
    sim.enqueue(Script([steps.ToolCall("search_attachments", {"query": "ferry leaves"})]),
                Script([steps.Text("At noon.")]))

    send(page, "When does the ferry leave?")

    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    expect(reply.get_by_test_id("citation")).to_have_text(["1notes.txt lines 1-2"])
