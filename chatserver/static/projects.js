// Projects (docs/API.md "Projects"): folders in the sidebar, above the conversations, each holding
// its conversations; a conversation moves in or out with one action (dragged onto a folder or the
// list, or "Project" in the conversation's ⋯ menu: one PATCH of its `project_id`). A project's
// dialog edits its name, its instructions and its files, and deletes it (its conversations move
// out, its files go). Names and texts are shown as text, never as markup.

import { api, upload } from "./api.js";
import { openConversation } from "./conversation.js";
import { pickedModel } from "./header.js";
import { loadList, showingArchived } from "./list.js";
import { $, showError, toast } from "./page.js";
import { listOrder, setOpen, setProjects, store, subscribe } from "./store.js";
import { UNTITLED, button, node } from "./ui.js";

let editing = null; // the project the dialog shows, or null for a new one
const DRAG_TYPE = "application/x-chat-conversation";

export async function loadProjects() {
  setProjects(await api.projects());
}

const projectList = () => [...store.projects.values()];

/** Move a conversation into project `projectId` (null: out of every project): one PATCH. */
export async function moveToProject(convId, projectId) {
  const updated = await api.patchConversation(convId, { project_id: projectId });
  if (store.conv?.id === convId) setOpen(updated);
  await loadList();
  const name = store.projects.get(projectId)?.name;
  toast(projectId ? `Moved to “${name}”.` : "Moved out of the project.");
}

function render() {
  const list = $("project-list");
  const open = new Set([...list.querySelectorAll("details[open]")].map((d) => d.dataset.projectId));
  const chats = listOrder();
  list.replaceChildren(...projectList().map((p) => folder(p, chats.filter((c) => c.project_id === p.id), open.has(p.id))));
  $("projects").hidden = showingArchived();
  renderMenu();
}

function folder(project, chats, expanded) {
  const li = node("li", "project");
  const details = node("details", "project-folder");
  details.dataset.projectId = project.id;
  details.dataset.test = "project-folder";
  details.open = expanded || chats.some((c) => c.id === store.conv?.id);
  const summary = node("summary", "project-summary");
  summary.append(node("span", "project-name", `📁 ${project.name}`), node("span", "conv-meta", ` ${chats.length}`));
  const edit = button("✎", { className: "icon small", label: `Edit project “${project.name}”`, onClick: (e) => {
    e.preventDefault();
    openDialog(project).catch(showError);
  } });
  summary.append(edit);
  const inner = node("ul", "project-chats");
  for (const c of chats) {
    const item = node("li", `conv-item${c.id === store.conv?.id ? " active" : ""}`);
    item.dataset.id = c.id;
    item.draggable = true;
    const openIt = button(c.title || UNTITLED, { className: "conv-open",
      onClick: () => openConversation(c.id).catch(showError) });
    item.append(openIt);
    inner.append(item);
  }
  const add = button("+ New chat here", { className: "small project-new-chat", onClick: () =>
    newChatIn(project.id).catch(showError) });
  details.append(summary, inner, add);
  dropTarget(details, project.id);
  li.append(details);
  return li;
}

async function newChatIn(projectId) {
  const conv = await api.createConversation({ model: pickedModel() || undefined, project_id: projectId });
  await loadList();
  await openConversation(conv.id);
}

function dropTarget(el, projectId) {
  el.addEventListener("dragover", (e) => {
    if (!e.dataTransfer.types.includes(DRAG_TYPE)) return;
    e.preventDefault();
    el.classList.add("drop-here");
  });
  el.addEventListener("dragleave", () => el.classList.remove("drop-here"));
  el.addEventListener("drop", (e) => {
    el.classList.remove("drop-here");
    const id = e.dataTransfer.getData(DRAG_TYPE);
    if (!id) return;
    e.preventDefault();
    e.stopPropagation();
    if (store.conversations.get(id)?.project_id !== projectId) moveToProject(id, projectId).catch(showError);
  });
}

