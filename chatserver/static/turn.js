// Turns as this page sees them: sending (and regenerating), reading the reply as it streams,
// Stop, following a turn that runs elsewhere (a switch, a reload, another tab), and settling the
// transcript by what ended it. The turn itself runs on the server: leaving it only stops the reading.

import { ApiError, api, attachTurn, openTurn } from "./api.js";
import { comparing, followComparison, sendCompared } from "./compare.js";
import { composerText, files, returnDraft, setComposer } from "./composer.js";
import { isOpening, noteIfLeftEmpty, refresh } from "./conversation.js";
import { clearFailure, currentFailure, renderFailure, setFailure } from "./failures.js";
import { $, showError, toast } from "./page.js";
import { followTurn } from "./sse.js";
import { isReasoning, setOpen, setTurn, store } from "./store.js";
import {
  drawnMessage, lastDrawn, nearBottom, place, renderGreeting, renderRegenerate, renderTranscript, scrollToBottom,
  updateJump,
} from "./transcript.js";
import { AssistantView, renderNotice, renderUser } from "./views.js";

const sendButton = $("send");
// The conversation whose turn this page read to its end: the server's "ended" is no news then.
let readToEnd = null;
// The conversation whose reply this page stopped reading (Stop): drawn once the server has saved it.
let awaitingSave = null;

export async function send() {
  const text = composerText();
  // While another conversation is being opened, the one on screen is not where the address points.
  if (store.turn || !store.conv || isOpening() || !text.trim()) return;
  if (files.uploading) {
    toast("A file is still uploading: send once its chip is ready.");
    return;
  }
  const failed = files.failed();
  if (failed.length) {
    // Sending now would leave the file out without a word: the message waits until the person chooses.
    const names = failed.map((p) => p.file.name).join(", ");
    toast(`Not sent: ${names} could not be attached (${failed[0].error}). Remove its chip (✕) to send without it, or attach it again.`);
    return;
  }
  if (comparing()) return sendCompared(text);
  clearFailure();
  setComposer("");
  const sentFiles = files.ready();
  const attachmentIds = sentFiles.map((f) => f.id);
  const body = attachmentIds.length ? { content: text, attachment_ids: attachmentIds } : { content: text };
  const userEl = renderUser({ content: text });
  const chips = files.chipsFor({ attachment_ids: attachmentIds });
  if (chips) userEl.append(chips);
  files.clearPending();
  place(userEl);
  $("greeting").hidden = true;
  await runTurn("messages", body, { userEl, text, sentFiles });
}

export async function regenerate() {
  if (store.turn || !store.conv) return;
  clearFailure();
  // The server drops the last assistant turn before answering again; mirror that now.
  const last = lastDrawn();
  if (last?.dataset.role === "assistant") last.remove();
  await runTurn("regenerate", {}, {});
}

/**
 * Answer again in place of the reply `messageId` (any reply of the path), with `model` or the
 * conversation's: the server keeps the old reply and what followed it on another branch, so the
 * transcript from that reply on gives way to the new one.
 */
export async function regenerateReply(messageId, model) {
  if (store.turn || !store.conv) return;
  clearFailure();
  cutFrom(messageId);
  const body = { message_id: messageId };
  if (model && model !== store.conv.model) body.model = model;
  await runTurn("regenerate", body, { model: body.model });
}

/** Go on from the last reply (interrupted or cut at the output limit): the new text joins it as it streams. */
export async function continueReply(m) {
  if (store.turn || !store.conv) return;
  clearFailure();
  cutFrom(m.id);
  await runTurn("continue", { message_id: m.id }, { model: m.model, prefix: m.content || "" });
}

/** Take a message and everything after it off the transcript (a new version is coming). */
function cutFrom(messageId) {
  for (let n = drawnMessage(messageId); n; ) {
    const next = n.nextElementSibling;
    n.remove();
    n = next;
  }
}

/**
 * Stop the reply: the server stops the turn, saves what arrived as interrupted, and ends every
 * stream following it with `done` (`status: "interrupted"`). Works without a stream open too
 * (a reload that could not re-attach): the page then re-reads the conversation.
 */
export async function stop() {
  const turn = store.turn;
  const convId = turn?.convId ?? (store.conv?.streaming ? store.conv.id : null);
  if (!convId) return;
  sendButton.disabled = true;
  try {
    await api.stop(convId);
  } catch (err) {
    // The route is out of reach: at least stop reading, and say why.
    turn?.controller.abort();
    throw err;
  } finally {
    sendButton.disabled = false;
  }
  if (!turn) {
    await refresh();
    return;
  }
  // The saved reply ends the stream at once; should the stream have gone quiet, let go of it.
  setTimeout(() => {
    if (store.turn === turn) turn.controller.abort();
  }, 3000);
}

/** This page read the turn on `convId` to its end: the server's "ended" for it is no news. */
export function readThrough(convId) {
  readToEnd = convId;
}

/** Stop following the turn in this page (the reply goes on on the server). */
export function detach() {
  const turn = store.turn;
  if (!turn) return;
  turn.detached = true;
  turn.controller.abort();
  setTurn(null);
  setStreaming(false);
}

