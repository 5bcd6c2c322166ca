"""Errors in words a person understands (issue 26): sizes in MB, the setting behind a limit, and
the way on when a person gave Import the wrong file."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import Server, conversation_id, exchange


@pytest.fixture(scope="module")
def server(tmp_path_factory, gateway):
    # A small file limit, so a too-large upload is quick to send.
    srv = Server(tmp_path_factory.mktemp("words") / "data", {
        "GATEWAY_BASE_URL": gateway.base_url, "MAX_ATTACHMENT_BYTES": str(1024 * 1024)})
    yield srv
    srv.stop()


def import_file(page, name: str, mime: str, data: bytes):
    page.get_by_test_id("import-input").set_input_files(files=[{"name": name, "mimeType": mime, "buffer": data}])
    status = page.get_by_test_id("import-status")
    expect(status).to_have_class(re.compile("error-text"))
    return status


def test_a_markdown_export_given_to_import_says_to_use_the_json_export(page, server, sim):
    sim.enqueue(Script([steps.Text("Bring a coat.")]))
    exchange(page, "What should I pack for Jeju?")
    markdown = server.api("GET", f"/api/conversations/{conversation_id(page)}/export?format=md")
    before = len(server.api("GET", "/api/conversations").json())

    status = import_file(page, "jeju.md", "text/markdown", markdown.content)
    expect(status).to_have_text(
        "Not imported: Markdown exports can't be imported; use the JSON export (⋯ → Export as JSON)")
    assert len(server.api("GET", "/api/conversations").json()) == before

    png = b"\x89PNG\r\n\x1a\n" + bytes(200)
    status = import_file(page, "photo.png", "image/png", png)
    expect(status).to_have_text(re.compile(
        r"^Not imported: this is an image, not a conversation export; to ask about an image, attach it"))


def test_a_file_over_the_limit_says_the_limit_in_mb_and_its_setting(page, server):
    page.get_by_test_id("attach-input").set_input_files(
        files=[{"name": "big.txt", "mimeType": "text/plain", "buffer": b"word " * 300_000}])
    error = page.get_by_test_id("attachment-error")
    expect(error).to_have_text(re.compile(
        r"the file is larger than 1 MB, the most one file may be here \(the server's MAX_ATTACHMENT_BYTES setting"))
    expect(error).not_to_contain_text("bytes,")
    expect(error).not_to_contain_text("1048576")
