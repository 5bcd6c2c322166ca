"""Browser: MCP servers in Settings. The server from MCP_SERVERS shows with its state and header
names (never the value), an admin adds an HTTP server that then connects, a killed server shows
down and comes back, an MCP call shows in the activity trail, and the preset editor warns past a
dozen tools."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from mcp_support import SECRET, SERVER, McpServer
from pagekit import Server, assistant_messages, conversation_id, send
from support import free_port


@pytest.fixture(scope="module")
def mcp():
    server = McpServer(free_port(), token=SECRET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, gateway, mcp):
    data = tmp_path_factory.mktemp("e2e-mcp") / "data"
    listing = data.parent / "mcp.json"
    listing.write_text(f'[{{"name": "demo", "url": "{mcp.url}", "headers": {{"X-Token": "{SECRET}"}}}}]')
    srv = Server(data, {"GATEWAY_BASE_URL": gateway.base_url, "UPSTREAM_TIMEOUT": "10", "MCP_SERVERS": str(listing),
                        "MCP_TIMEOUT": "10", "DEFAULT_TOOL_RUNTIME": "local"})
    yield srv
    srv.stop()


def open_settings(page):
    page.get_by_test_id("settings-open").click()
    dialog = page.locator("#settings")
    expect(dialog).to_be_visible()
    return dialog


def entry(dialog, name: str):
    return dialog.get_by_test_id("mcp-server").and_(dialog.locator(f"[data-name='{name}']"))


def test_settings_show_the_server_and_an_admin_adds_one(page, server, mcp):
    dialog = open_settings(page)
    demo = entry(dialog, "demo")
    expect(demo).to_have_attribute("data-connected", "true")
    expect(demo.get_by_test_id("mcp-state")).to_have_text("connected")
    expect(demo).to_contain_text(f"{SERVER.read_text().count('@server.tool(')} tools")  # every tool it defines
    expect(demo).to_contain_text("headers: X-Token")
    expect(demo).to_contain_text("MCP_SERVERS")
    assert SECRET not in page.content()

    dialog.get_by_test_id("mcp-add-name").fill("second")
    dialog.get_by_test_id("mcp-add-url").fill(mcp.url)
    dialog.get_by_test_id("mcp-add-headers").fill(f"X-Token: {SECRET}")
    dialog.get_by_test_id("mcp-add-button").click()
    expect(dialog.get_by_test_id("mcp-status")).to_have_text("Added second; it connects in the background.")
    second = entry(dialog, "second")
    expect(second).to_have_attribute("data-connected", "true")
    expect(second).to_contain_text("headers: X-Token")
    expect(dialog.get_by_test_id("mcp-add-headers")).to_have_value("")
    assert SECRET not in page.content()

    # A stdio command is refused from the page with the server's reason, and nothing is added.
    dialog.get_by_test_id("mcp-add-name").fill("bad name!")
    dialog.get_by_test_id("mcp-add-url").fill(mcp.url)
    dialog.get_by_test_id("mcp-add-button").click()
    expect(dialog.get_by_test_id("mcp-status")).to_contain_text("name")
    expect(dialog.get_by_test_id("mcp-server")).to_have_count(2)

    # Killed, it shows down with the reason while Settings stays open; restarted, it comes back.
    mcp.kill()
    expect(demo).to_have_attribute("data-connected", "false", timeout=40_000)
    expect(demo.get_by_test_id("mcp-error")).not_to_be_empty()
    mcp.start()
    expect(demo).to_have_attribute("data-connected", "true", timeout=40_000)

    second.get_by_test_id("mcp-remove").click()
    expect(dialog.get_by_test_id("mcp-status")).to_have_text("Removed second.")
    expect(dialog.get_by_test_id("mcp-server")).to_have_count(1)


def test_an_mcp_call_shows_in_the_trail_and_the_editor_warns_past_a_dozen(page, server, sim):
    created = server.api("POST", "/api/presets", json={"name": "calc", "text": "You add.", "tools": ["demo__*"]})
    assert created.status_code == 201, created.text
    conv_id = conversation_id(page)
    chosen = server.api("PATCH", f"/api/conversations/{conv_id}",
                        json={"settings": {"preset": "calc", "tools": ["demo__*"]}})
    assert chosen.status_code == 200, chosen.text
    sim.enqueue(Script([steps.ToolCall("demo__add", {"a": 40, "b": 2})]), Script([steps.Text("It is 42.")]))

    send(page, "What is 40 + 2?")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    step = reply.get_by_test_id("tool-step")
    expect(step).to_have_count(1)
    expect(step).to_have_attribute("data-status", "done")
    expect(step).to_contain_text("demo__add")
    expect(step).to_contain_text("42")

    dialog = open_settings(page)
    dialog.get_by_test_id("preset-new").click()
    warning = dialog.get_by_test_id("preset-tools-warning")
    checks = dialog.locator("#preset-tools-list").get_by_test_id("tool-checkbox")
    dialog.locator("#preset-tools-list input[value='demo__*']").check()
    expect(warning).to_be_hidden()  # nine tools
    for i in range(checks.count()):
        checks.nth(i).check()
    expect(warning).to_be_visible()
    expect(warning).to_contain_text("Small models choose worse among many")
