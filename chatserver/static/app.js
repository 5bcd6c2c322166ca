// The page, composed: the client store (store.js) fed by what the server tells (live.js) and by
// what the page reads, and the parts that draw from it and act: the list, the open conversation,
// the transcript, turns, the composer, the header and the failure line. This module wires them
// and the page-wide keys, import, and the demo banner, and starts the page.

import { citationOf } from "./activity.js";
import { api, upload } from "./api.js";
import { startAuth } from "./auth.js";
import { wireCompare } from "./compare.js";
import { checkBudget } from "./budget.js";
import { files, focusComposer, wireComposer } from "./composer.js";
import {
  followAddress, hashId, newConversation, onConversation, onDeleted, openAt, openConversation, openLatest,
  reconnected,
} from "./conversation.js";
import { closeHeaderMenu, loadModels, setServerInfo, wireHeader } from "./header.js";
import { closeRowMenu, loadList, showArchived, showingArchived, wireList } from "./list.js";
import { listen } from "./live.js";
import { $, closeSidebar, openSidebar, showError, sidebarOpen, toast } from "./page.js";
import { wirePeople } from "./people.js";
import { loadProjects, wireProjects } from "./projects.js";
import { SearchBox } from "./search.js";
import { setSharing, wireSharing } from "./sharing.js";
import { store, subscribe } from "./store.js";
import { wireTranscript } from "./transcript.js";
import { onTurn, stop } from "./turn.js";
import { Viewer } from "./viewer.js";
import { copyText } from "./views.js";

let viewer = null; // made in wire(): its elements are in the page by then

const search = new SearchBox({ open: (id, messageId) => openAt(id, messageId).catch(showError) });

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
    // Conversations of the file that could not be read, and images of a zip, were left out: say so.
    const skipped = result.warnings?.filter((w) => w.code === "conversation_skipped") || [];
    const images = result.warnings?.find((w) => w.code === "images_skipped");
    status.textContent = `Imported ${n} ${n === 1 ? "conversation" : "conversations"}.` +
      (replaced ? ` ${replaced} now ${replaced === 1 ? "uses" : "use"} the default model: theirs is not in the lineup.` : "") +
      (skipped.length ? ` Skipped ${skipped.length}: ${skipped[0].message}${skipped.length > 1 ? "; …" : "."}` : "") +
      (images ? ` ${images.message}` : "");
    if (showingArchived()) await showArchived(false);
    else await loadList();
  } catch (err) {
    // "Not imported" already says what the server's detail starts with; its reason is the news.
    status.textContent = `Not imported: ${err.message.replace(/^the file cannot be imported: /, "")}`;
    status.classList.add("error-text");
  } finally {
    box.hidden = true;
  }
}

async function copyLastReply() {
  if (!store.conv) return;
  // Read from the server: a reply that just finished may not be in the page's copy yet.
  const conv = await api.conversation(store.conv.id);
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
    if (viewer.isOpen) viewer.close();
    else if (closeRowMenu() || closeHeaderMenu()) e.preventDefault();
    else if (sidebarOpen()) closeSidebar();
    else if (store.turn || store.conv?.streaming) stop().catch(showError);
  } else if (e.key === "?" && !mod && !e.altKey && !typingInField(e.target) && !document.querySelector("dialog[open]")) {
    e.preventDefault();
    $("shortcuts").showModal();
  }
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

const BANNER_DISMISSED = "demo-banner-dismissed";

function dismissBanner() {
  $("demo-banner").hidden = true;
  localStorage.setItem(BANNER_DISMISSED, "1");
}

function wire() {
  wireComposer();
  wireCompare();
  wireHeader();
  wireList();
  wireProjects();
  wireSharing();
  wirePeople();
  wireTranscript();
  viewer = new Viewer();
  // A file citation chip opens its passage; the chips are redrawn often, so one listener serves them all.
  $("transcript").addEventListener("click", (e) => {
    const chip = e.target.closest?.(".citation-file");
    const citation = chip && citationOf(chip);
    if (citation) viewer.open(citation, store.conv?.id, chip).catch(showError);
  });
  // A passage belongs to the conversation it was opened from: another one opened closes it.
  subscribe((change) => {
    if (change.type === "open" && change.previous !== (store.conv?.id ?? null)) viewer.close();
  });
  $("new-conversation").addEventListener("click", () => newConversation().catch(showError));
  $("login-form").addEventListener("submit", logIn);
  // Without the token nothing works, so the login dialog cannot be dismissed.
  $("login").addEventListener("cancel", (e) => e.preventDefault());
  $("sidebar-toggle").addEventListener("click", () => (sidebarOpen() ? closeSidebar() : openSidebar()));
  $("scrim").addEventListener("click", closeSidebar);
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
  $("shortcuts-open").addEventListener("click", () => $("shortcuts").showModal());
  $("shortcuts-close").addEventListener("click", () => $("shortcuts").close());
  if (/Mac|iPhone|iPad/.test(navigator.platform)) for (const k of document.querySelectorAll("kbd.mod")) k.textContent = "⌘";
  $("demo-banner-dismiss").addEventListener("click", dismissBanner);
}

async function boot() {
  wire();
  const readProjects = () => loadProjects().catch(showError);
  // A turn's cost counts toward the month's budget as it ends: the warning is read again then, for
  // a turn of the conversation on screen (a page left idle makes no requests for others' turns).
  const budgetWarning = $("budget-warning");
  const turnChanged = (event) => {
    const shown = store.conv?.id === event.id;
    onTurn(event);
    if (event.state === "ended" && shown) checkBudget(budgetWarning);
  };
  listen({ conversation: onConversation, deleted: onDeleted, turn: turnChanged, project: readProjects, reconnected: () => {
    reconnected();
    readProjects();
  } });
  checkBudget(budgetWarning);
  const [health, presets, tools] = await Promise.all([
    api.health().catch(() => null),
    api.presets().catch(() => []),
    api.tools().catch(() => []),
    loadModels(),
    loadList(),
    loadProjects(),
  ]);
  setServerInfo({ health, presets, tools });
  setSharing(health);
  $("demo-banner").hidden = !health || health.gateway_configured !== false || !!localStorage.getItem(BANNER_DISMISSED);
  const wanted = hashId();
  if (wanted) await openConversation(wanted, { address: "replace" });
  else await openLatest({ address: "replace" });
  focusComposer();
  document.body.dataset.ready = "true";
}

startAuth().then((ready) => ready && boot()).catch(showError);
