// A small Markdown renderer for untrusted model output, plus its streaming wrapper.
//
// Every node is built with createElement/textContent, so nothing in the text can become markup:
// `<script>` or `<img onerror>` in a reply stays visible text. Links are kept only for http and
// https. It covers what chat replies use (headings, lists and task lists, quotes, fenced code,
// tables, emphasis, inline code, links, footnotes, maths) and deliberately not raw HTML or reference
// links; an image is a placeholder that loads nothing by itself (`hooks.image`). Maths is only marked out here (its TeX kept exactly as written, escapes and
// all); highlighting and drawing formulas are the page's hooks (richtext.js).
//
// Model output is hostile input, and one reply that freezes the tab freezes it on every reload.
// So the work is linear in the text: every pattern matches one way only (no two neighbouring
// quantifiers that can take the same character; the optional parts of headings, fences and table
// rows are cut by hand), brackets and parentheses are paired in one pass, failed searches are
// remembered, and blocks nest at most MAX_DEPTH deep. `work.steps` counts what the hand-written
// scans visit, so a test can bound the work without timing it.

import { node as el } from "./ui.js";

const FENCE_OPEN_RE = /^(\s*)(`{3,}|~{3,})/;
const HEADING_OPEN_RE = /^ {0,3}(#{1,6})(?=[ \t]|$)/;
const HR_RE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const LIST_RE = /^(\s*)([-*+]|\d{1,9}[.)])(?:([ \t]+)(.*))?$/;
const QUOTE_RE = /^ {0,3}> ?(.*)$/;
const DELIM_CELL_RE = /^:?-+:?$/;
// Deeper quotes and lists render as text: each level re-reads its lines, and recursion is finite.
const MAX_DEPTH = 16;
// A bare URL longer than this ends there: it bounds the scan from each candidate start.
const MAX_BARE_URL = 2048;

export const work = { steps: 0 };

/**
 * What the page plugs in (richtext.js): `highlight(codeEl, code, lang)` for a finished code block,
 * `math(el, tex, display)` for a formula and `image(placeholder, {url, raw, alt})` for an image. Unset (as under node), code stays plain text and a
 * formula shows its TeX source. The renderer itself stays pure and its work bounded.
 */
export const hooks = { highlight: null, math: null, image: null };

// Footnotes of the render under way: label -> {id, n}, and the prefix that keeps ids unique.
let notes = null;
let renderSeq = 0;
const FOOTNOTE_DEF_RE = /^ {0,3}\[\^([\w-]{1,32})\]:[ \t]?(.*)$/;
// A task list item's box: `[ ]`, `[x]` or `[X]` and a blank (or nothing) after it.
const TASK_RE = /^\[([ xX])\](?:[ \t]|$)/;

/** Render complete Markdown text into a DocumentFragment. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  // A lone \r is a line break too; left inside a line it would stop `.` in the line patterns.
  const lines = text.split(/\r\n|\r|\n/);
  const outer = notes;
  notes = collectNotes(lines);
  try {
    parseBlocks(lines, fragment, 0);
    if (notes.defs.length) fragment.append(footnoteSection(notes));
  } finally {
    notes = outer;
  }
  return fragment;
}

/**
 * Footnote definitions (`[^label]: text` at the top level) are taken out of the lines first, so a
 * reference anywhere before them knows its note. One pattern test per line.
 */
function collectNotes(lines) {
  const found = { prefix: `fn${++renderSeq}`, byLabel: new Map(), defs: [] };
  for (let i = 0; i < lines.length; i++) {
    work.steps++;
    if (lines[i][0] === " " ? !lines[i].trimStart().startsWith("[^") : !lines[i].startsWith("[^")) continue;
    const m = FOOTNOTE_DEF_RE.exec(lines[i]);
    if (!m || found.byLabel.has(m[1])) continue;
    const def = { label: m[1], text: m[2], n: found.defs.length + 1, id: `${found.prefix}-${found.defs.length + 1}` };
    found.byLabel.set(m[1], def);
    found.defs.push(def);
    lines[i] = "";
  }
  return found;
}

function footnoteSection(found) {
  const section = el("section", "footnotes");
  section.dataset.test = "footnotes";
  section.append(el("hr"));
  const list = el("ol");
  for (const def of found.defs) {
    const li = el("li");
    li.id = def.id;
    li.dataset.test = "footnote";
    parseInline(def.text, li);
    const back = el("a", "footnote-back", "↩");
    back.href = `#${def.id}-ref`;
    back.setAttribute("aria-label", "Back to the reference");
    li.append(" ", back);
    list.append(li);
  }
  section.append(list);
  return section;
}

