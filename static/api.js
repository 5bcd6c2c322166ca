// The HTTP contract (docs/API.md) as functions. Errors become ApiError carrying the server's
// `detail` as a readable message; turn streams are returned as Responses for sse.js to read.

export class ApiError extends Error {
  constructor(status, detail) {
    super(describeDetail(detail) || `Request failed (${status})`);
    this.status = status;
    this.detail = detail;
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

async function request(method, path, body, { retryBusy = false } = {}) {
  const init = { method, headers: {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await (retryBusy ? fetchRetryingBusy(path, init) : fetch(path, init));
  if (!res.ok) throw new ApiError(res.status, await readDetail(res));
  if (res.status === 204) return null;
  const type = res.headers.get("content-type") || "";
  return type.includes("json") ? res.json() : null;
}

async function readDetail(res) {
  try {
    return (await res.json()).detail;
  } catch {
    return res.statusText;
  }
}

const conv = (id) => `/api/conversations/${encodeURIComponent(id)}`;

export const api = {
  health: () => request("GET", "/healthz"),
  login: (token) => request("POST", "/api/login", { token }),
  models: () => request("GET", "/api/models"),
  // Ids may contain "/" (OpenRouter style) and the route takes the rest of the path.
  addModel: (id, tier) => request("POST", "/api/models", { id, tier }),
  removeModel: (id) => request("DELETE", `/api/models/${id.split("/").map(encodeURIComponent).join("/")}`),
  presets: () => request("GET", "/api/presets"),
  memory: () => request("GET", "/api/memory"),
  saveMemory: (text) => request("PUT", "/api/memory", { text }),
  conversations: () => request("GET", "/api/conversations"),
  createConversation: (body) => request("POST", "/api/conversations", body),
  conversation: (id) => request("GET", conv(id)),
  patchConversation: (id, patch) => request("PATCH", conv(id), patch),
  deleteConversation: (id) => request("DELETE", conv(id)),
  rewind: (id) => request("POST", `${conv(id)}/rewind`, {}, { retryBusy: true }),
  compress: (id) => request("POST", `${conv(id)}/compress`, {}, { retryBusy: true }),
  reviewFacts: (id, noticeId, keep) => request("POST", `${conv(id)}/facts`, { notice_id: noticeId, keep }),
};

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

/** Open a turn stream (`messages` or `regenerate`) and return the Response for sse.js. */
export async function openTurn(id, kind, body, signal) {
  const res = await fetchRetryingBusy(`${conv(id)}/${kind}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify(body),
    signal,
  });
  if (!res.ok) throw new ApiError(res.status, await readDetail(res));
  return res;
}
