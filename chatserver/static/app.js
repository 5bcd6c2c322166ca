// The page controller: conversations, the composer, turns (stream, Stop, Regenerate), failures and
// their actions, the header meters. Rendering lives in views.js/activity.js/markdown.js, the wire in
// api.js/sse.js; this module decides what happens when.

import { api, ApiError, attachTurn, exportUrl, openTurn, upload } from "./api.js";
import { branchSwitcher } from "./branches.js";
import { showAccountLogin, startAuth } from "./auth.js";
import { Files } from "./files.js";
import { SearchBox } from "./search.js";
import { listen } from "./live.js";
import { followTurn } from "./sse.js";
import { SettingsPanel } from "./settings.js";
import { UNTITLED, button, node, tierLabel } from "./ui.js";
import {
  AssistantView, contextBar, copyText, describeCompression, renderArchive, renderMessage, renderNotice,
  renderUser, usageItems,
} from "./views.js";

const $ = (id) => document.getElementById(id);

const el = {
  app: $("app"),
  sidebarToggle: $("sidebar-toggle"),
  scrim: $("scrim"),
  list: $("conversation-list"),
  title: $("conv-title"),
  picker: $("model-picker"),
  usage: $("usage-header"),
  contextBar: $("context-bar"),
  compressNow: $("compress-now"),
  transcript: $("transcript"),
  messages: $("messages"),
  failure: $("failure"),
  form: $("composer-form"),
  composer: $("composer"),
  send: $("send"),
  banner: $("demo-banner"),
  greeting: $("greeting"),
  toast: $("toast"),
};

const state = {
  health: null,
  models: null,
  modelIndex: new Map(),
  presets: [],
  tools: [],
  conversations: [],
  // The sidebar lists archived conversations instead of the others.
  archivedView: false,
  // Whether the server knows `pinned`/`archived` (its list entries carry them); null until read.
  organizes: null,
  conv: null,
  // The conversation being opened (its id) until it is on screen: a send waits for it.
  opening: null,
  // The turn this page follows now: {convId, controller, view, userEl}. The turn itself runs on
  // the server: leaving it only stops the reading.
  turn: null,
  // The failure line under the transcript: an error event's data plus what a retry resends.
  failure: null,
  countdown: null,
  // Conversations left empty by a first message that failed: "+ New" may take them again.
  reusable: new Set(),
  // The conversation whose Delete is armed: the list re-renders while it waits for the second click.
  armedDelete: null,
  // The title being typed in the list ({id, input}): it stays, typed text and all, when the list re-renders.
  renaming: null,
  // True while the list's items are being replaced: the blur that causes is not the person leaving.
  redrawingList: false,
  // Conversations this page is deleting: the server's word that they are gone is no news here.
  deleting: new Set(),
  // The conversation whose turn this page read to its end: the server's "ended" is no news either.
  readToEnd: null,
  // The conversation whose reply this page stopped reading (Stop): drawn once the server has saved it.
  awaitingSave: null,
};

const settings = new SettingsPanel({
  conversation: () => state.conv,
  conversationChanged: (conv) => {
    state.conv = conv;
    renderHeader();
  },
  models: () => state.models,
  modelsChanged: loadModels,
  presets: () => state.presets,
  presetsChanged: async () => {
    state.presets = await api.presets();
  },
  tools: () => state.tools,
  health: () => state.health,
  memoryChanged: () => refresh({ transcript: false }),
});

const files = new Files({
  conversation: () => state.conv,
  conversationChanged: (conv) => {
    state.conv = conv;
    renderHeader();
  },
  toast: (text) => toast(text),
});

const search = new SearchBox({ open: (id, messageId) => openAt(id, messageId).catch(showError) });

// ---------------------------------------------------------------- drafts

const draftKey = (id) => `draft:${id}`;

function saveDraft() {
  if (!state.conv) return;
  const text = el.composer.value;
  if (text) localStorage.setItem(draftKey(state.conv.id), text);
  else localStorage.removeItem(draftKey(state.conv.id));
}

function setComposer(text) {
  el.composer.value = text;
  saveDraft();
  autosize();
}

/** Put a rolled-back message back in its conversation's composer, keeping anything typed since. */
function returnDraft(convId, text) {
  const open = state.conv?.id === convId;
  const current = open ? el.composer.value : localStorage.getItem(draftKey(convId)) || "";
  const merged = current.trim() && current.trim() !== text.trim() ? `${text}\n\n${current}` : text;
  if (!open) {
    localStorage.setItem(draftKey(convId), merged);
    return;
  }
  setComposer(merged);
  el.composer.focus();
}

function autosize() {
  el.composer.style.height = "auto";
  el.composer.style.height = `${Math.min(el.composer.scrollHeight, window.innerHeight * 0.4)}px`;
}

// ---------------------------------------------------------------- loading

async function loadModels() {
  state.models = await api.models();
  state.modelIndex = new Map(state.models.tiers.flatMap((t) => t.models.map((m) => [m.id, m])));
  renderPicker();
}

async function loadList() {
  const list = await api.conversations({ archived: state.archivedView });
  state.organizes = list.length ? "pinned" in list[0] : state.organizes;
  // A server without archiving has no archived view: the list is everything.
  state.conversations = state.archivedView && state.organizes ? list.filter((c) => c.archived) : list;
  renderList();
}

// ---------------------------------------------------------------- what the server tells

/** Pinned first, then the newest last message first: the list's order on the server too. */
function sortList() {
  state.conversations.sort((a, b) => (b.last_message_at || "").localeCompare(a.last_message_at || ""));
  state.conversations.sort((a, b) => Number(!!b.pinned) - Number(!!a.pinned));
}

/** A conversation changed (here, in another tab, on another device): its row and header follow. */
function onConversation(change) {
  const entry = state.conversations.find((c) => c.id === change.id);
  if (entry) Object.assign(entry, change);
  else if ("title" in change) state.conversations.push({ streaming: false, ...change });
  else return; // a turn on a conversation not listed here (another view): nothing to show
  const listed = state.conversations.find((c) => c.id === change.id);
  if (!!listed.archived !== state.archivedView) {
    state.conversations = state.conversations.filter((c) => c.id !== change.id);
  }
  sortList();
  renderList();
  if (state.conv?.id === change.id && "title" in change && change.title !== state.conv.title) {
    state.conv.title = change.title;
    renderHeader();
    // A generated title comes with its call's spend, which the header shows apart: read it.
    if (!state.turn) refresh({ transcript: false }).catch(showError);
  }
}

