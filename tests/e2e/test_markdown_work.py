"""Hostile replies cannot freeze the page: the Markdown renderer's work is linear in the reply.

Runs tests/e2e/js/markdown_work.mjs under node, which renders each pathological input at 200k
characters. Work is counted, never timed: the renderer counts the characters its own scans visit
(`work.steps`), and V8, with regexp optimisation off so every backtrack is counted, reports any
single pattern match that backtracks more than a bound linear in the input.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "js" / "markdown_work.mjs"
LENGTH = 200_000
# Per pattern execution; a pattern that matches one way only stays within a few per character.
BACKTRACKS = 5 * LENGTH
V8_FLAGS = [
    "--regexp-interpret-all", "--no-regexp-optimization",
    "--enable-experimental-regexp-engine-on-excessive-backtracks",
    f"--regexp-backtracks-before-fallback={BACKTRACKS}", "--trace-experimental-regexp-engine",
]


@pytest.fixture(scope="module")
def results():
    node = shutil.which("node")
    if not node:
        pytest.skip("node is not installed")
    # The timeout only keeps a regression from hanging the suite; the bounds below are counts.
    run = subprocess.run([node, *V8_FLAGS, str(SCRIPT)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    return {
        "cases": {(r := json.loads(line))["name"]: r for line in lines if line.startswith("{")},
        "backtracking": [line for line in lines if line.startswith("Experimental execution")],
    }


def test_no_pattern_backtracks_more_than_linearly(results):
    assert results["backtracking"] == []


@pytest.mark.parametrize("name", [
    "heading", "heading_hashes", "table_delimiter", "table_cells", "brackets", "image_brackets",
    "bracket_parens", "link_title_blanks", "fence_blanks", "list_lone_cr", "nested_quotes", "nested_lists",
    "url_parens", "code_ticks", "emphasis",
    "dollars", "dollar_pairs", "math_lines", "math_brackets", "footnote_refs", "footnote_defs", "task_items",
])
def test_each_hostile_reply_renders_in_linear_work(results, name):
    case = results["cases"][name]
    assert case["length"] >= 0.9 * LENGTH
    assert case["nodes"] >= 1, "nothing was rendered"
    assert case["steps"] <= 3 * case["length"], case


@pytest.mark.parametrize("name", ["tail_emphasis", "tail_runs"])
def test_a_streaming_tail_closed_for_the_moment_renders_in_linear_work(results, name):
    # The partial line is read once more to close what is open, and the one closer it adds can
    # make one emphasis scan to the end: two more per character than a finished reply.
    case = results["cases"][name]
    assert case["length"] >= 0.9 * LENGTH
    assert case["steps"] <= 5 * case["length"], case