/** A turn began or ended where this page is not reading it: show it as it is now. */
export function onTurn({ id, state: phase }) {
  if (store.conv?.id !== id || store.turn) return;
  if (phase === "ended" && readToEnd === id && awaitingSave !== id) {
    readToEnd = null; // this page read the turn to its `done` and drew the saved reply then
    return;
  }
  awaitingSave = null;
  refresh()
    .then(() => {
      if (phase === "started" && store.conv?.id === id && store.conv.streaming) return follow(store.conv);
    })
    .catch(showError);
}

export function setStreaming(streaming) {
  sendButton.textContent = streaming ? "Stop" : "Send";
  sendButton.setAttribute("aria-label", streaming ? "Stop" : "Send");
  sendButton.classList.toggle("stop", streaming);
  $("compress-now").disabled = streaming;
  $("app").classList.toggle("streaming", streaming);
  renderRegenerate();
}

function newTurn(convId, model, { userEl = null, sentFiles = [] } = {}) {
  const view = new AssistantView({ model, reasoning: isReasoning(model) });
  view.startStreaming();
  const turn = { convId, controller: new AbortController(), view, userEl, sentFiles };
  setTurn(turn);
  setStreaming(true);
  return turn;
}

/**
 * Run one turn stream to its end, then settle the transcript by what ended it. `model`: the one
 * answering when it is not the conversation's; `prefix`: the text a continued reply already has.
 */
export async function runTurn(kind, body, { userEl = null, text = null, sentFiles = [], model = null, prefix = "" }) {
  const conv = store.conv;
  const turn = newTurn(conv.id, model || conv.model, { userEl, sentFiles });
  if (prefix) turn.view.addText(prefix);
  place(turn.view.el);
  scrollToBottom(true);
  let outcome;
  try {
    const res = await openTurn(conv.id, kind, body, turn.controller.signal);
    outcome = await readTurn(turn, res, 0);
  } catch (err) {
    if (err.name === "AbortError") outcome = { type: "aborted" };
    else if (err instanceof ApiError && err.status === 409) outcome = { type: "busy", error: err };
    else if (err instanceof ApiError) outcome = { type: "rejected", error: err };
    else outcome = { type: "lost", error: err };
  }
  await endTurn(turn, outcome, text);
}

/**
 * A 409 on sending: is a reply being written here that this page does not follow (started in
 * another tab, on another device)? Then show it as it streams, with Stop, and keep what the person
 * typed in the composer for when it ends. False when no such reply runs (the 409 was another one).
 */
async function joinRunningTurn(turn, text) {
  const conv = await api.conversation(turn.convId).catch(() => null);
  const reply = conv?.messages.find((m) => m.id === conv.turn?.assistant_message_id);
  // Right after a reply's `done` its turn may hold the conversation a moment longer: not a reply to show.
  if (!conv?.streaming || (reply && reply.status !== "streaming")) return false;
  turn.userEl?.remove();
  turn.view.el.remove();
  if (text != null) {
    returnDraft(turn.convId, text);
    files.restore(turn.convId, turn.sentFiles);
  }
  if (store.conv?.id !== turn.convId || store.turn) return true;
  setOpen(conv);
  renderTranscript();
  toast("A reply is already being written here (in another tab or on another device). " +
    (text != null ? "Your message waits in the composer until it ends." : "Stop it, or wait for it to end."));
  follow(conv).catch(showError);
  return true;
}

/**
 * Follow a turn already running on the server (after a switch, a reload, in a second tab): its
 * events are replayed from the start into a fresh reply, in place of the checkpoint, then live.
 */
export async function follow(conv) {
  if (store.turn || store.conv?.id !== conv.id) return;
  if (conv.turn?.compare) return followComparison(conv);
  const checkpoint = conv.turn?.assistant_message_id;
  const turn = newTurn(conv.id, conv.model);
  const saved = checkpoint && drawnMessage(checkpoint);
  if (saved) saved.replaceWith(turn.view.el);
  else place(turn.view.el);
  renderGreeting();
  scrollToBottom(true);
  let outcome;
  try {
    const res = await attachTurn(conv.id, 0, turn.controller.signal);
    outcome = res ? await readTurn(turn, res, 0) : { type: "ended" };
  } catch (err) {
    if (err.name === "AbortError") outcome = { type: "aborted" };
    else outcome = { type: "lost", error: err };
  }
  await endTurn(turn, outcome, null);
}

/** Read a turn's events into the page until `done` or `error`, reconnecting after a blip. */
export async function readTurn(turn, res, lastId) {
  const reopen = (after) => attachTurn(turn.convId, after, turn.controller.signal);
  for await (const { event, data } of followTurn(res, reopen, { lastId })) {
    if (event === "delta") {
      turn.view.addText(data.text);
      drawSoon(turn);
      continue;
    }
    drawText(turn);
    if (event === "done" || event === "error") return { type: event, data };
    // Follow the reply only if the person has not scrolled up to read.
    const stick = nearBottom();
    handleEvent(turn, event, data);
    if (stick) scrollToBottom(true);
    else updateJump();
  }
  drawText(turn);
  // Nothing runs any more (the turn ended while the page was not reading): the store knows how.
  return { type: "ended" };
}

