"""One realistic turn with everything at once (thought, search, page read, Markdown, code, citations),
checked for its order and then photographed for the README (docs/screenshot.png), light, dark and
at phone width."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import ROOT, assistant_messages, open_page, screenshot, send

DOCS = "https://docs.python.org/3/library/asyncio-task.html"
PEP = "https://peps.python.org/pep-0654/"
ANSWER = """Since Python 3.11, **`asyncio.TaskGroup`** is the simplest way: every task started in the group is awaited when the block ends, and one failure cancels the rest.

```python
async with asyncio.TaskGroup() as tg:
    users = tg.create_task(fetch_users())
    posts = tg.create_task(fetch_posts())
print(users.result(), posts.result())
```

- Errors arrive together as an *ExceptionGroup*; catch them with `except*`.
- For a fixed list of coroutines, `asyncio.gather()` still works.
"""


def other_conversation(server, sim, question: str) -> None:
    conv = server.api("POST", "/api/conversations", json={}).json()
    sim.enqueue(Script([steps.Text("Sure.")]))
    server.api("POST", f"/api/conversations/{conv['id']}/messages", json={"content": question})


def test_a_thinking_search_turn_renders_its_steps_in_order(browser, server, sim):
    for question in ("Weekend trip ideas for Busan", "이번 주 회의록 요약해 줘", "Explain Rust lifetimes simply"):
        other_conversation(server, sim, question)
    reasoning_model = next(m["id"] for tier in server.models()["tiers"] for m in tier["models"] if m["reasoning"])
    conv = server.api("POST", "/api/conversations", json={"model": reasoning_model}).json()
    sim.enqueue(Script([
        steps.Reasoning("They want concurrency in 3.11. TaskGroup is new there; check the docs for its semantics."),
        steps.Search("python 3.11 asyncio TaskGroup", [
            {"url": DOCS, "title": "Coroutines and Tasks"},
            {"url": PEP, "title": "PEP 654 – Exception Groups and except*"},
        ]),
        steps.Fetch(DOCS, "Coroutines and Tasks — Python 3.11 documentation"),
        steps.Cite(DOCS, "Coroutines and Tasks"),
        steps.Text(ANSWER[:200], chunk_size=4),
        steps.Cite(PEP, "PEP 654"),
        steps.Text(ANSWER[200:], chunk_size=4),
    ], chunk_delay=0.01))

    page = open_page(browser, f"{server.base_url}/#{conv['id']}")
    try:
        send(page, "How do I run several tasks concurrently in Python 3.11?")
        reply = assistant_messages(page).last
        expect(reply).to_have_attribute("data-status", "complete")

        trail = reply.get_by_test_id("activity")
        expect(trail.locator("summary")).to_have_text(
            re.compile(r"^Thought (for \d+s|briefly) · Searched the web · Read 1 page$"))
        kinds = trail.locator(".timeline > li").evaluate_all(
            "steps => steps.map(s => s.className.replace('step step-', ''))")
        assert kinds == ["thinking", "search", "fetch"]
        expect(reply.get_by_test_id("citation")).to_have_text(["1docs.python.org", "2peps.python.org"])
        expect(reply.locator("pre > code")).to_have_text(ANSWER.split("```python\n")[1].split("\n```")[0])
        expect(page.get_by_test_id("conversation-list").locator(".conv-name")).to_contain_text(
            ["How do I run several tasks", "Explain Rust lifetimes simply", "이번 주 회의록 요약해 줘",
             "Weekend trip ideas for Busan"])

        (ROOT / "docs").mkdir(exist_ok=True)
        page.screenshot(path=str(ROOT / "docs" / "screenshot.png"), animations="disabled")
        trail.locator("summary").click()
        screenshot(page, "tour-trail-open")
    finally:
        page.context.close()

    for name, options in (("tour-dark", {"color_scheme": "dark"}),
                          ("tour-phone", {"viewport": {"width": 390, "height": 844}})):
        page = open_page(browser, f"{server.base_url}/#{conv['id']}", **options)
        try:
            expect(assistant_messages(page).last.get_by_test_id("citation")).to_have_count(2)
            screenshot(page, name)
        finally:
            page.context.close()
