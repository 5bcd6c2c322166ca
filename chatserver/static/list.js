// The sidebar's list of conversations, drawn from the store. Each conversation's row is made once
// and updated in place by id when the store changes, so a title being typed, an open ⋯ menu and
// the focus stay where they are while other rows change, arrive, move or leave. Rows fall under
// date headings (Pinned, Today, Yesterday, Previous 7 days, Previous 30 days, then months) in the
// person's own time zone; each row has one ⋯ button, so its title keeps the width.

import { api, exportUrl } from "./api.js";
import { draftOf } from "./composer.js";
import { deleteConversation, openConversation, organize, untitled } from "./conversation.js";
import { $, showError } from "./page.js";
import { inProject, listOrder, modelLabel, setList, setOpen, store, subscribe } from "./store.js";
import { UNTITLED, button, node } from "./ui.js";

const list = $("conversation-list");
// id → the row's elements: {li, open, name, meta, more, input}.
const rows = new Map();
// Heading label → its list item, reused while the heading stays.
const heads = new Map();
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

const DAY = 24 * 60 * 60 * 1000;
const midnight = (d) => new Date(d.getFullYear(), d.getMonth(), d.getDate());

/** The heading a conversation falls under, by its last message in the person's local time. */
export function dateGroup(c, now = new Date()) {
  if (c.pinned) return "Pinned";
  const at = new Date(c.last_message_at || c.updated_at || 0);
  // Calendar days between the two local midnights; rounding absorbs a daylight-saving hour.
  const days = Math.round((midnight(now) - midnight(at)) / DAY);
  if (days <= 0) return "Today";
  if (days === 1) return "Yesterday";
  if (days <= 7) return "Previous 7 days";
  if (days <= 30) return "Previous 30 days";
  return at.toLocaleDateString(undefined, { month: "long", year: "numeric" });
}

function headItem(label) {
  let li = heads.get(label);
  if (!li) {
    li = node("li", "conv-group");
    li.dataset.test = "conversation-group";
    li.setAttribute("role", "heading");
    li.setAttribute("aria-level", "2");
    li.textContent = label;
    heads.set(label, li);
  }
  return li;
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
    if (menu.id && !ids.has(menu.id)) closeMenu(false);
    for (const [id, row] of rows) {
      if (ids.has(id)) continue;
      row.li.remove();
      rows.delete(id);
    }
    const now = new Date();
    const items = [];
    const labels = new Set();
    for (const c of shown) {
      const label = dateGroup(c, now);
      // The list is ordered pinned first, then newest first, so each heading's rows are together.
      if (!labels.has(label)) {
        labels.add(label);
        items.push(headItem(label));
      }
      const row = rows.get(c.id) ?? makeRow(c.id);
      updateRow(row, c);
      items.push(row.li);
    }
    for (const [label, li] of heads) {
      if (labels.has(label)) continue;
      li.remove();
      heads.delete(label);
    }
    if (archivedView && !shown.length) items.push(noArchived);
    else noArchived.remove();
    // Only items out of place move, each before the one that should follow it.
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
  if (menu.id) placeMenu();
  $("list-head").hidden = !archivedView;
}

function makeRow(id) {
  const li = node("li", "conv-item");
  li.dataset.id = id;
  li.draggable = true; // onto a project's folder (projects.js)
  const open = button("", { className: "conv-open", onClick: () => openConversation(id).catch(showError) });
  const name = node("span", "conv-name");
  const meta = node("span", "conv-meta");
  open.append(name, meta);
  const more = button("⋯", { className: "icon small conv-more" });
  more.dataset.test = "conversation-actions";
  more.setAttribute("aria-haspopup", "menu");
  more.setAttribute("aria-expanded", "false");
  more.addEventListener("click", () => (menu.id === id ? closeMenu(true) : openMenu(id)));
  more.addEventListener("keydown", (e) => {
    if (e.key !== "ArrowDown" && e.key !== "ArrowUp") return;
    e.preventDefault();
    openMenu(id, e.key === "ArrowUp" ? -1 : 0);
  });
  li.append(open, more);
  const row = { li, open, name, meta, more, input: null };
  rows.set(id, row);
  return row;
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
  row.more.setAttribute("aria-label", `Actions for “${title}”`);
  row.more.title = "Rename, pin, archive, export or delete";
  if (menu.id === c.id) fillMenu(c);
}

function runningMark() {
  const mark = node("span", "conv-running", "●");
  mark.dataset.test = "conversation-running";
  mark.title = "A reply is being written";
  mark.setAttribute("aria-label", "A reply is being written");
  return mark;
}

// ---------------------------------------------------------------- the row's ⋯ menu

// One menu serves every row: it moves into the row it is open for, so it travels with the row when
// the list is redrawn, and finding "the Delete of this row" means looking inside that row.
const menu = {
  id: null,
  el: node("div", "conv-actions"),
  items: {},
};
menu.el.setAttribute("role", "menu");
menu.el.dataset.test = "conversation-actions-menu";

function menuItem(key, test, onClick) {
  const item = button("", { className: "menu-item" });
  item.setAttribute("role", "menuitem");
  item.dataset.test = test;
  item.addEventListener("click", onClick);
  menu.items[key] = item;
  return item;
}