function onDeleted({ id }) {
  state.conversations = state.conversations.filter((c) => c.id !== id);
  renderList();
  if (state.conv?.id === id && !state.deleting.has(id)) {
    toast("This conversation was deleted in another window.");
    leaveDeleted(id).catch(showError);
  }
}

/** A turn began or ended where this page is not reading it: show it as it is now. */
function onTurn({ id, state: phase }) {
  if (state.conv?.id !== id || state.turn) return;
  if (phase === "ended" && state.readToEnd === id && state.awaitingSave !== id) {
    state.readToEnd = null; // this page read the turn to its `done` and drew the saved reply then
    return;
  }
  state.awaitingSave = null;
  refresh()
    .then(() => {
      if (phase === "started" && state.conv?.id === id && state.conv.streaming) return follow(state.conv);
    })
    .catch(showError);
}

function reconnected() {
  (state.conv ? refresh() : loadList()).catch(showError);
}

/** Re-read the open conversation (and the list) from the server, the source of truth. */
async function refresh({ transcript = true } = {}) {
  if (!state.conv) return;
  const id = state.conv.id;
  const [conv] = await Promise.all([api.conversation(id), loadList()]);
  if (state.conv?.id !== id) return;
  state.conv = conv;
  renderHeader();
  if (transcript) renderTranscript();
}

/**
 * Open conversation `id`. `address` says what the address bar does: "push" a history entry (the
 * person opened it here, so Back returns), "replace" the current one, or "keep" it (it already
 * names `id`: typed, pasted, Back or Forward). An id that is no conversation of this person's
 * shows "not found" rather than another conversation.
 */
async function openConversation(id, { address = "push" } = {}) {
  if (id === state.conv?.id) {
    closeSidebar();
    return;
  }
  state.opening = id;
  try {
    await showConversation(id, address);
  } finally {
    if (state.opening === id) state.opening = null;
  }
}

async function showConversation(id, address) {
  // Leaving a conversation mid-reply only stops following it: the reply goes on on the server.
  const running = state.turn?.convId;
  let conv;
  try {
    conv = await api.conversation(id);
  } catch (err) {
    if (err.status !== 404 || state.opening !== id) throw err;
    await showNotFound(id, address);
    return;
  }
  if (state.opening !== id) return; // another conversation was asked for meanwhile
  detach();
  clearFailure();
  const left = state.conv;
  state.conv = conv;
  setMissing(false);
  const discarded = left?.id !== running && (await discardIfUntouched(left));
  await files.load(id);
  // A conversation just discarded leaves no history entry to come Back to.
  showAddress(id, discarded && address === "push" ? "replace" : address);
  el.composer.value = localStorage.getItem(draftKey(id)) || "";
  autosize();
  renderHeader();
  renderTranscript();
  renderList();
  closeSidebar();
  scrollToBottom(true);
  if (conv.streaming) follow(conv).catch(showError);
}

/**
 * Open an empty conversation: one nobody has touched yet if there is one (no messages, no title,
 * no draft, no change since it was made), else a new one. So "+ New" clicked again and again, or
 * after a first message that failed, does not pile up empty conversations.
 */
async function newConversation({ address = "push" } = {}) {
  if (state.archivedView) await showArchived(false);
  const conv = (await findUntouched()) ?? (await api.createConversation({ model: el.picker.value || undefined }));
  await loadList();
  await openConversation(conv.id, { address });
  el.composer.focus();
  // For tests: counts finished "+ New" actions, whether they made a conversation or reused one.
  document.body.dataset.newCount = String(Number(document.body.dataset.newCount || 0) + 1);
}

/**
 * A conversation left exactly as it was made (see `isUntouched`, and no files) is deleted when the
 * person opens another one: empty conversations never pile up in the list.
 */
