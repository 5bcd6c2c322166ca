"""Rendering benchmark in chromium (issue 26): how long the page takes to draw a long reply, and
whether streaming keeps every frame short.

Debian's chromium (Playwright with executable_path, as tests/e2e does) drives the real page, served
by the real server whose gateway is the simulator. Two figures:

- `render_200k_*`: a finished 200,000-character reply holding 50 fenced code blocks (highlighted by
  highlight.js) and 100 formulas (drawn by KaTeX), drawn by the page's own renderer
  (`renderMarkdown`, with the page's hooks) into the transcript and laid out; the median and the
  worst of `RENDER_RUNS` draws on the wall clock, and a draw's CPU time from chromium's trace
  (`render_200k_cpu_ms`: on a shared machine the wall clock also counts waiting for a core).
  Also `open_200k_ms`: opening the conversation that holds it, from the click in the sidebar to
  the reply on screen.
- `stream_*`: a reply streamed at 100 tokens/s (one word a chunk every 10 ms) after a 150,000-
  character beginning, the way a long answer goes on: the long tasks the browser reports
  (PerformanceObserver 'longtask', every task over 50 ms) while it streams, the longest, and the
  longest gap between animation frames. The aim is no long task at all.

Writes bench/results_render.json and prints it.

    .venv/bin/python bench/render_bench.py
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from playwright.sync_api import expect, sync_playwright  # noqa: E402

from conftest import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from gateway_sim.simulator import GatewaySimulator, Script, steps  # noqa: E402
from pagekit import Server, assistant_messages, conversation_id, new_conversation, open_page, send  # noqa: E402

TARGET_CHARS = 200_000
CODE_BLOCKS = 50
FORMULAS = 100
RENDER_RUNS = 5
# Budgets stated in README (Measured): a finished 200k reply drawn within RENDER_BUDGET_MS (median),
# and no frame over 50 ms while a reply streams at 100 tokens/s.
RENDER_BUDGET_MS = 1000
LONG_FRAME_MS = 50
STREAM_PREFIX = 150_000
STREAM_TOKENS = 1500
TOKENS_PER_S = 100

# Each block differs by its number ({n}), as a real reply's blocks do: the page highlights a block
# it has seen before from its cache.
CODE = [
    ("python", "# block {n}\ndef merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
               "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
               "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n"),
    ("javascript", "// block {n}\nexport function debounce(fn, ms) {\n  let t = null;\n  return (...args) => {\n"
                   "    clearTimeout(t);\n    t = setTimeout(() => fn(...args), ms);\n  };\n}\n"),
    ("json", '{"block": {n}, "name": "harbour", "berths": [1, 2, 3], "open": true, "depth_m": 14.5, "pilot": null}\n'),
    ("sh", "# block {n}\nfor f in *.log; do\n  grep -c ERROR \"$f\" | sed \"s/^/$f: /\"\ndone | sort -t: -k2 -n\n"),
    ("sql", "-- block {n}\nSELECT ship, COUNT(*) AS calls\nFROM arrivals\nWHERE arrived_at > now() - interval '7 days'\n"
            "GROUP BY ship ORDER BY calls DESC LIMIT 10;\n"),
]
FORMULA = [
    r"E = mc^2", r"\int_0^1 x^2\,dx = \frac{1}{3}", r"\sum_{k=1}^{n} k = \frac{n(n+1)}{2}",
    r"\sqrt{a^2 + b^2}", r"e^{i\pi} + 1 = 0", r"\frac{\partial f}{\partial x} = 2x + y",
]
PROSE = ("The harbour opens at dawn, and **every pilot** checks the tide table before the first ship "
         "moves; the *berth plan* is read from `plan.json`, and a [note](https://example.com/notes) "
         "explains the exceptions. ")


def long_reply() -> str:
    """About 200,000 characters: headings, prose, lists and a table around 50 code blocks and 100
    formulas (half inline, half display), spread evenly."""
    sections = []
    per_section = TARGET_CHARS // CODE_BLOCKS
    for n in range(CODE_BLOCKS):
        lang, code = CODE[n % len(CODE)]
        code = code.replace("{n}", str(n))
        inline, display = FORMULA[n % len(FORMULA)], FORMULA[(n + 3) % len(FORMULA)]
        head = (f"## Part {n + 1}\n\n{PROSE}With ${inline}$ in the line.\n\n$$\n{display}\n$$\n\n"
                f"- first point about **berth {n}**\n- second point with `code`\n- [x] checked\n\n"
                f"```{lang}\n{code}```\n\n| berth | depth |\n|---|---|\n| {n} | {n % 7 + 9} m |\n\n")
        body = PROSE * max(1, -(-(per_section - len(head)) // len(PROSE)))
        sections.append(head + body.strip() + "\n\n")
    return "".join(sections)


# Every long task and animation-frame gap from now on, in window.__perf, until the paced part's last
# word (`marker`) shows; long tasks after it (the finished reply drawn again) are kept apart.
WATCH = """(marker) => {
  const perf = window.__perf = { longtasks: [], after: [], maxFrameGap: 0, frames: 0, ended: false };
  new PerformanceObserver((list) => {
    for (const e of list.getEntries()) (perf.ended ? perf.after : perf.longtasks).push(Math.round(e.duration));
  }).observe({ type: "longtask" });
  let last = performance.now();
  const frame = (now) => {
    perf.maxFrameGap = Math.max(perf.maxFrameGap, now - last);
    perf.frames++;
    last = now;
    const tail = document.querySelector('[data-status="streaming"] .md-tail');
    if (tail && tail.textContent.includes(marker)) perf.ended = true;
    else requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame);
}"""

# Draw the finished reply with the page's own renderer (its hooks installed by richtext.js) into the
# transcript, lay it out, and take it away again; milliseconds per draw.
DRAW = """async ([text, runs, salt]) => {
  const { renderMarkdown } = await import("/static/markdown.js");
  await import("/static/richtext.js");
  const times = [];
  for (let i = 0; i < runs; i++) {
    // Each draw's code blocks are new to the highlighter's cache, as a new reply's are.
    const drawn = text.replaceAll("block", `block ${salt}-${i}`);
    const box = document.createElement("div");
    box.className = "bubble markdown";
    const start = performance.now();
    box.append(renderMarkdown(drawn));
    document.getElementById("messages").append(box);
    box.getBoundingClientRect();
    document.body.offsetHeight;
    times.push(performance.now() - start);
    box.remove();
  }
  return times;
}"""


TRACE_CATEGORIES = ["toplevel", "devtools.timeline", "disabled-by-default-devtools.timeline"]


def measure_render(browser, page, text: str) -> dict:
    page.evaluate(DRAW, [text, 1, "warm"])  # modules loaded and warmed up outside the measured draws
    browser.start_tracing(page=page, categories=TRACE_CATEGORIES)
    times = page.evaluate(DRAW, [text, RENDER_RUNS, "run"])
    # The draws run in one task: its CPU time over the runs is a draw's CPU time, whatever the
    # other load on the machine did to the wall clock.
    cpu = max((c for _, c in main_thread_tasks(browser.stop_tracing())), default=0) / RENDER_RUNS
    counts = page.evaluate("""async (text) => {
      const { renderMarkdown } = await import("/static/markdown.js");
      const el = renderMarkdown(text);
      return { code: el.querySelectorAll(".code-block").length, highlighted: el.querySelectorAll("code.hljs").length,
               maths: el.querySelectorAll(".math-rendered").length };
    }""", text)
    return {
        "render_200k_chars": len(text), "render_200k_code_blocks": counts["code"],
        "render_200k_highlighted": counts["highlighted"], "render_200k_formulas": counts["maths"],
        "render_200k_median_ms": round(statistics.median(times), 1), "render_200k_max_ms": round(max(times), 1),
        "render_200k_cpu_ms": round(cpu, 1), "render_200k_budget_ms": RENDER_BUDGET_MS,
        "render_200k_within_budget": statistics.median(times) <= RENDER_BUDGET_MS,
        "render_200k_cpu_within_budget": cpu <= RENDER_BUDGET_MS,
    }


def measure_open(page, conv_id: str) -> float:
    """From a click on the conversation's row to its 200k reply drawn, in ms."""
    start = time.perf_counter()
    page.locator(f"li[data-id='{conv_id}'] .conv-open").click()
    expect(assistant_messages(page).last.get_by_test_id("code-block")).to_have_count(CODE_BLOCKS, timeout=60_000)
    return round((time.perf_counter() - start) * 1000, 1)


