// Server-sent events, decoded the way the spec says: lines may end in \r\n, \n or \r, a line or a
// multi-byte character may be split across network reads, `data:` lines join with "\n", lines
// starting with ":" are comments. Knows nothing about what the events mean.

export class SSEDecoder {
  constructor() {
    this.buffer = "";
    this.sawCR = false;
    this.eventType = "";
    this.data = [];
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
        events.push({ event: this.eventType || "message", data: this.data.join("\n") });
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
  }
}

/** Yield {event, data} (data parsed as JSON when it is JSON) from a fetch Response body. */
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
    return { event: ev.event, data: JSON.parse(ev.data) };
  } catch {
    return { event: ev.event, data: ev.data };
  }
}