async function discardIfUntouched(conv) {
  if (!conv || conv.id === state.conv?.id || state.turn?.convId === conv.id) return false;
  if (localStorage.getItem(draftKey(conv.id)) || files.convId !== conv.id || files.count || files.pending.length) return false;
  // The page's copy may predate a message sent since: the list entry is newer.
  const entry = state.conversations.find((c) => c.id === conv.id);
  if (!isUntouched(conv) || entry?.streaming || entry?.message_count) return false;
  try {
    await api.deleteConversation(conv.id);
  } catch {
    return false; // it stays; nothing is lost
  }
  state.reusable.delete(conv.id);
  state.conversations = state.conversations.filter((c) => c.id !== conv.id);
  renderList();
  return true;
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
function followAddress() {
  const id = hashId();
  if (!id || id === state.conv?.id || id === state.opening) return;
  openConversation(id, { address: "keep" }).catch(showError);
}

/**
 * The address names no conversation of this person's (deleted, mistyped, someone else's): say so,
 * instead of showing another conversation a message would then be sent to.
 */
async function showNotFound(id, address) {
  detach();
  clearFailure();
  const left = state.conv;
  state.conv = null;
  await discardIfUntouched(left);
  await files.load(null);
  if (address !== "keep") showAddress(id, address);
  el.composer.value = "";
  setMissing(true);
  renderHeader();
  el.title.textContent = "Conversation not found";
  renderTranscript();
  renderList();
  closeSidebar();
}

/** Whether the page shows "not found": nothing to send to, so the composer waits. */
function setMissing(missing) {
  $("not-found").hidden = !missing;
  el.composer.disabled = missing;
  el.send.disabled = missing;
  $("attach").disabled = missing;
}

// The server names a new conversation with the same words the page shows for no title.
const untitled = (title) => !title || title === UNTITLED;

function isUntouched(conv) {
  return !conv.messages?.length && !conv.archive?.length && untitled(conv.title) && !conv.pinned &&
    (conv.created_at === conv.updated_at || state.reusable.has(conv.id));
}

async function findUntouched() {
  const candidates = state.conversations.filter((c) => c.message_count === 0 && untitled(c.title)).slice(0, 5);
  for (const c of candidates) {
    if (localStorage.getItem(draftKey(c.id)) || c.id === state.turn?.convId) continue;
    if (c.id === state.conv?.id && (files.count || files.pending.length)) continue;
    const conv = c.id === state.conv?.id ? state.conv : await api.conversation(c.id).catch(() => null);
    if (conv && isUntouched(conv)) return conv;
  }
  return null;
}

// ---------------------------------------------------------------- rendering

function renderPicker() {
  const current = state.conv?.model ?? el.picker.value;
  const groups = (state.models?.tiers || []).map((tier) => {
    const group = document.createElement("optgroup");
    group.label = tierLabel(tier.tier);
    for (const m of tier.models) group.append(new Option(m.label || m.id, m.id));
    return group;
  });
  // A conversation may use a model since removed from the lineup; keep it selectable.
  if (current && !state.modelIndex.has(current)) {
    const other = document.createElement("optgroup");
    other.label = "Other";
    other.append(new Option(current, current));
    groups.push(other);
  }
  el.picker.replaceChildren(...groups);
  el.picker.value = current || state.models?.default || "";
}

function renderList() {
  // Replacing the items blurs an armed Delete; the new button stays armed and takes the focus back.
  const armed = state.armedDelete;
  const typing = state.renaming?.input === document.activeElement ? state.renaming.input : null;
  const selection = typing && [typing.selectionStart, typing.selectionEnd, typing.selectionDirection];
  state.redrawingList = true;
  try {
    el.list.replaceChildren(...state.conversations.filter(listed).map(renderListItem));
  } finally {
    state.redrawingList = false;
  }
  const again = armed && el.list.querySelector(`li[data-id="${CSS.escape(armed)}"] .conv-delete`);
  state.armedDelete = again ? armed : null;
  again?.focus();
  // A title being typed keeps its place and caret; its conversation gone from the list, it is dropped.
  if (state.renaming && !state.renaming.input.isConnected) state.renaming = null;
  else if (typing) {
    typing.focus();
    typing.setSelectionRange(...selection);
  }
  $("show-archived").hidden = !state.organizes && !state.archivedView;
  $("list-head").hidden = !state.archivedView;
  if (state.archivedView && !state.conversations.length) {
    el.list.append(node("li", "faint conv-empty", "No archived conversations."));
  }
}

/**
 * An empty "New conversation" is listed only where it is open or has a draft: one another browser
 * or tab just made is nobody's business here until it has a message (as in other chat apps).
 */
function listed(c) {
  return !!(c.message_count || !untitled(c.title) || c.pinned || c.streaming || c.id === state.conv?.id ||
    localStorage.getItem(draftKey(c.id)));
}

function renderListItem(c) {
  const li = document.createElement("li");
  li.className = "conv-item";
  li.dataset.id = c.id;
  if (c.id === state.conv?.id) {
    li.classList.add("active");
    li.setAttribute("aria-current", "true");
  }
  const title = c.title || UNTITLED;
  const open = document.createElement("button");
  open.type = "button";
  open.className = "conv-open";
  open.title = title;
  const name = document.createElement("span");
  name.className = "conv-name";
  name.textContent = title;
  const meta = document.createElement("span");
  meta.className = "conv-meta";
  const model = state.modelIndex.get(c.model)?.label || c.model;
  meta.textContent = `${model} · ${c.message_count} ${c.message_count === 1 ? "message" : "messages"}`;
  open.append(name, meta);
  if (c.streaming) {
    li.classList.add("running");
    const mark = node("span", "conv-running", "●");
    mark.dataset.test = "conversation-running";
    mark.title = "A reply is being written";
    mark.setAttribute("aria-label", "A reply is being written");
    meta.prepend(mark, " ");
  }
  open.addEventListener("click", () => openConversation(c.id).catch(showError));

  const rename = button("✎", { className: "icon small", label: `Rename “${title}”`, onClick: () => startRename(li, c) });
  const del = button("🗑", { className: "icon small conv-delete", label: `Delete “${title}”` });
  del.addEventListener("click", () => confirmDelete(del, c));
  del.addEventListener("blur", () => disarmDelete(del));
  if (state.armedDelete === c.id) armDelete(del);
  li.append(state.renaming?.id === c.id ? state.renaming.input : open);
  // Pin and archive only where the server keeps them (its entries carry the fields).
  if ("pinned" in c) {
    li.classList.toggle("pinned", !!c.pinned);
    const pin = button("📌", { className: "icon small conv-pin", label: c.pinned ? `Unpin “${title}”` : `Pin “${title}”` });
    pin.dataset.test = "pin-toggle";
    pin.setAttribute("aria-pressed", String(!!c.pinned));
    pin.addEventListener("click", () => organize(c.id, { pinned: !c.pinned }).catch(showError));
    const archive = button(c.archived ? "⇪" : "🗄", {
      className: "icon small conv-archive", label: c.archived ? `Unarchive “${title}”` : `Archive “${title}”`,
    });
    archive.dataset.test = "archive-toggle";
    archive.addEventListener("click", () => organize(c.id, { archived: !c.archived }).catch(showError));
    li.append(pin, archive);
  }
  li.append(rename, del);
  return li;
}

function startRename(li, c) {
  const input = document.createElement("input");
  input.className = "conv-rename";
  input.value = c.title || "";
  input.setAttribute("aria-label", "Conversation title");
  let done = false;
  const finish = async (save) => {
    if (done || state.redrawingList) return;
    done = true;
    if (state.renaming?.input === input) state.renaming = null;
    const title = input.value.trim();
    if (save && title && title !== c.title) {
      try {
        const updated = await api.patchConversation(c.id, { title });
        if (state.conv?.id === c.id) {
          state.conv = updated;
          renderHeader();
        }
      } catch (err) {
        showError(err);
      }
    }
    await loadList().catch(showError);
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.isComposing && e.keyCode !== 229) {
      e.preventDefault();
      finish(true);
    } else if (e.key === "Escape") {
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(true));
  li.querySelector(".conv-open").replaceWith(input);
  state.renaming = { id: c.id, input };
  input.focus();
  input.select();
}

// Deleting asks once, in place: the first click arms the button, the second deletes.
function confirmDelete(button, c) {
  if (button.dataset.armed !== "true") {
    armDelete(button);
    state.armedDelete = c.id;
    button.focus();
    return;
  }
  state.armedDelete = null;
  deleteConversation(c.id).catch(showError);
}

function armDelete(button) {
  button.dataset.armed = "true";
  button.textContent = "Delete?";
  button.classList.add("danger");
}

function disarmDelete(button) {
  state.armedDelete = null;
  button.dataset.armed = "false";
  button.textContent = "🗑";
  button.classList.remove("danger");
}

async function deleteConversation(id) {
  // The server stops a running turn before it deletes.
  if (state.turn?.convId === id) detach();
  state.deleting.add(id);
  try {
    await api.deleteConversation(id);
    await leaveDeleted(id);
  } finally {
    state.deleting.delete(id);
  }
}

/** After a conversation is gone: forget its draft, and open another if it was the open one. */
async function leaveDeleted(id) {
  localStorage.removeItem(draftKey(id));
  await loadList();
  if (state.conv?.id !== id) return;
  state.conv = null;
  // The deleted conversation's history entry becomes the one opened instead.
  if (state.conversations.length) await openConversation(state.conversations[0].id, { address: "replace" });
  else await newConversation({ address: "replace" });
}

/** PATCH pinned/archived; a server that refuses the fields loses the controls, not the person's time. */
async function organize(id, patch) {
  let updated;
  try {
    updated = await api.patchConversation(id, patch);
  } catch (err) {
    if (err.status === 422 && /pinned|archived/.test(err.message)) {
      state.organizes = false;
      for (const c of state.conversations) {
        delete c.pinned;
        delete c.archived;
      }
      renderList();
      renderHeader();
      toast("This server cannot pin or archive conversations yet.");
      return;
    }
    throw err;
  }
  if (state.conv?.id === id) {
    state.conv = updated;
    renderHeader();
  }
  await loadList();
}

async function showArchived(on) {
  state.archivedView = on;
  $("show-archived").setAttribute("aria-pressed", String(on));
  $("show-archived").textContent = on ? "All conversations" : "Archived";
  await loadList();
}

function renderMenu() {
  const conv = state.conv;
  for (const [id, format] of [["export-md", "md"], ["export-json", "json"]]) {
    const link = $(id);
    if (conv) link.href = exportUrl(conv.id, format);
    else link.removeAttribute("href");
  }
  const organizes = !!conv && state.organizes !== false && "pinned" in conv;
  $("menu-pin").hidden = !organizes;
  $("menu-archive").hidden = !organizes;
  if (organizes) {
    $("menu-pin").textContent = conv.pinned ? "Unpin" : "Pin";
    $("menu-archive").textContent = conv.archived ? "Unarchive" : "Archive";
  }
}

function renderHeader() {
  const conv = state.conv;
  renderMenu();
  el.title.textContent = conv?.title || UNTITLED;
  document.title = conv?.title ? `${conv.title} · Chat` : "Chat";
  renderPicker();
  // Replies the totals never counted (imported ones) have no usage of their own.
  renderUsage(conv?.totals, conv?.messages?.filter((m) => m.role === "assistant" && !m.usage).length ?? 0);
  renderContext(conv?.context);
}

function renderUsage(t, uncounted) {
  if (!t) {
    el.usage.replaceChildren();
    return;
  }
  el.usage.replaceChildren(...usageItems(t, uncounted).map(([key, text]) => node("span", `usage-${key}`, text)));
  el.usage.title = "Session totals for this conversation. Cached % is the share of input read from the prompt cache.";
}

function renderContext(ctx) {
  if (!ctx) {
    el.contextBar.replaceChildren();
    return;
  }
  const { items, over, account } = contextBar(ctx);
  el.contextBar.classList.toggle("over", over);
  el.contextBar.title = account;
  el.contextBar.setAttribute("aria-label", `Context: ${account}`);
  el.contextBar.replaceChildren(...items);
}

function isReasoning(model) {
  return !!state.modelIndex.get(model)?.reasoning;
}

function renderTranscript() {
  const stick = nearBottom();
  const messages = state.conv?.messages || [];
  const options = { reasoning: isReasoning, userExtra: (m) => files.chipsFor(m) };
  const notices = [...(state.conv?.archive || []), ...messages].filter((m) => m.role === "notice");
  const archive = renderArchive(state.conv?.archive, { ...options, dropped: notices.some((m) => m.compression?.failed) });
  // Re-reading the conversation keeps open what the person opened: folded history, a long message
  // shown whole, a reply's trail (the re-read after a reply often lands just after such a click).
  if (archive && el.messages.querySelector("[data-test=folded]")?.open) archive.open = true;
  const opened = openedMessages();
  const live = state.turn && state.turn.convId === state.conv?.id ? state.turn.view : null;
  const shown = messages.filter((m) => !live || m.id !== live.el.dataset.id)
    .map((m) => reopen(decorate(m, renderMessage(m, options)), opened));
  el.messages.replaceChildren(...(archive ? [archive] : []), ...shown, ...(live ? [live.el] : []));
  renderGreeting();
  renderRegenerate();
  renderFailure();
  scrollToBottom(stick);
}

/** Ids of the shown messages the person opened: long ones shown whole, replies with their trail open. */
function openedMessages() {
  // A streaming reply's trail is open because it streams, not because the person opened it.
  const ids = (selector) => new Set([...el.messages.querySelectorAll(selector)].map((e) => e.closest("[data-id]"))
    .filter((m) => m && m.dataset.status !== "streaming").map((m) => m.dataset.id));
  return { whole: ids("[data-test=show-more][aria-expanded=true]"), trails: ids("details[data-test=activity][open]") };
}

/** Open in a freshly drawn message what was open in the one it replaces. */
function reopen(node_, opened) {
  const id = node_.dataset.id;
  if (opened.whole.has(id)) node_.querySelector(":scope > [data-test=show-more]")?.click();
  const trail = node_.querySelector("details[data-test=activity]");
  if (trail && opened.trails.has(id)) trail.open = true;
  return node_;
}

/** Add a message's own controls: the branch switcher, and Edit on what the person typed. */
function decorate(m, node_) {
  if (m.role === "notice") return node_;
  const busy = !!state.turn || !!state.conv?.streaming;
  const switcher = branchSwitcher(m.id, state.conv?.branches, {
    disabled: busy, onSwitch: (sibling) => switchBranch(sibling).catch(showError),
  });
  let actions = node_.querySelector(".message-actions");
  if (m.role === "user") {
    actions = node("div", "message-actions");
    // Drawn by CSS (no text of its own), so the message reads as exactly what was typed.
    const edit = button("", { className: "small edit-message", label: "Edit and resend", onClick: () => startEdit(m, node_) });
    edit.dataset.test = "edit-message";
    edit.title = "Change this message and send it again (the old version is kept)";
    edit.disabled = busy;
    actions.append(edit);
    node_.append(actions);
  }
  if (switcher) actions.prepend(switcher);
  return node_;
}

/** Make the path through `messageId` the current one (the server answers the Conversation). */
async function switchBranch(messageId) {
  if (state.turn || !state.conv) return;
  const conv = await api.branch(state.conv.id, messageId);
  if (state.conv?.id !== conv.id) return;
  clearFailure();
  state.conv = conv;
  renderHeader();
  renderTranscript();
}

/** Edit a sent message in place; sending it starts a new branch beside the old one. */
function startEdit(m, article) {
  if (state.turn || article.querySelector(".edit-box")) return;
  const box = node("div", "edit-box");
  const input = document.createElement("textarea");
  input.className = "edit-input";
  input.dataset.test = "edit-input";
  input.setAttribute("aria-label", "Edit the message");
  input.value = m.content || "";
  input.rows = Math.min(12, Math.max(2, input.value.split("\n").length));
  const cancel = button("Cancel", { className: "small" });
  cancel.dataset.test = "edit-cancel";
  const save = button("Send", { className: "primary small" });
  save.dataset.test = "edit-send";
  const row = node("div", "edit-actions");
  row.append(cancel, save);
  box.append(input, row);
  const hidden = [...article.children];
  for (const child of hidden) child.hidden = true;
  article.append(box);
  const close = () => {
    box.remove();
    for (const child of hidden) child.hidden = false;
  };
  cancel.addEventListener("click", close);
  const submit = () => {
    const text = input.value;
    if (!text.trim() || state.turn) return;
    resendEdited(m, text).catch(showError);
  };
  save.addEventListener("click", submit);
  input.addEventListener("keydown", (e) => {
    if (e.key === "Escape") {
      e.stopPropagation();
      close();
    } else if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
      e.preventDefault();
      submit();
    }
  });
  input.focus();
}

