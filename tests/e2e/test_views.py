"""The transcript views and header meters, run in chromium as the page loads them, on messages and
conversations shaped as the server stores them (API.md)."""

from __future__ import annotations

import pytest

from pagekit import open_page


@pytest.fixture(scope="module")
def blank(browser, server):
    page = open_page(browser, server.base_url)
    yield page
    page.context.close()


def render_reply(page, message: dict) -> dict:
    return page.evaluate(
        """async (message) => {
          const { AssistantView } = await import('/static/views.js');
          const view = AssistantView.fromMessage(message);
          document.body.append(view.el);
          const out = {
            status: view.el.dataset.status,
            bodyHidden: view.el.querySelector('.bubble').hidden,
            bodyHeight: view.el.querySelector('.bubble').getBoundingClientRect().height,
            note: view.el.querySelector('.interrupted-note')?.textContent ?? null,
            stats: view.el.querySelector('.stats')?.textContent ?? null,
            warnings: [...view.el.querySelectorAll('[data-test=warning]')].map(
              (w) => ({ code: w.dataset.code, text: w.textContent })),
            domains: [...view.el.querySelectorAll('.result-domains a')].map((a) => a.textContent),
            copy: !!view.el.querySelector('[data-test=copy-reply]'),
          };
          view.el.remove();
          return out;
        }""",
        message,
    )


USAGE = {"input_tokens": 1200, "output_tokens": 0, "cached_tokens": 0, "cache_write_tokens": 0,
         "cost": None, "searches": 0, "fetches": 0, "estimated": True}


def test_a_stored_reply_shows_its_warnings(blank):
    got = render_reply(blank, {
        "id": "m1", "role": "assistant", "content": "Cut short", "status": "complete", "model": "m",
        "warnings": [{"code": "max_tokens", "message": "The reply reached the output limit and was cut."},
                     {"code": "over_budget", "message": "Over the context budget."}],
    })
    assert got["warnings"] == [
        {"code": "max_tokens", "text": "The reply reached the output limit and was cut."},
        {"code": "over_budget", "text": "Over the context budget."},
    ]


def test_a_reply_stopped_before_its_first_word_says_so_with_its_usage(blank):
    got = render_reply(blank, {
        "id": "m2", "role": "assistant", "content": "", "status": "interrupted", "model": "thinker",
        "usage": USAGE, "activity": [{"kind": "thinking", "text": "Hmm", "started_at": 1.0, "ended_at": 4.0}],
    })
    assert got["note"] == "Stopped before the answer began"
    assert got["bodyHidden"] and got["bodyHeight"] == 0, "an empty answer box is drawn"
    assert got["stats"].startswith("thinker · 1,200 in · 0 out") and "estimated" in got["stats"]
    assert not got["copy"], "nothing to copy"


def test_a_partly_answered_stop_still_reads_interrupted(blank):
    got = render_reply(blank, {"id": "m3", "role": "assistant", "content": "Half", "status": "interrupted"})
    assert got["note"] == "Interrupted before the end"
    assert not got["bodyHidden"] and got["copy"]


def test_domains_are_derived_from_the_results_never_read_from_a_stored_list(blank):
    got = render_reply(blank, {
        "id": "m4", "role": "assistant", "content": "x", "status": "complete",
        "activity": [{"kind": "search", "query": "q", "at": 1.0, "domains": ["stale.example"],
                      "results": [{"url": "https://www.python.org/doc", "title": "Docs"},
                                  {"url": "https://docs.python.org/3/", "title": "3"}]}],
    })
    assert got["domains"] == ["python.org", "docs.python.org"]


def test_live_search_steps_carry_only_raw_facts(blank):
    steps = blank.evaluate(
        """async () => {
          const { accumulateActivity } = await import('/static/activity.js');
          const steps = [];
          accumulateActivity(steps, 'search', { query: 'q', results: null }, 5);
          accumulateActivity(steps, 'search', { query: 'q', results: [{ url: 'https://www.a.example/', title: 'A' }] }, 6);
          return steps;
        }"""
    )
    assert steps == [{"kind": "search", "query": "q", "at": 5, "results": [{"url": "https://www.a.example/", "title": "A"}]}]


