"""The page's pure modules (SSE decoder, Markdown renderer) run in chromium as the page loads them."""

from __future__ import annotations

import json

import pytest

from pagekit import open_page


@pytest.fixture(scope="module")
def blank(browser, server):
    page = open_page(browser, server.base_url)
    yield page
    page.context.close()


def render(page, text: str) -> str:
    return page.evaluate(
        """async (text) => {
          const md = await import('/static/markdown.js');
          const box = document.createElement('div');
          box.append(md.renderMarkdown(text));
          return box.innerHTML;
        }""",
        text,
    )


@pytest.mark.parametrize(("source", "html"), [
    ("# Title\n\nSome *em*, **strong** and `co*de*`.",
     "<h1>Title</h1><p>Some <em>em</em>, <strong>strong</strong> and <code>co*de*</code>.</p>"),
    ("1. a\n2. b\n   - nested\n\n- x",
     "<ol><li><p>a</p></li><li><p>b</p><ul><li><p>nested</p></li></ul></li></ol><ul><li><p>x</p></li></ul>"),
    ("snake_case_name and 2 * 3 * 4 stay plain; **bold *nested* text**",
     "<p>snake_case_name and 2 * 3 * 4 stay plain; <strong>bold <em>nested</em> text</strong></p>"),
    ("> quoted\nline two",
     "<blockquote><p>quoted<br>line two</p></blockquote>"),
    ("| a | b |\n|---|--:|\n| 1 | 2 |",
     '<div class="md-table" data-test="md-table"><table><thead><tr><th>a</th><th style="text-align: right;">b</th></tr></thead>'
     '<tbody><tr><td>1</td><td style="text-align: right;">2</td></tr></tbody></table></div>'),
    ("[ok](https://a.example/x) [bad](javascript:alert(1)) <https://b.example> see https://c.example/p.",
     '<p><a href="https://a.example/x" target="_blank" rel="noopener noreferrer">ok</a> <span>bad</span> '
     '<a href="https://b.example/" target="_blank" rel="noopener noreferrer">https://b.example</a> see '
     '<a href="https://c.example/p" target="_blank" rel="noopener noreferrer">https://c.example/p</a>.</p>'),
    ("<b onmouseover=alert(1)>x</b>",
     "<p>&lt;b onmouseover=alert(1)&gt;x&lt;/b&gt;</p>"),
    # The parts now cut by hand rather than by pattern: closing hashes, titles, fence info, delimiters.
    ("## Closed heading ##\n#not a heading\n\n### a #b   ",
     "<h2>Closed heading</h2><p>#not a heading</p><h3>a #b</h3>"),
    ('[t](https://a.example/x "A title") [u](<https://b.example/y>)',
     '<p><a href="https://a.example/x" target="_blank" rel="noopener noreferrer">t</a> '
     '<a href="https://b.example/y" target="_blank" rel="noopener noreferrer">u</a></p>'),
    ("```py  extra words\nx\n```", None),
    ("a | b\n:-- | :-:\n1 | 2\n\nx | y\n-- | z!\n",
     '<div class="md-table" data-test="md-table"><table><thead><tr><th style="text-align: left;">a</th>'
     '<th style="text-align: center;">b</th>'
     '</tr></thead><tbody><tr><td style="text-align: left;">1</td><td style="text-align: center;">2</td></tr></tbody>'
     "</table></div><p>x | y<br>-- | z!</p>"),
    ("one\rtwo\r\n- item", "<p>one<br>two</p><ul><li><p>item</p></li></ul>"),
    ("``a`` and `` ` `` and ```x`", "<p><code>a</code> and <code>`</code> and ```x`</p>"),
])
def test_markdown_renders_the_constructs_chat_replies_use(blank, source, html):
    if html is None:
        # The page's highlighter marks the block it highlighted (`hljs`); the code is unchanged.
        assert '<code class="language-py hljs">x</code>' in render(blank, source)
    else:
        assert render(blank, source) == html


def test_a_code_block_holds_its_code_exactly(blank):
    code = "const a = '<b>&amp;</b>';\n\n\tindented\t tab\n  **not bold**"
    html = render(blank, f"```js\n{code}\n```")
    assert '<code class="language-js hljs">' in html and ">Copy</button>" in html
    text = blank.evaluate(
        """async (src) => {
          const md = await import('/static/markdown.js');
          const box = document.createElement('div');
          box.append(md.renderMarkdown(src));
          return box.querySelector('pre > code').textContent;
        }""",
        f"```js\n{code}\n```",
    )
    assert text == code