/** Send an edited message as a sibling of `m`: the transcript from `m` on gives way to the new turn. */
async function resendEdited(m, text) {
  if (state.turn || !state.conv) return;
  clearFailure();
  const from = el.messages.querySelector(`[data-id="${CSS.escape(m.id)}"]`);
  for (let n = from; n; ) {
    const next = n.nextElementSibling;
    n.remove();
    n = next;
  }
  const userEl = renderUser({ content: text });
  el.messages.append(userEl);
  await runTurn("messages", { content: text, parent_id: m.parent_id ?? null }, { userEl, text });
}

/** An empty conversation greets with what this is and a few prompts to start from. */
function renderGreeting() {
  el.greeting.hidden = !!(!state.conv || state.turn || state.conv.messages?.length || state.conv.archive?.length);
}

/**
 * Only the last message, if it is a finished assistant reply, offers Regenerate; not when the
 * failure line under it already offers a Retry that would do the same.
 */
function renderRegenerate() {
  for (const old of el.messages.querySelectorAll("[data-test=regenerate]")) old.remove();
  if (state.turn || (state.failure && failureOffersTheWayBack(state.failure))) return;
  const last = [...el.messages.children].filter((m) => m.dataset.role && m.dataset.role !== "notice").at(-1);
  if (!last || last.dataset.role !== "assistant") return;
  const regen = button("↻ Regenerate", { onClick: () => regenerate() });
  regen.dataset.test = "regenerate";
  regen.title = "Answer the last message again with the model selected above";
  last.querySelector(".message-actions").append(regen);
}

