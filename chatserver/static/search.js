// The search box (Ctrl/Cmd+K): `GET /api/search` as the person types, results with their snippets,
// arrow keys and Enter to open one. A snippet is HTML whose only markup is <mark>; it is rebuilt
// here from text nodes (split on the mark tags, entities decoded), never parsed as HTML.

import { api } from "./api.js";
import { UNTITLED, node } from "./ui.js";

const $ = (id) => document.getElementById(id);

const ENTITIES = { amp: "&", lt: "<", gt: ">", quot: '"', "#39": "'", "#x27": "'" };

function decode(text) {
  return text.replace(/&(amp|lt|gt|quot|#39|#x27);/g, (_, name) => ENTITIES[name]);
}

/** The snippet as text nodes, each marked run in a <mark>; nothing in it can become markup. */
export function snippetNodes(snippet) {
  const out = [];
  let marked = false;
  for (const part of String(snippet || "").split(/(<mark>|<\/mark>)/)) {
    if (part === "<mark>") marked = true;
    else if (part === "</mark>") marked = false;
    else if (part) out.push(marked ? node("mark", null, decode(part)) : document.createTextNode(decode(part)));
  }
  return out;
}

export class SearchBox {
  /** `open(conversationId, messageId)` opens a hit; `messageId` is null for a title match. */
  constructor({ open }) {
    this.openHit = open;
    this.dialog = $("search");
    this.input = $("search-input");
    this.results = $("search-results");
    this.status = $("search-status");
    this.hits = [];
    this.selected = -1;
    this.timer = null;
    this.controller = null;
    this.input.addEventListener("input", () => this.schedule());
    this.input.addEventListener("keydown", (e) => this.key(e));
    this.dialog.addEventListener("click", (e) => {
      if (e.target === this.dialog) this.dialog.close();
    });
  }

  show() {
    if (!this.dialog.open) this.dialog.showModal();
    this.input.focus();
    this.input.select();
  }

  schedule() {
    clearTimeout(this.timer);
    // Debounced: one request once typing pauses, not one per key.
    this.timer = setTimeout(() => this.run(), 180);
  }

  async run() {
    const q = this.input.value.trim();
    this.controller?.abort();
    if (!q) {
      this.render([], "");
      return;
    }
    const controller = new AbortController();
    this.controller = controller;
    try {
      const hits = await api.search(q, controller.signal);
      if (controller.signal.aborted) return;
      this.render(hits, hits.length ? "" : "Nothing found.");
    } catch (err) {
      if (err.name !== "AbortError") this.render([], err.message);
    }
  }

  render(hits, status) {
    this.hits = hits;
    this.selected = hits.length ? 0 : -1;
    this.status.textContent = status;
    this.results.replaceChildren(...hits.map((hit, i) => {
      const li = node("li", "search-hit");
      li.dataset.test = "search-result";
      li.dataset.conversation = hit.conversation_id;
      if (hit.message_id) li.dataset.message = hit.message_id;
      li.id = `search-hit-${i}`;
      li.setAttribute("role", "option");
      const title = node("div", "search-title", hit.title || UNTITLED);
      const snippet = node("div", "search-snippet");
      snippet.append(...snippetNodes(hit.snippet));
      li.append(title, snippet);
      li.addEventListener("click", () => this.choose(i));
      li.addEventListener("mousemove", () => this.select(i));
      return li;
    }));
    this.select(this.selected);
  }

  select(i) {
    this.selected = i;
    for (const [n, li] of [...this.results.children].entries()) li.setAttribute("aria-selected", String(n === i));
    if (i >= 0) {
      this.input.setAttribute("aria-activedescendant", `search-hit-${i}`);
      this.results.children[i]?.scrollIntoView({ block: "nearest" });
    } else {
      this.input.removeAttribute("aria-activedescendant");
    }
  }

  key(e) {
    if (e.key === "Escape") {
      // A search field would spend Esc on clearing itself; here Esc closes the box, as it says.
      e.preventDefault();
      this.dialog.close();
    } else if (e.key === "ArrowDown" || e.key === "ArrowUp") {
      e.preventDefault();
      if (!this.hits.length) return;
      const step = e.key === "ArrowDown" ? 1 : -1;
      this.select((this.selected + step + this.hits.length) % this.hits.length);
    } else if (e.key === "Enter" && !e.isComposing && e.keyCode !== 229) {
      e.preventDefault();
      // Enter before the pause ends searches at once rather than opening a stale hit.
      if (this.timer && this.input.value.trim() && !this.hits.length) this.run();
      else if (this.selected >= 0) this.choose(this.selected);
    }
  }

  choose(i) {
    const hit = this.hits[i];
    if (!hit) return;
    this.dialog.close();
    this.openHit(hit.conversation_id, hit.message_id);
  }
}
