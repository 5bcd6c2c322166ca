// The Presets section of Settings: every preset listed, your own created, edited and deleted
// (`/api/presets`), built-in ones read-only; each preset's tools chosen from `GET /api/tools`.
// Also the tool checklist both this editor and the conversation settings draw.

import { api } from "./api.js";
import { button, node } from "./ui.js";

const $ = (id) => document.getElementById(id);

// Past this many tools a preset is warned about: small models choose worse among many.
export const TOOLS_WARN_OVER = 12;

/** One entry per tool name (a tool may be listed once per place it runs), local first. */
export function uniqueTools(tools) {
  const byName = new Map();
  for (const t of tools || []) {
    if (!byName.has(t.name) || t.runs === "local") byName.set(t.name, t);
  }
  return [...byName.values()];
}

/** The tools of each MCP server, by server name. */
function serverTools(tools) {
  const byServer = new Map();
  for (const t of tools || []) {
    if (t.runs === "mcp") byServer.set(t.server, [...(byServer.get(t.server) || []), t.name]);
  }
  return byServer;
}

/** The names a whitelist offers: `server__*` stands for every tool that server lists now. */
export function offeredTools(names, tools) {
  const byServer = serverTools(tools);
  return new Set(names.flatMap((n) => (n.endsWith("__*") ? byServer.get(n.slice(0, -3)) || [] : [n])));
}

/** Checkboxes for `names` (described from `tools`) in `box`, ticked where `checked` has them. */
export function renderToolChecks(box, names, tools, checked, test = "tool-checkbox") {
  const described = new Map(uniqueTools(tools).map((t) => [t.name, t]));
  const byServer = serverTools(tools);
  box.replaceChildren(...names.map((name) => {
    const label = node("label", "tool-check");
    const input = document.createElement("input");
    input.type = "checkbox";
    input.value = name;
    input.checked = checked.includes(name);
    input.dataset.test = test;
    const tool = described.get(name);
    if (tool) {
      label.title = tool.description || "";
      if (tool.available === false) label.classList.add("unavailable");
    }
    label.append(input, node("span", "tool-name", name));
    if (name.endsWith("__*")) {
      const count = (byServer.get(name.slice(0, -3)) || []).length;
      label.append(node("span", "faint", ` (every tool of ${name.slice(0, -3)}: ${count} now)`));
    } else if (tool?.available === false) {
      label.append(node("span", "faint", tool.runs === "mcp" ? " (server down)" : " (not configured)"));
    }
    return label;
  }));
}

export function checkedTools(box) {
  return [...box.querySelectorAll("input[type=checkbox]:checked")].map((i) => i.value);
}

export class PresetEditor {
  /** `app` supplies `presets()`, `presetsChanged()` (re-reads them), `tools()` and `models()`. */
  constructor(app) {
    this.app = app;
    this.list = $("preset-list");
    this.form = $("preset-form");
    this.editing = null; // the name being edited, or "" for a new preset
    $("preset-new").addEventListener("click", () => this.edit(null));
    $("preset-cancel").addEventListener("click", () => this.closeForm());
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.save();
    });
    $("preset-tools-list").addEventListener("change", () => this.warnIfMany());
  }

  /** A preset offering more than about a dozen tools is allowed, with a word on why fewer choose better. */
  warnIfMany() {
    const count = offeredTools(checkedTools($("preset-tools-list")), this.app.tools()).size;
    const warning = $("preset-tools-warning");
    warning.hidden = count <= TOOLS_WARN_OVER;
    warning.textContent = `This preset offers ${count} tools. Small models choose worse among many: ` +
      `about ${TOOLS_WARN_OVER} or fewer work best.`;
  }

  render() {
    this.list.replaceChildren(...this.app.presets().map((p) => {
      const li = node("li", "preset-entry");
      li.dataset.test = "preset-entry";
      li.dataset.name = p.name;
      li.append(node("span", "preset-name", p.name));
      const tools = p.tools?.length ? p.tools.join(", ") : "no tools";
      li.append(node("span", "preset-tools faint", tools));
      if (p.builtin) {
        li.append(node("span", "badge", "built-in"));
      } else {
        const edit = button("Edit", { className: "small", label: `Edit “${p.name}”` });
        edit.dataset.test = "preset-edit";
        edit.addEventListener("click", () => this.edit(p));
        const del = button("Delete", { className: "small", label: `Delete “${p.name}”` });
        del.dataset.test = "preset-delete";
        del.addEventListener("click", () => this.remove(p.name, del));
        li.append(edit, del);
      }
      return li;
    }));
  }

  edit(preset) {
    this.editing = preset ? preset.name : "";
    $("preset-form-title").textContent = preset ? `Edit “${preset.name}”` : "New preset";
    $("preset-name").value = preset?.name ?? "";
    $("preset-text").value = preset?.text ?? "";
    // Each MCP server's tools follow a `server__*` choice that takes them all, as they are now or later.
    const names = [];
    for (const t of uniqueTools(this.app.tools())) {
      if (t.runs === "mcp" && !names.includes(`${t.server}__*`)) names.push(`${t.server}__*`);
      names.push(t.name);
    }
    for (const name of preset?.tools ?? []) if (!names.includes(name)) names.push(name);
    renderToolChecks($("preset-tools-list"), names, this.app.tools(), preset?.tools ?? []);
    this.warnIfMany();
    const model = $("preset-model");
    const ids = (this.app.models()?.tiers || []).flatMap((t) => t.models.map((m) => m.id));
    if (preset?.model && !ids.includes(preset.model)) ids.push(preset.model);
    model.replaceChildren(new Option("The conversation's own", ""), ...ids.map((id) => new Option(id, id)));
    model.value = preset?.model ?? "";
    setStatus("");
    this.form.hidden = false;
    $("preset-name").focus();
  }

  closeForm() {
    this.form.hidden = true;
    this.editing = null;
  }

  async save() {
    const body = {
      name: $("preset-name").value.trim(),
      text: $("preset-text").value,
      tools: checkedTools($("preset-tools-list")),
    };
    const model = $("preset-model").value;
    if (model) body.model = model;
    try {
      if (this.editing) await api.updatePreset(this.editing, body);
      else await api.createPreset(body);
      await this.app.presetsChanged();
      this.closeForm();
      this.render();
      setStatus(`Saved preset ${body.name}.`);
    } catch (err) {
      setStatus(err.message, true);
    }
  }

  async remove(name, del) {
    // Like the conversation list: the first click arms, the second deletes.
    if (del.dataset.armed !== "true") {
      del.dataset.armed = "true";
      del.textContent = "Delete?";
      del.classList.add("danger");
      return;
    }
    try {
      await api.deletePreset(name);
      await this.app.presetsChanged();
      if (this.editing === name) this.closeForm();
      this.render();
      setStatus(`Deleted preset ${name}.`);
    } catch (err) {
      setStatus(err.message, true);
    }
  }
}

function setStatus(text, isError = false) {
  const el = $("presets-status");
  el.textContent = text;
  el.classList.toggle("error-text", isError);
}
