// Which conversation is open: opening one (from the list, the address, a search hit), "+ New",
// "not found", deleting and organizing, re-reading the open one from the server, and what the
// server tells about conversations (live.js) going into the store.

import { api } from "./api.js";
import { draftOf, files, focusComposer, forgetDraft, showDraft } from "./composer.js";
import { clearFailure } from "./failures.js";
import { pickedModel, renderHeader, showNotFoundTitle } from "./header.js";
import { listed, loadList, showArchived, showingArchived } from "./list.js";
import { $, closeSidebar, showError, toast } from "./page.js";
import { changeConversation, removeConversation, setOpen, store } from "./store.js";
import { renderTranscript, scrollToBottom, switchBranch } from "./transcript.js";
import { detach, follow } from "./turn.js";
import { UNTITLED } from "./ui.js";

// The conversation being opened (its id) until it is on screen: a send waits for it.
let opening = null;
// Conversations left empty by a first message that failed: "+ New" may take them again.
const reusable = new Set();
// Conversations this page is deleting: the server's word that they are gone is no news here.
const deleting = new Set();

export const isOpening = () => opening !== null;

// ---------------------------------------------------------------- what the server tells

/** A conversation changed (here, in another tab, on another device): its row and header follow. */
export function onConversation(change) {
  const titled = "title" in change && store.conv?.id === change.id && change.title !== store.conv.title;
  if (!changeConversation(change)) return; // a turn on a conversation not listed here (another view)
  if (!!store.conversations.get(change.id).archived !== showingArchived()) removeConversation(change.id);
  // A generated title comes with its call's spend, which the header shows apart: read it.
  if (titled && !store.turn) refresh({ transcript: false }).catch(showError);
}

export function onDeleted({ id }) {
  removeConversation(id);
  if (store.conv?.id === id && !deleting.has(id)) {
    toast("This conversation was deleted in another window.");
    leaveDeleted(id).catch(showError);
  }
}

export function reconnected() {
  (store.conv ? refresh() : loadList()).catch(showError);
}

/** Re-read the open conversation (and the list) from the server, the source of truth. */
export async function refresh({ transcript = true } = {}) {
  if (!store.conv) return;
  const id = store.conv.id;
  const [conv] = await Promise.all([api.conversation(id), loadList()]);
  if (store.conv?.id !== id) return;
  setOpen(conv);
  if (transcript) renderTranscript();
}

// ---------------------------------------------------------------- opening

/**
 * Open conversation `id`. `address` says what the address bar does: "push" a history entry (the
 * person opened it here, so Back returns), "replace" the current one, or "keep" it (it already
 * names `id`: typed, pasted, Back or Forward). An id that is no conversation of this person's
 * shows "not found" rather than another conversation.
 */
export async function openConversation(id, { address = "push" } = {}) {
  if (id === store.conv?.id) {
    closeSidebar();
    return;
  }
  opening = id;
  try {
    await showConversation(id, address);
  } finally {
    if (opening === id) opening = null;
  }
}

async function showConversation(id, address) {
  // Leaving a conversation mid-reply only stops following it: the reply goes on on the server.
  const running = store.turn?.convId;
  let conv;
  try {
    conv = await api.conversation(id);
  } catch (err) {
    if (err.status !== 404 || opening !== id) throw err;
    await showNotFound(id, address);
    return;
  }
  if (opening !== id) return; // another conversation was asked for meanwhile
  detach();
  clearFailure();
  const left = store.conv;
  setMissing(false);
  setOpen(conv);
  const discarded = left?.id !== running && (await discardIfUntouched(left));
  await files.load(id);
  // A conversation just discarded leaves no history entry to come Back to.
  showAddress(id, discarded && address === "push" ? "replace" : address);
  showDraft(id);
  renderHeader();
  renderTranscript();
  closeSidebar();
  scrollToBottom(true);
  if (conv.streaming) follow(conv).catch(showError);
}

/**
 * Open an empty conversation: one nobody has touched yet if there is one (no messages, no title,
 * no draft, no change since it was made), else a new one. So "+ New" clicked again and again, or
 * after a first message that failed, does not pile up empty conversations.
 */
export async function newConversation({ address = "push" } = {}) {
  if (showingArchived()) await showArchived(false);
  const conv = (await findUntouched()) ?? (await api.createConversation({ model: pickedModel() || undefined }));
  await loadList();
  await openConversation(conv.id, { address });
  focusComposer();
  // For tests: counts finished "+ New" actions, whether they made a conversation or reused one.
  document.body.dataset.newCount = String(Number(document.body.dataset.newCount || 0) + 1);
}

/** Open the latest listed conversation, or a new one when none is listed. */
export async function openLatest({ address }) {
  const latest = [...store.conversations.values()].find(listed);
  if (latest) await openConversation(latest.id, { address });
  else await newConversation({ address });
}

/**
 * A conversation left exactly as it was made (see `isUntouched`, and no files) is deleted when the
 * person opens another one: empty conversations never pile up in the list.
 */