@pytest.mark.parametrize(("text", "expected"), [
    ("Hello wor", {"prefix": "", "tail": "Hello wor", "fence": None}),
    ("line one\nline tw", {"prefix": "line one\n", "tail": "line tw", "fence": None}),
    ("Intro\n```py\nx = 1\ny =", {"prefix": "Intro\n", "tail": "", "fence": {"lang": "py", "code": "x = 1\ny ="}}),
    ("```\nx\n``", {"prefix": "", "tail": "", "fence": {"lang": "", "code": "x"}}),
    ("```\nx\n```\nafter", {"prefix": "```\nx\n```\n", "tail": "after", "fence": None}),
])
def test_split_stable_cuts_at_the_last_line_and_before_an_open_fence(blank, text, expected):
    got = blank.evaluate("async (t) => (await import('/static/markdown.js')).splitStable(t)", text)
    assert got == expected


def test_streaming_renders_a_finished_block_once_and_the_prefix_only_when_a_line_completes(blank):
    result = blank.evaluate(
        """async () => {
          const { StreamingMarkdown } = await import('/static/markdown.js');
          const box = document.createElement('div');
          const md = new StreamingMarkdown(box);
          const firstParagraph = () => box.querySelector('.md-stable p');
          let text = 'First **line**\\n';
          md.update(text);
          const first = firstParagraph();
          const keptWithinLine = [];
          for (const ch of 'second *li') {
            text += ch;
            md.update(text);
            keptWithinLine.push(firstParagraph() === first);
          }
          const tail = box.querySelector('.md-tail').innerHTML;
          text += 'ne*\\n';
          md.update(text);
          const rebuiltOnNewLine = firstParagraph() !== first;
          text += '\\nNext paragraph\\n\\nAnd another\\n';
          md.update(text);
          const closed = firstParagraph();
          text += 'and more of it\\n';
          md.update(text);
          return {
            keptWithinLine, tail, rebuiltOnNewLine,
            frozenKept: firstParagraph() === closed,
            html: box.querySelector('.md-stable').innerHTML,
          };
        }"""
    )
    assert all(result["keptWithinLine"])
    # The partial line is drawn as Markdown, its open emphasis closed for the moment.
    assert result["tail"] == "<p>second <em>li</em></p>"
    assert result["rebuiltOnNewLine"]
    assert result["frozenKept"], "a paragraph closed by a blank line was rendered again"
    assert result["html"] == (
        '<div class="md-frozen"><p>First <strong>line</strong><br>second <em>line</em></p>'
        "<p>Next paragraph</p></div>"
        '<div class="md-live"><p>And another<br>and more of it</p></div>'
    )


SSE_BODY = (
    ": keep-alive comment\r\n"
    "id: 7\r\n"
    "event: delta\r\n"
    'data: {"text": "안녕 🙂"}\r\n'
    "\r\n"
    "data: first line\n"
    "data: second line\n"
    "\n"
    "event: done\r"
    "id: 8\r"
    "data: {}\r"
    "\r"
    "event: incomplete\n"
    "data: never dispatched"
)
# An id holds for the events after it until another one comes, as the spec says.
SSE_EVENTS = [
    {"event": "delta", "data": '{"text": "안녕 🙂"}', "id": "7"},
    {"event": "message", "data": "first line\nsecond line", "id": "7"},
    {"event": "done", "data": "{}", "id": "8"},
]


def test_the_sse_decoder_gives_the_same_events_however_the_bytes_are_split(blank):
    results = blank.evaluate(
        """async (body) => {
          const { SSEDecoder } = await import('/static/sse.js');
          const bytes = new TextEncoder().encode(body);
          const run = (chunks) => {
            const decoder = new TextDecoder('utf-8');
            const sse = new SSEDecoder();
            const events = [];
            for (const chunk of chunks) events.push(...sse.push(decoder.decode(chunk, { stream: true })));
            events.push(...sse.push(decoder.decode()));
            return JSON.stringify(events);
          };
          const out = [run([bytes])];
          for (let i = 1; i < bytes.length; i++) out.push(run([bytes.slice(0, i), bytes.slice(i)]));
          out.push(run([...bytes].map((b) => new Uint8Array([b]))));
          return out;
        }""",
        SSE_BODY,
    )
    assert len(results) > len(SSE_BODY)
    assert {r for r in results} == {json.dumps(SSE_EVENTS, ensure_ascii=False, separators=(",", ":"))}