function setStreaming(streaming) {
  el.send.textContent = streaming ? "Stop" : "Send";
  el.send.setAttribute("aria-label", streaming ? "Stop" : "Send");
  el.send.classList.toggle("stop", streaming);
  el.compressNow.disabled = streaming;
  el.app.classList.toggle("streaming", streaming);
  renderRegenerate();
}

function nearBottom() {
  const t = el.transcript;
  return t.scrollHeight - t.scrollTop - t.clientHeight < 80;
}

function scrollToBottom(force = false) {
  if (force || nearBottom()) el.transcript.scrollTop = el.transcript.scrollHeight;
}

// ---------------------------------------------------------------- turns

async function send() {
  const text = el.composer.value;
  // While another conversation is being opened, the one on screen is not where the address points.
  if (state.turn || !state.conv || state.opening || !text.trim()) return;
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
  clearFailure();
  setComposer("");
  const sentFiles = files.ready();
  const attachmentIds = sentFiles.map((f) => f.id);
  const body = attachmentIds.length ? { content: text, attachment_ids: attachmentIds } : { content: text };
  const userEl = renderUser({ content: text });
  const chips = files.chipsFor({ attachment_ids: attachmentIds });
  if (chips) userEl.append(chips);
  files.clearPending();
  el.messages.append(userEl);
  el.greeting.hidden = true;
  await runTurn("messages", body, { userEl, text, sentFiles });
}

async function regenerate() {
  if (state.turn || !state.conv) return;
  clearFailure();
  // The server drops the last assistant turn before answering again; mirror that now.
  const last = [...el.messages.children].at(-1);
  if (last?.dataset.role === "assistant") last.remove();
  await runTurn("regenerate", {}, {});
}

/**
 * Stop the reply: the server stops the turn, saves what arrived as interrupted, and ends every
 * stream following it with `done` (`status: "interrupted"`). Works without a stream open too
 * (a reload that could not re-attach): the page then re-reads the conversation.
 */
async function stop() {
  const turn = state.turn;
  const convId = turn?.convId ?? (state.conv?.streaming ? state.conv.id : null);
  if (!convId) return;
  el.send.disabled = true;
  try {
    await api.stop(convId);
  } catch (err) {
    // The route is out of reach: at least stop reading, and say why.
    turn?.controller.abort();
    throw err;
  } finally {
    el.send.disabled = false;
  }
  if (!turn) {
    await refresh();
    return;
  }
  // The saved reply ends the stream at once; should the stream have gone quiet, let go of it.
  setTimeout(() => {
    if (state.turn === turn) turn.controller.abort();
  }, 3000);
}

