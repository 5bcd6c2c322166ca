// Syntax highlighting and maths for the Markdown renderer, from the vendored highlight.js and
// KaTeX (static/vendor/README.md). Both run on untrusted model output:
// - highlight.js escapes the code it is given, and its output (spans with `hljs-*` classes and
//   escaped text) is never handed to the HTML parser: `tokenNodes` rebuilds it with createElement
//   and text nodes, and anything else in it leaves the block plain.
// - KaTeX runs with `trust: false` (no \href, \url, \includegraphics, \htmlClass...), expansion
//   and size limits, and builds its nodes with createElement, styled through the CSSOM, which the
//   page's Content-Security-Policy allows (an HTML string with style attributes it would refuse).
//   A formula that does not parse shows its TeX source as code.

import hljs from "./vendor/highlight/highlight.min.js";
import katex from "./vendor/katex/katex.mjs";
import { hooks } from "./markdown.js";

// Highlighting work is bounded: past this, a block stays plain text.
const MAX_HIGHLIGHT_CHARS = 100_000;
// The same finished block is drawn again while the text after it streams: highlight it once.
const highlighted = new Map();
const CACHE_SIZE = 64;

const KATEX_OPTIONS = {
  throwOnError: true,
  trust: false,
  strict: "ignore",
  maxExpand: 500,
  maxSize: 20,
  output: "htmlAndMathml",
};

hooks.highlight = (codeEl, code, lang) => {
  if (!code || code.length > MAX_HIGHLIGHT_CHARS) return;
  const language = lang && hljs.getLanguage(lang) ? lang : null;
  // An unnamed or unknown language is left plain: guessing costs every grammar's work.
  if (!language) return;
  const key = `${language}\n${code}`;
  let html = highlighted.get(key);
  if (html === undefined) {
    try {
      html = hljs.highlight(code, { language, ignoreIllegals: true }).value;
    } catch {
      return;
    }
    if (highlighted.size >= CACHE_SIZE) highlighted.delete(highlighted.keys().next().value);
    highlighted.set(key, html);
  }
  const nodes = tokenNodes(html);
  if (!nodes) return;
  codeEl.replaceChildren(...nodes);
  codeEl.classList.add("hljs");
};

const ENTITIES = { "&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&#x27;": "'", "&#39;": "'" };
const TOKEN = /<span class="([a-z0-9_ -]+)">|<\/span>|([^<]+)/gy;

/** highlight.js's output as DOM nodes, or null when it holds anything but its spans and text. */
function tokenNodes(html) {
  if (!html) return null;
  const root = document.createDocumentFragment();
  const open = [root];
  TOKEN.lastIndex = 0;
  let match;
  while (TOKEN.lastIndex < html.length && (match = TOKEN.exec(html))) {
    if (match[1] !== undefined) {
      const span = document.createElement("span");
      span.className = match[1];
      open[open.length - 1].append(span);
      open.push(span);
    } else if (match[2] !== undefined) {
      open[open.length - 1].append(match[2].replace(/&(?:amp|lt|gt|quot|#x27|#39);/g, (e) => ENTITIES[e]));
    } else if (open.length > 1) {
      open.pop();
    } else {
      return null;
    }
  }
  return TOKEN.lastIndex === html.length && open.length === 1 ? [...root.childNodes] : null;
}

hooks.math = (el, tex, display) => {
  try {
    const box = document.createElement(display ? "div" : "span");
    katex.render(tex, box, { ...KATEX_OPTIONS, displayMode: display });
    el.replaceChildren(...box.childNodes);
    el.classList.add("math-rendered");
  } catch {
    // Not TeX KaTeX can draw (or past the limits): the source, as code.
    const code = document.createElement("code");
    code.className = "math-error";
    code.textContent = display ? `$$${tex}$$` : `$${tex}$`;
    el.replaceChildren(code);
  }
};