def test_read_events_parses_json_data_from_a_streamed_response(blank):
    events = blank.evaluate(
        """async (body) => {
          const { readEvents } = await import('/static/sse.js');
          const bytes = new TextEncoder().encode(body);
          const stream = new ReadableStream({
            start(controller) {
              for (let i = 0; i < bytes.length; i += 5) controller.enqueue(bytes.slice(i, i + 5));
              controller.close();
            },
          });
          const out = [];
          for await (const ev of readEvents(new Response(stream))) out.push(ev);
          return out;
        }""",
        SSE_BODY,
    )
    assert events == [
        {"event": "delta", "data": {"text": "안녕 🙂"}, "id": "7"},
        {"event": "message", "data": "first line\nsecond line", "id": "7"},
        {"event": "done", "data": {}, "id": "8"},
    ]


@pytest.mark.parametrize("ending", ["\n", "\r\n", "\r", ""])
def test_a_last_record_without_its_blank_line_is_dropped_at_end_of_stream(blank, ending):
    # WHATWG SSE: at end of stream an event still being built is discarded, even one whose lines
    # all ended; only a blank line dispatches it.
    events = blank.evaluate(
        """async (body) => {
          const { readEvents } = await import('/static/sse.js');
          const out = [];
          for await (const ev of readEvents(new Response(body))) out.push(ev);
          return out;
        }""",
        f'event: delta\ndata: {{"text": "kept"}}\n\nevent: done\ndata: {{}}{ending}',
    )
    assert events == [{"event": "delta", "data": {"text": "kept"}, "id": ""}]


def record(n: int, event: str, data: str) -> str:
    return f"id: {n}\r\nevent: {event}\r\ndata: {data}\r\n\r\n"


def test_follow_turn_resumes_after_a_broken_stream_from_the_last_id_it_saw(blank):
    # The first stream breaks after event 3; the reopened one must be asked for what follows 3, and
    # what it sends is read once. A new turn's `start` numbers from 1 again.
    first = record(1, "start", "{}") + record(2, "delta", '{"text":"a"}') + record(3, "delta", '{"text":"b"}')
    rest = record(4, "delta", '{"text":"c"}') + record(5, "done", '{"status":"complete"}')
    got = blank.evaluate(
        """async ([first, rest]) => {
          const { followTurn } = await import('/static/sse.js');
          const bytes = new TextEncoder().encode(first);
          // The bytes arrive, then the connection breaks on the next read.
          let reads = 0;
          const broken = new Response(new ReadableStream({
            pull(c) {
              if (reads++ === 0) c.enqueue(bytes);
              else c.error(new TypeError('network error'));
            },
          }));
          const asked = [];
          const reopen = async (after) => {
            asked.push(after);
            return new Response(rest);
          };
          const events = [];
          for await (const ev of followTurn(broken, reopen, { pauseMs: 1 })) events.push([ev.id, ev.event, ev.data.text ?? null]);
          return { asked, events };
        }""",
        [first, rest],
    )
    assert got["asked"] == [3]
    assert got["events"] == [["1", "start", None], ["2", "delta", "a"], ["3", "delta", "b"], ["4", "delta", "c"],
                             ["5", "done", None]]


def test_follow_turn_ends_without_done_when_nothing_runs_and_gives_up_after_its_attempts(blank):
    got = blank.evaluate(
        """async (first) => {
          const { followTurn } = await import('/static/sse.js');
          const read = async (response, reopen) => {
            const events = [];
            try {
              for await (const ev of followTurn(response, reopen, { pauseMs: 1, attempts: 3 })) events.push(ev.event);
            } catch (err) {
              return { events, error: err.message };
            }
            return { events, error: null };
          };
          const ended = await read(new Response(first), async () => null);
          let calls = 0;
          const failing = await read(new Response(first), async () => { calls += 1; throw new TypeError('offline'); });
          return { ended, failing, calls };
        }""",
        record(1, "start", "{}") + record(2, "delta", '{"text":"a"}'),
    )
    assert got["ended"] == {"events": ["start", "delta"], "error": None}
    assert got["failing"] == {"events": ["start", "delta"], "error": "offline"}
    assert got["calls"] == 3
