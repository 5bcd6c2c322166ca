// The activity trail: what the model did before and while answering (thought, searched, read).
//
// Steps have the shape the server saves with each message:
//   {kind: "thinking", text, started_at, ended_at}
//   {kind: "search", query, results: [{url, title}] | null, at, error?}
//   {kind: "fetch", url, title, ok, at, error?}
//   {kind: "tool", call_id, name, arguments, status: "running"|"done"|"error", summary?, error?,
//    duration_ms?, usage?, at}   (a tool that ran on this server; one step per call, updated when it
//    ends; `usage` when the tool asked a model itself)
// Everything shown (domains, counts, durations) is derived here from those raw facts, the same
// way for a live trail and a saved one; anything else a saved step carries (an old `domains`
// list) is ignored. Times are in seconds.

import { safeUrl } from "./markdown.js";
import { node } from "./ui.js";
// views.js imports this module too; these are only called when a step is drawn, after both loaded.
import { COST_UNKNOWN, formatCost, formatTokens } from "./views.js";

/**
 * Fold one turn-stream event (reasoning, search, fetch) into `steps`, in place. Returns the index
 * of the step it changed or added, so a trail redraws that step alone.
 */
export function accumulateActivity(steps, event, data, now = Date.now() / 1000) {
  if (event === "reasoning") {
    const last = steps.at(-1);
    if (last && last.kind === "thinking") {
      last.text += data.text;
      last.ended_at = now;
    } else {
      steps.push({ kind: "thinking", text: data.text, started_at: now, ended_at: now });
    }
    return steps.length - 1;
  }
  if (event === "search") {
    // The first event announces the query (results null); the second brings results or an error.
    const done = data.results || data.error;
    const index = done ? steps.findLastIndex((s) => s.kind === "search" && s.results === null && !s.error) : -1;
    const step = index === -1 ? { kind: "search", query: data.query, at: now } : steps[index];
    if (index === -1) steps.push(step);
    step.results = data.results ?? null;
    if (data.error) step.error = data.error;
    return index === -1 ? steps.length - 1 : index;
  }
  if (event === "fetch") {
    const step = { kind: "fetch", url: data.url, title: data.title ?? null, ok: !!data.ok, at: now };
    if (data.error) step.error = data.error;
    steps.push(step);
    return steps.length - 1;
  }
  if (event === "tool") {
    // `running` adds the call's step; `done` or `error` ends that same step.
    const index = steps.findIndex((s) => s.kind === "tool" && s.call_id === data.call_id && s.status === "running");
    if (index !== -1 && data.status !== "running") {
      Object.assign(steps[index], data);
      return index;
    }
    steps.push({ kind: "tool", ...data, at: now });
    return steps.length - 1;
  }
  return -1;
}

/** The site a URL belongs to, as a person names it: host without `www.`. */
export function domainOf(url) {
  try {
    return new URL(url).hostname.replace(/^www\./, "");
  } catch {
    return url;
  }
}

function plural(n, one, many) {
  return n === 1 ? one : many;
}

function thinkingSeconds(steps) {
  return steps
    .filter((s) => s.kind === "thinking")
    .reduce((sum, s) => sum + Math.max(0, (s.ended_at ?? 0) - (s.started_at ?? 0)), 0);
}

/** The one faint line a finished trail collapses to, e.g. "Thought for 5s · Searched the web · Read 2 pages". */
function summarizeActivity(steps) {
  const parts = [];
  if (steps.some((s) => s.kind === "thinking")) {
    const secs = Math.round(thinkingSeconds(steps));
    parts.push(secs >= 1 ? `Thought for ${secs}s` : "Thought briefly");
  }
  const searches = steps.filter((s) => s.kind === "search").length;
  if (searches === 1) parts.push("Searched the web");
  else if (searches > 1) parts.push(`Searched the web ${searches} times`);
  const read = steps.filter((s) => s.kind === "fetch" && s.ok).length;
  const unread = steps.filter((s) => s.kind === "fetch" && !s.ok).length;
  if (read) parts.push(`Read ${read} ${plural(read, "page", "pages")}`);
  if (unread) parts.push(`${unread} ${plural(unread, "page", "pages")} unreadable`);
  const calls = steps.filter((s) => s.kind === "tool");
  if (calls.length) parts.push(`Used ${calls.length} ${plural(calls.length, "tool", "tools")}`);
  const failed = calls.filter((s) => s.status === "error").length;
  if (failed) parts.push(`${failed} failed`);
  return parts.join(" · ");
}

