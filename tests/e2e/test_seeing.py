"""Images in replies never leak where you read (issue 25), and which models see, through the page."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from gateway_sim.simulator import Script, Usage, steps
from pagekit import Server, assistant_messages, conversation_id, eventually, send
from support import PixelServer, png


@pytest.fixture(scope="module")
def pixels():
    server = PixelServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, gateway):
    # The route fetches under web_fetch's address rules, which refuse loopback: the test's own
    # image server is allowed by name, as FETCH_ALLOW_HOSTS allows an intranet host.
    srv = Server(tmp_path_factory.mktemp("e2e-vision") / "data", {
        "GATEWAY_BASE_URL": gateway.base_url, "UPSTREAM_TIMEOUT": "10", "FETCH_ALLOW_HOSTS": "127.0.0.1",
        "VISION_MODEL": "openai/gpt-5-mini",
    })
    yield srv
    srv.stop()


def test_a_replys_image_is_fetched_by_nobody_until_clicked_then_through_our_route(page, server, sim, pixels):
    address = f"http://127.0.0.1:{pixels.port}/pixel.png"
    sim.enqueue(Script([steps.Text(f"Here is the chart: ![x]({address}) as promised.")]))
    send(page, "show me the chart")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    placeholder = reply.get_by_test_id("remote-image")
    expect(placeholder).to_contain_text(f"Image from 127.0.0.1:{pixels.port}: x")
    expect(placeholder.get_by_role("link", name="open in new tab")).to_have_attribute("href", address)
    page.reload()
    expect(assistant_messages(page).last.get_by_test_id("remote-image")).to_be_visible()
    assert pixels.requests == []  # neither the reply's first drawing nor a reload asked the host

    assistant_messages(page).last.get_by_role("button", name=f"Image from 127.0.0.1:{pixels.port}: x").click()
    shown = assistant_messages(page).last.get_by_test_id("remote-image-shown")
    expect(shown).to_be_visible()
    page.wait_for_function("img => img.complete && img.naturalWidth === 3", arg=shown.element_handle())
    assert shown.get_attribute("src").startswith("/api/conversations/")
    (request,) = pixels.requests
    assert request["path"] == "/pixel.png" and "web_fetch" in request["user_agent"]  # the server's fetch


def test_a_custom_model_is_marked_as_seeing_in_settings(page, server):
    page.get_by_test_id("settings-open").click()
    dialog = page.get_by_role("dialog", name="Settings")
    dialog.get_by_label("Gateway model id").fill("acme/eyes-1")
    dialog.get_by_label("Sees images").check()
    dialog.get_by_role("button", name="Add model").click()
    expect(dialog.locator("#models-status")).to_have_text("Added acme/eyes-1.")
    box = dialog.get_by_label("acme/eyes-1 sees images")
    expect(box).to_be_checked()

    def vision() -> bool:
        return next(m for t in server.models()["tiers"] for m in t["models"] if m["id"] == "acme/eyes-1")["vision"]

    assert vision() is True
    box.uncheck()
    expect(dialog.locator("#models-status")).to_have_text("acme/eyes-1 no longer receives images.")
    eventually(lambda: vision() is False)
    # A built-in model the gateway lists with image input shows it too.
    expect(dialog.locator("#model-lineup li", has_text="openai/gpt-5-mini")).to_contain_text("sees images")


def test_an_image_the_model_returns_shows_in_the_reply_and_after_reload(page, server, sim):
    sim.enqueue(Script([steps.Text("Here it is:"), steps.ImageOut(png(12, 8, "blue"))]))
    send(page, "draw a small blue box")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    image = reply.get_by_test_id("reply-image")
    expect(image).to_be_visible()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())
    page.reload()
    again = assistant_messages(page).last.get_by_test_id("reply-image")
    expect(again).to_be_visible()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=again.element_handle())


def test_a_model_without_eyes_asks_vision_model_and_the_trail_shows_the_cost(page, server, sim):
    conv_id = conversation_id(page)
    page.get_by_test_id("model-picker").select_option("deepseek/deepseek-r1")
    eventually(lambda: server.conversation(conv_id)["model"] == "deepseek/deepseek-r1")
    uploaded = server.api("POST", f"/api/conversations/{conv_id}/attachments",
                          files={"file": ("chart.png", png(40, 30, "green"), "application/octet-stream")})
    image_id = uploaded.json()["id"]
    sim.enqueue(Script([steps.ToolCall("analyze_image", {"image_id": image_id, "question": "Which colour?"})]),
                Script([steps.Text("Green all over.")], usage=Usage(prompt=900, completion=4, cost=0.0021,
                                                                      dialect="openrouter")),
                Script([steps.Text("Your chart is green.")]))
    send(page, "What colour is chart.png?")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    reply.get_by_test_id("activity").locator("summary").click()
    step = reply.get_by_test_id("tool-step")
    expect(step).to_have_attribute("data-status", "done")
    expect(step.get_by_test_id("tool-usage")).to_have_text("openai/gpt-5-mini · 900 in · 4 out · $0.0021")
