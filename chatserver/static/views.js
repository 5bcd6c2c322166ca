// Transcript views: one element per message, built from saved messages or grown live from a turn
// stream, plus the number formats the header and stats lines share. No network access here, but for
// a notice's facts panel (facts.js), which saves its own review.

import { renderFacts } from "./facts.js";
import { ActivityTrail, accumulateActivity, renderCitations } from "./activity.js";
import { StreamingMarkdown, renderMarkdown } from "./markdown.js";
import "./richtext.js";
import "./remoteimage.js";
import { store } from "./store.js";
import { button, node } from "./ui.js";

const tokensFormat = new Intl.NumberFormat("en-US");

export function formatTokens(n) {
  return tokensFormat.format(Math.round(n || 0));
}

export function formatCost(cost) {
  if (cost === 0) return "$0";
  if (cost >= 1) return `$${cost.toFixed(2)}`;
  if (cost >= 0.0001) return `$${cost.toFixed(4)}`;
  return `$${new Intl.NumberFormat("en-US", { maximumSignificantDigits: 2 }).format(cost)}`;
}

export function cachedPercent(cached, input) {
  return input > 0 ? `${Math.round((100 * (cached || 0)) / input)}%` : "0%";
}

// The one label of a cost nobody reported, in the header and under each reply.
export const COST_UNKNOWN = "cost unknown";

/**
 * The header's cost item: a number alone only when every reply reported its cost; null while
 * nothing was spent (a new conversation), never "$0". `uncounted`: replies the totals never
 * counted (imported ones), whose cost is unknown too.
 */
export function describeCost(totals, uncounted = 0) {
  const replies = (totals.turns || 0) + uncounted;
  if (!replies && !totals.title_calls && !totals.compression_calls) return null;
  const unknown = (totals.cost_unreported || 0) + uncounted;
  const cost = totals.cost || 0;
  if (!unknown) return formatCost(cost);
  // Unreported calls may also include the summarizer's, which are no replies.
  if (unknown < replies) return `${COST_UNKNOWN} for ${unknown} of ${replies} replies; ${formatCost(cost)} for the rest`;
  return cost > 0 ? `${COST_UNKNOWN}; ${formatCost(cost)} reported` : COST_UNKNOWN;
}

/**
 * A token total with the summarizer's calls named, so it agrees with the replies' own figures:
 * "1,013 in (replies 489, title 524)".
 */
function itemised(t, key, label) {
  const total = t[`${key}_tokens`] || 0;
  const calls = [["title", t.title_calls, t[`title_${key}_tokens`]],
                 ["summary", t.compression_calls, t[`compression_${key}_tokens`]]].filter(([, count]) => count > 0);
  const figure = `${formatTokens(total)} ${label}`;
  if (!calls.length) return figure;
  if (calls.some(([, , tokens]) => typeof tokens !== "number")) {
    // Counted before the server kept those calls' tokens apart: say they are in, not how many.
    return `${figure} (incl. ${calls.map(([name, count]) => `${count} ${name} call${count === 1 ? "" : "s"}`).join(", ")})`;
  }
  const replies = total - calls.reduce((sum, [, , tokens]) => sum + tokens, 0);
  return `${figure} (replies ${formatTokens(replies)}, ${calls.map(([name, , tokens]) => `${name} ${formatTokens(tokens)}`).join(", ")})`;
}

/** The header's session totals as [key, text] items; `uncounted` as for `describeCost`. */
export function usageItems(t, uncounted = 0) {
  const cost = describeCost(t, uncounted);
  return [
    ["in", itemised(t, "input", "in")],
    ["out", itemised(t, "output", "out")],
    ["cached", `${cachedPercent(t.cached_tokens, t.input_tokens)} cached`],
    ["searches", `${t.searches} ${t.searches === 1 ? "search" : "searches"}`],
    ["fetches", `${t.fetches} ${t.fetches === 1 ? "fetch" : "fetches"}`],
    ...(cost === null ? [] : [["cost", cost]]),
    ["turns", `${t.turns} ${t.turns === 1 ? "turn" : "turns"}`],
  ];
}

