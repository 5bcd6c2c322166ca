"""Images in the page (issue 25): paste a screenshot with Ctrl/Cmd+V, see its thumbnail on the
composer, send it, see it under the message (also after a reload), open it full size; remove one
before sending; drop one in."""

from __future__ import annotations

import io

from PIL import Image
from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import assistant_messages, conversation_id, eventually, send, user_messages
from test_everyday import attachments, drop_file


def paste_image(page, data: bytes) -> None:
    """Put a PNG on the clipboard and press Ctrl/Cmd+V in the message box, as a person pastes a screenshot."""
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.evaluate(
        """async (bytes) => {
          const blob = new Blob([new Uint8Array(bytes)], { type: "image/png" });
          await navigator.clipboard.write([new ClipboardItem({ "image/png": blob })]);
        }""",
        list(data),
    )
    page.get_by_test_id("composer").focus()
    page.keyboard.press("ControlOrMeta+V")


def loaded(locator) -> int:
    """The natural width of an <img> once it has loaded (0 until then or when it failed)."""
    return locator.evaluate("img => img.complete ? img.naturalWidth : 0")


def test_paste_a_screenshot_send_it_and_see_it_after_a_reload_then_open_it_full_size(page, server, sim):
    conv_id = conversation_id(page)
    before = {a["id"] for a in attachments(server, conv_id)}  # a reused conversation may hold some
    screenshot = page.screenshot()  # a real screenshot: of this page, 1280 x 860
    assert Image.open(io.BytesIO(screenshot)).size == (1280, 860)

    paste_image(page, screenshot)

    chip = page.get_by_test_id("composer-attachments").get_by_test_id("attachment-chip")
    expect(chip).to_have_attribute("data-state", "ready")
    composer_thumb = chip.get_by_test_id("attachment-thumb")
    eventually(lambda: loaded(composer_thumb) == 320)
    [stored] = [a for a in attachments(server, conv_id) if a["id"] not in before]
    assert (stored["kind"], stored["media_type"], stored["width"], stored["height"]) == \
        ("image", "image/png", 1280, 860)

    sim.enqueue(Script([steps.Text("It shows a chat page.")]))
    send(page, "What is in this screenshot?")
    expect(assistant_messages(page).last).to_have_attribute("data-status", "complete")
    question = server.conversation(conv_id)["messages"][-2]
    assert stored["id"] in question["attachment_ids"]

    sent = user_messages(page).last.get_by_test_id("message-image")
    expect(sent).to_have_count(1)
    eventually(lambda: loaded(sent.locator("img")) == 320)
    expect(page.get_by_test_id("composer-attachments").get_by_test_id("attachment-chip")).to_have_count(0)

    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    sent = user_messages(page).last.get_by_test_id("message-image")
    expect(sent).to_have_count(1)
    eventually(lambda: loaded(sent.locator("img")) == 320)

    sent.click()
    viewer = page.get_by_test_id("image-viewer")
    expect(viewer).to_be_visible()
    expect(page.get_by_test_id("image-viewer-name")).to_have_text(stored["name"])
    full = page.get_by_test_id("image-full")
    eventually(lambda: loaded(full) == 1280)  # the original, not the thumbnail
    page.keyboard.press("Escape")
    expect(viewer).to_be_hidden()


def test_a_pasted_image_removed_before_sending_is_deleted_and_a_dropped_one_shows_too(page, server, sim):
    conv_id = conversation_id(page)
    before = attachments(server, conv_id)
    picture = io.BytesIO()
    Image.new("RGB", (800, 400), (30, 120, 200)).save(picture, format="JPEG")

    paste_image(page, page.screenshot())
    chips = page.get_by_test_id("composer-attachments").get_by_test_id("attachment-chip")
    expect(chips).to_have_attribute("data-state", "ready")
    chips.get_by_role("button", name="Remove").click()
    expect(chips).to_have_count(0)
    eventually(lambda: attachments(server, conv_id) == before)

    drop_file(page, "#composer-form", "holiday.jpg", picture.getvalue(), "image/jpeg")
    expect(chips).to_have_count(1)
    expect(chips).to_have_attribute("data-state", "ready")
    eventually(lambda: loaded(chips.get_by_test_id("attachment-thumb")) == 320)
    expect(chips).to_contain_text("holiday.jpg")
    expect(chips).to_contain_text("800 × 400")



def test_an_image_removed_while_it_uploads_is_not_left_on_the_server(page, server, sim):
    """Removing a chip before its upload answered took the chip away but left the file stored."""
    conv_id = conversation_id(page)
    # "+ New" reuses a conversation nobody wrote in, which may hold an earlier test's unsent file.
    before = attachments(server, conv_id)
    held = []
    page.route(f"**/api/conversations/{conv_id}/attachments", lambda route: held.append(route))
    paste_image(page, page.screenshot())
    chips = page.get_by_test_id("composer-attachments").get_by_test_id("attachment-chip")
    expect(chips).to_have_attribute("data-state", "uploading")
    eventually(lambda: held)
    chips.get_by_role("button", name="Remove").click()
    expect(chips).to_have_count(0)
    with page.expect_response(lambda r: r.request.method == "POST" and r.url.endswith("/attachments")) as answer:
        held[0].continue_()  # the upload now reaches the server and is stored
    assert answer.value.status == 201
    eventually(lambda: attachments(server, conv_id) == before)