async function discardIfUntouched(conv) {
  if (!conv || conv.id === store.conv?.id || store.turn?.convId === conv.id) return false;
  if (draftOf(conv.id) || files.convId !== conv.id || files.count || files.pending.length) return false;
  // The page's copy may predate a message sent since: the list entry is newer.
  const entry = store.conversations.get(conv.id);
  if (!isUntouched(conv) || entry?.streaming || entry?.message_count) return false;
  try {
    await api.deleteConversation(conv.id);
  } catch {
    return false; // it stays; nothing is lost
  }
  reusable.delete(conv.id);
  removeConversation(conv.id);
  return true;
}

// The server names a new conversation with the same words the page shows for no title.
export const untitled = (title) => !title || title === UNTITLED;

function isUntouched(conv) {
  return !conv.messages?.length && !conv.archive?.length && untitled(conv.title) && !conv.pinned &&
    (conv.created_at === conv.updated_at || reusable.has(conv.id));
}

async function findUntouched() {
  const candidates = [...store.conversations.values()]
    .filter((c) => c.message_count === 0 && untitled(c.title)).slice(0, 5);
  for (const c of candidates) {
    if (draftOf(c.id) || c.id === store.turn?.convId) continue;
    if (c.id === store.conv?.id && (files.count || files.pending.length)) continue;
    const conv = c.id === store.conv?.id ? store.conv : await api.conversation(c.id).catch(() => null);
    if (conv && isUntouched(conv)) return conv;
  }
  return null;
}

/** A first message that failed leaves its conversation empty: "+ New" may take it again. */
export function noteIfLeftEmpty(convId) {
  if (store.conv?.id === convId && !store.conv.messages?.length) reusable.add(convId);
}

// ---------------------------------------------------------------- the address

/** Make the address name conversation `id`: "push" a history entry, "replace" the current one, or "keep" it. */
function showAddress(id, address) {
  const hash = `#${encodeURIComponent(id)}`;
  if (address === "keep" || location.hash === hash) return;
  if (address === "replace") history.replaceState(null, "", hash);
  else history.pushState(null, "", hash);
}

/** The address changed under the page (typed, pasted, a link, Back, Forward): open what it names. */
export function followAddress() {
  const id = hashId();
  if (!id || id === store.conv?.id || id === opening) return;
  openConversation(id, { address: "keep" }).catch(showError);
}

/** The conversation id in the address (#id), or "" when it is missing or not decodable. */
export function hashId() {
  try {
    return decodeURIComponent(location.hash.slice(1));
  } catch {
    // A hand-typed or truncated address (#%E0%A4%A) names no conversation: open the latest.
    return "";
  }
}

/**
 * The address names no conversation of this person's (deleted, mistyped, someone else's): say so,
 * instead of showing another conversation a message would then be sent to.
 */
async function showNotFound(id, address) {
  detach();
  clearFailure();
  const left = store.conv;
  setOpen(null);
  await discardIfUntouched(left);
  await files.load(null);
  if (address !== "keep") showAddress(id, address);
  showDraft(null);
  setMissing(true);
  renderHeader();
  showNotFoundTitle();
  renderTranscript();
  closeSidebar();
}

/** Whether the page shows "not found": nothing to send to, so the composer waits. */
function setMissing(missing) {
  $("not-found").hidden = !missing;
  $("composer").disabled = missing;
  $("send").disabled = missing;
  $("attach").disabled = missing;
}

// ---------------------------------------------------------------- deleting, organizing

export async function deleteConversation(id) {
  // The server stops a running turn before it deletes.
  if (store.turn?.convId === id) detach();
  deleting.add(id);
  try {
    await api.deleteConversation(id);
    await leaveDeleted(id);
  } finally {
    deleting.delete(id);
  }
}

/** After a conversation is gone: forget its draft, and open another if it was the open one. */
async function leaveDeleted(id) {
  forgetDraft(id);
  await loadList();
  if (store.conv?.id !== id) return;
  setOpen(null);
  // The deleted conversation's history entry becomes the one opened instead.
  const [first] = store.conversations.keys();
  if (first) await openConversation(first, { address: "replace" });
  else await newConversation({ address: "replace" });
}

/** PATCH pinned/archived, then read the list again: the conversation may move or leave this view. */
export async function organize(id, patch) {
  const updated = await api.patchConversation(id, patch);
  if (store.conv?.id === id) setOpen(updated);
  await loadList();
}

// ---------------------------------------------------------------- a search hit

/** Open a conversation at one message (a search hit), scrolled to it and marked for a moment. */
export async function openAt(id, messageId) {
  if (showingArchived() && !store.conversations.has(id)) await showArchived(false);
  await openConversation(id);
  if (!messageId) return;
  const onPath = [...(store.conv.archive || []), ...store.conv.messages].some((m) => m.id === messageId);
  // A hit on another branch: make its branch the current one first (not while a reply runs).
  if (!onPath && !store.turn) await switchBranch(messageId).catch(() => {});
  const messages = $("messages");
  const target = messages.querySelector(`[data-id="${CSS.escape(messageId)}"]`);
  if (!target) return;
  const folded = target.closest("details");
  if (folded) folded.open = true;
  for (const old of messages.querySelectorAll("[data-highlighted]")) old.removeAttribute("data-highlighted");
  target.dataset.highlighted = "true";
  target.scrollIntoView({ block: "center" });
  setTimeout(() => target.removeAttribute("data-highlighted"), 4000);
}
