// The Settings dialog: per-conversation settings (PATCH), the memory file (PUT /api/memory) and the
// model lineup (POST/DELETE /api/models). Invalid input shows the server's own 422 message; the
// page does not second-guess the server's validation.

import { api } from "./api.js";

const $ = (id) => document.getElementById(id);

const TIERS = { fast: "Fast", balanced: "Balanced", frontier: "Frontier" };

export function tierLabel(tier) {
  return TIERS[tier] || tier;
}

export class SettingsPanel {
  /**
   * `app` supplies `conversation()` (the open one), `conversationChanged(conv)`, `models()`,
   * `modelsChanged()`, `presets()`, `health()` and `memoryChanged()`.
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
      tool_instructions: $("set-tool-instructions"),
      compression_prompt: $("set-compression-prompt"),
    };
    $("settings-close").addEventListener("click", () => this.dialog.close());
    this.dialog.addEventListener("click", (e) => {
      if (e.target === this.dialog) this.dialog.close();
    });
    this.fields.preset.addEventListener("change", () => this.choosePreset());
    this.fields.system_prompt.addEventListener("input", () => this.matchPreset());
    $("conv-settings").addEventListener("submit", (e) => {
      e.preventDefault();
      this.applyConversation();
    });
    $("memory-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.saveMemory();
    });
    $("model-add").addEventListener("submit", (e) => {
      e.preventDefault();
      this.addModel();
    });
    wireInfoMarkers(this.dialog);
  }

  async open({ focus } = {}) {
    for (const id of ["conv-settings-status", "memory-status", "models-status"]) setStatus(id, "");
    // Read before showing: a late answer must never overwrite what the person starts typing.
    try {
      $("memory-editor").value = (await api.memory()).text;
    } catch (err) {
      setStatus("memory-status", err.message, true);
    }
    this.fillConversation();
    this.renderLineup();
    this.renderGateway();
    if (!this.dialog.open) this.dialog.showModal();
    if (focus === "gateway") $("gateway-section").focus();
  }

  fillConversation() {
    const conv = this.app.conversation();
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
    this.fields.tool_instructions.value = s.tool_instructions ?? "";
    this.fields.compression_prompt.value = s.compression_prompt ?? "";
    $("conv-settings-apply").disabled = !conv;
  }

  /** A system prompt edited away from its preset's text is a custom one. */
  matchPreset() {
    const chosen = this.app.presets().find((p) => p.name === this.fields.preset.value);
    if (!chosen || chosen.text !== this.fields.system_prompt.value) this.fields.preset.value = "";
  }

  choosePreset() {
    const chosen = this.app.presets().find((p) => p.name === this.fields.preset.value);
    if (chosen) this.fields.system_prompt.value = chosen.text;
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
      tool_instructions: f.tool_instructions.value,
      compression_prompt: f.compression_prompt.value,
    };
    return Object.fromEntries(
      Object.entries(next).filter(([key, value]) => value !== (current[key] ?? "")),
    );
  }

  async applyConversation() {
    const conv = this.app.conversation();
    if (!conv) return;
    const settings = this.changedSettings(conv.settings || {});
    if (!Object.keys(settings).length) {
      setStatus("conv-settings-status", "Nothing changed.");
      return;
    }
    try {
      const updated = await api.patchConversation(conv.id, { settings });
      this.app.conversationChanged(updated);
      this.fillConversation();
      setStatus("conv-settings-status", "Applied to this conversation.");
    } catch (err) {
      setStatus("conv-settings-status", err.message, true);
    }
  }

  async saveMemory() {
    try {
      const saved = await api.saveMemory($("memory-editor").value);
      $("memory-editor").value = saved.text;
      setStatus("memory-status", "Saved.");
      this.app.memoryChanged();
    } catch (err) {
      setStatus("memory-status", err.message, true);
    }
  }

  renderLineup() {
    const models = this.app.models();
    const wrap = $("model-lineup");
    wrap.replaceChildren();
    for (const tier of models?.tiers || []) {
      const group = document.createElement("div");
      group.className = "lineup-tier";
      const h = document.createElement("h4");
      h.textContent = tierLabel(tier.tier);
      const list = document.createElement("ul");
      for (const model of tier.models) {
        const li = document.createElement("li");
        const name = document.createElement("span");
        name.className = "lineup-id";
        name.textContent = model.id;
        li.append(name);
        if (model.reasoning) li.append(badge("thinks"));
        if (model.id === models.default) li.append(badge("default"));
        if (model.custom) {
          const remove = document.createElement("button");
          remove.type = "button";
          remove.className = "small";
          remove.textContent = "Remove";
          remove.setAttribute("aria-label", `Remove ${model.id}`);
          remove.addEventListener("click", () => this.removeModel(model.id));
          li.append(remove);
        }
        list.append(li);
      }
      group.append(h, list);
      wrap.append(group);
    }
  }

  async addModel() {
    const id = $("model-add-id").value.trim();
    if (!id) return;
    try {
      await api.addModel(id, $("model-add-tier").value);
      $("model-add-id").value = "";
      await this.app.modelsChanged();
      this.renderLineup();
      setStatus("models-status", `Added ${id}.`);
    } catch (err) {
      setStatus("models-status", err.message, true);
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

function badge(text) {
  const span = document.createElement("span");
  span.className = "badge";
  span.textContent = text;
  return span;
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
