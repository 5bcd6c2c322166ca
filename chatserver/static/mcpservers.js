// The MCP servers section of Settings: each server's state (`GET /api/tools/servers`), and for
// admins its address and header names (never their values, which the server keeps), a form to add
// an HTTP server and Remove for the ones added here. The server refuses whoever is not an admin.
// While Settings is open the states are read again every few seconds: servers come and go.

import { api } from "./api.js";
import { button, node } from "./ui.js";

const $ = (id) => document.getElementById(id);
const REFRESH_MS = 2000;

export class McpServersPanel {
  /** `app` supplies `toolsChanged()` (re-reads `GET /api/tools`, whose MCP tools follow the servers). */
  constructor(app) {
    this.app = app;
    this.list = $("mcp-server-list");
    $("mcp-add").addEventListener("submit", (e) => {
      e.preventDefault();
      this.add();
    });
  }

  async render() {
    clearTimeout(this.timer);
    let servers;
    try {
      servers = (await api.mcpServers()).servers;
    } catch (err) {
      setStatus(err.message, true);
      return;
    }
    $("mcp-none").hidden = servers.length > 0;
    this.list.replaceChildren(...servers.map((s) => this.entry(s)));
    if ($("settings").open) this.timer = setTimeout(() => this.render(), REFRESH_MS);
  }

  entry(server) {
    const li = node("li", "mcp-server");
    li.dataset.test = "mcp-server";
    li.dataset.name = server.name;
    li.dataset.connected = String(server.connected);
    li.append(node("span", "lineup-id", server.name));
    const state = node("span", `badge ${server.connected ? "ok" : "down"}`, server.connected ? "connected" : "down");
    state.dataset.test = "mcp-state";
    li.append(state, node("span", "faint", `${server.tools} tools`));
    if (server.failures) li.append(node("span", "faint", `${server.failures} failures`));
    if (server.url || server.command) li.append(node("span", "faint mcp-where", server.url || server.command));
    if (server.header_names?.length) li.append(node("span", "faint", `headers: ${server.header_names.join(", ")}`));
    if (server.source === "file") li.append(node("span", "badge", "MCP_SERVERS"));
    if (server.source === "page") {
      const remove = button("Remove", { label: `Remove ${server.name}` });
      remove.dataset.test = "mcp-remove";
      remove.addEventListener("click", () => this.remove(server.name));
      li.append(remove);
    }
    if (server.error) {
      const error = node("div", "faint error-text mcp-error", server.error);
      error.dataset.test = "mcp-error";
      li.append(error);
    }
    return li;
  }

  async add() {
    const name = $("mcp-add-name").value.trim();
    const headers = parseHeaders($("mcp-add-headers").value);
    if (typeof headers === "string") {
      setStatus(headers, true);
      return;
    }
    try {
      await api.addMcpServer({ name, url: $("mcp-add-url").value.trim(), transport: $("mcp-add-transport").value, headers });
      for (const id of ["mcp-add-name", "mcp-add-url", "mcp-add-headers"]) $(id).value = "";
      setStatus(`Added ${name}; it connects in the background.`);
      await this.render();
      await this.app.toolsChanged();
    } catch (err) {
      setStatus(err.message, true);
    }
  }

  async remove(name) {
    try {
      await api.removeMcpServer(name);
      setStatus(`Removed ${name}.`);
      await this.render();
      await this.app.toolsChanged();
    } catch (err) {
      setStatus(err.message, true);
    }
  }
}

/** "Name: value" lines into an object, or a sentence saying which line is not one. */
function parseHeaders(text) {
  const headers = {};
  for (const [i, line] of text.split("\n").entries()) {
    if (!line.trim()) continue;
    const at = line.indexOf(":");
    if (at < 1) return `Header line ${i + 1} is not "Name: value".`;
    headers[line.slice(0, at).trim()] = line.slice(at + 1).trim();
  }
  return headers;
}

function setStatus(text, isError = false) {
  const el = $("mcp-status");
  el.textContent = text;
  el.classList.toggle("error-text", isError);
}