// What the next request is made of, as the compression trigger counts it: the reserve is room
// kept for the reply, so it counts against the budget like the prompt does.
export const CONTEXT_PARTS = [
  ["persona", "Persona"],
  ["memory", "Memory"],
  ["summary", "Summary"],
  ["history", "History"],
  ["reserve", "Reserved for the reply"],
];

/** The context bar's parts: the track's segments, the label and the one-line account. */
export function contextBar(ctx) {
  const parts = CONTEXT_PARTS.filter(([key]) => key !== "reserve" || ctx.reserve != null);
  const used = parts.reduce((sum, [key]) => sum + (ctx[key] || 0), 0);
  const scale = Math.max(ctx.budget, used) || 1;
  const track = node("div", "context-track");
  for (const [key, label] of parts) {
    const seg = node("div", `context-seg seg-${key}`);
    seg.dataset.segment = key;
    seg.dataset.tokens = String(ctx[key] || 0);
    seg.style.width = `${(100 * (ctx[key] || 0)) / scale}%`;
    seg.title = `${label}: ${formatTokens(ctx[key])} tokens`;
    track.append(seg);
  }
  // Until a turn has measured the prompt, the numbers are local estimates.
  const approx = ctx.measured === false ? "≈ " : "";
  const label = node("span", "context-label", `${approx}${formatTokens(used)} / ${formatTokens(ctx.budget)} tokens`);
  const items = [track, label];
  if (ctx.reserve) {
    items.push(node("span", "context-reserve", `incl. ${formatTokens(ctx.reserve)} reserved for the reply`));
  }
  const account = parts.map(([key, name]) => `${name} ${formatTokens(ctx[key])}`).join(" · ") +
    ` of a ${formatTokens(ctx.budget)}-token budget`;
  return { items, over: used > ctx.budget, account };
}

/** Put `text` on the clipboard; falls back where the Clipboard API is refused (plain http on a LAN). */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const scratch = document.createElement("textarea");
    scratch.value = text;
    document.body.append(scratch);
    scratch.select();
    document.execCommand("copy");
    scratch.remove();
  }
}

/** A button that copies what `text()` gives and says so for a moment. */
export function copyButton(label, text, className = "small") {
  const b = button(label, { className });
  b.addEventListener("click", async () => {
    await copyText(text());
    b.textContent = "Copied";
    setTimeout(() => {
      b.textContent = label;
    }, 1500);
  });
  return b;
}

// Elements that start on a line of their own, and those of them followed by a blank line.
const LINES = new Set(["DIV", "LI", "TR", "DETAILS", "SECTION"]);
const PARAGRAPHS = new Set(["P", "PRE", "UL", "OL", "BLOCKQUOTE", "TABLE", "H1", "H2", "H3", "H4", "H5", "H6", "HR"]);

/**
 * What a drawn reply says, as plain text: paragraphs and list items on lines of their own, table
 * cells split by tabs, formulas as their TeX source, code as typed, and no button labels.
 */
