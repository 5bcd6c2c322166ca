// Syntax highlighting and maths for the Markdown renderer, from the vendored highlight.js and
// KaTeX (static/vendor/README.md). Both run on untrusted model output:
// - highlight.js escapes the code it is given; its output (spans with `hljs-*` classes) is the only
//   HTML the page ever inserts, and only inside the block's <code>, which markdown.js built.
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
  codeEl.innerHTML = html;
  codeEl.classList.add("hljs");
};

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