def test_a_long_thought_grows_in_place_instead_of_being_redrawn(blank):
    result = blank.evaluate(
        """async () => {
          const { AssistantView } = await import('/static/views.js');
          const view = new AssistantView({ model: 'thinker', reasoning: true });
          document.body.append(view.el);
          view.startStreaming();
          view.addActivity('search', { query: 'first', results: [{ url: 'https://a.example/', title: 'A' }] });
          view.addActivity('reasoning', { text: 'chunk 0 ' });
          const timeline = view.el.querySelector('.timeline');
          const firstStep = timeline.firstElementChild;
          const thought = timeline.querySelector('.thinking-text');
          let removed = 0;
          let added = 0;
          const observer = new MutationObserver(() => {});
          observer.observe(timeline, { childList: true, subtree: true });
          for (let i = 1; i < 300; i++) view.addActivity('reasoning', { text: `chunk ${i} ` });
          for (const r of observer.takeRecords()) {
            // Elements taken out mean a step was rebuilt; the title's own text may change.
            removed += [...r.removedNodes].filter((n) => n.nodeType === Node.ELEMENT_NODE).length;
            if (r.target === thought) for (const n of r.addedNodes) added += n.data.length;
          }
          observer.disconnect();
          const text = thought.textContent;
          const out = {
            removed, added, sameFirst: timeline.firstElementChild === firstStep,
            sameThought: timeline.querySelector('.thinking-text') === thought,
            starts: text.startsWith('chunk 0 chunk 1 '), ends: text.endsWith('chunk 299 '), length: text.length,
          };
          view.el.remove();
          return out;
        }"""
    )
    assert result["sameFirst"] and result["sameThought"]
    assert result["removed"] == 0, "steps were rebuilt on each reasoning chunk"
    assert result["starts"] and result["ends"]
    # Each chunk's words are added once: the text added equals the thought minus its first chunk.
    assert result["added"] == result["length"] - len("chunk 0 ")


def header(page, conv: dict) -> dict:
    return page.evaluate(
        """async (conv) => {
          const { usageItems, contextBar } = await import('/static/views.js');
          const bar = contextBar(conv.context);
          const box = document.createElement('div');
          box.append(...bar.items);
          return {
            cost: Object.fromEntries(usageItems(conv.totals))['cost'],
            label: box.querySelector('.context-label').textContent,
            reserve: box.querySelector('.context-reserve')?.textContent ?? null,
            segments: Object.fromEntries([...box.querySelectorAll('[data-segment]')].map(
              (s) => [s.dataset.segment, Number(s.dataset.tokens)])),
            over: bar.over,
            account: bar.account,
          };
        }""",
        conv,
    )


TOTALS = {"input_tokens": 10, "output_tokens": 5, "cached_tokens": 0, "searches": 0, "fetches": 0}
CONTEXT = {"budget": 4000, "persona": 300, "memory": 100, "summary": 536, "history": 1500}


@pytest.mark.parametrize(("totals", "cost"), [
    ({"cost": 0.0123, "cost_unreported": 0, "turns": 9}, "$0.0123"),
    ({"cost": 0.0123, "cost_unreported": 7, "turns": 9}, "cost unknown for 7 of 9 replies; $0.0123 for the rest"),
    ({"cost": 0, "cost_unreported": 3, "turns": 3}, "cost unknown"),
    # A summarizer call whose cost went unreported counts too, though it is no reply.
    ({"cost": 0.002, "cost_unreported": 4, "turns": 3}, "cost unknown; $0.0020 reported"),
])
def test_the_cost_never_reads_as_a_number_alone_when_some_went_unreported(blank, totals, cost):
    assert header(blank, {"totals": {**TOTALS, **totals}, "context": CONTEXT})["cost"] == cost


