"""The sidebar on a phone (390×844): full titles under date headings in the person's own time zone,
one ⋯ per row whose menu renames, pins, archives, exports and deletes (by mouse and keyboard), and a
header title that keeps its words next to the header's buttons."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

from playwright.sync_api import expect

from pagekit import conversation_id, eventually, open_page, row_action

PHONE = {"viewport": {"width": 390, "height": 844}, "timezone_id": "Asia/Seoul", "locale": "en-US"}
# 00:30 on 15 June in Seoul: still 14 June in UTC, so "today" and "yesterday" differ by time zone.
NOW = datetime(2026, 6, 14, 15, 30, tzinfo=UTC)

# Title → when its last message was written (UTC), and the heading a person in Seoul expects.
CONVERSATIONS = [
    ("Breakfast ideas for a rainy Monday morning", datetime(2026, 6, 14, 15, 10, tzinfo=UTC), "Today"),
    # 23:50 on 14 June in Seoul: yesterday there, though the same UTC day as NOW.
    ("Late-night question about tides and the moon", datetime(2026, 6, 14, 14, 50, tzinfo=UTC), "Yesterday"),
    ("Comparing SQLite and PostgreSQL for a small app", datetime(2026, 6, 10, 9, 0, tzinfo=UTC), "Previous 7 days"),
    ("Planning a three-day food trip to Busan in autumn", datetime(2026, 5, 25, 9, 0, tzinfo=UTC), "Previous 30 days"),
    ("Notes on the history of printing in Korea", datetime(2026, 3, 3, 9, 0, tzinfo=UTC), "March 2026"),
    ("Weekly grocery list and a budget that holds", datetime(2026, 1, 5, 9, 0, tzinfo=UTC), "Pinned"),
]


def chatgpt_export(conversations) -> bytes:
    """A ChatGPT conversations.json with one question and answer per conversation, at the given times."""
    out = []
    for n, (title, at, _) in enumerate(conversations):
        stamp = at.timestamp()

        def message(mid, role, text, parent, children):
            return {"id": mid, "parent": parent, "children": children, "message": {
                "id": mid, "author": {"role": role}, "create_time": stamp,
                "content": {"content_type": "text", "parts": [text]}}}

        out.append({"title": title, "create_time": stamp - 60, "update_time": stamp, "current_node": f"a{n}",
                    "mapping": {"root": {"id": "root", "parent": None, "children": [f"u{n}"], "message": None},
                                f"u{n}": message(f"u{n}", "user", f"About {title.lower()}?", "root", [f"a{n}"]),
                                f"a{n}": message(f"a{n}", "assistant", "Here is what I know.", f"u{n}", [])}})
    return json.dumps(out).encode()


def phone_with_sidebar(browser, server):
    """The page on a phone in Seoul at NOW, its sidebar open."""
    page = open_page(browser, server.base_url, **PHONE)
    page.clock.set_fixed_time(NOW)
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    page.locator("#sidebar-toggle").click()
    return page


def heading_of(row) -> str:
    """The date heading a sidebar row is listed under."""
    return row.evaluate("""li => {
        let at = li.previousElementSibling;
        while (at && !at.matches('.conv-group')) at = at.previousElementSibling;
        return at?.textContent;
    }""")


def test_the_phone_list_has_date_groups_full_titles_and_one_menu_per_row(browser, server):
    imported = server.api("POST", "/api/import", files={"file": ("conversations.json", chatgpt_export(CONVERSATIONS))})
    assert imported.status_code == 201, imported.text
    ids = dict(zip([c[0] for c in CONVERSATIONS], imported.json()["imported"], strict=True))
    pinned = ids[CONVERSATIONS[-1][0]]
    assert server.api("PATCH", f"/api/conversations/{pinned}", json={"pinned": True}).status_code == 200

    page = phone_with_sidebar(browser, server)
    sidebar = page.get_by_test_id("conversation-list")
    expect(sidebar.get_by_test_id("conversation-group")).to_have_text(
        ["Pinned", "Today", "Yesterday", "Previous 7 days", "Previous 30 days", "March 2026"])
    # Each imported conversation sits right under its heading, in that order.
    order = sidebar.locator("li").evaluate_all(
        "items => items.map(li => li.dataset.id ? li.querySelector('.conv-name').textContent : '#' + li.textContent)")
    expected = []
    for heading in ["Pinned", "Today", "Yesterday", "Previous 7 days", "Previous 30 days", "March 2026"]:
        expected += [f"#{heading}", *(title for title, _, group in CONVERSATIONS if group == heading)]
    assert [item for item in order if item.startswith("#") or item in ids] == expected

    rows = sidebar.locator("li.conv-item")
    for title, conv_id in ids.items():
        row = sidebar.locator(f"li[data-id='{conv_id}']")
        # The whole title is on screen: nothing of it clipped or ellipsed.
        name = row.locator(".conv-name")
        expect(name).to_have_text(title)
        assert name.evaluate("el => el.scrollWidth <= el.clientWidth && el.scrollHeight <= el.clientHeight + 1"), title
        expect(row.get_by_role("button")).to_have_count(2)  # the title, and one ⋯
        expect(row.get_by_test_id("conversation-actions")).to_be_visible()
    expect(page.get_by_test_id("conversation-actions")).to_have_count(rows.count())
    page.screenshot(path="tests/artifacts/sidebar-phone.png", animations="disabled")
    assert page.js_errors == [], page.js_errors
    page.context.close()


def test_each_row_action_works_from_the_menu_on_a_phone(browser, server):
    titles = [("Sorting a list of words by length", datetime(2026, 6, 14, 15, 0, tzinfo=UTC), "Today"),
              ("What to pack for a week of rain", datetime(2026, 6, 12, 9, 0, tzinfo=UTC), "Previous 7 days")]
    imported = server.api("POST", "/api/import", files={"file": ("conversations.json", chatgpt_export(titles))})
    newer, older = imported.json()["imported"]
    page = phone_with_sidebar(browser, server)
    sidebar = page.get_by_test_id("conversation-list")
    row = sidebar.locator(f"li[data-id='{older}']")
    menu = page.get_by_test_id("conversation-actions-menu")

    # The keyboard: Enter opens the menu on its first item, arrows move, Escape closes it and
    # gives the focus back to the ⋯.
    more = row.get_by_test_id("conversation-actions")
    more.focus()
    page.keyboard.press("Enter")
    expect(row.get_by_role("menuitem", name="Rename")).to_be_focused()
    expect(more).to_have_attribute("aria-expanded", "true")
    page.keyboard.press("ArrowDown")
    expect(row.get_by_role("menuitem", name="Pin")).to_be_focused()
    page.keyboard.press("End")
    expect(row.get_by_role("menuitem", name="Delete")).to_be_focused()
    page.keyboard.press("Escape")
    expect(menu).to_have_count(0)
    expect(more).to_be_focused()
    expect(more).to_have_attribute("aria-expanded", "false")
    expect(page.locator("#sidebar")).to_be_in_viewport()  # Escape closed the menu, not the sidebar
    # A click outside closes it too.
    more.click()
    expect(menu).to_be_visible()
    sidebar.get_by_test_id("conversation-group").first.click()
    expect(menu).to_have_count(0)

    # Rename.
    row_action(row, "Rename").click()
    field = row.get_by_role("textbox", name="Conversation title")
    field.fill("Packing for a rainy week in Jeju")
    field.press("Enter")
    expect(row.locator(".conv-name")).to_have_text("Packing for a rainy week in Jeju")
    assert server.conversation(older)["title"] == "Packing for a rainy week in Jeju"

    # Pin: it moves on top, under Pinned; Unpin puts it back under its date.
    assert heading_of(row) == "Previous 7 days"
    row_action(row, "Pin").click()
    expect(sidebar.locator("li").first).to_have_text("Pinned")
    expect(sidebar.locator("li").nth(1)).to_have_attribute("data-id", older)
    assert server.conversation(older)["pinned"] is True
    row_action(row, "Unpin").click()
    eventually(lambda: heading_of(row) == "Previous 7 days")
    assert server.conversation(older)["pinned"] is False

    # Export: the row's own download, of this conversation.
    with page.expect_download() as download:
        row_action(row, "Export as Markdown").click()
    assert "Packing for a rainy week in Jeju" in download.value.path().read_text()
    with page.expect_download() as download:
        row_action(row, "Export as JSON").click()
    assert json.loads(download.value.path().read_text())["conversations"][0]["id"] == older

    # Archive hides it; the Archived view shows it and Unarchive brings it back.
    row_action(row, "Archive").click()
    expect(row).to_have_count(0)
    assert server.conversation(older)["archived"] is True
    page.get_by_test_id("show-archived").click()
    row_action(row, "Unarchive").click()
    expect(row).to_have_count(0)
    page.get_by_test_id("show-archived").click()
    expect(row).to_have_count(1)
    assert server.conversation(older)["archived"] is False

    # Delete asks first, then removes.
    delete = row_action(row, "Delete")
    delete.click()
    expect(delete).to_have_text("Delete?")
    assert server.api("GET", f"/api/conversations/{older}").status_code == 200
    delete.click()
    expect(row).to_have_count(0)
    eventually(lambda: server.api("GET", f"/api/conversations/{older}").status_code == 404)
    expect(sidebar.locator(f"li[data-id='{newer}']")).to_have_count(1)
    assert page.js_errors == [], page.js_errors
    page.context.close()


def test_the_header_title_keeps_its_words_at_390_px(browser, server):
    title = "Planning a trip to Seoul for food lovers"
    imported = server.api("POST", "/api/import", files={"file": ("conversations.json", chatgpt_export(
        [(title, datetime(2026, 6, 1, tzinfo=UTC), "")]))})
    conv_id = imported.json()["imported"][0]
    page = open_page(browser, f"{server.base_url}/#{conv_id}", **PHONE)
    assert conversation_id(page) == conv_id
    header = page.locator("#conv-title")
    expect(header).to_have_text(title)
    width = header.evaluate("el => el.clientWidth")
    # Nearly half the screen: about twenty characters, where sharing the row with the model
    # picker left three.
    assert width >= 170, width
    shown = header.evaluate("""el => {
        const range = document.createRange();
        const text = el.firstChild;
        let n = 0;
        for (; n < text.length; n++) {
            range.setStart(text, n); range.setEnd(text, n + 1);
            if (range.getBoundingClientRect().right > el.getBoundingClientRect().right) break;
        }
        return n;
    }""")
    assert shown >= 18, shown
    # The picker is still there, on a row of its own.
    expect(page.get_by_test_id("model-picker")).to_be_visible()
    assert page.js_errors == [], page.js_errors
    page.context.close()



def test_with_a_mouse_the_menu_of_any_row_is_reached_by_tab(browser, server):
    titles = [("Tab to my menu", datetime(2026, 6, 13, 9, 0, tzinfo=UTC), "")]
    other = server.api("POST", "/api/import", files={"file": ("c.json", chatgpt_export(titles))}).json()["imported"][0]
    page = open_page(browser, server.base_url)
    row = page.get_by_test_id("conversation-list").locator(f"li[data-id='{other}']")
    expect(row).not_to_have_class(re.compile("active"))
    row.locator(".conv-open").focus()
    page.keyboard.press("Tab")
    expect(row.get_by_test_id("conversation-actions")).to_be_focused()
    page.keyboard.press("Enter")
    expect(row.get_by_role("menuitem", name="Rename")).to_be_focused()
    page.keyboard.press("Escape")
    expect(row.get_by_test_id("conversation-actions-menu")).to_have_count(0)
    assert page.js_errors == [], page.js_errors
    page.context.close()