export function plainTextOf(root) {
  let text = "";
  // A block opening right after a list item's marker stays on the marker's line.
  let afterMarker = false;
  const push = (more) => {
    text += more;
    afterMarker = false;
  };
  const newLine = () => {
    if (text && !text.endsWith("\n") && !afterMarker) push("\n");
  };
  const walk = (el) => {
    for (const child of el.childNodes) {
      if (child.nodeType === Node.TEXT_NODE) {
        if (child.textContent) push(child.textContent);
        continue;
      }
      if (child.nodeType !== Node.ELEMENT_NODE || child.matches("button, .code-head")) continue;
      if (child.dataset.tex !== undefined) {
        push(child.dataset.tex);
        continue;
      }
      if (child.tagName === "BR") push("\n");
      else if (child.tagName === "INPUT" && child.type === "checkbox") {
        push(child.checked ? "[x] " : "[ ] ");
        afterMarker = true;
      }
      const block = LINES.has(child.tagName) || PARAGRAPHS.has(child.tagName);
      if (block) newLine();
      if (child.tagName === "LI") {
        const list = child.parentElement;
        push(list?.tagName === "OL" ? `${[...list.children].indexOf(child) + (list.start || 1)}. ` : "- ");
        afterMarker = true;
      }
      walk(child);
      if (child.tagName === "TD" || child.tagName === "TH") push("\t");
      if (block) newLine();
      // A paragraph ends with a blank line, except the last thing in a list item.
      if (PARAGRAPHS.has(child.tagName) && !(child.parentElement?.tagName === "LI" && !child.nextSibling)) push("\n");
    }
  };
  walk(root);
  return text.replace(/[ \t]+\n/g, "\n").replace(/\n{3,}/g, "\n\n").trim();
}

function shell(role, id, test = "message") {
  const el = node("article", `message message-${role}`);
  el.dataset.test = test;
  el.dataset.role = role;
  if (id) el.dataset.id = id;
  return el;
}

// A message typed longer than this starts collapsed, with "Show more".
const LONG_MESSAGE_CHARS = 1200;
const LONG_MESSAGE_LINES = 14;

export function renderUser(message, test = "message") {
  const el = shell("user", message.id, test);
  const bubble = node("div", "bubble", message.content);
  el.append(bubble);
  const text = message.content || "";
  if (text.length > LONG_MESSAGE_CHARS || text.split("\n", LONG_MESSAGE_LINES + 1).length > LONG_MESSAGE_LINES) {
    bubble.classList.add("collapsed");
    const toggle = button("Show more", { className: "small link-button" });
    toggle.dataset.test = "show-more";
    toggle.setAttribute("aria-expanded", "false");
    toggle.addEventListener("click", () => {
      const open = bubble.classList.toggle("collapsed") === false;
      toggle.textContent = open ? "Show less" : "Show more";
      toggle.setAttribute("aria-expanded", String(open));
    });
    el.append(toggle);
  }
  return el;
}

export function renderNotice(message, test = "message") {
  const el = shell("notice", message.id, test);
  el.setAttribute("role", "note");
  el.append(node("div", "notice-text", message.content));
  const facts = renderFacts(message);
  if (facts) el.append(facts);
  return el;
}

/** One saved message as its transcript element. */
export function renderMessage(m, { reasoning = () => false, test = "message", userExtra = () => null } = {}) {
  if (m.role === "user") {
    const el = renderUser(m, test);
    // What the page adds under a sent message (its attachment chips), when there is any.
    const extra = userExtra(m);
    if (extra) el.append(extra);
    return el;
  }
  if (m.role === "notice") return renderNotice(m, test);
  const view = AssistantView.fromMessage(m, { reasoning: reasoning(m.model) });
  view.el.dataset.test = test;
  return view.el;
}

/**
 * Messages folded into the summary (or dropped) by compression: still the person's history, so
 * shown collapsed at the top, each marked as folded. Their own notices come with them, in order.
 */
export function renderArchive(archive, options = {}) {
  if (!archive?.length) return null;
  const box = node("details", "folded");
  box.dataset.test = "folded";
  const n = archive.filter((m) => m.role !== "notice").length;
  // A failed summarizer drops messages without folding them into anything: say so then.
  const how = options.dropped ? "left the context (folded or dropped)" : "folded into the summary";
  box.append(node("summary", "folded-line", `${n} earlier ${n === 1 ? "message" : "messages"} ${how}`));
  const list = node("div", "folded-messages");
  list.append(...archive.map((m) => {
    const el = renderMessage(m, { ...options, test: "folded-message" });
    el.dataset.folded = "true";
    return el;
  }));
  box.append(list);
  return box;
}

