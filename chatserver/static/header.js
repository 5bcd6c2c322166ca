// The header over the transcript: the open conversation's title and ⋯ menu, the model picker, the
// usage meters and the context bar (with Compress now), and the Settings panel they lead to. It
// draws itself from the store whenever the open conversation or the lineup changes.

import { api, exportUrl } from "./api.js";
import { organize, refresh } from "./conversation.js";
import { loadList } from "./list.js";
import { $, showError, toast } from "./page.js";
import { SettingsPanel } from "./settings.js";
import { setModels, setOpen, store, subscribe } from "./store.js";
import { UNTITLED, node, tierLabel } from "./ui.js";
import { contextBar, describeCompression, usageItems } from "./views.js";

const el = {
  title: $("conv-title"),
  picker: $("model-picker"),
  usage: $("usage-header"),
  contextBar: $("context-bar"),
  compressNow: $("compress-now"),
};

// What settings shows besides the conversation: read once at boot, presets again when edited.
const server = { health: null, presets: [], tools: [] };

export const settings = new SettingsPanel({
  conversation: () => store.conv,
  conversationChanged: setOpen,
  models: () => store.models,
  modelsChanged: loadModels,
  presets: () => server.presets,
  presetsChanged: async () => {
    server.presets = await api.presets();
  },
  tools: () => server.tools,
  toolsChanged: async () => {
    server.tools = await api.tools();
  },
  health: () => server.health,
  memoryChanged: () => refresh({ transcript: false }),
});

export function setServerInfo({ health, presets, tools }) {
  Object.assign(server, { health, presets, tools });
}

export async function loadModels() {
  setModels(await api.models());
}

/** The model the picker shows: a new conversation takes it. */
export const pickedModel = () => el.picker.value;

subscribe((change) => {
  if (change.type === "models") renderPicker();
  else if (change.type === "open") {
    renderHeader();
    settings.conversationOpened();
  }
  else if (change.type === "conversation" && change.id === store.conv?.id && shownInHeader(change.change)) renderHeader();
});

// What the header shows of a list entry's fields; a turn starting or ending is the transcript's news.
const shownInHeader = (change) => ["title", "pinned", "archived"].some((key) => key in change);

function renderPicker() {
  const current = store.conv?.model ?? el.picker.value;
  const groups = (store.models?.tiers || []).map((tier) => {
    const group = document.createElement("optgroup");
    group.label = tierLabel(tier.tier);
    for (const m of tier.models) group.append(new Option(m.label || m.id, m.id));
    return group;
  });
  // A conversation may use a model since removed from the lineup; keep it selectable.
  if (current && !store.modelIndex.has(current)) {
    const other = document.createElement("optgroup");
    other.label = "Other";
    other.append(new Option(current, current));
    groups.push(other);
  }
  el.picker.replaceChildren(...groups);
  el.picker.value = current || store.models?.default || "";
}

function renderMenu() {
  const conv = store.conv;
  for (const [id, format] of [["export-md", "md"], ["export-json", "json"]]) {
    const link = $(id);
    if (conv) link.href = exportUrl(conv.id, format);
    else link.removeAttribute("href");
  }
  $("menu-pin").hidden = !conv;
  $("menu-archive").hidden = !conv;
  if (conv) {
    $("menu-pin").textContent = conv.pinned ? "Unpin" : "Pin";
    $("menu-archive").textContent = conv.archived ? "Unarchive" : "Archive";
  }
}

export function renderHeader() {
  const conv = store.conv;
  renderMenu();
  el.title.textContent = conv?.title || UNTITLED;
  document.title = conv?.title ? `${conv.title} · Chat` : "Chat";
  renderPicker();
  // Replies the totals never counted (imported ones) have no usage of their own.
  renderUsage(conv?.totals, conv?.messages?.filter((m) => m.role === "assistant" && !m.usage).length ?? 0);
  renderContext(conv?.context);
}

/** The address names no conversation: the header says so until another one opens. */
export function showNotFoundTitle() {
  el.title.textContent = "Conversation not found";
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

async function changeModel() {
  const model = el.picker.value;
  const conv = store.conv;
  if (!conv || model === conv.model) return;
  try {
    setOpen(await api.patchConversation(conv.id, { model }));
    loadList().catch(showError);
  } catch (err) {
    el.picker.value = conv.model;
    showError(err);
  }
}

async function compressNow() {
  if (!store.conv || store.turn) return;
  el.compressNow.disabled = true;
  try {
    const result = await api.compress(store.conv.id);
    // A fold leaves its notice in the transcript; only "nothing to do" needs saying here.
    if (!result.folded && !result.dropped) toast(describeCompression(result));
    await refresh();
  } catch (err) {
    showError(err);
  } finally {
    el.compressNow.disabled = !!store.turn;
  }
}

/** Let the person pick another model (a failure line's "Choose another model"). */
export function chooseModel() {
  el.picker.focus();
  try {
    el.picker.showPicker();
  } catch {
    // showPicker is missing in older browsers; focus alone still lets the keyboard open it.
  }
}

/** Escape: close the header's ⋯ menu, the focus back on its button; false when it was not open. */
export function closeHeaderMenu() {
  const menu = $("conv-menu");
  if (!menu.open) return false;
  menu.open = false;
  menu.querySelector("summary").focus();
  return true;
}

export function wireHeader() {
  el.picker.addEventListener("change", changeModel);
  el.compressNow.addEventListener("click", compressNow);
  $("settings-open").addEventListener("click", () => settings.open().catch(showError));
  const menu = $("conv-menu");
  $("menu-pin").addEventListener("click", () => {
    menu.open = false;
    if (store.conv) organize(store.conv.id, { pinned: !store.conv.pinned }).catch(showError);
  });
  $("menu-archive").addEventListener("click", () => {
    menu.open = false;
    if (store.conv) organize(store.conv.id, { archived: !store.conv.archived }).catch(showError);
  });
  for (const id of ["export-md", "export-json"]) $(id).addEventListener("click", () => { menu.open = false; });
  document.addEventListener("click", (e) => {
    if (!menu.contains(e.target)) menu.open = false;
  });
}
