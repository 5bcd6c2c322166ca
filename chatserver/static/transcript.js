// The transcript of the open conversation: drawn from the store's copy (keeping open what the
// person opened), each message's own controls (Edit, the branch switcher, Regenerate on the last
// reply), the greeting of an empty conversation, and following the bottom as replies grow.

import { api } from "./api.js";
import { branchSwitcher } from "./branches.js";
import { files } from "./composer.js";
import { clearFailure, failureOffersTheWayBack, renderFailure } from "./failures.js";
import { $, showError } from "./page.js";
import { isReasoning, setOpen, store } from "./store.js";
import { continueReply, regenerate, regenerateReply, runTurn } from "./turn.js";
import { button, node } from "./ui.js";
import { copyText, renderArchive, renderMessage, renderUser } from "./views.js";

const transcript = $("transcript");
const messages = $("messages");

export function renderTranscript() {
  const stick = nearBottom();
  const conv = store.conv;
  const shown = conv?.messages || [];
  const options = { reasoning: isReasoning, userExtra: (m) => files.chipsFor(m) };
  const notices = [...(conv?.archive || []), ...shown].filter((m) => m.role === "notice");
  const archive = renderArchive(conv?.archive, { ...options, dropped: notices.some((m) => m.compression?.failed) });
  // Re-reading the conversation keeps open what the person opened: folded history, a long message
  // shown whole, a reply's trail (the re-read after a reply often lands just after such a click).
  if (archive && messages.querySelector("[data-test=folded]")?.open) archive.open = true;
  const opened = openedMessages();
  const live = store.turn && store.turn.convId === conv?.id ? store.turn.view : null;
  const drawn = shown.filter((m) => !live || m.id !== live.el.dataset.id)
    .map((m) => reopen(decorate(m, renderMessage(m, options)), opened));
  messages.replaceChildren(...(archive ? [archive] : []), ...drawn, ...(live ? [live.el] : []));
  renderGreeting();
  renderRegenerate();
  renderFailure();
  scrollToBottom(stick);
}

/** Ids of the shown messages the person opened: long ones shown whole, replies with their trail open. */
function openedMessages() {
  // A streaming reply's trail is open because it streams, not because the person opened it.
  const ids = (selector) => new Set([...messages.querySelectorAll(selector)].map((e) => e.closest("[data-id]"))
    .filter((m) => m && m.dataset.status !== "streaming").map((m) => m.dataset.id));
  return { whole: ids("[data-test=show-more][aria-expanded=true]"), trails: ids("details[data-test=activity][open]") };
}

/** Open in a freshly drawn message what was open in the one it replaces. */
function reopen(message, opened) {
  const id = message.dataset.id;
  if (opened.whole.has(id)) message.querySelector(":scope > [data-test=show-more]")?.click();
  const trail = message.querySelector("details[data-test=activity]");
  if (trail && opened.trails.has(id)) trail.open = true;
  return message;
}

/** Add a message's own controls: the branch switcher, and Edit on what the person typed. */
function decorate(m, message) {
  if (m.role === "notice") return message;
  const busy = !!store.turn || !!store.conv?.streaming;
  const switcher = branchSwitcher(m.id, store.conv?.branches, {
    disabled: busy, onSwitch: (sibling) => switchBranch(sibling).catch(showError),
  });
  let actions = message.querySelector(".message-actions");
  if (m.role === "user") {
    actions = node("div", "message-actions");
    // Drawn by CSS (no text of its own), so the message reads as exactly what was typed.
    const edit = button("", { className: "small edit-message", label: "Edit and resend", onClick: () => startEdit(m, message) });
    edit.dataset.test = "edit-message";
    edit.title = "Change this message and send it again (the old version is kept)";
    edit.disabled = busy;
    actions.append(edit);
    message.append(actions);
  }
  if (m.role === "assistant" && m.status !== "streaming") actions.append(...replyActions(m, message, busy));
  if (switcher) actions.prepend(switcher);
  return message;
}