MARKER = "harbour-pilot-signs-off"


def stream_script(text: str) -> tuple[Script, str]:
    """The prefix at once, a pause for it to be drawn, then STREAM_TOKENS words at 100 a second
    ending with MARKER, a pause, then the rest; and the words that end the prefix."""
    prefix, rest = text[:STREAM_PREFIX], text[STREAM_PREFIX:]
    words = rest.split(" ")
    paced, tail = words[:STREAM_TOKENS], words[STREAM_TOKENS:]
    out: list = [steps.Text(prefix, chunk_size=100_000), steps.Sleep(2.0)]
    for word in paced:
        out += [steps.Text(word + " ", chunk_size=1), steps.Sleep(1 / TOKENS_PER_S)]
    out += [steps.Text(f"{MARKER} ", chunk_size=1), steps.Sleep(3.0), steps.Text(" ".join(tail), chunk_size=100_000)]
    return Script(out), prefix[-60:]


def main_thread_tasks(trace: bytes) -> list[tuple[float, float]]:
    """(wall ms, CPU ms) of each task the page's main thread ran, from a chromium trace."""
    events = json.loads(trace)["traceEvents"]
    mains = {(e["pid"], e["tid"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e["args"].get("name") == "CrRendererMain"}
    return [(e.get("dur", 0) / 1000, e.get("tdur", 0) / 1000) for e in events
            if e.get("ph") == "X" and e.get("name") == "RunTask" and (e["pid"], e["tid"]) in mains]


def measure_stream(browser, page, sim, text: str) -> dict:
    script, prefix_end = stream_script(text)
    sim.enqueue(script)
    new_conversation(page)
    send(page, "Tell me everything about the harbour")
    reply = assistant_messages(page).last
    # The 150k beginning is drawn (its cost is the render figure's); watch what streaming costs.
    expect(reply).to_contain_text(prefix_end.split()[-1], timeout=60_000)
    # The trace gives each task's CPU time beside its wall time: on a shared machine a task that
    # waited for a core is long on the wall clock without being long work.
    browser.start_tracing(page=page, categories=TRACE_CATEGORIES)
    page.evaluate(WATCH, MARKER)
    start = time.perf_counter()
    # Waited for with a cheap check twice a second: Playwright's own polling of a locator in a page
    # this large costs the page's main thread long tasks of its own.
    page.wait_for_function("() => window.__perf.ended", polling=500, timeout=120_000)
    seconds = time.perf_counter() - start
    tasks = main_thread_tasks(browser.stop_tracing())
    page.wait_for_function("() => document.querySelector('[data-role=assistant][data-status=complete]:last-child')",
                           polling=500, timeout=120_000)
    perf = page.evaluate("() => window.__perf")
    longest = max(perf["longtasks"], default=0)
    cpu = sorted((c for _, c in tasks), reverse=True)
    return {
        "stream_tokens_per_s": TOKENS_PER_S, "stream_tokens": STREAM_TOKENS, "stream_prefix_chars": STREAM_PREFIX,
        "stream_seconds": round(seconds, 1), "stream_frames": perf["frames"],
        "stream_long_tasks": len(perf["longtasks"]), "stream_longest_task_ms": longest,
        "stream_long_task_durations_ms": sorted(perf["longtasks"], reverse=True)[:20],
        "stream_max_frame_gap_ms": round(perf["maxFrameGap"], 1),
        "stream_under_50ms": longest < LONG_FRAME_MS,
        "stream_finish_longest_task_ms": max(perf["after"], default=0),
        "stream_tasks": len(tasks), "stream_task_cpu_max_ms": round(cpu[0], 1) if cpu else None,
        "stream_task_cpu_p99_ms": round(cpu[len(cpu) // 100], 1) if cpu else None,
        "stream_tasks_cpu_over_50ms": sum(1 for c in cpu if c > LONG_FRAME_MS),
        "stream_cpu_under_50ms": bool(cpu) and cpu[0] < LONG_FRAME_MS,
    }


def main() -> None:
    text = long_reply()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="render-bench-") as work, GatewaySimulator() as sim, \
            sync_playwright() as pw:
        server = Server(Path(work) / "data", {"GATEWAY_BASE_URL": sim.base_url, "UPSTREAM_TIMEOUT": "120",
                                              "MAX_REQUEST_BYTES": str(4 * 2**20)})
        pw.selectors.set_test_id_attribute("data-test")
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = open_page(browser, server.base_url)
            results.update(measure_render(browser, page, text))
            print(json.dumps(results), flush=True)
            results.update(measure_stream(browser, page, sim, text))
            streamed = conversation_id(page)
            new_conversation(page)
            results["open_200k_ms"] = measure_open(page, streamed)
            page.context.close()
        finally:
            browser.close()
            server.stop()
    out = json.dumps(results, indent=2)
    (ROOT / "bench" / "results_render.json").write_text(out + "\n")
    print(out)


if __name__ == "__main__":
    main()