/** What a `compression` event means, in the words of a transcript notice. */
export function describeCompression(c) {
  if (c.failed) {
    return `The summarizer failed: the ${c.dropped} oldest messages were dropped without a summary.`;
  }
  if (!c.folded) return "Nothing was old enough to compress.";
  let text = `Compressed ${c.folded} earlier messages into a summary of about ${formatTokens(c.summary_tokens)} tokens.`;
  if (c.facts_added) text += ` ${c.facts_added} new ${c.facts_added === 1 ? "fact" : "facts"} saved to memory.`;
  return text;
}

/** The per-reply stats line: tokens in/out, cached share, cost or COST_UNKNOWN, searches. */
function statsLine(usage, model) {
  const parts = [];
  if (model) parts.push(model);
  parts.push(`${formatTokens(usage.input_tokens)} in`, `${formatTokens(usage.output_tokens)} out`);
  parts.push(`${cachedPercent(usage.cached_tokens, usage.input_tokens)} cached`);
  if (usage.searches) parts.push(`${usage.searches} ${usage.searches === 1 ? "search" : "searches"}`);
  if (usage.fetches) parts.push(`${usage.fetches} ${usage.fetches === 1 ? "fetch" : "fetches"}`);
  const cost = typeof usage.cost === "number" ? formatCost(usage.cost) : COST_UNKNOWN;
  // Where a cost the gateway did not report came from (issue 28): our price table, or its bill afterwards.
  const source = usage.cost_source;
  parts.push(typeof usage.cost === "number" && (source === "priced" || source === "reconciled") ? `${cost} (${source})` : cost);
  if (usage.estimated) parts.push("estimated");
  return parts.join(" · ");
}

const NO_ANSWER = "Stopped before the answer began";

const PARAM_WORDS = {
  temperature: (v) => `temperature ${v}`,
  top_p: (v) => `top_p ${v}`,
  max_tokens: (v) => `max ${formatTokens(v)} tokens`,
  reasoning_effort: (v) => `${v} reasoning`,
};

/**
 * What the footer says beyond usage: the generation parameters that were not the defaults, that
 * the person wrote this reply (an edit), and that Continue carried it on.
 */
function replyNotes(message) {
  const parts = [];
  if (message.edited) parts.push(["edited", "Edited by you"]);
  if (message.continued) parts.push(["continued", message.continued === 1 ? "Continued once" : `Continued ${message.continued} times`]);
  const params = Object.entries(message.params || {}).filter(([key]) => key in PARAM_WORDS);
  if (params.length) parts.push(["params", params.map(([key, value]) => PARAM_WORDS[key](value)).join(" · ")]);
  if (!parts.length) return null;
  const line = node("div", "reply-notes");
  for (const [test, text] of parts) {
    const item = node("span", `reply-note ${test}`, text);
    item.dataset.test = `reply-${test}`;
    line.append(item);
  }
  return line;
}

/** An assistant message: trail, body, warnings, citations, stats, actions. Live or saved. */
export class AssistantView {
  constructor({ id, model, reasoning = false } = {}) {
    this.el = shell("assistant", id);
    this.model = model;
    this.reasoning = reasoning;
    this.text = "";
    this.steps = [];
    this.trail = new ActivityTrail();
    this.body = node("div", "bubble markdown");
    this.images = node("div", "reply-images");
    this.warnings = node("div", "warnings");
    this.footer = node("div", "message-footer");
    this.actions = node("div", "message-actions");
    this.el.append(this.trail.el, this.body, this.images, this.warnings, this.footer, this.actions);
  }