/**
 * What any saved reply offers: Regenerate it (with a model to choose), Edit it (the person's
 * version becomes a sibling used from then on), and, on the reply that ends the path when it was
 * interrupted or cut at the output limit, Continue.
 */
function replyActions(m, article, busy) {
  const out = [];
  const again = button("Regenerate…", { onClick: () => pickModel(m, article) });
  again.dataset.test = "regenerate-reply";
  again.title = "Answer this message again, with this or another model (this reply and what followed it are kept)";
  const edit = button("Edit", { onClick: () => editReply(m, article) });
  edit.dataset.test = "edit-reply";
  edit.title = "Write this reply your way: the model reads your version from now on (the original is kept)";
  out.push(again, edit);
  const cut = m.status === "interrupted" || (m.warnings || []).some((w) => w.code === "max_tokens");
  if (cut && m.content && endsThePath(m.id)) {
    const more = button("Continue", { onClick: () => continueReply(m).catch(showError) });
    more.dataset.test = "continue-reply";
    more.title = "Ask the model to go on from where this reply stopped";
    out.push(more);
  }
  for (const b of out) b.disabled = busy;
  return out;
}

function endsThePath(id) {
  const nodes = (store.conv?.messages || []).filter((m) => m.role !== "notice");
  return nodes.at(-1)?.id === id;
}

/** The inline choice of the model that answers again (the conversation's is preselected). */
function pickModel(m, article) {
  if (store.turn || article.querySelector(".reply-tool")) return;
  const row = node("div", "reply-tool");
  row.dataset.test = "regenerate-picker";
  const select = document.createElement("select");
  select.dataset.test = "regenerate-model";
  select.setAttribute("aria-label", "Model to answer with");
  const ids = (store.models?.tiers || []).flatMap((t) => t.models.map((model) => model.id));
  select.replaceChildren(...ids.map((id) => new Option(id, id, false, id === store.conv?.model)));
  const go = button("Regenerate", { className: "primary small" });
  go.dataset.test = "regenerate-go";
  const cancel = button("Cancel");
  row.append(select, go, cancel);
  article.append(row);
  cancel.addEventListener("click", () => row.remove());
  go.addEventListener("click", () => regenerateReply(m.id, select.value).catch(showError));
  select.focus();
}

/** Edit a reply in place; saving stores the person's version beside the model's and makes it current. */
function editReply(m, article) {
  if (store.turn || article.querySelector(".edit-box")) return;
  const box = node("div", "edit-box");
  const input = document.createElement("textarea");
  input.className = "edit-input";
  input.dataset.test = "edit-reply-input";
  input.setAttribute("aria-label", "Edit the reply");
  input.value = m.content || "";
  input.rows = Math.min(16, Math.max(3, input.value.split("\n").length));
  const cancel = button("Cancel");
  const save = button("Save", { className: "primary small" });
  save.dataset.test = "edit-reply-save";
  const row = node("div", "edit-actions");
  row.append(cancel, save);
  box.append(input, row);
  const hidden = [...article.children];
  for (const child of hidden) child.hidden = true;
  article.append(box);
  cancel.addEventListener("click", () => {
    box.remove();
    for (const child of hidden) child.hidden = false;
  });
  save.addEventListener("click", async () => {
    if (!input.value.trim() || store.turn || !store.conv) return;
    save.disabled = true;
    try {
      const conv = await api.editReply(store.conv.id, m.id, input.value);
      if (store.conv?.id !== conv.id) return;
      setOpen(conv);
      renderTranscript();
    } catch (err) {
      save.disabled = false;
      showError(err);
    }
  });
  input.focus();
}

/** Make the path through `messageId` the current one (the server answers the Conversation). */
export async function switchBranch(messageId) {
  if (store.turn || !store.conv) return;
  const conv = await api.branch(store.conv.id, messageId);
  if (store.conv?.id !== conv.id) return;
  clearFailure();
  setOpen(conv);
  renderTranscript();
}

