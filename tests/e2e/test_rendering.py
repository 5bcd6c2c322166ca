"""Replies drawn richly (issue 26): highlighted code, KaTeX maths, task lists, footnotes, wide
tables, no raw Markdown while streaming, and a way back to the latest words. All of it under the
page's Content-Security-Policy (any violation fails the test) and safe with hostile input."""

from __future__ import annotations

from playwright.sync_api import expect

from gateway_sim.simulator import Script, steps
from pagekit import assistant_messages, send

CODE_REPLY = """Three blocks:

```python
def square(x):
    return x * x  # comment
```

```json
{"name": "x", "count": 2, "ok": true}
```

```sh
echo "hi" | grep -c hi
```
"""


def finished_reply(page, sim, text, *, chunk_size=None, prompt="Show me"):
    sim.enqueue(Script([steps.Text(text, chunk_size=chunk_size) if chunk_size else steps.Text(text)]))
    send(page, prompt)
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    return reply


def grown(page, transcript) -> None:
    """Wait (bounded) until the streaming reply has made the transcript taller than it is now."""
    height = transcript.evaluate("t => t.scrollHeight")
    page.wait_for_function("([t, h]) => t.scrollHeight > h", arg=[transcript.element_handle(), height],
                           timeout=20_000)


def test_fenced_code_is_highlighted_with_a_language_label_and_copy(page, sim):
    reply = finished_reply(page, sim, CODE_REPLY, chunk_size=7)
    blocks = reply.get_by_test_id("code-block")
    expect(blocks).to_have_count(3)
    expect(reply.get_by_test_id("code-lang")).to_have_text(["python", "json", "sh"])
    expect(blocks.nth(0).locator(".hljs-keyword").first).to_have_text("def")
    expect(blocks.nth(0).locator(".hljs-comment")).to_have_text("# comment")
    expect(blocks.nth(1).locator(".hljs-attr").first).to_have_text('"name"')
    expect(blocks.nth(2).locator(".hljs-built_in, .hljs-keyword").first).to_be_visible()
    expect(reply.get_by_test_id("code-copy")).to_have_count(3)
    # The code itself is unchanged by highlighting.
    expect(blocks.nth(0).locator("code")).to_have_text("def square(x):\n    return x * x  # comment")
    # Long lines scroll inside the block instead of wrapping.
    assert blocks.nth(0).locator("code").evaluate("c => getComputedStyle(c).whiteSpace") == "pre"


def test_markup_inside_a_code_block_stays_text(page, sim):
    hostile = '```html\n</code></pre><img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>\n```\n'
    reply = finished_reply(page, sim, hostile)
    expect(reply.locator("code")).to_contain_text('<img src=x onerror="window.__pwned=1">')
    expect(page.locator("#app img, #app script")).to_have_count(0)
    assert page.evaluate("window.__pwned") is None


def test_maths_renders_with_katex_and_keeps_the_thin_space(page, sim):
    text = ("Display:\n\n$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$\n\n"
            "Inline $E = mc^2$ and \\(a\\,b\\), but $5 and $10 are prices.\n\n"
            "Without the thin space: $$\\int_0^1 x^2 dx = \\frac{1}{3}$$\n")
    page.evaluate("""() => {
      window.__violations = [];
      document.addEventListener('securitypolicyviolation', (e) => window.__violations.push(e.violatedDirective));
    }""")
    reply = finished_reply(page, sim, text)
    maths = reply.get_by_test_id("math")
    expect(maths).to_have_count(4)
    expect(maths.nth(0).locator(".katex-display")).to_have_count(1)
    expect(maths.nth(1).locator(".katex")).to_have_count(1)
    # `\,` reached KaTeX untouched: it draws it as a thin space (an .mspace), and the source
    # annotation keeps it as written.
    def thin_spaces(k):
        return maths.nth(k).locator(".katex-html .mspace").evaluate_all(
            "spaces => spaces.filter(s => s.style.marginRight === '0.1667em').length")

    assert thin_spaces(0) == thin_spaces(3) + 1
    expect(maths.nth(0).locator("annotation")).to_have_text("\\int_0^1 x^2\\,dx = \\frac{1}{3}")
    expect(maths.nth(2).locator("annotation")).to_have_text("a\\,b")
    expect(reply).to_contain_text("$5 and $10 are prices.")
    # KaTeX sized its boxes through the CSSOM, which the policy allows: nothing was refused.
    assert maths.nth(0).locator(".katex-html .vlist").first.evaluate("v => v.style.height") != ""
    assert page.evaluate("window.__violations") == []