/** What is happening right now, for the trail's line while the reply streams. */
function liveLine(steps) {
  const last = steps.at(-1);
  // With no step yet the trail shows only for a reasoning model, which is thinking.
  if (!last || last.kind === "thinking") return "Thinking…";
  if (last.kind === "search") {
    return last.results === null && !last.error ? `Searching the web for “${last.query}”…` : summarizeActivity(steps);
  }
  const running = steps.filter((s) => s.kind === "tool" && s.status === "running");
  if (running.length) return `Running ${running.map((s) => s.name).join(", ")}…`;
  return summarizeActivity(steps);
}

function link(url, text) {
  const href = safeUrl(url);
  if (!href) return node("span", null, text);
  const a = node("a", null, text);
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  return a;
}

function thinkingTitle(step) {
  const secs = Math.round(Math.max(0, step.ended_at - step.started_at));
  return secs >= 1 ? `Thought for ${secs}s` : "Thought";
}

/** A call's arguments in one short line: `query: "tea", page: 7` (text, never markup). */
function argumentLine(args) {
  const text = Object.entries(args || {})
    .map(([k, v]) => `${k}: ${JSON.stringify(v)}`)
    .join(", ");
  return text.length > 160 ? `${text.slice(0, 159)}…` : text;
}

function toolTitle(step) {
  if (step.status === "running") return `Running ${step.name}…`;
  const secs = (step.duration_ms ?? 0) / 1000;
  const took = step.duration_ms == null ? "" : ` (${secs < 10 ? secs.toFixed(1) : Math.round(secs)}s)`;
  return step.status === "error" ? `${step.name} failed${took}` : `Ran ${step.name}${took}`;
}

function renderStep(step) {
  const li = node("li", `step step-${step.kind}`);
  if (step.kind === "thinking") {
    li.append(node("div", "step-title", thinkingTitle(step)));
    // Reasoning is model output like the reply: shown as plain text, never parsed as markup.
    li.append(node("div", "thinking-text", step.text));
  } else if (step.kind === "search") {
    li.append(node("div", "step-title", `Searched “${step.query}”`));
    if (step.error) {
      li.append(node("div", "step-note", `Search failed (${step.error})`));
    } else if (step.results === null) {
      li.append(node("div", "step-note", "Waiting for results…"));
    } else if (!step.results.length) {
      li.append(node("div", "step-note", "No results"));
    } else {
      const list = node("ul", "result-domains");
      for (const r of step.results) {
        const item = node("li");
        const a = link(r.url, domainOf(r.url));
        if (r.title) a.title = r.title;
        item.append(a);
        list.append(item);
      }
      li.append(list);
    }
  } else if (step.kind === "tool") {
    li.classList.add(`tool-${step.status}`);
    li.dataset.test = "tool-step";
    li.dataset.status = step.status;
    li.append(node("div", "step-title", toolTitle(step)));
    const args = argumentLine(step.arguments);
    if (args) li.append(node("div", "step-args", args));
    const note = step.status === "error" ? step.error || step.summary : step.summary;
    if (note) li.append(node("div", "step-note", note));
    // A tool that asked a model (analyze_image asks VISION_MODEL): which, and what it cost.
    if (step.usage) {
      const u = step.usage;
      const cost = u.cost == null ? COST_UNKNOWN : formatCost(u.cost);
      const usage = node("div", "step-usage", `${u.model || "model"} · ${formatTokens(u.input_tokens)} in · ${formatTokens(u.output_tokens)} out · ${cost}`);
      usage.dataset.test = "tool-usage";
      li.append(usage);
    }
  } else if (step.kind === "fetch") {
    const title = step.title || domainOf(step.url);
    const line = node("div", "step-title", step.ok ? "Read " : "Could not read ");
    line.append(link(step.url, title));
    li.append(line);
  }
  return li;
}

