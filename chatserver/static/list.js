// The sidebar's list of conversations, drawn from the store. Each conversation's row is made once
// and updated in place by id when the store changes, so a title being typed, an armed Delete and
// the focus stay where they are while other rows change, arrive, move or leave.

import { api } from "./api.js";
import { draftOf } from "./composer.js";
import { deleteConversation, openConversation, organize, untitled } from "./conversation.js";
import { $, showError } from "./page.js";
import { inProject, listOrder, modelLabel, setList, setOpen, store, subscribe } from "./store.js";
import { UNTITLED, button, node } from "./ui.js";

const list = $("conversation-list");
// id → the row's elements: {li, open, name, meta, pin, archive, rename, del, input}.
const rows = new Map();
const noArchived = node("li", "faint conv-empty", "No archived conversations.");
// The sidebar lists archived conversations instead of the others.
let archivedView = false;
// True while rows are moved or removed: the blur that causes is not the person leaving.
let rearranging = false;

export const showingArchived = () => archivedView;

/** Read the list of the current view again (after an action here, or a gap in what the server told). */
export async function loadList() {
  setList(await api.conversations({ archived: archivedView }));
}

export async function showArchived(on) {
  archivedView = on;
  $("show-archived").setAttribute("aria-pressed", String(on));
  $("show-archived").textContent = on ? "All conversations" : "Archived";
  await loadList();
}

subscribe((change) => {
  if (change.type !== "turn") render();
});

/**
 * An empty "New conversation" is listed only where it is open or has a draft: one another browser
 * or tab just made is nobody's business here until it has a message (as in other chat apps).
 */
export function listed(c) {
  return !!(c.message_count || !untitled(c.title) || c.pinned || c.streaming || c.id === store.conv?.id ||
    draftOf(c.id));
}

function render() {
  // A project's conversations are in its folder (projects.js), except in the archived view.
  const shown = listOrder().filter((c) => listed(c) && (archivedView || !inProject(c)));
  const focused = list.contains(document.activeElement) ? document.activeElement : null;
  const selection = focused instanceof HTMLInputElement &&
    [focused.selectionStart, focused.selectionEnd, focused.selectionDirection];
  rearranging = true;
  try {
    const ids = new Set(shown.map((c) => c.id));
    for (const [id, row] of rows) {
      if (ids.has(id)) continue;
      row.li.remove();
      rows.delete(id);
    }
    const items = shown.map((c) => {
      const row = rows.get(c.id) ?? makeRow(c.id);
      updateRow(row, c);
      return row.li;
    });
    if (archivedView && !shown.length) items.push(noArchived);
    else noArchived.remove();
    // Only rows out of place move, each before the one that should follow it.
    let next = null;
    for (const li of items.reverse()) {
      if (li.parentNode !== list || li.nextSibling !== next) list.insertBefore(li, next);
      next = li;
    }
  } finally {
    rearranging = false;
  }
  if (focused?.isConnected && document.activeElement !== focused) {
    focused.focus();
    if (selection) focused.setSelectionRange(...selection);
  }
  $("list-head").hidden = !archivedView;
}

function makeRow(id) {
  const entry = () => store.conversations.get(id) ?? {};
  const li = node("li", "conv-item");
  li.dataset.id = id;
  li.draggable = true; // onto a project's folder (projects.js)
  const open = button("", { className: "conv-open", onClick: () => openConversation(id).catch(showError) });
  const name = node("span", "conv-name");
  const meta = node("span", "conv-meta");
  open.append(name, meta);
  const pin = button("📌", { className: "icon small conv-pin" });
  pin.dataset.test = "pin-toggle";
  pin.addEventListener("click", () => organize(id, { pinned: !entry().pinned }).catch(showError));
  const archive = button("", { className: "icon small conv-archive" });
  archive.dataset.test = "archive-toggle";
  archive.addEventListener("click", () => organize(id, { archived: !entry().archived }).catch(showError));
  const rename = button("✎", { className: "icon small" });
  const del = button("🗑", { className: "icon small conv-delete" });
  const row = { li, open, name, meta, pin, archive, rename, del, input: null };
  rename.addEventListener("click", () => startRename(row, id));
  del.addEventListener("click", () => confirmDelete(row, id));
  del.addEventListener("blur", () => {
    if (!rearranging) disarmDelete(del);
  });
  li.append(open, pin, archive, rename, del);
  rows.set(id, row);
  return row;
}

function label(el, text) {
  el.setAttribute("aria-label", text);
  el.title = text;
}

function updateRow(row, c) {
  const title = c.title || UNTITLED;
  const active = c.id === store.conv?.id;
  row.li.classList.toggle("active", active);
  if (active) row.li.setAttribute("aria-current", "true");
  else row.li.removeAttribute("aria-current");
  row.li.classList.toggle("running", !!c.streaming);
  row.li.classList.toggle("pinned", !!c.pinned);
  row.open.title = title;
  row.name.textContent = title;
  const count = `${modelLabel(c.model)} · ${c.message_count} ${c.message_count === 1 ? "message" : "messages"}`;
  row.meta.replaceChildren(...(c.streaming ? [runningMark(), " "] : []), count);
  label(row.pin, c.pinned ? `Unpin “${title}”` : `Pin “${title}”`);
  row.pin.setAttribute("aria-pressed", String(!!c.pinned));
  row.archive.textContent = c.archived ? "⇪" : "🗄";
  label(row.archive, c.archived ? `Unarchive “${title}”` : `Archive “${title}”`);
  label(row.rename, `Rename “${title}”`);
  label(row.del, `Delete “${title}”`);
}

function runningMark() {
  const mark = node("span", "conv-running", "●");
  mark.dataset.test = "conversation-running";
  mark.title = "A reply is being written";
  mark.setAttribute("aria-label", "A reply is being written");
  return mark;
}

function startRename(row, id) {
  if (row.input) return;
  const before = store.conversations.get(id)?.title || "";
  const input = document.createElement("input");
  input.className = "conv-rename";
  input.value = before;
  input.setAttribute("aria-label", "Conversation title");
  let done = false;
  const finish = async (save) => {
    if (done || rearranging) return;
    done = true;
    const title = input.value.trim();
    if (save && title && title !== before) {
      try {
        const updated = await api.patchConversation(id, { title });
        if (store.conv?.id === id) setOpen(updated);
      } catch (err) {
        showError(err);
      }
    }
    await loadList().catch(showError);
    // The field gives way to the title once the list says what it now is.
    row.input = null;
    if (input.isConnected) input.replaceWith(row.open);
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
  row.open.replaceWith(input);
  row.input = input;
  input.focus();
  input.select();
}

// Deleting asks once, in place: the first click arms the button, the second deletes.
function confirmDelete(row, id) {
  if (row.del.dataset.armed !== "true") {
    row.del.dataset.armed = "true";
    row.del.textContent = "Delete?";
    row.del.classList.add("danger");
    row.del.focus();
    return;
  }
  deleteConversation(id).catch(showError);
}

function disarmDelete(del) {
  del.dataset.armed = "false";
  del.textContent = "🗑";
  del.classList.remove("danger");
}

export function wireList() {
  $("show-archived").addEventListener("click", () => showArchived(!archivedView).catch(showError));
}
