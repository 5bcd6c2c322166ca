// Server-sent events, decoded the way the spec says: lines may end in \r\n, \n or \r, a line or a
// multi-byte character may be split across network reads, `data:` lines join with "\n", lines
// starting with ":" are comments, `id:` sets the last event id (kept from one event to the next, as
// the spec says). Knows nothing about what the events mean, except that a turn's numbering starts
// again at its `start` event (see `followTurn`).

export class SSEDecoder {
  constructor() {
    this.buffer = "";
    this.sawCR = false;
    this.eventType = "";
    this.data = [];
    this.lastId = "";
  }

  /** Feed decoded text; returns the events completed by it as [{event, data}]. */
  push(text) {
    // A \r at the very end of one read may be the first half of a \r\n split across reads.
    if (this.sawCR && text.startsWith("\n")) text = text.slice(1);
    this.sawCR = false;
    this.buffer += text;
    const events = [];
    let start = 0;
    for (let i = 0; i < this.buffer.length; i++) {
      const ch = this.buffer[i];
      if (ch !== "\n" && ch !== "\r") continue;
      this.takeLine(this.buffer.slice(start, i), events);
      if (ch === "\r") {
        if (i + 1 === this.buffer.length) this.sawCR = true;
        else if (this.buffer[i + 1] === "\n") i++;
      }
      start = i + 1;
    }
    this.buffer = this.buffer.slice(start);
    return events;
  }

  takeLine(line, events) {
    if (line === "") {
      if (this.data.length) {
        events.push({ event: this.eventType || "message", data: this.data.join("\n"), id: this.lastId });
      }
      this.data = [];
      this.eventType = "";
      return;
    }
    if (line.startsWith(":")) return;
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") this.eventType = value;
    else if (field === "data") this.data.push(value);
    else if (field === "id" && !value.includes("\0")) this.lastId = value;
  }
}

/** Yield {event, data, id} (data parsed as JSON when it is JSON) from a fetch Response body. */
export async function* readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder("utf-8");
  const sse = new SSEDecoder();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      for (const ev of sse.push(decoder.decode(value, { stream: true }))) yield parse(ev);
    }
    // Whatever follows the last blank line is an incomplete event and is dropped with the decoder.
    for (const ev of sse.push(decoder.decode())) yield parse(ev);
  } finally {
    // Also reached when the consumer stops early or the fetch is aborted: let go of the socket.
    reader.cancel().catch(() => {});
  }
}

function parse(ev) {
  try {
    return { event: ev.event, data: JSON.parse(ev.data), id: ev.id };
  } catch {
    return { event: ev.event, data: ev.data, id: ev.id };
  }
}

const endsATurn = (ev) => ev.event === "done" || ev.event === "error";

/**
 * Follow one turn to its end across network blips, as EventSource would: yield its events from
 * `response`; when the stream breaks before `done` or `error`, call `reopen(lastId)` (a Response
 * for the events after `lastId`, or null when nothing runs any more) and go on from there, so no
 * text is lost and none repeats. `lastId` is the last `id` seen on this stream, reset by `start`
 * (a turn numbers its events from 1). Returns without `done`/`error` when `reopen` gives null;
 * throws the last failure after `attempts` reopenings in a row that brought nothing; an abort
 * (AbortError) is thrown at once. `isLast(ev)` says which event ends the turn (a comparison's
 * replies each end with their own `done` before the comparison's).
 */
export async function* followTurn(response, reopen, { lastId = 0, attempts = 5, pauseMs = 300, isLast = endsATurn } = {}) {
  let failures = 0;
  let failure = null;
  for (;;) {
    if (response) {
      failure = new Error("the stream ended before the reply did");
      try {
        for await (const ev of readEvents(response)) {
          if (ev.event === "start") lastId = 0;
          const id = Number(ev.id);
          if (ev.id !== "" && Number.isInteger(id)) lastId = id;
          failures = 0;
          yield ev;
          if (isLast(ev)) return;
        }
      } catch (err) {
        if (err.name === "AbortError") throw err;
        failure = err;
      }
    }
    if (++failures > attempts) throw failure;
    await new Promise((resolve) => setTimeout(resolve, pauseMs * failures));
    try {
      response = await reopen(lastId);
      if (response === null) return;
    } catch (err) {
      // The server is out of reach for now: that counts as one more failed attempt.
      if (err.name === "AbortError") throw err;
      failure = err;
      response = undefined;
    }
  }
}
