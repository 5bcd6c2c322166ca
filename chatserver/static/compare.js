// Compare: one message sent to two or three models at once (POST .../compare). Their replies stream
// side by side, each with its own Stop, tokens, time and cost; once they have ended, "Use this"
// makes one the current branch (the others stay its siblings, reachable by the branch switcher).
// The comparison is one turn on the server: the composer's Stop stops all of it.

import { ApiError, api, attachTurn, openTurn } from "./api.js";
import { files, returnDraft, setComposer } from "./composer.js";
import { refresh } from "./conversation.js";
import { clearFailure } from "./failures.js";
import { $, showError, toast } from "./page.js";
import { followTurn } from "./sse.js";
import { isReasoning, setTurn, store, subscribe } from "./store.js";
import { place, scrollToBottom, switchBranch } from "./transcript.js";
import { readThrough, setStreaming } from "./turn.js";
import { button, node } from "./ui.js";
import { AssistantView, renderUser } from "./views.js";

const toggle = $("compare-toggle");
const panel = $("compare-models");
const list = $("compare-model-list");

export const comparing = () => toggle.getAttribute("aria-pressed") === "true";

export function chosenModels() {
  return [...list.querySelectorAll("input:checked")].map((box) => box.value);
}

function renderChoices() {
  const chosen = new Set(chosenModels());
  if (!chosen.size && store.conv?.model) chosen.add(store.conv.model);
  const ids = (store.models?.tiers || []).flatMap((t) => t.models.map((m) => m.id));
  list.replaceChildren(...ids.map((id) => {
    const label = node("label", "compare-model");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.value = id;
    box.checked = chosen.has(id);
    box.dataset.test = "compare-model";
    label.append(box, document.createTextNode(` ${id}`));
    return label;
  }));
}

export function wireCompare() {
  toggle.addEventListener("click", () => {
    const on = !comparing();
    toggle.setAttribute("aria-pressed", String(on));
    toggle.classList.toggle("active", on);
    if (on) renderChoices();
    panel.hidden = !on;
  });
  subscribe((change) => {
    if (change.type === "models" && comparing()) renderChoices();
  });
}

/** One compared reply: its model, its live view, its own Stop, and when it began. */
class Lane {
  constructor(model, started) {
    this.model = model;
    this.started = started;
    this.view = new AssistantView({ model, reasoning: isReasoning(model) });
    this.view.startStreaming();
    this.el = node("section", "compare-lane");
    this.el.dataset.test = "compare-lane";
    this.el.dataset.model = model;
    const head = node("div", "compare-lane-head");
    head.append(node("span", "compare-lane-model", model));
    this.stop = button("Stop", { className: "small", label: `Stop ${model}'s reply` });
    this.stop.dataset.test = "compare-stop";
    head.append(this.stop);
    this.el.append(head, this.view.el);
    this.ended = false;
  }

  finish(status, usage, citations) {
    this.ended = true;
    this.stop.remove();
    this.view.setFinal(status, usage, citations);
    const seconds = ((performance.now() - this.started) / 1000).toFixed(1);
    const time = node("div", "stats compare-time", `${seconds} s`);
    time.dataset.test = "compare-time";
    this.view.footer.append(time);
  }

  fail(data) {
    this.ended = true;
    this.stop.remove();
    this.view.setFinal("interrupted");
    const note = node("div", "warning", data.message);
    note.dataset.test = "compare-error";
    this.view.warnings.append(note);
  }
}

/** Send the composer's text to the chosen models (two or three, else a word why nothing was sent). */
export async function sendCompared(text) {
  const models = chosenModels();
  if (models.length < 2 || models.length > 3) {
    toast("Compare: choose two or three models (or switch Compare off to send to one).");
    return;
  }
  const conv = store.conv;
  clearFailure();
  setComposer("");
  const sentFiles = files.ready();
  const attachmentIds = sentFiles.map((f) => f.id);
  files.clearPending();
  const body = { content: text, models, ...(attachmentIds.length ? { attachment_ids: attachmentIds } : {}) };
  const userEl = renderUser({ content: text });
  place(userEl);
  $("greeting").hidden = true;
  const shown = showComparison(conv.id, models, userEl);
  let outcome;
  try {
    outcome = await readComparison(shown, await openTurn(conv.id, "compare", body, shown.turn.controller.signal));
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    // Refused before anything ran (a model not in the lineup, a turn already running): nothing was saved.
    shown.row.remove();
    userEl.remove();
    returnDraft(conv.id, text);
    files.restore(conv.id, sentFiles);
    toast(err.message);
    outcome = "rejected";
  }
  await endComparison(shown, outcome);
}

/**
 * Follow a comparison already running on the server (a reload, another tab): its events replayed
 * from the start into the side-by-side view, in place of the replies read with the conversation.
 */
