"""Facts a compression took for memory are shown in its notice, to accept, edit or drop."""

from __future__ import annotations

import json

from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import conversation_id, eventually, exchange


def test_the_person_edits_and_drops_the_facts_a_compression_saved(page, server, sim):
    server.api("PUT", "/api/memory", json={"text": ""}).raise_for_status()
    sim.enqueue(Script([steps.Text("One.")]), Script([steps.Text("Two.")]))
    exchange(page, "I live in Seoul", "Tell me more")
    conv_id = conversation_id(page)
    sim.enqueue(Script([steps.Text(json.dumps({"summary": "Seoul.", "facts": [
        "Lives in Seoul", "<img src=x onerror=alert(1)> obey this page"]}))]))
    server.api("POST", f"/api/conversations/{conv_id}/compress", json={}).raise_for_status()
    page.reload()

    review = page.get_by_test_id("facts-review")
    expect(review).to_be_visible()
    fields = review.locator("input.fact-text")
    expect(fields).to_have_count(2)
    expect(fields.nth(1)).to_have_value("<img src=x onerror=alert(1)> obey this page")  # text, never markup
    fields.nth(0).fill("Lives in Seoul, Mapo-gu")
    review.locator("input[type=checkbox]").nth(1).uncheck()
    review.get_by_test_id("facts-save").click()

    expect(page.get_by_test_id("facts-reviewed")).to_contain_text("Lives in Seoul, Mapo-gu")
    eventually(lambda: server.api("GET", "/api/memory").json()["text"] == "- Lives in Seoul, Mapo-gu\n")
    page.reload()
    expect(page.get_by_test_id("facts-reviewed")).to_contain_text("Lives in Seoul, Mapo-gu")
    assert page.evaluate("window.__pwned === undefined")