// Words are drawn once an animation frame, not once a delta: each draw lays the transcript out
// (following the reply reads its height), which for a long reply took longer than a frame when
// done a hundred times a second.
function drawSoon(turn) {
  if (turn.drawPending) return;
  turn.drawPending = true;
  requestAnimationFrame(() => drawText(turn));
  // A hidden tab gets no animation frames; its reply is still drawn.
  setTimeout(() => drawText(turn), 250);
}

function drawText(turn) {
  if (!turn.drawPending) return;
  turn.drawPending = false;
  const stick = nearBottom();
  turn.view.drawText();
  if (stick) scrollToBottom(true);
  else updateJump();
}

export async function endTurn(turn, outcome, text) {
  if (turn.detached) return;
  readToEnd = turn.convId;
  if (store.turn === turn) {
    setTurn(null);
    setStreaming(false);
  }
  await settleTurn(turn, outcome, text).catch(showError);
}

export function handleEvent(turn, event, data) {
  const { view, userEl } = turn;
  switch (event) {
    case "start":
      if (data.assistant_message_id) view.el.dataset.id = data.assistant_message_id;
      if (data.user_message_id && userEl) userEl.dataset.id = data.user_message_id;
      if (data.model) {
        view.model = data.model;
        view.reasoning = isReasoning(data.model);
      }
      break;
    case "compression":
      // A replayed turn's notice may already be in the transcript, read with the conversation.
      if (!drawnMessage(data.notice.id)) place(renderNotice(data.notice), userEl || view.el);
      break;
    case "reasoning":
    case "search":
    case "fetch":
    case "tool":
      view.addActivity(event, data);
      break;
    case "warning":
      view.addWarning(data.message, data.code);
      break;
    case "image":
      view.addImage(data.attachment.id);
      break;
  }
}

async function settleTurn(turn, outcome, text) {
  const { view, userEl } = turn;
  const here = store.conv?.id === turn.convId;
  switch (outcome.type) {
    case "done": {
      const finish = () => view.setFinal(outcome.data.status || "complete", outcome.data.usage, outcome.data.citations);
      if (!here) return finish();
      // The saved reply is drawn in place of the streamed one and only then shows as finished, so what
      // the person clicks in a finished reply (Copy, Show more) is not drawn again a moment later.
      try {
        await refresh();
      } finally {
        if (view.el.isConnected) finish();
      }
      return;
    }
    case "ended":
      if (view.isEmpty) view.el.remove();
      else view.setFinal("interrupted");
      if (here) await refresh();
      return;
    case "aborted":
      // The server saves the interrupted reply once it notices the closed connection (even one
      // stopped before its first word: it was billed); the page shows the same result now and
      // re-reads the conversation when the server is done.
      view.setFinal("interrupted");
      // The saved reply is drawn when the server says the turn has ended (onTurn).
      if (here) {
        awaitingSave = turn.convId;
        renderRegenerate();
        refresh().catch(showError); // the server may have let it go already: then no word is coming
      }
      return;
    case "error": {
      const data = outcome.data;
      if (data.draft != null) {
        userEl?.remove();
        returnDraft(turn.convId, data.draft);
        files.restore(turn.convId, turn.sentFiles);
      }
      if (!data.partial && view.isEmpty) view.el.remove();
      else view.setFinal("interrupted");
      if (!here) return;
      setFailure({ ...data });
      await refresh().catch((err) => {
        showError(err);
        renderFailure();
      });
      noteIfLeftEmpty(turn.convId);
      return;
    }
    case "busy":
      if (await joinRunningTurn(turn, text)) return;
      return settleTurn(turn, { ...outcome, type: "rejected" }, text);
    case "rejected": {
      // The server refused the request itself (e.g. too long, busy): nothing was saved. Sending
      // the same again only helps when the server was busy or failed, not when it said no.
      userEl?.remove();
      view.el.remove();
      if (text != null) {
        returnDraft(turn.convId, text);
        files.restore(turn.convId, turn.sentFiles);
      }
      if (!here) return;
      const status = outcome.error.status;
      setFailure({
        kind: "request", message: outcome.error.message, draft: text, retry_after: null,
        retryable: status === 409 || status >= 500,
      });
      renderTranscript();
      noteIfLeftEmpty(turn.convId);
      return;
    }
    default: {
      // The stream ended without `done` or `error`: the server or the network went away.
      if (outcome.error) console.error(outcome.error);
      if (view.isEmpty) view.el.remove();
      else view.setFinal("interrupted");
      if (!here) return;
      setFailure({ kind: "upstream", message: "The connection to the server was lost.", retry_after: null });
      await refresh().catch(showError);
      const kept = store.conv.messages.some((m) => m.role === "user" && m.id === userEl?.dataset.id);
      if (text != null && !kept) {
        // The message never made it into the conversation: hand it back rather than lose it.
        userEl?.remove();
        currentFailure().draft = text;
        returnDraft(turn.convId, text);
        files.restore(turn.convId, turn.sentFiles);
      }
      renderFailure();
    }
  }
}