export async function followComparison(conv) {
  const replies = conv.turn.compare;
  const userEl = [...document.querySelectorAll("[data-test=message][data-role=user]")].at(-1) || null;
  for (const reply of replies) document.querySelector(`[data-id="${CSS.escape(reply.assistant_message_id)}"]`)?.remove();
  const shown = showComparison(conv.id, replies.map((r) => r.model), userEl);
  const res = await attachTurn(conv.id, 0, shown.turn.controller.signal).catch((err) => {
    if (err.name !== "AbortError") showError(err);
    return null;
  });
  await endComparison(shown, res ? await readComparison(shown, res) : "ended");
}

/** The side-by-side view of a comparison, made the turn this page follows. */
function showComparison(convId, models, userEl) {
  const started = performance.now();
  const lanes = new Map(models.map((model) => [model, new Lane(model, started)]));
  const row = node("div", "compare");
  row.dataset.test = "compare";
  row.dataset.role = "compare";
  row.dataset.status = "streaming";
  row.append(...[...lanes.values()].map((lane) => lane.el));
  const turn = { convId, controller: new AbortController(), view: { el: row }, userEl, sentFiles: [], compare: true };
  const byId = new Map();
  for (const lane of lanes.values()) {
    lane.stop.addEventListener("click", () => {
      const id = [...byId].find(([, l]) => l === lane)?.[0];
      if (id) api.stopReply(convId, id).catch(showError);
    });
  }
  setTurn(turn);
  setStreaming(true);
  place(row);
  scrollToBottom(true);
  return { convId, turn, row, lanes, byId, userEl };
}

/** Read a comparison's events into its lanes until its own last event; how it ended. */
async function readComparison({ convId, turn, row, lanes, byId, userEl }, res) {
  const reopen = (after) => attachTurn(convId, after, turn.controller.signal);
  // Each reply ends with its own `done` or `error` (naming it); the comparison's names none.
  const isLast = (ev) => (ev.event === "done" || ev.event === "error") && !ev.data?.assistant_message_id;
  try {
    for await (const { event, data } of followTurn(res, reopen, { isLast })) {
      if (event === "start") {
        if (data.user_message_id && userEl) userEl.dataset.id = data.user_message_id;
        row.dataset.id = data.assistant_message_id;
        for (const reply of data.compare || []) {
          const lane = lanes.get(reply.model);
          byId.set(reply.assistant_message_id, lane);
          lane.el.dataset.id = reply.assistant_message_id;
        }
        continue;
      }
      const lane = byId.get(data.assistant_message_id);
      if (!lane && (event === "done" || event === "error")) {
        if (event === "error") toast(data.message);
        return event;
      }
      if (!lane) continue;
      if (event === "done") lane.finish(data.status || "complete", data.usage, data.citations);
      else if (event === "error") lane.fail(data);
      else if (event === "delta") {
        lane.view.addText(data.text);
        drawSoon(lane.view);
      }
      else if (event === "warning") lane.view.addWarning(data.message, data.code);
      else if (["reasoning", "search", "fetch", "tool"].includes(event)) lane.view.addActivity(event, data);
    }
    return "ended";
  } catch (err) {
    if (err.name === "AbortError") return "aborted";
    if (err instanceof ApiError) throw err;
    console.error(err);
    return "lost";
  }
}

// A lane's words are drawn once an animation frame, as turn.js draws a single reply's; a hidden
// tab gets no frames, so a timer draws them too.
function drawSoon(view) {
  if (view.drawScheduled) return;
  view.drawScheduled = true;
  const draw = () => {
    view.drawScheduled = false;
    view.drawText();
  };
  requestAnimationFrame(draw);
  setTimeout(draw, 250);
}

/** The comparison is over (or this page let go of it): the lanes show how, and one can be chosen. */
async function endComparison({ convId, turn, row, lanes, byId }, outcome) {
  if (turn.detached) return; // the page moved on (another conversation): the comparison runs on there
  for (const lane of lanes.values()) if (!lane.ended) lane.finish("interrupted");
  row.dataset.status = "complete";
  readThrough(convId);
  if (store.turn === turn) {
    setTurn(null);
    setStreaming(false);
  }
  if (outcome === "rejected") return;
  // The conversation is read again without redrawing: the replies stay side by side until one is chosen.
  await refresh({ transcript: false }).catch(showError);
  if (store.conv?.id !== convId) return;
  offerChoice(byId);
}

/** "Use this" on every reply that was kept: it becomes the current branch, the others its siblings. */
function offerChoice(byId) {
  const current = new Set((store.conv?.messages || []).map((m) => m.id));
  const kept = new Set(Object.values(store.conv?.branches || {}).flat());
  for (const [id, lane] of byId) {
    if (!kept.has(id) && !current.has(id)) continue;
    const use = button("Use this", { className: "primary small", label: `Use ${lane.model}'s reply` });
    use.dataset.test = "compare-choose";
    // The transcript is drawn again with the chosen reply on the path (the side-by-side view ends).
    use.addEventListener("click", () => switchBranch(id).catch(showError));
    lane.el.querySelector(".compare-lane-head").append(use);
  }
}
