// Transcript views: one element per message, built from saved messages or grown live from a turn
// stream, plus the number formats the header and stats lines share. No network access here.

import { ActivityTrail, accumulateActivity, renderCitations } from "./activity.js";
import { StreamingMarkdown, renderMarkdown } from "./markdown.js";

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

function node(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function shell(role, id) {
  const el = node("article", `message message-${role}`);
  el.dataset.test = "message";
  el.dataset.role = role;
  if (id) el.dataset.id = id;
  return el;
}

export function renderUser(message) {
  const el = shell("user", message.id);
  el.append(node("div", "bubble", message.content));
  return el;
}

export function renderNotice(message) {
  const el = shell("notice", message.id);
  el.setAttribute("role", "note");
  el.append(node("div", "notice-text", message.content));
  return el;
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

/** The per-reply stats line: tokens in/out, cached share, cost or "cost n/a", searches. */
function statsLine(usage, model) {
  const parts = [];
  if (model) parts.push(model);
  parts.push(`${formatTokens(usage.input_tokens)} in`, `${formatTokens(usage.output_tokens)} out`);
  parts.push(`${cachedPercent(usage.cached_tokens, usage.input_tokens)} cached`);
  if (usage.searches) parts.push(`${usage.searches} ${usage.searches === 1 ? "search" : "searches"}`);
  if (usage.fetches) parts.push(`${usage.fetches} ${usage.fetches === 1 ? "fetch" : "fetches"}`);
  parts.push(typeof usage.cost === "number" ? formatCost(usage.cost) : "cost n/a");
  if (usage.estimated) parts.push("estimated");
  return parts.join(" · ");
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
    this.warnings = node("div", "warnings");
    this.footer = node("div", "message-footer");
    this.actions = node("div", "message-actions");
    this.el.append(this.trail.el, this.body, this.warnings, this.footer, this.actions);
  }

  static fromMessage(message, { reasoning = false } = {}) {
    const view = new AssistantView({ id: message.id, model: message.model, reasoning });
    view.text = message.content || "";
    view.steps = message.activity || [];
    view.body.replaceChildren(renderMarkdown(view.text));
    view.setFinal(message.status || "complete", message.usage, message.citations);
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
    return !this.text && !this.steps.length;
  }

  addText(text) {
    this.text += text;
    this.markdown.update(this.text);
    if (this.reasoning && !this.steps.length) this.drawTrail();
  }

  addActivity(event, data) {
    accumulateActivity(this.steps, event, data);
    this.drawTrail();
  }

  addWarning(message) {
    this.warnings.append(node("div", "warning", message));
  }

  drawTrail() {
    const live = this.el.dataset.status === "streaming";
    // A reasoning model shows "Thinking…" from the start, until the first words of the answer.
    this.trail.render(this.steps, { live, waitingForThought: this.reasoning && !this.text });
  }

  /** The reply is over; `status` is complete or interrupted. */
  setFinal(status, usage, citations) {
    this.el.dataset.status = status;
    this.el.removeAttribute("aria-busy");
    if (this.markdown) this.markdown.finish(this.text);
    this.trail.el.open = false;
    this.drawTrail();
    const footer = [];
    if (status === "interrupted") footer.push(node("div", "interrupted-note", "Interrupted before the end"));
    const chips = renderCitations(citations);
    if (chips) footer.push(chips);
    if (usage) footer.push(node("div", "stats", statsLine(usage, this.model)));
    this.footer.replaceChildren(...footer);
  }
}