/** A fence opener as {indent, marker, lang}, or null. A backtick in the info string means inline code. */
function fenceOpen(line) {
  const m = FENCE_OPEN_RE.exec(line);
  if (!m) return null;
  const info = line.slice(m[0].length);
  if (info.includes("`")) return null;
  return { indent: m[1], marker: m[2], lang: /^\s*(\S*)/.exec(info)[1] };
}

/** Strip spaces and tabs from both ends (String.trim also takes other blanks). */
function trimBlanks(s) {
  let a = 0;
  let b = s.length;
  while (a < b && (s[a] === " " || s[a] === "\t")) a++;
  while (b > a && (s[b - 1] === " " || s[b - 1] === "\t")) b--;
  work.steps += a + s.length - b;
  return s.slice(a, b);
}

/** An ATX heading as {level, content}, or null; the optional closing hashes are cut by hand. */
function heading(line) {
  const m = HEADING_OPEN_RE.exec(line);
  if (!m) return null;
  let content = trimBlanks(line.slice(m[0].length));
  let k = content.length;
  while (k > 0 && content[k - 1] === "#") k--;
  work.steps += content.length - k;
  if (k === 0) content = "";
  else if (k < content.length && (content[k - 1] === " " || content[k - 1] === "\t")) {
    content = trimBlanks(content.slice(0, k));
  }
  return { level: m[1].length, content };
}

/** A table's delimiter row: cells of dashes with optional alignment colons, split by pipes. */
function isDelimiterRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|")) s = s.slice(0, -1);
  return s.split("|").every((cell) => DELIM_CELL_RE.test(cell.trim()));
}

