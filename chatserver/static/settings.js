// The Settings dialog: per-conversation settings (PATCH) and the memory file (PUT /api/memory),
// saved together by one Save, and the model lineup (POST/DELETE /api/models), which acts at once.
// Closing with unsaved edits asks first. Invalid input shows the server's own 422 message; the
// page does not second-guess the server's validation.

import { api } from "./api.js";
import { McpServersPanel } from "./mcpservers.js";
import { PresetEditor, checkedTools, renderToolChecks } from "./preseteditor.js";
import { TIERS, node, tierLabel } from "./ui.js";

const $ = (id) => document.getElementById(id);

export class SettingsPanel {
  /**
   * `app` supplies `conversation()` (the open one), `conversationChanged(conv)`, `models()`,
   * `modelsChanged()`, `presets()`, `presetsChanged()`, `tools()`, `toolsChanged()`, `health()` and
   * `memoryChanged()`.
   */
  constructor(app) {
    this.app = app;
    this.dialog = $("settings");
    this.fields = {
      preset: $("set-preset"),
      system_prompt: $("set-system-prompt"),
      context_budget: $("set-budget"),
      web_search: $("set-web-search"),
      web_fetch: $("set-web-fetch"),
      approve_facts: $("set-approve-facts"),
      tool_instructions: $("set-tool-instructions"),
      compression_prompt: $("set-compression-prompt"),
    };
    // Generation parameters: empty means the default, and is sent as null (which clears one that was set).
    this.sampling = {
      temperature: $("set-temperature"),
      top_p: $("set-top-p"),
      max_tokens: $("set-max-tokens"),
      reasoning_effort: $("set-reasoning-effort"),
    };
    this.memory = $("memory-editor");
    this.tools = $("set-tools-list");
    this.presetEditor = new PresetEditor({
      ...app,
      presetsChanged: async () => {
        await app.presetsChanged();
        this.refreshPresetOptions();
      },
    });
    this.mcp = new McpServersPanel(app);
    // The memory text as last read or saved, to tell an edit from no change.
    this.savedMemory = null;
    $("settings-close").addEventListener("click", () => this.requestClose());
    this.dialog.addEventListener("click", (e) => {
      if (e.target === this.dialog) this.requestClose();
    });
    // Esc: the dialog would close itself; with unsaved edits it asks first.
    this.dialog.addEventListener("cancel", (e) => {
      if (!this.dirty()) return;
      e.preventDefault();
      this.askDiscard();
    });
    $("settings-discard-yes").addEventListener("click", () => {
      this.hideDiscard();
      this.dialog.close();
    });
    $("settings-discard-no").addEventListener("click", () => this.hideDiscard());
    this.fields.preset.addEventListener("change", () => this.choosePreset());
    this.fields.system_prompt.addEventListener("input", () => this.matchPreset());
    $("settings-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.save();
    });
    $("model-add").addEventListener("submit", (e) => {
      e.preventDefault();
      this.addModel();
    });
    $("model-add-tier").replaceChildren(...TIERS.map(([id, label]) => new Option(label, id, false, id === "balanced")));
    wireInfoMarkers(this.dialog);
  }

  /** The read-only line saying what the person's files and conversations take of their quotas. */
  async renderQuota() {
    const line = $("quota-line");
    try {
      const q = await api.quota();
      const count = (n) => n.toLocaleString("en-US");
      line.textContent = `Files: ${sizeWords(q.file_bytes)} of ${sizeWords(q.file_quota)}; ` +
        `conversations: ${count(q.conversations)} of ${count(q.conversation_quota)}`;
    } catch {
      line.textContent = "";
    }
  }

  async open({ focus } = {}) {
    for (const id of ["settings-status", "models-status", "mcp-status"]) setStatus(id, "");
    this.hideDiscard();
    // Read before showing: a late answer must never overwrite what the person starts typing.
    try {
      this.savedMemory = (await api.memory()).text;
      this.memory.value = this.savedMemory;
    } catch (err) {
      this.savedMemory = null;
      setStatus("settings-status", err.message, true);
    }
    this.renderQuota();
    // MCP tools come and go with their servers: the preset editor offers what is there now.
    await this.app.toolsChanged().catch(() => {});
    this.fillConversation();
    this.presetEditor.render();
    this.renderLineup();
    this.renderGateway();
    if (!this.dialog.open) this.dialog.showModal();
    this.mcp.render();
    if (focus === "gateway") $("gateway-section").focus();
  }

  /** A conversation opened while the dialog is up (a reload opens it late): show its settings. */
  conversationOpened() {
    if (this.dialog.open && this.shownId !== this.app.conversation()?.id) this.fillConversation();
  }

  fillConversation() {
    const conv = this.app.conversation();
    this.shownId = conv?.id;
    const s = conv?.settings || {};
    const presets = this.app.presets();
    const preset = this.fields.preset;
    preset.replaceChildren(new Option("Custom", ""), ...presets.map((p) => new Option(p.name, p.name)));
    this.fields.system_prompt.value = s.system_prompt ?? "";
    preset.value = s.preset ?? "";
    this.matchPreset();
    this.fields.context_budget.value = s.context_budget ?? "";
    this.fields.web_search.checked = !!s.web_search;
    this.fields.web_fetch.checked = !!s.web_fetch;
    this.fields.approve_facts.checked = !!s.approve_facts;
    this.fields.tool_instructions.value = s.tool_instructions ?? "";
    this.fields.compression_prompt.value = s.compression_prompt ?? "";
    for (const field of Object.values(this.fields)) field.disabled = !conv;
    for (const [key, field] of Object.entries(this.sampling)) {
      field.value = s[key] ?? "";
      field.disabled = !conv;
    }
    // Reasoning effort is sent to reasoning models only: the choice shows only for them.
    const thinks = !!(conv && this.app.models()?.tiers?.some((t) => t.models.some((m) => m.id === conv.model && m.reasoning)));
    this.sampling.reasoning_effort.hidden = !thinks;
    $("set-reasoning-effort-label").hidden = !thinks;
    this.fillTools(s.tools ?? this.allowedTools());
  }

  /** The preset choices after a preset was made or deleted, keeping what is chosen (and unsaved). */
  refreshPresetOptions() {
    const preset = this.fields.preset;
    const value = preset.value;
    const presets = this.app.presets();
    preset.replaceChildren(new Option("Custom", ""), ...presets.map((p) => new Option(p.name, p.name)));
    preset.value = presets.some((p) => p.name === value) ? value : "";
  }

  /** The tools the chosen preset allows: the conversation picks among these (a custom persona keeps its own). */
  allowedTools() {
    const settings = this.app.conversation()?.settings || {};
    const name = this.fields.preset.value || settings.preset;
    return this.app.presets().find((p) => p.name === name)?.tools ?? settings.tools ?? [];
  }

  fillTools(checked) {
    const allowed = this.allowedTools();
    renderToolChecks(this.tools, allowed, this.app.tools(), checked);
    $("set-tools-none").hidden = allowed.length > 0;
    $("set-tools").hidden = !this.app.conversation()?.settings?.tools;
  }

  /** The tool choice when it differs from the server's, else null. */
  changedTools(current) {
    if ($("set-tools").hidden) return null;
    const next = checkedTools(this.tools);
    const now = current.tools ?? [];
    const same = next.length === now.length && next.every((t) => now.includes(t));
    return same ? null : next;
  }

  /** Whether anything in the panel differs from what the server holds. */
  dirty() {
    const conv = this.app.conversation();
    const settings = conv ? this.changedSettings(conv.settings || {}) : {};
    const memory = this.savedMemory !== null && this.memory.value !== this.savedMemory;
    const tools = conv ? this.changedTools(conv.settings || {}) : null;
    return Object.keys(settings).length > 0 || memory || tools !== null;
  }

  requestClose() {
    if (this.dirty()) this.askDiscard();
    else this.dialog.close();
  }

  askDiscard() {
    $("settings-actions").hidden = true;
    $("settings-discard").hidden = false;
    $("settings-discard-no").focus();
  }

  hideDiscard() {
    $("settings-discard").hidden = true;
    $("settings-actions").hidden = false;
  }

  /** A system prompt edited away from its preset's text is a custom one. */
  matchPreset() {
    const chosen = this.app.presets().find((p) => p.name === this.fields.preset.value);
    if (!chosen || chosen.text !== this.fields.system_prompt.value) this.fields.preset.value = "";
  }

  choosePreset() {
    const chosen = this.app.presets().find((p) => p.name === this.fields.preset.value);
    if (chosen) {
      this.fields.system_prompt.value = chosen.text;
      this.fillTools(chosen.tools ?? []);
      // A preset that carries generation parameters sets them; one without leaves them as they are.
      for (const [key, value] of Object.entries(chosen.params || {})) {
        if (this.sampling[key]) this.sampling[key].value = value;
      }
    }
  }

  /** Only changed fields are sent: PATCH settings is partial and each change has its own cost. */
  changedSettings(current) {
    const f = this.fields;
    const budgetText = f.context_budget.value.trim();
    // Sent as typed when it is not a number, so the server's 422 explains what is wrong.
    const budget = /^-?\d+$/.test(budgetText) ? Number(budgetText) : budgetText;
    const next = {
      preset: f.preset.value,
      system_prompt: f.system_prompt.value,
      context_budget: budget,
      web_search: f.web_search.checked,
      web_fetch: f.web_fetch.checked,
      approve_facts: f.approve_facts.checked,
      tool_instructions: f.tool_instructions.value,
      compression_prompt: f.compression_prompt.value,
    };
    const changed = Object.fromEntries(
      // A switch the conversation does not carry yet reads as off.
      Object.entries(next).filter(([key, value]) =>
        value !== (typeof value === "boolean" ? !!current[key] : current[key] ?? "")),
    );
    for (const [key, field] of Object.entries(this.sampling)) {
      const text = field.value.trim();
      if (text === String(current[key] ?? "")) continue;
      // A number as a number; anything else as typed, so the server's 422 names what is wrong.
      changed[key] = text === "" ? null : key !== "reasoning_effort" && /^-?\d*\.?\d+$/.test(text) ? Number(text) : text;
    }
    return changed;
  }

  /**
   * Save every edit in the panel: the conversation's settings first (the server validates them),
   * then memory. A refused part keeps its edits on screen with the server's reason.
   */
  async save() {
    const conv = this.app.conversation();
    const settings = conv ? this.changedSettings(conv.settings || {}) : {};
    const memoryChanged = this.savedMemory !== null && this.memory.value !== this.savedMemory;
    const tools = conv ? this.changedTools(conv.settings || {}) : null;
    if (!Object.keys(settings).length && !memoryChanged && tools === null) {
      setStatus("settings-status", "Nothing changed.");
      return;
    }
    const done = [];
    try {
      if (Object.keys(settings).length) {
        const updated = await api.patchConversation(conv.id, { settings });
        this.app.conversationChanged(updated);
        this.fillConversation();
        done.push("this conversation's settings");
      }
      if (tools !== null) await this.saveTools(conv.id, tools, done);
      if (memoryChanged) {
        const saved = await api.saveMemory(this.memory.value);
        this.savedMemory = saved.text;
        this.memory.value = saved.text;
        done.push("memory");
        this.app.memoryChanged();
      }
      setStatus("settings-status", done.length ? `Saved ${done.join(" and ")}.` : "Nothing changed.");
    } catch (err) {
      const kept = done.length ? ` (${done.join(" and ")} saved)` : "";
      setStatus("settings-status", this.refusedFields(err) + kept, true);
    }
  }

  /**
   * What the server refused, each field called by its label here ("Context budget (tokens): ...",
   * not "settings.context_budget: ..."), the first one focused; its detail when it names no field.
   */
  refusedFields(err) {
    const named = (err.errors || []).map((e) => {
      const field = this.fields[e.loc?.at(-1)];
      const label = field?.labels?.[0]?.textContent.trim();
      // Pydantic heads a validator's own sentence with its kind ("Value error, ...").
      return label ? { field, text: `${label}: ${String(e.msg).replace(/^Value error, /, "")}` } : null;
    });
    if (!named.length || named.includes(null)) return err.message;
    named[0].field.focus();
    return named.map((n) => n.text).join("; ");
  }

  /** The tool choice goes on its own, so the status can say when only the tools changed. */
  async saveTools(id, tools, done) {
    const updated = await api.patchConversation(id, { settings: { tools } });
    this.app.conversationChanged(updated);
    this.fillConversation();
    if (!done.length) done.push("this conversation's tools");
  }

  renderLineup() {
    const models = this.app.models();
    const wrap = $("model-lineup");
    wrap.replaceChildren();
    for (const tier of models?.tiers || []) {
      const group = node("div", "lineup-tier");
      const h = node("h4", null, tierLabel(tier.tier));
      const list = node("ul");
      for (const model of tier.models) {
        const li = node("li");
        li.append(node("span", "lineup-id", model.id));
        if (model.reasoning) li.append(badge("thinks"));
        // Built-in models see as VISION_MODELS and the gateway's list say; a custom one as set here.
        if (model.vision && !model.custom) li.append(badge("sees images"));
        if (model.id === models.default) li.append(badge("default"));
        if (model.custom) {
          const sees = node("label", "check-inline");
          const box = document.createElement("input");
          box.type = "checkbox";
          box.checked = Boolean(model.vision);
          box.dataset.test = "model-vision";
          box.setAttribute("aria-label", `${model.id} sees images`);
          box.addEventListener("change", () => this.setVision(model.id, box.checked));
          sees.append(box, " sees images");
          li.append(sees);
          const remove = document.createElement("button");
          remove.type = "button";
          remove.className = "small";
          remove.textContent = "Remove";
          remove.setAttribute("aria-label", `Remove ${model.id}`);
          remove.addEventListener("click", () => this.removeModel(model.id));
          li.append(remove);
        }
        li.append(this.priceEditor(model));
        list.append(li);
      }
      group.append(h, list);
      wrap.append(group);
    }
  }

  /**
   * A model's price (USD per million tokens), for gateways that report no cost: shown as a line,
   * edited by admins (the gateway's published price is the starting point; Clear returns to it).
   */
  priceEditor(model) {
    const details = node("details", "lineup-price");
    details.dataset.test = "model-price";
    const p = model.price;
    const summary = node("summary", null, p
      ? `$${p.input} in / $${p.output} out per M tokens (${model.price_source === "admin" ? "set here" : "from the gateway"})`
      : "no price (a cost the gateway does not report stays unknown)");
    const form = node("form", "inline-form");
    const fields = [["input", "Input"], ["output", "Output"], ["cache_read", "Cache read"], ["cache_write", "Cache write"]]
      .map(([key, label]) => {
        const input = document.createElement("input");
        input.type = "number";
        input.min = "0";
        input.step = "any";
        input.value = p?.[key] ?? "";
        input.placeholder = key.startsWith("cache") ? "as input" : "";
        input.dataset.test = `price-${key}`;
        const wrap = node("label", null, `${label} `);
        wrap.append(input);
        return [key, input, wrap];
      });
    const save = node("button", "small primary", "Save price");
    save.type = "submit";
    const clear = node("button", "small", "Clear");
    clear.type = "button";
    form.append(...fields.map(([, , wrap]) => wrap), save, clear);
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      const price = {};
      for (const [key, input] of fields) {
        if (input.value.trim() !== "") price[key] = Number(input.value);
      }
      await this.changePrice(model.id, () => api.setPrice(model.id, price), `Price of ${model.id} saved.`);
    });
    clear.addEventListener("click", () =>
      this.changePrice(model.id, () => api.clearPrice(model.id), `Price of ${model.id} cleared.`));
    details.append(summary, form);
    return details;
  }

  async changePrice(id, change, done) {
    try {
      await change();
      await this.app.modelsChanged();
      this.renderLineup();
      setStatus("models-status", done);
    } catch (err) {
      setStatus("models-status", err.message, true);
    }
  }

  async addModel() {
    const id = $("model-add-id").value.trim();
    if (!id) return;
    try {
      await api.addModel(id, $("model-add-tier").value, $("model-add-runtime").value || undefined,
        $("model-add-vision").checked);
      $("model-add-id").value = "";
      $("model-add-vision").checked = false;
      await this.app.modelsChanged();
      this.renderLineup();
      setStatus("models-status", `Added ${id}.`);
    } catch (err) {
      setStatus("models-status", err.message, true);
    }
  }

  async setVision(id, vision) {
    try {
      await api.changeModel(id, { vision });
      await this.app.modelsChanged();
      this.renderLineup();
      setStatus("models-status", vision ? `${id} now receives images.` : `${id} no longer receives images.`);
    } catch (err) {
      setStatus("models-status", err.message, true);
      this.renderLineup();
    }
  }

  async removeModel(id) {
    try {
      await api.removeModel(id);
      await this.app.modelsChanged();
      this.renderLineup();
      setStatus("models-status", `Removed ${id}.`);
    } catch (err) {
      setStatus("models-status", err.message, true);
    }
  }

  renderGateway() {
    const health = this.app.health();
    $("gateway-status").textContent = !health
      ? "Gateway status unknown."
      : !health.gateway_configured
        ? "Using the built-in demo gateway: replies are simulated."
        : health.gateway_reachable === false
          ? "The configured gateway does not answer: check that it is running and GATEWAY_BASE_URL in .env."
          : "Connected to a configured gateway. If it rejects the key, fix GATEWAY_API_KEY in .env.";
  }
}

function sizeWords(bytes) {
  for (const [unit, size] of [["GB", 2 ** 30], ["MB", 2 ** 20], ["KB", 2 ** 10]]) {
    if (bytes >= size) return `${Number((bytes / size).toPrecision(3))} ${unit}`;
  }
  return `${bytes} bytes`;
}

function badge(text) {
  return node("span", "badge", text);
}

function setStatus(id, text, isError = false) {
  const el = $(id);
  el.textContent = text;
  el.classList.toggle("error-text", isError);
}

/** Info markers: hovering or focusing peeks at the tip (CSS); clicking pins it open. */
function wireInfoMarkers(root) {
  for (const button of root.querySelectorAll(".info")) {
    const tip = button.nextElementSibling;
    tip.id ||= `tip-${Math.random().toString(36).slice(2)}`;
    button.setAttribute("aria-describedby", tip.id);
    button.addEventListener("click", () => {
      button.setAttribute("aria-expanded", String(button.getAttribute("aria-expanded") !== "true"));
    });
  }
}
