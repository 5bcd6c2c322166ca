"""The page works under its Content-Security-Policy, and the policy really blocks injected script."""

from __future__ import annotations

import httpx
from playwright.sync_api import expect

from pagekit import exchange


def test_page_runs_a_turn_and_opens_settings_with_no_policy_violation(page, server, sim):
    assert "default-src 'self'" in httpx.get(server.base_url + "/").headers["content-security-policy"]
    messages: list[str] = []
    page.on("console", lambda msg: messages.append(f"{msg.type}: {msg.text}") if msg.type == "error" else None)

    exchange(page, "Hello under a strict policy")
    page.get_by_test_id("settings-open").click()
    expect(page.get_by_role("dialog", name="Settings")).to_be_visible()
    page.keyboard.press("Escape")
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")

    assert messages == []


def test_injected_inline_script_does_not_run(page):
    ran = page.evaluate("""() => {
        const s = document.createElement('script');
        s.textContent = 'window.__injected = true';
        document.body.append(s);
        return window.__injected === true;
    }""")

    assert ran is False
    expect_violation = [e for e in page.js_errors if "Content Security Policy" in e]
    assert expect_violation, page.js_errors
    page.js_errors.clear()  # the violation was the point of this test