/** Edit a sent message in place; sending it starts a new branch beside the old one. */
function startEdit(m, article) {
  if (store.turn || article.querySelector(".edit-box")) return;
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
    if (!text.trim() || store.turn) return;
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
  if (store.turn || !store.conv) return;
  clearFailure();
  const from = messages.querySelector(`[data-id="${CSS.escape(m.id)}"]`);
  for (let n = from; n; ) {
    const next = n.nextElementSibling;
    n.remove();
    n = next;
  }
  const userEl = renderUser({ content: text });
  messages.append(userEl);
  await runTurn("messages", { content: text, parent_id: m.parent_id ?? null }, { userEl, text });
}

/** An empty conversation greets with what this is and a few prompts to start from. */
export function renderGreeting() {
  const conv = store.conv;
  $("greeting").hidden = !!(!conv || store.turn || conv.messages?.length || conv.archive?.length);
}

/**
 * Only the last message, if it is a finished assistant reply, offers Regenerate; not when the
 * failure line under it already offers a Retry that would do the same.
 */
export function renderRegenerate() {
  for (const old of messages.querySelectorAll("[data-test=regenerate]")) old.remove();
  if (store.turn || failureOffersTheWayBack()) return;
  const last = [...messages.children].filter((m) => m.dataset.role && m.dataset.role !== "notice").at(-1);
  if (!last || last.dataset.role !== "assistant") return;
  const regen = button("↻ Regenerate", { onClick: () => regenerate() });
  regen.dataset.test = "regenerate";
  regen.title = "Answer the last message again with the model selected above";
  last.querySelector(".message-actions").append(regen);
}

export function nearBottom() {
  return transcript.scrollHeight - transcript.scrollTop - transcript.clientHeight < 80;
}

export function scrollToBottom(force = false) {
  if (force || nearBottom()) transcript.scrollTop = transcript.scrollHeight;
  updateJump();
}

/**
 * "Jump to latest": shown while a reply streams and the person has scrolled up from the bottom
 * (which also stops the transcript following the reply: turn.js follows only when near the
 * bottom). A click scrolls back down, and following resumes from there.
 */
const jump = $("jump-latest");

export function updateJump() {
  const streaming = !!messages.querySelector('[data-role="assistant"][data-status="streaming"]');
  const show = streaming && !nearBottom();
  if (jump.hidden === show) jump.hidden = !show;
}

/** A message element already in the transcript, by id (null when it is not drawn). */
export const drawnMessage = (id) => messages.querySelector(`[data-id="${CSS.escape(id)}"]`);

/** Append to the transcript (a message being sent, a reply arriving), or insert before `before`. */
export function place(el, before = null) {
  messages.insertBefore(el, before);
}

export const lastDrawn = () => [...messages.children].at(-1);

async function copyCode(copy) {
  await copyText(copy.closest(".code-block").querySelector("code").textContent);
  copy.textContent = "Copied";
  setTimeout(() => {
    copy.textContent = "Copy";
  }, 1500);
}

export function wireTranscript() {
  transcript.addEventListener("scroll", updateJump, { passive: true });
  jump.addEventListener("click", () => scrollToBottom(true));
  // A reply starting or ending streaming shows or hides the button without a scroll.
  new MutationObserver(updateJump).observe(messages, { subtree: true, attributeFilter: ["data-status"] });
  messages.addEventListener("click", (e) => {
    const copy = e.target.closest("button.copy");
    if (copy) copyCode(copy).catch(showError);
    // A footnote link and its way back scroll within the reply: the address names the
    // conversation, so `#fn…` must never reach it.
    const note = e.target.closest(".footnote-ref a, a.footnote-back");
    if (note) {
      e.preventDefault();
      const target = document.getElementById(note.getAttribute("href").slice(1));
      target?.scrollIntoView({ block: "center" });
      target?.classList.add("footnote-target");
      setTimeout(() => target?.classList.remove("footnote-target"), 1500);
    }
  });
}
