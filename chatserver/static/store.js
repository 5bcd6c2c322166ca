// The page's one client store: the conversations the sidebar lists (by id), the open conversation,
// the turn this page follows and the model lineup. Modules change it only through the functions
// below and learn of each change by subscribing; no DOM and no network here. What the server tells
// (live.js) and what the page reads or does itself come in through the same functions.

const listeners = new Set();

export const store = {
  /** id → list entry (`GET /api/conversations`), in the order the server listed them. */
  conversations: new Map(),
  /** The open Conversation, whole, or null. */
  conv: null,
  /** The turn this page follows now: {convId, controller, view, userEl, sentFiles}, or null. */
  turn: null,
  models: null,
  modelIndex: new Map(),
  /** id → the person's projects (`GET /api/projects`). */
  projects: new Map(),
};

/** Call `listener(change)` after every change; `change.type` says which (see the functions below). */
export function subscribe(listener) {
  listeners.add(listener);
  return () => listeners.delete(listener);
}

function notify(change) {
  for (const listener of listeners) listener(change);
}

/** The lineup read from `GET /api/models`. */
export function setModels(models) {
  store.models = models;
  store.modelIndex = new Map(models.tiers.flatMap((t) => t.models.map((m) => [m.id, m])));
  notify({ type: "models" });
}

/** The person's projects read again. */
export function setProjects(projects) {
  store.projects = new Map(projects.map((p) => [p.id, p]));
  notify({ type: "projects" });
}

/** A conversation shown in its project's folder rather than in the list (its project exists). */
export const inProject = (c) => !!c.project_id && store.projects.has(c.project_id);

/** The list read again: entries keep their ids, so what shows them can update each in place. */
export function setList(entries) {
  store.conversations = new Map(entries.map((c) => [c.id, c]));
  notify({ type: "list" });
}

/**
 * A conversation changed (here, in another tab, on another device): `change` is its id and the
 * fields that changed. An entry not listed yet joins the list when the change names it whole
 * (a new conversation carries its title); false when nothing here shows it.
 */
export function changeConversation(change) {
  const entry = store.conversations.get(change.id);
  if (entry) Object.assign(entry, change);
  else if ("title" in change) store.conversations.set(change.id, { streaming: false, ...change });
  else return false;
  const open = store.conv?.id === change.id ? store.conv : null;
  if (open) for (const key of ["title", "pinned", "archived"]) if (key in change) open[key] = change[key];
  notify({ type: "conversation", id: change.id, change });
  return true;
}

/** A conversation left the list (deleted, or moved to the other view). */
export function removeConversation(id) {
  if (!store.conversations.delete(id)) return;
  notify({ type: "removed", id });
}

/** The conversation on screen, read again or another one opened (null: none). */
export function setOpen(conv) {
  const previous = store.conv?.id ?? null;
  store.conv = conv;
  notify({ type: "open", previous });
}

export function setTurn(turn) {
  store.turn = turn;
  notify({ type: "turn" });
}

/** Pinned first, then the newest last message first: the list's order on the server too. */
export function listOrder() {
  return [...store.conversations.values()]
    .sort((a, b) => (b.last_message_at || "").localeCompare(a.last_message_at || ""))
    .sort((a, b) => Number(!!b.pinned) - Number(!!a.pinned));
}

export function isReasoning(model) {
  return !!store.modelIndex.get(model)?.reasoning;
}

export function modelLabel(model) {
  return store.modelIndex.get(model)?.label || model;
}