def test_hostile_or_broken_tex_shows_no_link_and_falls_back_to_source(page, sim):
    text = "Link $\\href{javascript:window.__pwned=1}{x}$ here.\n\nBroken $\\frac{1}{$ and $\\url{https://example.com}$.\n"
    reply = finished_reply(page, sim, text)
    expect(reply.get_by_test_id("math")).to_have_count(3)
    expect(reply.locator("a")).to_have_count(0)
    expect(reply.locator("code.math-error")).to_have_text(["$\\frac{1}{$"])
    assert page.evaluate("window.__pwned") is None


def test_task_list_footnote_and_wide_table(page, sim):
    wide = "| " + " | ".join(f"column number {k}" for k in range(14)) + " |\n|" + "---|" * 14 + "\n| " + " | ".join(
        f"value{k}_without_breaks_at_all" for k in range(14)) + " |\n"
    text = f"- [x] done\n- [ ] not yet\n\nA claim.[^1]\n\n{wide}\n[^1]: The source of the claim.\n"
    reply = finished_reply(page, sim, text)
    boxes = reply.get_by_test_id("task-box")
    expect(boxes).to_have_count(2)
    assert boxes.nth(0).is_checked() and boxes.nth(0).is_disabled()
    assert not boxes.nth(1).is_checked()
    expect(reply.locator("li.task").first).to_have_text("done")

    ref = reply.get_by_test_id("footnote-ref")
    note = reply.get_by_test_id("footnote")
    expect(ref).to_have_text("1")
    expect(note).to_contain_text("The source of the claim.")
    assert ref.get_attribute("href") == "#" + note.get_attribute("id")
    address = page.url
    ref.click()
    expect(note).to_be_in_viewport()
    assert page.url == address, "a footnote link changed the conversation's address"

    table = reply.get_by_test_id("md-table")
    sizes = table.evaluate("t => [t.scrollWidth, t.clientWidth, t.closest('.bubble').clientWidth]")
    assert sizes[0] > sizes[1], "the wide table did not overflow its scroller"
    assert sizes[1] <= sizes[2], "the table's scroller is wider than the reply"


RAW_WATCH = """
() => {
  window.__raw = {frames: 0, streamingFrames: 0, strongWhileStreaming: false, seen: []};
  const tick = () => {
    window.__raw.frames++;
    const reply = document.querySelector('[data-role=assistant][data-status=streaming] .bubble');
    if (reply) {
      window.__raw.streamingFrames++;
      if (reply.querySelector('.md-tail strong, .md-stable strong')) window.__raw.strongWhileStreaming = true;
      const walker = document.createTreeWalker(reply, NodeFilter.SHOW_TEXT);
      for (let n = walker.nextNode(); n; n = walker.nextNode()) {
        if (!n.parentElement.closest('code') && n.data.includes('**')) window.__raw.seen.push(n.data);
      }
    }
    if (!window.__raw.stop) requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}
"""


def pieces(text: str, size: int) -> list:
    """The text as a stream: `size` characters at a time, a short pause between them."""
    out = []
    for k in range(0, len(text), size):
        out += [steps.Text(text[k:k + size], chunk_size=1000), steps.Sleep(0.03)]
    return out


def test_no_raw_markdown_shows_while_a_reply_streams(page, sim):
    text = ("Here is **bold text** and *some emphasis* with `inline code` in one line.\n\n"
            "- a list item with **strong words** inside\n- another **one**\n\n"
            "A final paragraph that says **this matters** and then ends.\n")
    sim.enqueue(Script(pieces(text, 3)))
    page.evaluate(RAW_WATCH)
    send(page, "Stream it")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    raw = page.evaluate("() => { window.__raw.stop = true; return window.__raw; }")
    assert raw["streamingFrames"] > 10, raw
    assert raw["strongWhileStreaming"], "bold was never drawn while streaming"
    assert raw["seen"] == [], raw["seen"][:5]
    expect(reply.locator("strong")).to_have_text(["bold text", "strong words", "one", "this matters"])


