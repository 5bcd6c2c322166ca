"""Browser fixtures: Debian's chromium (never a downloaded browser) driving the real page, served by a
real uvicorn server whose gateway is the scriptable simulator.

One browser per session, one simulator and one server per module, one fresh browser context per
test. Each test opens its own conversation, so tests sharing a server do not see each other's turns.
"""

from __future__ import annotations

import os

import pytest
from playwright.sync_api import Browser, sync_playwright

from gateway_sim.simulator import GatewaySimulator
from pagekit import Server, eventually, new_conversation, open_page

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="session")
def browser() -> Browser:
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (make browser-deps)")
    with sync_playwright() as pw:
        pw.selectors.set_test_id_attribute("data-test")
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def gateway():
    with GatewaySimulator(keep_requests=1000) as sim:
        yield sim


@pytest.fixture(scope="module")
def server(tmp_path_factory, gateway):
    # A small recent window lets a two-turn conversation have something old enough to compress;
    # a small message limit lets a test type a message the server refuses; the web tools start on,
    # so scripted search turns reach the page as searches. A hang-up does not stop a turn (the
    # server's default): only Stop does.
    srv = Server(tmp_path_factory.mktemp("e2e") / "data", {
        "GATEWAY_BASE_URL": gateway.base_url, "UPSTREAM_TIMEOUT": "10", "KEEP_RECENT_MESSAGES": "2",
        "MAX_MESSAGE_CHARS": "2000", "DEFAULT_WEB_SEARCH": "true", "DEFAULT_WEB_FETCH": "true",
    })
    yield srv
    srv.stop()


@pytest.fixture
def sim(gateway):
    """The module's simulator with no queued scripts or recorded requests left by earlier tests."""
    gateway.reset()
    return gateway


@pytest.fixture
def page(browser, server):
    """The page on a brand-new conversation of its own."""
    page = open_page(browser, server.base_url)
    conv_id = new_conversation(page)
    # A new conversation takes the model in the picker; start every test from the default.
    default = server.models()["default"]
    if page.get_by_test_id("model-picker").input_value() != default:
        page.get_by_test_id("model-picker").select_option(default)
        eventually(lambda: server.conversation(conv_id)["model"] == default)
    yield page
    assert page.js_errors == [], page.js_errors
    page.context.close()