/**
 * The trail above one reply: a <details> whose summary is the one-line account and whose body is
 * the timeline. Open while the reply streams, collapsed once it is over.
 */
export class ActivityTrail {
  constructor() {
    this.el = node("details", "activity");
    this.el.dataset.test = "activity";
    this.summary = node("summary", "activity-line");
    this.timeline = node("ol", "timeline");
    this.el.append(this.summary, this.timeline);
    // The drawn steps: [{li, text}] where `text` is how much of a thought is already shown.
    this.drawn = [];
  }

  /**
   * Draw `steps`; `live` while streaming; `waitingForThought` shows "Thinking…" before any step.
   * `changed` is the one step that changed since the last draw (from accumulateActivity): only it
   * is redrawn, and a growing thought only gets its new words, so a long thought costs its length
   * once rather than once per chunk.
   */
  render(steps, { live = false, waitingForThought = false, changed = null } = {}) {
    this.el.hidden = !steps.length && !(live && waitingForThought);
    this.el.classList.toggle("live", live);
    this.summary.textContent = live ? liveLine(steps) : summarizeActivity(steps);
    if (changed === null || this.drawn.length < changed || this.drawn.length > steps.length) {
      this.drawn = steps.map((step) => ({ li: renderStep(step), text: step.text?.length ?? 0 }));
      this.timeline.replaceChildren(...this.drawn.map((d) => d.li));
    } else if (changed >= 0) {
      this.redraw(steps, changed);
    }
    const thought = this.timeline.querySelector(".step-thinking:last-child .thinking-text");
    if (live && thought) thought.scrollTop = thought.scrollHeight;
  }

  redraw(steps, index) {
    const step = steps[index];
    const drawn = this.drawn[index];
    if (drawn && step.kind === "thinking" && drawn.li.classList.contains("step-thinking")) {
      drawn.li.querySelector(".step-title").textContent = thinkingTitle(step);
      drawn.li.querySelector(".thinking-text").append(step.text.slice(drawn.text));
      drawn.text = step.text.length;
      return;
    }
    const fresh = { li: renderStep(step), text: step.text?.length ?? 0 };
    if (drawn) drawn.li.replaceWith(fresh.li);
    else this.timeline.append(fresh.li);
    this.drawn[index] = fresh;
  }
}

/** The citation each file chip stands for, for the viewer its click opens (viewer.js). */
const chipCitations = new WeakMap();

/** The citation a file chip was drawn from; null for anything else. */
export function citationOf(chip) {
  return chipCitations.get(chip) ?? null;
}

/** An attachment page cited: `{attachment_id, name, page}` (and `label`, `source`, `query` when saved with them). */
function isAttachmentCitation(c) {
  return typeof c.attachment_id === "string" && typeof c.name === "string" && Number.isInteger(c.page);
}

/**
 * Numbered chips for the sources: web pages as domain links (non-http(s) URLs are left out),
 * attachment passages as "name label" (text: a file name is untrusted and never markup).
 */
export function renderCitations(citations) {
  const safe = (citations || []).filter((c) => safeUrl(c.url) || isAttachmentCitation(c));
  if (!safe.length) return null;
  const wrap = node("div", "citations");
  wrap.setAttribute("aria-label", "Sources");
  safe.forEach((c, i) => {
    let chip;
    if (isAttachmentCitation(c)) {
      // The passage's own label ("p. 3", "lines 40-80", "§ Budget"); replies saved before labels were pages.
      const where = typeof c.label === "string" && c.label ? c.label : `p. ${c.page}`;
      // A button: it opens the passage in the viewer.
      chip = node("button", "citation citation-file");
      chip.type = "button";
      chip.title = `${c.name}, ${where}: show the passage`;
      chipCitations.set(chip, c);
      chip.append(node("span", "citation-n", String(i + 1)), node("span", "citation-domain", `${c.name} ${where}`));
    } else {
      chip = link(c.url, "");
      chip.className = "citation";
      chip.title = c.title || c.url;
      chip.append(node("span", "citation-n", String(i + 1)), node("span", "citation-domain", domainOf(c.url)));
    }
    chip.dataset.test = "citation";
    wrap.append(chip);
  });
  return wrap;
}