def test_the_context_bar_counts_the_reply_reserve_as_the_trigger_does(blank):
    got = header(blank, {"totals": {**TOTALS, "cost": 0, "cost_unreported": 0, "turns": 1},
                         "context": {**CONTEXT, "reserve": 2000}})
    assert got["segments"] == {**{k: v for k, v in CONTEXT.items() if k != "budget"}, "reserve": 2000}
    assert got["label"] == "4,436 / 4,000 tokens"
    assert got["reserve"] == "incl. 2,000 reserved for the reply"
    assert got["over"], "the prompt fits but prompt and reserve do not: the next turn compresses"
    assert "Reserved for the reply 2,000" in got["account"]


def test_without_a_reserve_the_bar_shows_the_prompt_alone(blank):
    got = header(blank, {"totals": {**TOTALS, "cost": 0, "cost_unreported": 0, "turns": 1}, "context": CONTEXT})
    assert "reserve" not in got["segments"] and got["reserve"] is None
    assert got["label"] == "2,436 / 4,000 tokens" and not got["over"]


@pytest.mark.parametrize(("dropped", "line"), [
    (False, "2 earlier messages folded into the summary"),
    (True, "2 earlier messages left the context (folded or dropped)"),
])
def test_folded_history_is_collapsed_and_marked(blank, dropped, line):
    got = blank.evaluate(
        """async ({ dropped }) => {
          const { renderArchive } = await import('/static/views.js');
          const box = renderArchive([
            { id: 'a', role: 'user', content: 'Old question' },
            { id: 'b', role: 'assistant', content: 'Old **answer**', status: 'complete' },
            { id: 'c', role: 'notice', content: 'Folded 2 earlier messages.' },
          ], { dropped });
          return {
            open: box.open, line: box.querySelector('summary').textContent,
            entries: [...box.querySelectorAll('[data-test=folded-message]')].map(
              (e) => [e.dataset.role, e.dataset.folded, e.querySelector('.bubble, .notice-text').textContent]),
            none: renderArchive([], {}) === null && renderArchive(undefined, {}) === null,
          };
        }""",
        {"dropped": dropped},
    )
    assert not got["open"] and got["line"] == line and got["none"]
    assert got["entries"] == [["user", "true", "Old question"], ["assistant", "true", "Old answer"],
                              ["notice", "true", "Folded 2 earlier messages."]]


@pytest.mark.parametrize(("totals", "uncounted", "items"), [
    # Counted before the server kept the title's tokens apart: named, not split.
    ({"input_tokens": 1013, "output_tokens": 25, "title_calls": 1, "turns": 1, "cost": 0.001},
     0, ["1,013 in (incl. 1 title call)", "25 out (incl. 1 title call)"]),
    ({"input_tokens": 1500, "output_tokens": 80, "title_calls": 1, "title_input_tokens": 500,
      "title_output_tokens": 5, "compression_calls": 2, "compression_input_tokens": 700,
      "compression_output_tokens": 60, "turns": 3, "cost": 0.01},
     0, ["1,500 in (replies 300, title 500, summary 700)", "80 out (replies 15, title 5, summary 60)"]),
    # Imported replies were never counted: their cost is unknown, not zero.
    ({"input_tokens": 0, "output_tokens": 0, "turns": 0, "cost": 0}, 2, ["0 in", "0 out", "cost unknown"]),
    ({"input_tokens": 10, "output_tokens": 5, "turns": 1, "cost": 0.002}, 2,
     ["10 in", "5 out", "cost unknown for 2 of 3 replies; $0.0020 for the rest"]),
])
def test_the_header_itemises_summarizer_calls_and_never_shows_a_missing_cost_as_zero(blank, totals, uncounted, items):
    got = blank.evaluate(
        """async ({ totals, uncounted }) => {
          const { usageItems } = await import('/static/views.js');
          return Object.fromEntries(usageItems(totals, uncounted));
        }""",
        {"totals": {"cached_tokens": 0, "searches": 0, "fetches": 0, "cost_unreported": 0, **totals},
         "uncounted": uncounted},
    )
    assert [got["in"], got["out"], *([got["cost"]] if len(items) == 3 else [])] == items
