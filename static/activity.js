// The activity trail: what the model did before and while answering (thought, searched, read).
//
// Steps have the shape the server saves with each message (events.py `accumulate`):
//   {kind: "thinking", text, started_at, ended_at}
//   {kind: "search", query, results: [{url, title}] | null, domains, at, error?}
//   {kind: "fetch", url, title, ok, at, error?}
// so a live trail and a saved one render through the same code. Times are in seconds.

import { safeUrl } from "./markdown.js";

/** Fold one turn-stream event (reasoning, search, fetch) into `steps`, in place. */
export function accumulateActivity(steps, event, data, now = Date.now() / 1000) {
  if (event === "reasoning") {
    const last = steps.at(-1);
    if (last && last.kind === "thinking") {
      last.text += data.text;
      last.ended_at = now;
    } else {
      steps.push({ kind: "thinking", text: data.text, started_at: now, ended_at: now });
    }
  } else if (event === "search") {
    // The first event announces the query (results null); the second brings results or an error.
    const done = data.results || data.error;
    const pending = done ? steps.findLast((s) => s.kind === "search" && s.results === null && !s.error) : null;
    const step = pending ?? { kind: "search", query: data.query, at: now };
    if (!pending) steps.push(step);
    step.results = data.results ?? null;
    step.domains = domainsOf(data.results ?? []);
    if (data.error) step.error = data.error;
  } else if (event === "fetch") {
    const step = { kind: "fetch", url: data.url, title: data.title ?? null, ok: !!data.ok, at: now };
    if (data.error) step.error = data.error;
    steps.push(step);
  }
  return steps;
}

function domainOf(url) {
  try {
    return new URL(url).hostname.replace(/^www\./, "");
  } catch {
    return url;
  }
}

function domainsOf(results) {
  return [...new Set(results.map((r) => domainOf(r.url)))].sort();
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
  return summarizeActivity(steps);
}

function node(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
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

function renderStep(step) {
  const li = node("li", `step step-${step.kind}`);
  if (step.kind === "thinking") {
    const secs = Math.round(Math.max(0, step.ended_at - step.started_at));
    li.append(node("div", "step-title", secs >= 1 ? `Thought for ${secs}s` : "Thought"));
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
  }

  /** Draw `steps`; `live` while streaming; `waitingForThought` shows "Thinking…" before any step. */
  render(steps, { live = false, waitingForThought = false } = {}) {
    this.el.hidden = !steps.length && !(live && waitingForThought);
    this.el.classList.toggle("live", live);
    this.summary.textContent = live ? liveLine(steps) : summarizeActivity(steps);
    this.timeline.replaceChildren(...steps.map(renderStep));
    const thought = this.timeline.querySelector(".step-thinking:last-child .thinking-text");
    if (live && thought) thought.scrollTop = thought.scrollHeight;
  }
}

/** Numbered domain chips linking to the sources; non-http(s) URLs are left out. */
export function renderCitations(citations) {
  const safe = (citations || []).filter((c) => safeUrl(c.url));
  if (!safe.length) return null;
  const wrap = node("div", "citations");
  wrap.setAttribute("aria-label", "Sources");
  safe.forEach((c, i) => {
    const a = link(c.url, "");
    a.className = "citation";
    a.dataset.test = "citation";
    a.title = c.title || c.url;
    a.append(node("span", "citation-n", String(i + 1)), node("span", "citation-domain", domainOf(c.url)));
    wrap.append(a);
  });
  return wrap;
}