// The ⋯ menu's "Project" choice for the open conversation.
function renderMenu() {
  const select = $("menu-project");
  const conv = store.conv;
  $("menu-project-row").hidden = !conv || !store.projects.size;
  const options = [new Option("No project", ""), ...projectList().map((p) => new Option(p.name, p.id))];
  select.replaceChildren(...options);
  select.value = conv?.project_id || "";
}

// ---------------------------------------------------------------- the project dialog

async function openDialog(project) {
  editing = project;
  $("project-dialog-title").textContent = project ? "Project" : "New project";
  $("project-name").value = project?.name || "";
  $("project-instructions").value = project?.instructions || "";
  $("project-delete").hidden = !project;
  $("project-files-section").hidden = !project;
  $("project-status").textContent = "";
  disarm();
  if (project) await renderFiles();
  $("project-dialog").showModal();
  $("project-name").focus();
}

async function save(event) {
  event.preventDefault();
  const body = { name: $("project-name").value, instructions: $("project-instructions").value };
  try {
    const saved = editing ? await api.updateProject(editing.id, body) : await api.createProject(body);
    await loadProjects();
    if (!editing) {
      editing = saved;
      await openDialog(saved);
      $("project-status").textContent = "Created. Add files below, or close.";
    } else {
      $("project-dialog").close();
    }
  } catch (err) {
    $("project-status").textContent = err.message;
  }
}

function disarm() {
  const del = $("project-delete");
  del.dataset.armed = "false";
  del.textContent = "Delete project";
}

// Deleting asks once, in place, saying what happens to what the project holds.
async function remove() {
  const del = $("project-delete");
  if (del.dataset.armed !== "true") {
    del.dataset.armed = "true";
    del.textContent = "Delete? Its conversations are kept (moved out); its files are deleted.";
    return;
  }
  await api.deleteProject(editing.id);
  $("project-dialog").close();
  await Promise.all([loadProjects(), loadList()]);
  if (store.conv) setOpen(await api.conversation(store.conv.id));
  toast("Project deleted; its conversations were moved out.");
}

async function renderFiles() {
  const items = await api.projectFiles(editing.id);
  const projectId = editing.id;
  $("project-files").replaceChildren(...items.map((f) => {
    const li = node("li", "file-item");
    li.append(node("span", "file-name", f.name), button("✕", { className: "icon small", label: `Delete ${f.name}`,
      onClick: () => api.deleteProjectFile(projectId, f.id).then(renderFiles).catch(showError) }));
    return li;
  }));
  $("project-files-empty").hidden = items.length > 0;
}

async function addFiles(fileList) {
  const bar = $("project-progress");
  for (const file of fileList) {
    bar.hidden = false;
    try {
      await upload(`/api/projects/${encodeURIComponent(editing.id)}/files`, file, (f) => (bar.value = f));
    } catch (err) {
      $("project-status").textContent = `${file.name}: ${err.message}`;
    } finally {
      bar.hidden = true;
    }
  }
  await renderFiles();
}

export function wireProjects() {
  subscribe((change) => {
    if (change.type !== "turn") render();
  });
  $("project-new").addEventListener("click", () => openDialog(null).catch(showError));
  $("project-form").addEventListener("submit", (e) => save(e).catch(showError));
  $("project-close").addEventListener("click", () => $("project-dialog").close());
  $("project-delete").addEventListener("click", () => remove().catch(showError));
  $("project-add-file").addEventListener("click", () => $("project-file-input").click());
  $("project-file-input").addEventListener("change", (e) => {
    const chosen = [...e.target.files];
    e.target.value = "";
    addFiles(chosen).catch(showError);
  });
  $("menu-project").addEventListener("change", (e) => {
    if (store.conv) moveToProject(store.conv.id, e.target.value || null).catch(showError);
    $("conv-menu").open = false;
  });
  // Conversations are dragged from the list and from folders; the list takes them out of projects.
  document.addEventListener("dragstart", (e) => {
    const row = e.target.closest?.(".conv-item[data-id]");
    if (!row) return;
    e.dataTransfer.setData(DRAG_TYPE, row.dataset.id);
    e.dataTransfer.effectAllowed = "move";
  });
  dropTarget($("conversation-list"), null);
}
