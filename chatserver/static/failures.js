// The failure line under the transcript: what went wrong (an `error` event's data, or the page's
// own word when a request was refused or the connection lost), what it means, and the action that
// is the way on (Retry with a countdown, Compress and retry, Rewind and edit, settings, a model).

import { api } from "./api.js";
import { composerText, focusComposer, returnDraft, setComposer } from "./composer.js";
import { refresh } from "./conversation.js";
import { chooseModel, settings } from "./header.js";
import { $, showError } from "./page.js";
import { store } from "./store.js";
import { scrollToBottom } from "./transcript.js";
import { regenerate, send } from "./turn.js";
import { button } from "./ui.js";

const HINTS = {
  auth: "The gateway rejected the API key, or the account is out of credit.",
  rate_limited: "The gateway is rate limiting requests.",
  context_overflow: "The conversation no longer fits the model's context window.",
  refused: "The model or the gateway's filter refused this request.",
  model_unavailable: "This model is not available on the gateway right now.",
  upstream: "The gateway or the network failed.",
  request: "The server did not accept the request.",
};

const line = $("failure");
// The failure shown: an error event's data plus what a retry resends (`draft`), or null.
let failure = null;
let countdown = null;

export const currentFailure = () => failure;

/** Remember the failure to show; it is drawn by `renderFailure` (the transcript draws it too). */
export function setFailure(f) {
  failure = f;
}

function stopCountdown() {
  if (countdown) clearInterval(countdown);
  countdown = null;
}

export function clearFailure() {
  stopCountdown();
  failure = null;
  line.replaceChildren();
}

export function renderFailure() {
  stopCountdown();
  const f = failure;
  if (!f) {
    line.replaceChildren();
    return;
  }
  const box = document.createElement("div");
  box.className = "failure";
  box.dataset.test = "error";
  box.dataset.kind = f.kind;
  box.setAttribute("role", "alert");
  const text = document.createElement("div");
  text.className = "failure-text";
  const message = document.createElement("strong");
  message.textContent = f.message || HINTS[f.kind] || "Something went wrong.";
  const hint = document.createElement("span");
  hint.className = "failure-hint";
  hint.textContent = hintFor(f);
  text.append(message, " ", hint);
  const actions = document.createElement("div");
  actions.className = "failure-actions";
  actions.append(...actionsFor(f));
  box.append(text, actions);
  line.replaceChildren(box);
  scrollToBottom(true);
}

function hintFor(f) {
  let hint = HINTS[f.kind] || "";
  if (f.kind === "request" && f.retryable === false) hint = "Change the message and send it again.";
  if (f.draft != null) hint += " Your message is back in the composer.";
  if (f.partial) hint += " The part of the reply that arrived is kept.";
  return hint;
}

function actionButton(label, onClick, primary = true) {
  const b = button(label, { className: primary ? "primary small" : "small" });
  b.addEventListener("click", () => onClick(b));
  return b;
}

/**
 * Whether the failure line's own action is the way on (Retry, Compress and retry, settings), so a
 * Regenerate beside it would only repeat it or fail the same way. After a refusal or with another
 * model to choose, answering again is a real alternative and Regenerate stays.
 */
export function failureOffersTheWayBack() {
  return !!failure && failure.kind !== "refused" && failure.kind !== "model_unavailable";
}

function actionsFor(f) {
  switch (f.kind) {
    case "auth":
      return [actionButton("Open settings", () => settings.open({ focus: "gateway" }))];
    case "rate_limited":
      return rateLimitActions(f);
    case "context_overflow":
      return [actionButton("Compress and retry", (b) => busy(b, compressAndRetry))];
    case "refused":
      // A rolled-back message is already in the composer; otherwise rewind takes it out of history.
      return f.draft != null
        ? [actionButton("Edit message", focusComposer)]
        : [actionButton("Rewind and edit", (b) => busy(b, rewind))];
    case "model_unavailable":
      return [actionButton("Choose another model", chooseModel)];
    default:
      // The same request again cannot work: the message itself has to change.
      if (f.retryable === false) {
        return f.draft != null ? [actionButton("Edit message", focusComposer)] : [];
      }
      return [actionButton("Retry", (b) => busy(b, retry))];
  }
}

async function busy(button, action) {
  button.disabled = true;
  try {
    await action();
  } catch (err) {
    button.disabled = false;
    showError(err);
  }
}

function rateLimitActions(f) {
  // The deadline is fixed once, so re-drawing the line does not restart the wait.
  f.retryAt ??= Date.now() + 1000 * Math.max(1, f.retry_after ?? 10);
  const status = document.createElement("span");
  status.className = "countdown";
  const tick = () => {
    const remaining = Math.ceil((f.retryAt - Date.now()) / 1000);
    status.textContent = `Retrying in ${Math.max(remaining, 0)}s…`;
    return remaining;
  };
  tick();
  countdown = setInterval(() => {
    if (tick() <= 0) {
      stopCountdown();
      status.textContent = "Retrying…";
      retry().catch(showError);
    }
  }, 1000);
  return [status, actionButton("Retry now", (b) => busy(b, retry), false)];
}

/** Answer again: resend a rolled-back message (as it now reads in the composer) or regenerate. */
async function retry() {
  const f = failure;
  if (!f || store.turn) return;
  if (f.draft != null) {
    if (!composerText().trim()) setComposer(f.draft);
    await send();
  } else {
    await regenerate();
  }
}

async function compressAndRetry() {
  // The notice the server stores at the fold shows in the transcript once the retry refreshes it.
  await api.compress(store.conv.id);
  await retry();
}

async function rewind() {
  const { content } = await api.rewind(store.conv.id);
  clearFailure();
  await refresh();
  returnDraft(store.conv.id, content);
}