/** Stop following the turn in this page (the reply goes on on the server). */
function detach() {
  const turn = state.turn;
  if (!turn) return;
  turn.detached = true;
  turn.controller.abort();
  state.turn = null;
  setStreaming(false);
}

function newTurn(convId, model, { userEl = null, sentFiles = [] } = {}) {
  const view = new AssistantView({ model, reasoning: isReasoning(model) });
  view.startStreaming();
  const turn = { convId, controller: new AbortController(), view, userEl, sentFiles };
  state.turn = turn;
  setStreaming(true);
  return turn;
}

/** Run one turn stream to its end, then settle the transcript by what ended it. */
async function runTurn(kind, body, { userEl = null, text = null, sentFiles = [] }) {
  const conv = state.conv;
  const turn = newTurn(conv.id, conv.model, { userEl, sentFiles });
  el.messages.append(turn.view.el);
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
  if (state.conv?.id !== turn.convId || state.turn) return true;
  state.conv = conv;
  renderHeader();
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
async function follow(conv) {
  if (state.turn || state.conv?.id !== conv.id) return;
  const checkpoint = conv.turn?.assistant_message_id;
  const turn = newTurn(conv.id, conv.model);
  const saved = checkpoint && el.messages.querySelector(`[data-id="${CSS.escape(checkpoint)}"]`);
  if (saved) saved.replaceWith(turn.view.el);
  else el.messages.append(turn.view.el);
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
async function readTurn(turn, res, lastId) {
  const reopen = (after) => attachTurn(turn.convId, after, turn.controller.signal);
  for await (const { event, data } of followTurn(res, reopen, { lastId })) {
    if (event === "done" || event === "error") return { type: event, data };
    // Follow the reply only if the person has not scrolled up to read.
    const stick = nearBottom();
    handleEvent(turn, event, data);
    if (stick) scrollToBottom(true);
  }
  // Nothing runs any more (the turn ended while the page was not reading): the store knows how.
  return { type: "ended" };
}

async function endTurn(turn, outcome, text) {
  if (turn.detached) return;
  state.readToEnd = turn.convId;
  if (state.turn === turn) {
    state.turn = null;
    setStreaming(false);
  }
  await settleTurn(turn, outcome, text).catch(showError);
}

function handleEvent(turn, event, data) {
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
    case "compression": {
      // A replayed turn's notice may already be in the transcript, read with the conversation.
      if (data.notice?.id && el.messages.querySelector(`[data-id="${CSS.escape(data.notice.id)}"]`)) break;
      // The server sends the notice it stored; older servers only the numbers.
      const notice = renderNotice(data.notice ?? { content: describeCompression(data) });
      el.messages.insertBefore(notice, userEl || view.el);
      break;
    }
    case "reasoning":
    case "search":
    case "fetch":
    case "tool":
      view.addActivity(event, data);
      break;
    case "delta":
      view.addText(data.text);
      break;
    case "warning":
      view.addWarning(data.message, data.code);
      break;
  }
}

async function settleTurn(turn, outcome, text) {
  const { view, userEl } = turn;
  const here = state.conv?.id === turn.convId;
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
        state.awaitingSave = turn.convId;
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
      state.failure = { ...data };
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
      state.failure = {
        kind: "request", message: outcome.error.message, draft: text, retry_after: null,
        retryable: status === 409 || status >= 500,
      };
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
      state.failure = {
        kind: "upstream", message: "The connection to the server was lost.", retry_after: null,
      };
      await refresh().catch(showError);
      const kept = state.conv.messages.some((m) => m.role === "user" && m.id === userEl?.dataset.id);
      if (text != null && !kept) {
        // The message never made it into the conversation: hand it back rather than lose it.
        userEl?.remove();
        state.failure.draft = text;
        returnDraft(turn.convId, text);
        files.restore(turn.convId, turn.sentFiles);
      }
      renderFailure();
    }
  }
}

/** A first message that failed leaves its conversation empty: "+ New" may take it again. */
function noteIfLeftEmpty(convId) {
  if (state.conv?.id === convId && !state.conv.messages?.length) state.reusable.add(convId);
}

// ---------------------------------------------------------------- failures

const FAILURE_HINTS = {
  auth: "The gateway rejected the API key, or the account is out of credit.",
  rate_limited: "The gateway is rate limiting requests.",
  context_overflow: "The conversation no longer fits the model's context window.",
  refused: "The model or the gateway's filter refused this request.",
  model_unavailable: "This model is not available on the gateway right now.",
  upstream: "The gateway or the network failed.",
  request: "The server did not accept the request.",
};

function clearFailure() {
  if (state.countdown) clearInterval(state.countdown);
  state.countdown = null;
  state.failure = null;
  el.failure.replaceChildren();
}

function renderFailure() {
  if (state.countdown) clearInterval(state.countdown);
  state.countdown = null;
  const f = state.failure;
  if (!f) {
    el.failure.replaceChildren();
    return;
  }
  const line = document.createElement("div");
  line.className = "failure";
  line.dataset.test = "error";
  line.dataset.kind = f.kind;
  line.setAttribute("role", "alert");
  const text = document.createElement("div");
  text.className = "failure-text";
  const message = document.createElement("strong");
  message.textContent = f.message || FAILURE_HINTS[f.kind] || "Something went wrong.";
  const hint = document.createElement("span");
  hint.className = "failure-hint";
  hint.textContent = hintFor(f);
  text.append(message, " ", hint);
  const actions = document.createElement("div");
  actions.className = "failure-actions";
  actions.append(...actionsFor(f, hint));
  line.append(text, actions);
  el.failure.replaceChildren(line);
  scrollToBottom(true);
}

