// The HTTP contract (docs/API.md) as functions. Errors become ApiError carrying the server's
// `detail` as a readable message; turn streams are returned as Responses for sse.js to read.

// What an answer without the server's own words means (a proxy's page, a network failure).
const STATUS_WORDS = {
  0: "the server could not be reached; check the connection and try again",
  401: "you are signed out; sign in again",
  404: "it is not there any more (deleted, or another account's)",
  408: "the request took too long to arrive; try again",
  413: "that is larger than the server accepts (a proxy in front of it may set its own limit)",
  429: "too many requests just now; wait a moment and try again",
  500: "the server failed; try again, and tell whoever runs it if it keeps happening",
  502: "the server is not answering right now; try again in a moment",
  503: "the server is not answering right now; try again in a moment",
  504: "the server took too long to answer; try again in a moment",
};

export class ApiError extends Error {
  /** `errors`: a refused body's fields, [{loc, msg}], for a form to name in its own words. */
  constructor(status, detail, errors = []) {
    super(describeDetail(detail) || STATUS_WORDS[status] || `the server answered ${status}`);
    this.status = status;
    this.detail = detail;
    this.errors = errors;
  }
}

/** FastAPI's 422 detail is a list of {loc, msg}; ours is a string. Either reads as one line. */
function describeDetail(detail) {
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {
    return detail
      .map((d) => {
        const field = Array.isArray(d.loc) ? d.loc.filter((p) => p !== "body").join(".") : "";
        return field ? `${field}: ${d.msg}` : d.msg;
      })
      .join("; ");
  }
  return detail ? JSON.stringify(detail) : "";
}