/** The URL if it is an absolute http(s) URL, else null: other schemes can run code. */
export function safeUrl(raw) {
  try {
    const url = new URL(raw.trim());
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

/**
 * Split streamed text into a prefix that can be rendered as Markdown now and a tail that cannot:
 * the cut is at the last complete line, moved back to the opening line of a code fence that has
 * not closed yet. `fence` holds the open fence's language and code so far, or null.
 */
export function splitStable(text) {
  const scanner = new LineScanner();
  const cut = text.lastIndexOf("\n") + 1;
  scanner.advance(text, cut);
  return splitAt(text, cut, scanner.fence);
}

function splitAt(text, cut, open) {
  if (!open) return { prefix: text.slice(0, cut), tail: text.slice(cut), fence: null };
  const partial = text.slice(cut);
  // A partial line of only backticks may be the closing fence arriving: never show it as code.
  const lastLine = /^\s*(`+|~+)\s*$/.test(partial) ? "" : partial;
  const code = (text.slice(open.bodyStart, cut) + lastLine).replace(/\n$/, "");
  return { prefix: text.slice(0, open.start), tail: "", fence: { lang: open.lang, code } };
}

/**
 * Reads complete lines once each, as they arrive, and keeps two facts about them: the code fence
 * still open (if any), and the last block boundary, a line at column 0 after a blank line outside
 * any fence that is not a list item. Nothing after such a boundary can change how the text before
 * it renders, so that part never needs rendering again.
 */
class LineScanner {
  constructor() {
    this.pos = 0;
    this.fence = null;
    this.afterBlank = true;
    this.boundary = 0;
  }

  advance(text, cut) {
    while (this.pos < cut) {
      const end = text.indexOf("\n", this.pos);
      const line = text.slice(this.pos, end);
      if (this.fence) {
        if (isClosingFence(line, this.fence.marker)) this.fence = null;
        this.afterBlank = false;
      } else {
        if (this.afterBlank && /^\S/.test(line) && !LIST_RE.test(line)) this.boundary = this.pos;
        const open = fenceOpen(line);
        if (open) this.fence = { start: this.pos, bodyStart: end + 1, marker: open.marker, lang: open.lang };
        this.afterBlank = isBlank(line);
      }
      this.pos = end + 1;
    }
  }
}

/**
 * Renders a growing reply: finished blocks once, the stable prefix after them again only when a
 * line completes, and the partial tail as plain text.
 */
export class StreamingMarkdown {
  constructor(container) {
    this.stable = el("div", "md-stable");
    this.frozen = el("div", "md-frozen");
    this.live = el("div", "md-live");
    this.tail = el("div", "md-tail");
    this.stable.append(this.frozen, this.live);
    container.replaceChildren(this.stable, this.tail);
    this.scanner = new LineScanner();
    this.frozenEnd = 0;
    this.prefixEnd = 0;
  }

  update(text) {
    const cut = text.lastIndexOf("\n") + 1;
    this.scanner.advance(text, cut);
    const { prefix, tail, fence } = splitAt(text, cut, this.scanner.fence);
    // Text only grows, so a prefix of the same length is the same prefix.
    if (prefix.length !== this.prefixEnd) {
      const freezeAt = Math.min(this.scanner.boundary, prefix.length);
      if (freezeAt > this.frozenEnd) {
        this.frozen.append(renderMarkdown(text.slice(this.frozenEnd, freezeAt)));
        this.frozenEnd = freezeAt;
      }
      this.live.replaceChildren(renderMarkdown(text.slice(this.frozenEnd, prefix.length)));
      this.prefixEnd = prefix.length;
    }
    if (fence) {
      this.tail.replaceChildren(codeBlock(fence.code, fence.lang, false));
    } else if (tail && !/^\s*(`+|~+)[\w+#.-]*$/.test(tail)) {
      // A partial line that may still become a fence opener stays hidden until its line ends.
      // The rest is drawn as Markdown now, its open emphasis and code closed for the moment,
      // so `**` never shows while the words it makes bold are arriving.
      this.tail.replaceChildren(renderMarkdown(provisional(tail)));
    } else {
      this.tail.replaceChildren();
    }
  }

  /** The reply is over (done, error or Stop): everything is final, unclosed fences included. */
  finish(text) {
    this.stable.replaceChildren(renderMarkdown(text));
    this.tail.replaceChildren();
  }
}

/**
 * A partial line made renderable: the delimiter run it ends with (a `**` whose words have not
 * arrived) is held back, the code span still open is closed, and so is the first emphasis or
 * strike-through still open (only one: a run of several closers could close many nested levels at
 * once, each found by its own scan to the end). One pass over the line.
 */
export function provisional(line) {
  let end = line.length;
  while (end > 0 && "*_~`$".includes(line[end - 1])) end--;
  while (end > 0 && (line[end - 1] === " " || line[end - 1] === "\t")) end--;
  work.steps += line.length - end;
  const s = line.slice(0, end);
  const open = [];
  let code = "";
  for (let i = 0; i < s.length; i++) {
    work.steps++;
    const ch = s[i];
    if (ch === "\\") {
      i++;
      continue;
    }
    if (ch !== "`" && ch !== "*" && ch !== "_" && ch !== "~") continue;
    let n = 1;
    while (s[i + n] === ch) n++;
    const run = ch.repeat(n);
    const before = s[i - 1];
    const after = s[i + n];
    i += n - 1;
    if (ch === "`") {
      if (!code) code = run;
      else if (code === run) code = "";
      continue;
    }
    if (code || (ch === "~" && n !== 2)) continue;
    if (ch === "_" && before !== undefined && /[\p{L}\p{N}]/u.test(before)) continue;
    const k = open.lastIndexOf(run);
    if (k !== -1 && before !== undefined && !/\s/.test(before)) open.splice(k, 1);
    else if (after !== undefined && !/\s/.test(after) && open.length < 1) open.push(run);
  }
  return s + code + open.reverse().join("");
}

function isClosingFence(line, marker) {
  const m = /^\s*(`{3,}|~{3,})\s*$/.exec(line);
  return !!m && m[1][0] === marker[0] && m[1].length >= marker.length;
}


function indentOf(line) {
  let cols = 0;
  for (const ch of line) {
    if (ch === " ") cols += 1;
    else if (ch === "\t") cols += 4 - (cols % 4);
    else break;
  }
  return cols;
}

/** Remove up to `cols` columns of leading whitespace. */
function dedent(line, cols) {
  let i = 0;
  let seen = 0;
  while (i < line.length && seen < cols && (line[i] === " " || line[i] === "\t")) {
    seen += line[i] === "\t" ? 4 - (seen % 4) : 1;
    i++;
  }
  return line.slice(i);
}

const isBlank = (line) => /^\s*$/.test(line);

function startsBlock(lines, i, depth) {
  const line = lines[i];
  work.steps++;
  return (
    !!fenceOpen(line) || !!heading(line) || HR_RE.test(line) || mathOpen(line) !== null ||
    (depth < MAX_DEPTH && QUOTE_RE.test(line)) ||
    (depth < MAX_DEPTH && LIST_RE.test(line) && !isBlank(LIST_RE.exec(line)[4] ?? "")) ||
    isTableStart(lines, i)
  );
}

function parseBlocks(lines, parent, depth) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    work.steps++;
    let h;
    if (isBlank(line)) {
      i++;
    } else if (fenceOpen(line)) {
      i = parseFence(lines, i, parent);
    } else if (mathOpen(line) !== null && (h = parseMathBlock(lines, i, parent)) !== -1) {
      i = h;
    } else if ((h = heading(line))) {
      const node = el(`h${h.level}`);
      parseInline(h.content, node);
      parent.append(node);
      i++;
    } else if (HR_RE.test(line)) {
      parent.append(el("hr"));
      i++;
    } else if (depth < MAX_DEPTH && QUOTE_RE.test(line)) {
      i = parseQuote(lines, i, parent, depth);
    } else if (depth < MAX_DEPTH && LIST_RE.test(line)) {
      i = parseList(lines, i, parent, depth);
    } else if (isTableStart(lines, i)) {
      i = parseTable(lines, i, parent);
    } else {
      i = parseParagraph(lines, i, parent, depth);
    }
  }
}

/** The closing delimiter a display-maths line opens (`$$` or `\\]`), or null. */
function mathOpen(line) {
  const s = trimBlanks(line);
  if (s.startsWith("$$")) return "$$";
  if (s.startsWith("\\[")) return "\\]";
  return null;
}

/**
 * `$$...$$` or `\\[...\\]` on its own lines: the TeX between goes to the formula untouched. Returns
 * the next line's index, or -1 when the block never closes (it is then a paragraph). A failed
 * search is remembered on the lines, so a reply of unclosed `$$` lines is read once.
 */
function parseMathBlock(lines, i, parent) {
  const close = mathOpen(lines[i]);
  const first = trimBlanks(lines[i]).slice(2);
  let tex = null;
  let j = i;
  if (first.length >= 2 && first.endsWith(close)) {
    tex = first.slice(0, -2);
    // `$$a$$ and $$b$$` is two formulas in a line of text, not one block.
    if (tex.includes(close)) return -1;
  } else if (!(lines.mathUnclosed?.[close] <= i)) {
    const body = [first];
    for (j = i + 1; j < lines.length; j++) {
      const s = trimBlanks(lines[j]);
      if (s.endsWith(close)) {
        body.push(s.slice(0, -2));
        tex = body.join("\n");
        break;
      }
      body.push(lines[j]);
    }
    if (tex === null) {
      lines.mathUnclosed = { ...lines.mathUnclosed, [close]: i };
      return -1;
    }
  } else {
    return -1;
  }
  if (!tex.trim()) return -1;
  parent.append(mathNode(tex, true));
  return j + 1;
}

/** A formula: its TeX source as text, drawn by the page's math hook when there is one. */
function mathNode(tex, display) {
  const node = el(display ? "div" : "span", display ? "math math-display" : "math math-inline", tex);
  node.dataset.test = "math";
  // Kept for Copy as plain text, which gives a drawn formula back as its source.
  node.dataset.tex = tex;
  if (hooks.math) hooks.math(node, tex, display);
  return node;
}

function parseFence(lines, i, parent) {
  const { indent, marker, lang } = fenceOpen(lines[i]);
  const cols = indentOf(indent);
  const code = [];
  let j = i + 1;
  while (j < lines.length && !isClosingFence(lines[j], marker)) {
    code.push(dedent(lines[j], cols));
    j++;
  }
  parent.append(codeBlock(code.join("\n"), lang, true));
  return j + 1;
}

/** A code block: `<pre><code>` holding the code exactly, and a Copy button once complete. */
function codeBlock(code, lang, complete) {
  const wrap = el("div", complete ? "code-block" : "code-block pending");
  wrap.dataset.test = "code-block";
  const head = el("div", "code-head");
  const label = el("span", "code-lang", lang || "code");
  label.dataset.test = "code-lang";
  head.append(label);
  const pre = el("pre");
  const codeEl = el("code", null, code);
  const safeLang = (lang || "").replace(/[^\w+#.-]/g, "");
  if (safeLang) codeEl.className = `language-${safeLang}`;
  pre.append(codeEl);
  // Highlighted once, when the fence has closed: a block still streaming stays plain text.
  if (complete && hooks.highlight) hooks.highlight(codeEl, code, safeLang);
  if (complete) {
    const copy = el("button", "copy", "Copy");
    copy.type = "button";
    copy.dataset.test = "code-copy";
    head.append(copy);
  }
  wrap.append(head, pre);
  return wrap;
}

function parseQuote(lines, i, parent, depth) {
  const inner = [];
  while (i < lines.length) {
    const m = QUOTE_RE.exec(lines[i]);
    if (m) inner.push(m[1]);
    else if (!isBlank(lines[i]) && inner.length && !isBlank(inner.at(-1)) && !startsBlock(lines, i, depth)) {
      inner.push(lines[i]);
    } else break;
    i++;
  }
  const quote = el("blockquote");
  parseBlocks(inner, quote, depth + 1);
  parent.append(quote);
  return i;
}

function parseList(lines, i, parent, depth) {
  const first = LIST_RE.exec(lines[i]);
  const base = indentOf(first[1]);
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  const items = [];
  while (i < lines.length) {
    const line = lines[i];
    const m = LIST_RE.exec(line);
    const indent = indentOf(line);
    const item = items.at(-1);
    if (m && indent <= base + 1) {
      if (/\d/.test(m[2]) !== ordered) break;
      items.push({ lines: [m[4] ?? ""], offset: indent + m[2].length + Math.min((m[3] ?? " ").length, 4) });
    } else if (isBlank(line)) {
      // A blank line continues the list only if what follows is indented or another item.
      let j = i + 1;
      while (j < lines.length && isBlank(lines[j])) j++;
      if (j >= lines.length) break;
      const nextM = LIST_RE.exec(lines[j]);
      const continues = indentOf(lines[j]) > base + 1 ||
        (nextM && /\d/.test(nextM[2]) === ordered);
      if (!continues) break;
      for (; i < j - 1; i++) item.lines.push("");
      item.lines.push("");
    } else if (indent > base + 1) {
      item.lines.push(dedent(line, item.offset));
    } else if (!isBlank(item.lines.at(-1)) && !startsBlock(lines, i, depth)) {
      item.lines.push(line.trim());
    } else {
      break;
    }
    i++;
  }
  for (const item of items) list.append(renderItem(item, depth + 1));
  parent.append(list);
  return i;
}

function renderItem(item, depth) {
  const li = el("li");
  const task = TASK_RE.exec(item.lines[0]);
  if (task) {
    // A task: a box the reader sees but cannot tick (the reply is the model's, not a form).
    const box = el("input");
    box.type = "checkbox";
    box.disabled = true;
    box.checked = task[1] !== " ";
    box.dataset.test = "task-box";
    li.className = "task";
    li.append(box);
    item.lines[0] = item.lines[0].slice(task[0].length);
  }
  parseBlocks(item.lines, li, depth);
  return li;
}

function isTableStart(lines, i) {
  return (
    i + 1 < lines.length && lines[i].includes("|") && lines[i + 1].includes("|") &&
    isDelimiterRow(lines[i + 1]) && splitRow(lines[i]).length === splitRow(lines[i + 1]).length
  );
}

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function parseTable(lines, i, parent) {
  const head = splitRow(lines[i]);
  const aligns = splitRow(lines[i + 1]).map((d) =>
    d.startsWith(":") && d.endsWith(":") ? "center" : d.endsWith(":") ? "right" : d.startsWith(":") ? "left" : "",
  );
  const table = el("table");
  const thead = el("thead");
  const tbody = el("tbody");
  thead.append(tableRow(head, "th", aligns));
  i += 2;
  while (i < lines.length && !isBlank(lines[i]) && lines[i].includes("|")) {
    tbody.append(tableRow(splitRow(lines[i]), "td", aligns));
    i++;
  }
  table.append(thead, tbody);
  const wrap = el("div", "md-table");
  wrap.dataset.test = "md-table";
  wrap.append(table);
  parent.append(wrap);
  return i;
}

function tableRow(cells, tag, aligns) {
  const tr = el("tr");
  aligns.forEach((align, k) => {
    const cell = el(tag);
    if (align) cell.style.textAlign = align;
    parseInline(cells[k] ?? "", cell);
    tr.append(cell);
  });
  return tr;
}

function parseParagraph(lines, i, parent, depth) {
  const text = [lines[i].trim()];
  i++;
  while (i < lines.length && !isBlank(lines[i]) && !startsBlock(lines, i, depth)) {
    text.push(lines[i].trim());
    i++;
  }
  const p = el("p");
  parseInline(text.join("\n"), p);
  parent.append(p);
  return i;
}

// Inline parsing: one left-to-right scan; a construct that does not close is literal text.

const PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";

/** Append inline nodes for `text` to `parent`. */
function parseInline(text, parent) {
  new InlineParser(text).run(parent);
}

class InlineParser {
  constructor(text) {
    this.text = text;
    // Delimiters known to have no closer within a range: any narrower search fails too, so a
    // reply full of unclosed `*` costs one scan per delimiter, not one per occurrence.
    this.noCloser = new Map();
    // Backtick runs by length: length -> their start positions, ascending. Found on first use.
    this.tickRuns = null;
    // Partner of each [ and ( (the ] or ) that closes it), found on first use in one pass.
    this.partner = null;
    this.inLink = false;
    this.depth = 0;
  }

  /**
   * Pair brackets and parentheses in one left-to-right pass, skipping escaped characters. The
   * partner of an opener depends only on the text after it, so this answers every later question
   * "where does the label starting here end" in O(1) instead of a scan per `[`.
   */
  partners() {
    if (this.partner) return this.partner;
    const t = this.text;
    const partner = new Int32Array(t.length).fill(-1);
    const brackets = [];
    const parens = [];
    for (let j = 0; j < t.length; j++) {
      work.steps++;
      const c = t[j];
      if (c === "\\") j++;
      else if (c === "[") brackets.push(j);
      else if (c === "]") {
        if (brackets.length) partner[brackets.pop()] = j;
      } else if (c === "(") parens.push(j);
      else if (c === ")") {
        if (parens.length) partner[parens.pop()] = j;
      } else if (c === "\n") {
        // A link destination never spans lines.
        parens.length = 0;
      }
    }
    this.partner = partner;
    return partner;
  }

  run(parent, start = 0, end = this.text.length) {
    const t = this.text;
    let buf = "";
    const flush = () => {
      if (buf) parent.append(document.createTextNode(buf));
      buf = "";
    };
    let i = start;
    while (i < end) {
      work.steps++;
      const ch = t[i];
      if (ch === "\\" && (t[i + 1] === "(" || t[i + 1] === "[")) {
        const math = this.delimitedMath(i, end);
        if (math) {
          flush();
          parent.append(math.node);
          i = math.end;
          continue;
        }
      }
      if (ch === "\\" && i + 1 < end && PUNCT.includes(t[i + 1])) {
        buf += t[i + 1];
        i += 2;
        continue;
      }
      if (ch === "\n") {
        flush();
        parent.append(el("br"));
        i++;
        continue;
      }
      const next = this.construct(i, end);
      if (next) {
        flush();
        parent.append(next.node);
        i = next.end;
        continue;
      }
      buf += ch;
      i++;
    }
    flush();
  }

  construct(i, end) {
    const t = this.text;
    const ch = t[i];
    if (ch === "`") return this.codeSpan(i, end);
    if (ch === "*" || ch === "_" || (ch === "~" && t[i + 1] === "~")) return this.emphasis(i, end);
    if (ch === "$") return this.dollarMath(i, end);
    // Links never nest: a URL inside a link's label stays text.
    if (this.inLink) return null;
    if (ch === "[" && t[i + 1] === "^") {
      const note = this.footnoteRef(i, end);
      if (note) return note;
    }
    if (ch === "[") return this.link(i, end, i + 1);
    if (ch === "!" && t[i + 1] === "[") return this.link(i, end, i + 2);
    if (ch === "<") return this.autolink(i, end);
    if (ch === "h" && (i === 0 || /[\s(]/.test(t[i - 1]))) return this.bareUrl(i, end);
    return null;
  }

  /** `[^label]` naming a footnote of this reply: a numbered link to its note. */
  footnoteRef(i, end) {
    if (!notes) return null;
    const close = this.text.indexOf("]", i + 2);
    if (close === -1 || close >= end || close - i > 34) return null;
    const def = notes.byLabel.get(this.text.slice(i + 2, close));
    if (!def) return null;
    const sup = el("sup", "footnote-ref");
    const a = el("a", null, String(def.n));
    a.href = `#${def.id}`;
    a.id = `${def.id}-ref`;
    a.dataset.test = "footnote-ref";
    sup.append(a);
    return { node: sup, end: close + 1 };
  }

  /**
   * `$tex$` (no blank just inside either `$`, the closing one not followed by a digit, so
   * "$5 and $10" stays prices) or `$$tex$$`. The TeX is taken as written: no escapes apply.
   */
  dollarMath(i, end) {
    const t = this.text;
    if (t[i + 1] === "$") {
      const close = this.findText("$$", i + 2, end);
      if (close === -1 || close === i + 2) return null;
      return { node: mathNode(t.slice(i + 2, close), true), end: close + 2 };
    }
    const after = t[i + 1];
    if (after === undefined || /\s/.test(after)) return null;
    const close = this.findDollar(i + 1, end);
    if (close === -1) return null;
    return { node: mathNode(t.slice(i + 1, close), false), end: close + 1 };
  }

  /** `\\(tex\\)` inline, `\\[tex\\]` displayed. */
  delimitedMath(i, end) {
    const t = this.text;
    const display = t[i + 1] === "[";
    const close = this.findText(display ? "\\]" : "\\)", i + 2, end);
    if (close === -1 || close === i + 2) return null;
    return { node: mathNode(t.slice(i + 2, close), display), end: close + 2 };
  }

  /** The next `needle` in [from, end), or -1; a failed search is remembered like findCloser's. */
  findText(needle, from, end) {
    const known = this.noCloser.get(needle);
    if (known && known.from <= from && end <= known.end) return -1;
    const j = this.text.indexOf(needle, from);
    work.steps += (j === -1 ? end : Math.min(j, end)) - from;
    if (j === -1 || j + needle.length > end) {
      this.noCloser.set(needle, { from, end });
      return -1;
    }
    return j;
  }

  /** The `$` closing inline maths opened before `from`, or -1. */
  findDollar(from, end) {
    const known = this.noCloser.get("$");
    if (known && known.from <= from && end <= known.end) return -1;
    const t = this.text;
    for (let j = from; j < end; j++) {
      work.steps++;
      if (t[j] === "\\") {
        j++;
        continue;
      }
      if (t[j] !== "$") continue;
      if (j > from && !/\s/.test(t[j - 1]) && !/[0-9]/.test(t[j + 1] ?? "")) return j;
    }
    this.noCloser.set("$", { from, end });
    return -1;
  }

  codeSpan(i, end) {
    const t = this.text;
    let n = 0;
    while (t[i + n] === "`") n++;
    const ticks = "`".repeat(n);
    // The closer is the next run of exactly as many backticks.
    const j = this.nextTickRun(n, i + n);
    if (j === -1 || j + n > end) return { node: document.createTextNode(ticks), end: i + n };
    let code = t.slice(i + n, j).replace(/\n/g, " ");
    if (code.length > 2 && code.startsWith(" ") && code.endsWith(" ")) code = code.slice(1, -1);
    return { node: el("code", null, code), end: j + n };
  }

  /** Start of the first run of exactly `n` backticks at or after `from`, or -1. */
  nextTickRun(n, from) {
    if (!this.tickRuns) {
      this.tickRuns = new Map();
      const t = this.text;
      for (let k = 0; k < t.length; k++) {
        work.steps++;
        if (t[k] !== "`") continue;
        const start = k;
        while (t[k + 1] === "`") k++;
        const length = k - start + 1;
        if (!this.tickRuns.has(length)) this.tickRuns.set(length, []);
        this.tickRuns.get(length).push(start);
      }
    }
    const starts = this.tickRuns.get(n) || [];
    let lo = 0;
    let hi = starts.length;
    while (lo < hi) {
      work.steps++;
      const mid = (lo + hi) >> 1;
      if (starts[mid] < from) lo = mid + 1;
      else hi = mid;
    }
    return lo < starts.length ? starts[lo] : -1;
  }

  link(i, end, labelStart) {
    const t = this.text;
    const partner = this.partners();
    const labelEnd = partner[labelStart - 1];
    if (labelEnd === -1 || labelEnd >= end) return null;
    const j = labelEnd + 1;
    if (t[j] !== "(") return null;
    const close = partner[j];
    if (close === -1 || close >= end) return null;
    const destination = linkDestination(t.slice(j + 1, close));
    const url = safeUrl(destination);
    const isImage = labelStart === i + 2;
    if (isImage && url && !this.inLink) return { node: imagePlaceholder(url, destination.trim(), t.slice(labelStart, labelEnd)), end: close + 1 };
    if (!url) {
      // Unsafe or relative target: keep the words, drop the link.
      const span = el("span");
      this.run(span, labelStart, labelEnd);
      return { node: span, end: close + 1 };
    }
    const a = anchor(url);
    if (isImage) {
      a.textContent = t.slice(labelStart, labelEnd) || url;
    } else {
      this.inLink = true;
      this.run(a, labelStart, labelEnd);
      this.inLink = false;
    }
    return { node: a, end: close + 1 };
  }

  autolink(i, end) {
    const m = /^<(https?:\/\/[^\s<>]+)>/.exec(this.text.slice(i, end));
    const url = m && safeUrl(m[1]);
    if (!url) return null;
    const a = anchor(url);
    a.textContent = m[1];
    return { node: a, end: i + m[0].length };
  }

  bareUrl(i, end) {
    const m = BARE_URL_RE.exec(this.text.slice(i, end));
    if (!m) return null;
    let stop = m[0].length;
    work.steps += stop;
    let opens = count(m[0], "(");
    let closes = count(m[0], ")");
    // Sentence punctuation and an unbalanced closing parenthesis end the URL, not belong to it.
    for (;;) {
      const last = m[0][stop - 1];
      if (".,:;!?'\"*_~".includes(last)) stop--;
      else if (last === ")" && opens < closes) {
        stop--;
        closes--;
      } else break;
    }
    const raw = m[0].slice(0, stop);
    const url = safeUrl(raw);
    if (!url) return null;
    const a = anchor(url);
    a.textContent = raw;
    return { node: a, end: i + raw.length };
  }

  emphasis(i, end) {
    // Emphasis nests by recursion: deeper than blocks may, it stays text.
    if (this.depth >= MAX_DEPTH) return null;
    const t = this.text;
    const ch = t[i];
    let n = 0;
    while (t[i + n] === ch) n++;
    const after = t[i + n];
    if (after === undefined || /\s/.test(after)) return null;
    if (ch === "_" && i > 0 && /[\p{L}\p{N}]/u.test(t[i - 1])) return null;
    if (ch === "~") {
      if (n !== 2) return null;
      const close = this.findCloser("~~", i + 2, end);
      return close === -1 ? null : this.wrap(["del"], i + 2, close, close + 2);
    }
    const size = Math.min(n, 3);
    const delim = ch.repeat(size);
    const close = this.findCloser(delim, i + size, end);
    if (close === -1) return null;
    const tags = size === 3 ? ["strong", "em"] : size === 2 ? ["strong"] : ["em"];
    return this.wrap(tags, i + size, close, close + size);
  }

  findCloser(delim, from, end) {
    const known = this.noCloser.get(delim);
    if (known && known.from <= from && end <= known.end) return -1;
    const t = this.text;
    const ch = delim[0];
    for (let j = from; j < end; j++) {
      work.steps++;
      if (t[j] === "`") {
        const span = this.codeSpan(j, end);
        j = span.end - 1;
        continue;
      }
      if (t[j] === "\\") {
        j++;
        continue;
      }
      if (t[j] !== ch) continue;
      let run = 0;
      while (t[j + run] === ch) run++;
      const before = t[j - 1];
      const follow = t[j + run];
      // A run closes when it is exactly this delimiter, or a `***` ending nested emphasis;
      // a `**` pair inside `*...*` is its own pair and is skipped.
      const fits = run === delim.length || (run >= 3 && run > delim.length);
      const closes = fits && j > from && !/\s/.test(before) &&
        (ch !== "_" || follow === undefined || !/[\p{L}\p{N}]/u.test(follow));
      if (closes) return j + run - delim.length;
      j += run - 1;
    }
    this.noCloser.set(delim, { from, end });
    return -1;
  }

  wrap(tags, innerStart, innerEnd, end) {
    const outer = el(tags[0]);
    let inner = outer;
    for (const tag of tags.slice(1)) {
      const child = el(tag);
      inner.append(child);
      inner = child;
    }
    this.depth++;
    this.run(inner, innerStart, innerEnd);
    this.depth--;
    return { node: outer, end };
  }
}

const BARE_URL_RE = new RegExp(`^https?://[^\\s<>]{1,${MAX_BARE_URL}}`);

/** A link's target without its optional "title" and <angle brackets>, cut by hand, not by pattern. */
function linkDestination(inner) {
  let dest = inner.trim();
  const quote = dest.at(-1);
  if (dest.length > 1 && (quote === '"' || quote === "'")) {
    const open = dest.lastIndexOf(quote, dest.length - 2);
    if (open > 0 && /\s/.test(dest[open - 1])) dest = dest.slice(0, open).trimEnd();
  }
  if (dest.startsWith("<") && dest.endsWith(">") && dest.length > 1) dest = dest.slice(1, -1);
  return dest;
}

function count(s, ch) {
  let n = 0;
  for (let k = s.indexOf(ch); k !== -1; k = s.indexOf(ch, k + 1)) n++;
  return n;
}

/**
 * A reply's image, not loaded: loading it from its own address would tell that host who read the
 * reply, and when. The placeholder names the host; the page's `hooks.image` decides what a click
 * does (richtext.js: fetch it through this server). `raw` is the address exactly as the reply
 * wrote it, which is what the server looks for in the reply.
 */
function imagePlaceholder(url, raw, alt) {
  const box = el("span", "remote-image");
  box.dataset.test = "remote-image";
  const host = new URL(url).host;
  const load = el("button", "remote-image-load");
  load.type = "button";
  load.textContent = `Image from ${host}${alt ? `: ${alt}` : ""}`;
  load.title = `Load this image through this server (${host} is not contacted until you click)`;
  const open = anchor(url);
  open.className = "remote-image-open";
  open.textContent = "open in new tab";
  box.append(load, " ", open);
  if (hooks.image) hooks.image(box, { url, raw, alt });
  return box;
}

function anchor(url) {
  const a = el("a");
  a.href = url;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  return a;
}