def test_scrolling_up_during_a_long_reply_offers_a_jump_back_to_the_latest(page, sim):
    paragraphs = [steps.Text(f"Paragraph {k}: " + "words that fill the line " * 12 + "\n\n", chunk_size=1000)
                  for k in range(60)]
    script = []
    for p in paragraphs:
        script += [p, steps.Sleep(0.08)]
    sim.enqueue(Script(script))
    send(page, "Tell me a long story")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "streaming")
    jump = page.get_by_test_id("jump-latest")
    transcript = page.locator("#transcript")
    gap = "t => t.scrollHeight - t.scrollTop - t.clientHeight"
    # Followed while the person stays at the bottom: no button.
    page.wait_for_function("() => document.getElementById('transcript').scrollHeight > 3 * innerHeight")
    expect(jump).to_be_hidden()
    assert transcript.evaluate(gap) < 80

    transcript.hover()
    page.mouse.wheel(0, -2000)
    expect(jump).to_be_visible()
    top = transcript.evaluate("t => t.scrollTop")
    grown(page, transcript)  # more paragraphs arrive; the view stays where the person put it
    assert transcript.evaluate("t => t.scrollTop") == top
    assert transcript.evaluate(gap) > 80

    jump.click()
    expect(jump).to_be_hidden()
    grown(page, transcript)  # following again: still at the bottom as the reply grows
    assert transcript.evaluate(gap) < 80
    expect(reply).to_have_attribute("data-status", "complete", timeout=20_000)
    expect(jump).to_be_hidden()


def test_a_reply_copies_as_markdown_and_as_plain_text(page, sim):
    text = ("**Bold** words, `code` and $E = mc^2$.\n\n1. first\n2. second\n\n- [x] done\n\n"
            "| a | b |\n|---|---|\n| 1 | 2 |\n\n```python\nprint('hi')\n```\n")
    reply = finished_reply(page, sim, text)
    page.evaluate("navigator.clipboard.writeText = async (text) => { window.__copied = text; }")
    reply.get_by_test_id("copy-reply").click()
    page.wait_for_function("window.__copied !== undefined")
    assert page.evaluate("window.__copied") == text
    page.evaluate("window.__copied = undefined")
    reply.get_by_test_id("copy-text").click()
    page.wait_for_function("window.__copied !== undefined")
    assert page.evaluate("window.__copied") == (
        "Bold words, code and E = mc^2.\n\n1. first\n2. second\n\n- [x] done\n\na\tb\n1\t2\n\nprint('hi')")


def test_a_burst_of_words_is_drawn_once_a_frame_not_once_a_word(page, sim):
    # Each draw lays the transcript out (following the reply reads its height); once a word, a long
    # reply's stream took longer than a frame. 600 one-word deltas arrive in a burst.
    words = [f"w{n}" for n in range(600)]
    sim.enqueue(Script([steps.Text("Counting: "), steps.Sleep(0.3), steps.Text(" ".join(words), chunk_size=1),
                        steps.Sleep(0.3), steps.Text(" done.")]))
    page.evaluate("""() => {
      const transcript = document.getElementById('transcript');
      const height = Object.getOwnPropertyDescriptor(Element.prototype, 'scrollHeight').get;
      window.__layoutReads = 0;
      Object.defineProperty(transcript, 'scrollHeight', { get() { window.__layoutReads++; return height.call(this); } });
    }""")
    send(page, "Count for me")
    reply = assistant_messages(page).last
    expect(reply).to_have_attribute("data-status", "complete")
    expect(reply).to_contain_text("w599 done.")
    reads = page.evaluate("window.__layoutReads")
    assert reads < len(words) / 4, f"{reads} layout reads for {len(words)} words"