  static fromMessage(message, { reasoning = false } = {}) {
    const view = new AssistantView({ id: message.id, model: message.model, reasoning });
    view.text = message.content || "";
    view.steps = message.activity || [];
    view.body.replaceChildren(renderMarkdown(view.text));
    for (const id of message.attachment_ids || []) view.addImage(id);
    for (const w of message.warnings || []) view.addWarning(w.message, w.code);
    view.setFinal(message.status || "complete", message.usage, message.citations);
    const notes = replyNotes(message);
    if (notes) view.footer.append(notes);
    return view;
  }

  startStreaming() {
    this.el.dataset.status = "streaming";
    this.el.setAttribute("aria-busy", "true");
    this.markdown = new StreamingMarkdown(this.body);
    this.trail.el.open = true;
    this.drawTrail();
  }

  get isEmpty() {
    return !this.text && !this.steps.length && !this.images.childElementCount;
  }

  /**
   * An image the model returned (stored as a file of the conversation): its thumbnail, opening the
   * file full size. Both come from this server's own routes.
   */
  addImage(attachmentId) {
    const convId = store.conv?.id;
    if (!convId) return;
    const base = `/api/conversations/${encodeURIComponent(convId)}/attachments/${encodeURIComponent(attachmentId)}`;
    const link = node("a", "reply-image-link");
    link.href = base;
    link.target = "_blank";
    link.rel = "noopener";
    const img = node("img", "reply-image");
    img.src = `${base}/thumbnail`;
    img.alt = "image from the model";
    img.dataset.test = "reply-image";
    img.dataset.id = attachmentId;
    link.append(img);
    this.images.append(link);
  }

  /** More of the reply's words; shown by the next `drawText` (turn.js calls it once a frame). */
  addText(text) {
    this.text += text;
    this.textDrawn = false;
  }

  drawText() {
    if (this.textDrawn !== false) return;
    this.textDrawn = true;
    this.markdown.update(this.text);
    if (this.reasoning && !this.steps.length) this.drawTrail();
  }

  addActivity(event, data) {
    this.drawTrail(accumulateActivity(this.steps, event, data));
  }

  addWarning(message, code) {
    const w = node("div", "warning", message);
    w.dataset.test = "warning";
    if (code) w.dataset.code = code;
    this.warnings.append(w);
  }

  /** Redraw the trail; `changed` is the one step that changed, when only one did. */
  drawTrail(changed = null) {
    const live = this.el.dataset.status === "streaming";
    // A reasoning model shows "Thinking…" from the start, until the first words of the answer.
    this.trail.render(this.steps, { live, waitingForThought: this.reasoning && !this.text, changed });
  }

  /** The reply is over; `status` is complete or interrupted. */
  setFinal(status, usage, citations) {
    this.el.dataset.status = status;
    this.el.removeAttribute("aria-busy");
    this.textDrawn = true;
    if (this.markdown) this.markdown.finish(this.text);
    this.trail.el.open = false;
    this.drawTrail();
    // Stopped while the model was still thinking: there is no answer to frame, only what it cost.
    const noAnswer = status === "interrupted" && !this.text;
    this.el.classList.toggle("no-answer", noAnswer);
    this.body.hidden = noAnswer;
    const footer = [];
    if (noAnswer) footer.push(node("div", "interrupted-note", NO_ANSWER));
    else if (status === "interrupted") footer.push(node("div", "interrupted-note", "Interrupted before the end"));
    const chips = renderCitations(citations);
    if (chips) footer.push(chips);
    if (usage) footer.push(node("div", "stats", statsLine(usage, this.model)));
    this.footer.replaceChildren(...footer);
    const actions = [];
    if (this.text) {
      const copy = copyButton("Copy reply", () => this.text);
      copy.dataset.test = "copy-reply";
      copy.title = "Copy the whole reply as Markdown";
      const plain = copyButton("Copy text", () => plainTextOf(this.body));
      plain.dataset.test = "copy-text";
      plain.title = "Copy the reply as plain text, without Markdown";
      actions.push(copy, plain);
    }
    this.actions.replaceChildren(...actions);
  }
}