async function request(method, path, body, { retryBusy = false, signal } = {}) {
  const init = { method, headers: {}, signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await (retryBusy ? fetchRetryingBusy(path, init) : fetch(path, init));
  if (!res.ok) throw await refusal(res);
  if (res.status === 204) return null;
  const type = res.headers.get("content-type") || "";
  return type.includes("json") ? res.json() : null;
}

async function refusal(res) {
  let body = {};
  try {
    body = await res.json();
  } catch {
    // Not the server's JSON: the status says it (STATUS_WORDS).
  }
  return new ApiError(res.status, body?.detail, Array.isArray(body?.errors) ? body.errors : []);
}

const conv = (id) => `/api/conversations/${encodeURIComponent(id)}`;
const project = (id) => `/api/projects/${encodeURIComponent(id)}`;
const person = (name) => `/api/people/${encodeURIComponent(name)}`;

export const api = {
  health: () => request("GET", "/healthz"),
  login: (token) => request("POST", "/api/login", { token }),
  models: () => request("GET", "/api/models"),
  // Ids may contain "/" (OpenRouter style) and the route takes the rest of the path.
  addModel: (id, tier, toolRuntime, vision) =>
    request("POST", "/api/models", { id, tier, vision, ...(toolRuntime ? { tool_runtime: toolRuntime } : {}) }),
  changeModel: (id, change) => request("PATCH", `/api/models/${id.split("/").map(encodeURIComponent).join("/")}`, change),
  removeModel: (id) => request("DELETE", `/api/models/${id.split("/").map(encodeURIComponent).join("/")}`),
  setPrice: (id, price) => request("PUT", `/api/prices/${id.split("/").map(encodeURIComponent).join("/")}`, price),
  clearPrice: (id) => request("DELETE", `/api/prices/${id.split("/").map(encodeURIComponent).join("/")}`),
  presets: () => request("GET", "/api/presets"),
  tools: () => request("GET", "/api/tools"),
  mcpServers: () => request("GET", "/api/tools/servers"),
  addMcpServer: (server) => request("POST", "/api/tools/servers", server),
  removeMcpServer: (name) => request("DELETE", `/api/tools/servers/${encodeURIComponent(name)}`),
  createPreset: (preset) => request("POST", "/api/presets", preset),
  updatePreset: (name, preset) => request("PUT", `/api/presets/${encodeURIComponent(name)}`, preset),
  deletePreset: (name) => request("DELETE", `/api/presets/${encodeURIComponent(name)}`),
  memory: () => request("GET", "/api/memory"),
  saveMemory: (text) => request("PUT", "/api/memory", { text }),
  quota: () => request("GET", "/api/quota"),
  conversations: ({ archived = false } = {}) =>
    request("GET", archived ? "/api/conversations?archived=true" : "/api/conversations"),
  createConversation: (body) => request("POST", "/api/conversations", body),
  conversation: (id) => request("GET", conv(id)),
  patchConversation: (id, patch) => request("PATCH", conv(id), patch),
  deleteConversation: (id) => request("DELETE", conv(id)),
  stop: (id) => request("POST", `${conv(id)}/stop`, {}),
  stopReply: (id, assistantId) => request("POST", `${conv(id)}/stop`, { assistant_message_id: assistantId }),
  editReply: (id, messageId, content) =>
    request("POST", `${conv(id)}/messages/${encodeURIComponent(messageId)}/edit`, { content }),
  branch: (id, messageId) => request("POST", `${conv(id)}/branch`, { message_id: messageId }),
  rewind: (id) => request("POST", `${conv(id)}/rewind`, {}, { retryBusy: true }),
  compress: (id) => request("POST", `${conv(id)}/compress`, {}, { retryBusy: true }),
  reviewFacts: (id, noticeId, keep) => request("POST", `${conv(id)}/facts`, { notice_id: noticeId, keep }),
  attachments: (id) => request("GET", `${conv(id)}/attachments`),
  deleteAttachment: (id, aid) => request("DELETE", attachmentUrl(id, aid)),
  library: () => request("GET", "/api/library"),
  deleteFromLibrary: (aid) => request("DELETE", libraryUrl(aid)),
  // The passages behind a citation chip: `url` is a file's route + /passages?label=…&q=… (viewer.js).
  passages: (url) => request("GET", url),
  search: (q, signal) => request("GET", `/api/search?q=${encodeURIComponent(q)}`, undefined, { signal }),
  projects: () => request("GET", "/api/projects"),
  createProject: (body) => request("POST", "/api/projects", body),
  updateProject: (id, body) => request("PATCH", project(id), body),
  deleteProject: (id) => request("DELETE", project(id)),
  projectFiles: (id) => request("GET", `${project(id)}/files`),
  deleteProjectFile: (id, aid) => request("DELETE", projectFileUrl(id, aid)),
  share: (id, body) => request("POST", `${conv(id)}/share`, body),
  shares: () => request("GET", "/api/shares"),
  revokeShare: (shareId) => request("DELETE", `/api/shares/${encodeURIComponent(shareId)}`),
  people: () => request("GET", "/api/people"),
  addPerson: (body) => request("POST", "/api/people", body),
  resetPassword: (name, password) => request("PUT", `${person(name)}/password`, { password }),
  setAdmin: (name, admin) => request("PATCH", person(name), { admin }),
  removePerson: (name) => request("DELETE", person(name)),
};

/** Where a conversation's file downloads from (a no-id library file: `libraryUrl`). */
export const attachmentUrl = (id, aid) => `${conv(id)}/attachments/${encodeURIComponent(aid)}`;
export const libraryUrl = (aid) => `/api/library/${encodeURIComponent(aid)}`;
/** An image's thumbnail (issue 25): a conversation's file, or with a null `id` a library file. */
export const thumbnailUrl = (id, aid) => `${id == null ? libraryUrl(aid) : attachmentUrl(id, aid)}/thumbnail`;
export const projectFileUrl = (id, aid) => `${project(id)}/files/${encodeURIComponent(aid)}`;
export const exportUrl = (id, format) => `${conv(id)}/export?format=${format}`;
export const uploadUrl = (id) => (id == null ? "/api/library" : `${conv(id)}/attachments`);

/**
 * POST one file as multipart (field `file`) with XMLHttpRequest, the one browser API that reports
 * upload progress: `onProgress(fraction)` as bytes leave. Resolves with the JSON answer; rejects
 * with an ApiError carrying the server's detail (413, 415, 422) or status 0 when the network failed.
 */
export function upload(path, file, onProgress = () => {}) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", path);
    xhr.responseType = "json";
    xhr.upload.addEventListener("progress", (e) => {
      if (e.lengthComputable) onProgress(e.loaded / e.total);
    });
    xhr.addEventListener("load", () => {
      if (xhr.status >= 200 && xhr.status < 300) resolve(xhr.response);
      else reject(new ApiError(xhr.status, xhr.response?.detail));
    });
    xhr.addEventListener("error", () => reject(new ApiError(0, "the upload did not reach the server")));
    xhr.addEventListener("abort", () => reject(new ApiError(0, "the upload was cancelled")));
    const form = new FormData();
    form.append("file", file, file.name);
    xhr.send(form);
  });
}

/**
 * Right after Stop the server may not yet have noticed the closed connection and still be saving
 * the interrupted reply; it answers 409 meanwhile. Such a 409 is retried for a few seconds
 * before it counts as a failure.
 */
async function fetchRetryingBusy(path, init) {
  for (let attempt = 1; ; attempt++) {
    const res = await fetch(path, init);
    if (res.status !== 409 || attempt > 6) return res;
    await new Promise((resolve) => setTimeout(resolve, 150 * attempt));
  }
}

/**
 * Re-attach to the turn running on a conversation: a Response with the events after `after`, or
 * null (204) when no turn runs there any more.
 */
export async function attachTurn(id, after, signal) {
  const res = await fetch(`${conv(id)}/stream`, {
    headers: { Accept: "text/event-stream", "Last-Event-ID": String(after) },
    signal,
  });
  if (res.status === 204) return null;
  if (!res.ok) throw await refusal(res);
  return res;
}

/**
 * Open a turn stream (`messages`, `regenerate`, `continue` or `compare`) and return the Response for sse.js. A 409 (a
 * turn already runs) is not retried: the page shows that turn instead.
 */
export async function openTurn(id, kind, body, signal) {
  const res = await fetch(`${conv(id)}/${kind}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify(body),
    signal,
  });
  if (!res.ok) throw await refusal(res);
  return res;
}
