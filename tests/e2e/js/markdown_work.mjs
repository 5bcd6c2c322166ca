// Hostile replies render in work linear in their length. Run by tests/e2e/test_markdown_work.py
// under V8 flags that report any regular expression backtracking past a bound, and checked here
// against the renderer's own count of the characters its scans visit. Prints one JSON line per case.

import { tags } from "./dom.mjs";

const { renderMarkdown, work } = await import("../../../chatserver/static/markdown.js");

const N = 200_000;
const cases = {
  heading: "# a" + " ".repeat(N) + "b",
  heading_hashes: "# a" + " #".repeat(N / 2) + "b",
  table_delimiter: "a | b\n| -" + " ".repeat(N) + "x",
  table_cells: "a | b\n" + "| - ".repeat(N / 4) + "x",
  brackets: "[".repeat(N),
  image_brackets: "![".repeat(N / 2),
  bracket_parens: "[a](".repeat(N / 4),
  link_title_blanks: "[a](http://x" + " ".repeat(N) + "y)",
  fence_blanks: "```" + " ".repeat(N) + "`",
  list_lone_cr: "- " + " ".repeat(N) + "\r" + "x",
  nested_quotes: ">".repeat(N),
  nested_lists: "- ".repeat(N / 2) + "x",
  url_parens: "see http://a.example/" + ")".repeat(N),
  code_ticks: Array.from({ length: 600 }, (_, k) => "`".repeat(k + 1) + "a").join(" "),
  emphasis: "*a ".repeat(N / 3) + "**b _c ~~d",
  dollars: "$a ".repeat(N / 3),
  dollar_pairs: "$$a ".repeat(N / 4),
  math_lines: "$$\n".repeat(N / 3),
  math_brackets: "\\[a".repeat(N / 3) + "\n" + "\\(a".repeat(N / 3),
  footnote_refs: "[^a]".repeat(N / 4) + "\n\n[^a]: note",
  footnote_defs: "[^a]: x\n".repeat(N / 8),
  task_items: "- [x] a\n".repeat(N / 8),
};

const { provisional } = await import("../../../chatserver/static/markdown.js");
// The streaming tail: a partial line is closed for the moment, then rendered.
const tails = {
  tail_emphasis: "**a" + " *b _c".repeat(N / 6),
  tail_runs: "*".repeat(N),
};
for (const [name, text] of Object.entries(tails)) {
  work.steps = 0;
  const tree = renderMarkdown(provisional(text));
  console.log(JSON.stringify({ name, length: text.length, steps: work.steps, nodes: tags(tree).length }));
}

for (const [name, text] of Object.entries(cases)) {
  work.steps = 0;
  const tree = renderMarkdown(text);
  console.log(JSON.stringify({ name, length: text.length, steps: work.steps, nodes: tags(tree).length }));
}