function hintFor(f) {
  let hint = FAILURE_HINTS[f.kind] || "";
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
function failureOffersTheWayBack(f) {
  return f.kind !== "refused" && f.kind !== "model_unavailable";
}

function actionsFor(f, hint) {
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
        ? [actionButton("Edit message", () => el.composer.focus())]
        : [actionButton("Rewind and edit", (b) => busy(b, rewind))];
    case "model_unavailable":
      return [actionButton("Choose another model", chooseModel)];
    default:
      // The same request again cannot work: the message itself has to change.
      if (f.retryable === false) {
        return f.draft != null ? [actionButton("Edit message", () => el.composer.focus())] : [];
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
  state.countdown = setInterval(() => {
    if (tick() <= 0) {
      clearInterval(state.countdown);
      state.countdown = null;
      status.textContent = "Retrying…";
      retry().catch(showError);
    }
  }, 1000);
  return [status, actionButton("Retry now", (b) => busy(b, retry), false)];
}

/** Answer again: resend a rolled-back message (as it now reads in the composer) or regenerate. */
async function retry() {
  const f = state.failure;
  if (!f || state.turn) return;
  if (f.draft != null) {
    if (!el.composer.value.trim()) setComposer(f.draft);
    await send();
  } else {
    await regenerate();
  }
}

async function compressAndRetry() {
  // The notice the server stores at the fold shows in the transcript once the retry refreshes it.
  await api.compress(state.conv.id);
  await retry();
}

async function rewind() {
  const { content } = await api.rewind(state.conv.id);
  clearFailure();
  await refresh();
  returnDraft(state.conv.id, content);
}

function chooseModel() {
  el.picker.focus();
  try {
    el.picker.showPicker();
  } catch {
    // showPicker is missing in older browsers; focus alone still lets the keyboard open it.
  }
}

// ---------------------------------------------------------------- search, import, shortcuts

/** Open a conversation at one message (a search hit), scrolled to it and marked for a moment. */
async function openAt(id, messageId) {
  if (state.archivedView && !state.conversations.some((c) => c.id === id)) await showArchived(false);
  await openConversation(id);
  if (!messageId) return;
  const onPath = [...(state.conv.archive || []), ...state.conv.messages].some((m) => m.id === messageId);
  // A hit on another branch: make its branch the current one first (not while a reply runs).
  if (!onPath && !state.turn) await switchBranch(messageId).catch(() => {});
  const target = el.messages.querySelector(`[data-id="${CSS.escape(messageId)}"]`);
  if (!target) return;
  const folded = target.closest("details");
  if (folded) folded.open = true;
  for (const old of el.messages.querySelectorAll("[data-highlighted]")) old.removeAttribute("data-highlighted");
  target.dataset.highlighted = "true";
  target.scrollIntoView({ block: "center" });
  setTimeout(() => target.removeAttribute("data-highlighted"), 4000);
}

async function importFile(file) {
  const box = $("import-box");
  const bar = $("import-progress");
  const status = $("import-status");
  status.classList.remove("error-text");
  status.textContent = `Uploading ${file.name}…`;
  bar.value = 0;
  box.hidden = false;
  try {
    const result = await upload("/api/import", file, (fraction) => {
      bar.value = fraction;
      // The server reads the whole file once it has arrived.
      if (fraction >= 1) status.textContent = `Reading ${file.name}…`;
    });
    const n = result.imported.length;
    // A conversation whose model is not in the lineup now uses the default one (its notice says so).
    const replaced = result.warnings?.filter((w) => w.code === "model_replaced").length || 0;
    status.textContent = `Imported ${n} ${n === 1 ? "conversation" : "conversations"}.` +
      (replaced ? ` ${replaced} now ${replaced === 1 ? "uses" : "use"} the default model: theirs is not in the lineup.` : "");
    if (state.archivedView) await showArchived(false);
    else await loadList();
  } catch (err) {
    status.textContent = `Not imported: ${err.message}`;
    status.classList.add("error-text");
  } finally {
    box.hidden = true;
  }
}

async function copyLastReply() {
  if (!state.conv) return;
  // Read from the server: a reply that just finished may not be in the page's copy yet.
  const conv = await api.conversation(state.conv.id);
  const last = conv.messages.filter((m) => m.role === "assistant" && m.content).at(-1);
  if (!last) {
    toast("There is no reply to copy yet.");
    return;
  }
  await copyText(last.content);
  toast("Copied the last reply as Markdown.");
}

function typingInField(target) {
  return target instanceof HTMLElement &&
    (target.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(target.tagName));
}

function onShortcut(e) {
  const mod = e.ctrlKey || e.metaKey;
  const key = e.key.toLowerCase();
  if (mod && !e.shiftKey && !e.altKey && key === "k") {
    e.preventDefault();
    for (const dialog of document.querySelectorAll("dialog[open]")) if (dialog.id !== "search") return;
    search.show();
  } else if (mod && e.shiftKey && key === "o") {
    e.preventDefault();
    newConversation().catch(showError);
  } else if (mod && e.shiftKey && key === "c") {
    e.preventDefault();
    copyLastReply().catch(showError);
  } else if (e.key === "Escape") {
    // An open dialog takes Esc for itself; otherwise it stops a reply, then closes the sidebar.
    if (document.querySelector("dialog[open]") || e.target.classList?.contains("conv-rename")) return;
    if ($("conv-menu").open) $("conv-menu").open = false;
    else if (el.app.classList.contains("sidebar-open")) closeSidebar();
    else if (state.turn || state.conv?.streaming) stop().catch(showError);
  } else if (e.key === "?" && !mod && !e.altKey && !typingInField(e.target) && !document.querySelector("dialog[open]")) {
    e.preventDefault();
    $("shortcuts").showModal();
  }
}

// ---------------------------------------------------------------- misc

let toastTimer = null;

function toast(text) {
  el.toast.textContent = text;
  el.toast.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => {
    el.toast.hidden = true;
  }, 5000);
}

function showError(err) {
  console.error(err);
  if (err?.status === 401) showAccountLogin() || showLogin();
  else toast(err?.message || String(err));
}

/** A server with ACCESS_TOKEN answers 401 until the page trades the token for a login cookie. */
function showLogin() {
  const dialog = $("login");
  if (!dialog.open) dialog.showModal();
  $("login-token").focus();
}

async function logIn(event) {
  event.preventDefault();
  try {
    await api.login($("login-token").value);
    location.reload();
  } catch (err) {
    $("login-status").textContent = err.message;
  }
}

function openSidebar() {
  el.app.classList.add("sidebar-open");
  el.scrim.hidden = false;
  el.sidebarToggle.setAttribute("aria-expanded", "true");
  el.list.querySelector(".active .conv-open, .conv-open")?.focus();
}

function closeSidebar() {
  el.app.classList.remove("sidebar-open");
  el.scrim.hidden = true;
  el.sidebarToggle.setAttribute("aria-expanded", "false");
}

async function changeModel() {
  const model = el.picker.value;
  if (!state.conv || model === state.conv.model) return;
  try {
    const updated = await api.patchConversation(state.conv.id, { model });
    state.conv = updated;
    renderHeader();
    loadList().catch(showError);
  } catch (err) {
    el.picker.value = state.conv.model;
    showError(err);
  }
}

async function compressNow() {
  if (!state.conv || state.turn) return;
  el.compressNow.disabled = true;
  try {
    const result = await api.compress(state.conv.id);
    // A fold leaves its notice in the transcript; only "nothing to do" needs saying here.
    if (!result.folded && !result.dropped) toast(describeCompression(result));
    await refresh();
  } catch (err) {
    showError(err);
  } finally {
    el.compressNow.disabled = !!state.turn;
  }
}

async function copyCode(copy) {
  await copyText(copy.closest(".code-block").querySelector("code").textContent);
  copy.textContent = "Copied";
  setTimeout(() => {
    copy.textContent = "Copy";
  }, 1500);
}

const BANNER_DISMISSED = "demo-banner-dismissed";

function dismissBanner() {
  el.banner.hidden = true;
  localStorage.setItem(BANNER_DISMISSED, "1");
}

/** The conversation id in the address (#id), or "" when it is missing or not decodable. */
function hashId() {
  try {
    return decodeURIComponent(location.hash.slice(1));
  } catch {
    // A hand-typed or truncated address (#%E0%A4%A) names no conversation: open the latest.
    return "";
  }
}

function wire() {
  el.form.addEventListener("submit", (e) => {
    e.preventDefault();
    if (state.turn) stop().catch(showError);
    else send().catch(showError);
  });
  el.composer.addEventListener("keydown", (e) => {
    if (e.key !== "Enter" || e.shiftKey) return;
    // Enter that confirms an IME candidate (Hangul, kana) must not send half a syllable. Safari
    // ends the composition before this keydown, so only its keyCode 229 tells.
    if (e.isComposing || e.keyCode === 229) return;
    e.preventDefault();
    if (!state.turn) send().catch(showError);
  });
  el.composer.addEventListener("input", () => {
    saveDraft();
    autosize();
  });
  el.picker.addEventListener("change", changeModel);
  $("new-conversation").addEventListener("click", () => newConversation().catch(showError));
  $("settings-open").addEventListener("click", () => settings.open().catch(showError));
  el.compressNow.addEventListener("click", compressNow);
  $("login-form").addEventListener("submit", logIn);
  // Without the token nothing works, so the login dialog cannot be dismissed.
  $("login").addEventListener("cancel", (e) => e.preventDefault());
  el.sidebarToggle.addEventListener("click", () =>
    el.app.classList.contains("sidebar-open") ? closeSidebar() : openSidebar());
  el.scrim.addEventListener("click", closeSidebar);
  document.addEventListener("keydown", onShortcut);
  // Back and Forward between conversations fire popstate, a typed or pasted #id hashchange.
  window.addEventListener("hashchange", followAddress);
  window.addEventListener("popstate", followAddress);
  $("not-found-new").addEventListener("click", () => newConversation().catch(showError));
  $("search-open").addEventListener("click", () => search.show());
  $("files-open").addEventListener("click", () => files.openPanel().catch(showError));
  $("import").addEventListener("click", () => $("import-input").click());
  $("import-input").addEventListener("change", (e) => {
    const [file] = e.target.files;
    e.target.value = "";
    if (file) importFile(file);
  });
  $("show-archived").addEventListener("click", () => showArchived(!state.archivedView).catch(showError));
  $("shortcuts-open").addEventListener("click", () => $("shortcuts").showModal());
  $("shortcuts-close").addEventListener("click", () => $("shortcuts").close());
  if (/Mac|iPhone|iPad/.test(navigator.platform)) for (const k of document.querySelectorAll("kbd.mod")) k.textContent = "⌘";
  $("menu-pin").addEventListener("click", () => {
    $("conv-menu").open = false;
    if (state.conv) organize(state.conv.id, { pinned: !state.conv.pinned }).catch(showError);
  });
  $("menu-archive").addEventListener("click", () => {
    $("conv-menu").open = false;
    if (state.conv) organize(state.conv.id, { archived: !state.conv.archived }).catch(showError);
  });
  for (const id of ["export-md", "export-json"]) $(id).addEventListener("click", () => { $("conv-menu").open = false; });
  document.addEventListener("click", (e) => {
    if (!$("conv-menu").contains(e.target)) $("conv-menu").open = false;
  });
  el.messages.addEventListener("click", (e) => {
    const copy = e.target.closest("button.copy");
    if (copy) copyCode(copy).catch(showError);
  });
  $("demo-banner-dismiss").addEventListener("click", dismissBanner);
  for (const example of el.greeting.querySelectorAll("[data-test=example-prompt]")) {
    example.addEventListener("click", () => {
      setComposer(example.dataset.prompt || example.textContent);
      el.composer.focus();
    });
  }
}

async function boot() {
  wire();
  listen({ conversation: onConversation, deleted: onDeleted, turn: onTurn, reconnected });
  const [health, presets, tools] = await Promise.all([
    api.health().catch(() => null),
    api.presets().catch(() => []),
    api.tools().catch(() => []),
    loadModels(),
    loadList(),
  ]);
  state.health = health;
  state.presets = presets;
  state.tools = tools;
  el.banner.hidden = !health || health.gateway_configured !== false || !!localStorage.getItem(BANNER_DISMISSED);
  const wanted = hashId();
  const target = wanted || state.conversations.find(listed)?.id;
  if (target) await openConversation(target, { address: "replace" });
  else await newConversation({ address: "replace" });
  el.composer.focus();
  document.body.dataset.ready = "true";
}

startAuth().then((ready) => ready && boot()).catch(showError);