function exportItem(format, text) {
  const link = node("a", "menu-item", text);
  link.setAttribute("role", "menuitem");
  link.dataset.test = `row-export-${format}`;
  link.setAttribute("download", "");
  link.addEventListener("click", () => closeMenu(false));
  menu.items[`export-${format}`] = link;
  return link;
}

const entry = () => store.conversations.get(menu.id) ?? {};

menu.el.append(
  menuItem("rename", "rename", () => {
    const id = menu.id;
    closeMenu(false);
    startRename(rows.get(id), id);
  }),
  menuItem("pin", "pin-toggle", () => {
    const { id, pinned } = entry();
    closeMenu(true);
    organize(id, { pinned: !pinned }).catch(showError);
  }),
  menuItem("archive", "archive-toggle", () => {
    const { id, archived } = entry();
    closeMenu(true);
    organize(id, { archived: !archived }).catch(showError);
  }),
  exportItem("md", "Export as Markdown"),
  exportItem("json", "Export as JSON"),
  menuItem("delete", "conv-delete", confirmDelete),
);

function fillMenu(c) {
  const { rename, pin, archive, delete: del } = menu.items;
  rename.textContent = "Rename";
  pin.textContent = c.pinned ? "Unpin" : "Pin";
  archive.textContent = c.archived ? "Unarchive" : "Archive";
  menu.items["export-md"].href = exportUrl(c.id, "md");
  menu.items["export-json"].href = exportUrl(c.id, "json");
  if (del.dataset.armed !== "true") del.textContent = "Delete";
}

function openMenu(id, focusAt = 0) {
  if (menu.id) closeMenu(false);
  const row = rows.get(id);
  if (!row) return;
  menu.id = id;
  disarmDelete();
  fillMenu(store.conversations.get(id) ?? { id });
  row.li.append(menu.el);
  row.li.classList.add("menu-open");
  row.more.setAttribute("aria-expanded", "true");
  placeMenu();
  menuEntries().at(focusAt)?.focus();
}

/** Close the menu; `refocus` puts the focus back on its ⋯ (Escape, or a second click on ⋯). */
function closeMenu(refocus) {
  const row = rows.get(menu.id);
  menu.id = null;
  disarmDelete();
  menu.el.remove();
  if (!row) return;
  row.li.classList.remove("menu-open");
  row.more.setAttribute("aria-expanded", "false");
  if (refocus) row.more.focus();
}

/** Escape anywhere on the page: close a row's open menu first; false when none was open. */
export function closeRowMenu() {
  if (!menu.id) return false;
  closeMenu(true);
  return true;
}

const menuEntries = () => [...menu.el.querySelectorAll("[role=menuitem]")];

// Fixed to the ⋯ button, so the list's scrolling box never clips it; above the button when there
// is no room below.
function placeMenu() {
  const row = rows.get(menu.id);
  if (!row) return;
  const at = row.more.getBoundingClientRect();
  const height = menu.el.offsetHeight;
  const below = at.bottom + height <= window.innerHeight;
  menu.el.style.top = `${Math.max(4, below ? at.bottom + 2 : at.top - height - 2)}px`;
  menu.el.style.left = `${Math.max(4, at.right - menu.el.offsetWidth)}px`;
}

menu.el.addEventListener("keydown", (e) => {
  const entries = menuEntries();
  const at = entries.indexOf(document.activeElement);
  const moves = { ArrowDown: at + 1, ArrowUp: at - 1, Home: 0, End: -1 };
  if (e.key in moves) {
    e.preventDefault();
    entries.at(moves[e.key] % entries.length).focus();
  } else if (e.key === "Escape") {
    e.preventDefault();
    e.stopPropagation();
    closeMenu(true);
  } else if (e.key === "Tab") {
    closeMenu(false);
  }
});

// Deleting asks once, in the menu: the first click arms the item, the second deletes.
function confirmDelete() {
  const del = menu.items.delete;
  if (del.dataset.armed !== "true") {
    del.dataset.armed = "true";
    del.textContent = "Delete?";
    del.classList.add("danger");
    del.setAttribute("aria-label", "Delete? Click again to delete for good");
    return;
  }
  const id = menu.id;
  closeMenu(false);
  deleteConversation(id).catch(showError);
}

function disarmDelete() {
  const del = menu.items.delete;
  del.dataset.armed = "false";
  del.textContent = "Delete";
  del.removeAttribute("aria-label");
  del.classList.remove("danger");
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

export function wireList() {
  $("show-archived").addEventListener("click", () => showArchived(!archivedView).catch(showError));
  // A click anywhere but the menu or its ⋯ closes it, as menus elsewhere do.
  document.addEventListener("click", (e) => {
    if (!menu.id || menu.el.contains(e.target)) return;
    if (e.target.closest?.(".conv-more") === rows.get(menu.id)?.more) return;
    closeMenu(false);
  });
  list.addEventListener("scroll", () => menu.id && placeMenu(), { passive: true });
  window.addEventListener("resize", () => menu.id && placeMenu());
}
