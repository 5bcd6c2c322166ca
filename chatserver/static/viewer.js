// The viewer behind a file citation chip: a side panel (a full-width overlay on a phone) showing
// the file's name, the passage's label, the passages the model was given with the words it
// searched for marked, and for a PDF the page itself as an image.
//
// Everything it shows is untrusted (file names, file text, the model's query): it reaches the page
// as textContent and <mark> elements built here, never as markup.

import { api, attachmentUrl, libraryUrl, projectFileUrl } from "./api.js";
import { store } from "./store.js";
import { node } from "./ui.js";

const $ = (id) => document.getElementById(id);

/** `text` with the code-point ranges `marks` ([[start, end)], in order) wrapped in <mark>. */
export function highlighted(text, marks) {
  const chars = Array.from(text); // the server counts code points, as Python does
  const out = [];
  let at = 0;
  for (const [start, end] of marks || []) {
    if (!(start >= at && end > start && end <= chars.length)) continue;
    if (start > at) out.push(document.createTextNode(chars.slice(at, start).join("")));
    out.push(node("mark", null, chars.slice(start, end).join("")));
    at = end;
  }
  if (at < chars.length) out.push(document.createTextNode(chars.slice(at).join("")));
  return out;
}

function passagesUrl(base, citation) {
  const params = new URLSearchParams();
  // Replies saved before labels were pages: those are asked for by page.
  if (typeof citation.label === "string" && citation.label) params.set("label", citation.label);
  else params.set("page", String(citation.page));
  if (typeof citation.query === "string" && citation.query) params.set("q", citation.query.slice(0, 1000));
  return `${base}/passages?${params}`;
}

export class Viewer {
  constructor() {
    this.el = $("viewer");
    this.name = $("viewer-name");
    this.label = $("viewer-label");
    this.status = $("viewer-status");
    this.image = $("viewer-image");
    this.passages = $("viewer-passages");
    this.opening = 0; // a later chip's answers win over an earlier one's
    $("viewer-close").addEventListener("click", () => this.close());
    this.image.addEventListener("error", () => {
      if (!this.image.getAttribute("src")) return;
      this.image.hidden = true;
      this.status.textContent = "The page could not be drawn.";
    });
  }

  get isOpen() {
    return !this.el.hidden;
  }

  close() {
    if (!this.isOpen) return;
    this.opening += 1;
    this.el.hidden = true;
    this.image.removeAttribute("src");
    this.passages.replaceChildren();
    this.returnTo?.focus();
  }

  /** Show the passage `citation` ({attachment_id, name, page, label?, source?, query?}) points to. */
  async open(citation, convId, from = null) {
    const opening = ++this.opening;
    this.returnTo = from;
    const where = typeof citation.label === "string" && citation.label ? citation.label : `p. ${citation.page}`;
    this.name.textContent = citation.name;
    this.name.title = citation.name;
    this.label.textContent = where;
    this.status.textContent = "Loading…";
    const query = typeof citation.query === "string" ? citation.query.trim() : "";
    $("viewer-note").textContent = query
      ? `What the model was given from this file; the words it searched for (“${query}”) are marked.`
      : "What the model was given from this file.";
    this.image.hidden = true;
    this.image.removeAttribute("src");
    this.passages.replaceChildren();
    this.el.hidden = false;
    $("viewer-close").focus();
    // A chip says which files it came from; one saved before that was asked of both, conversation first.
    const own = convId ? attachmentUrl(convId, citation.attachment_id) : null;
    const library = libraryUrl(citation.attachment_id);
    // A project's file is reached through the project the open conversation is in.
    const project = store.conv?.project_id ? projectFileUrl(store.conv.project_id, citation.attachment_id) : null;
    const bases = citation.source === "library" ? [library] : citation.source === "conversation" ? [own]
      : citation.source === "project" ? [project] : [own, library];
    let answer = null;
    let base = null;
    let failure = null;
    for (const candidate of bases.filter(Boolean)) {
      try {
        answer = await api.passages(passagesUrl(candidate, citation));
        base = candidate;
        break;
      } catch (err) {
        failure = err;
      }
    }
    if (opening !== this.opening) return;
    if (!answer) {
      this.status.textContent = failure?.status === 404 ? "This file is no longer here." : `Could not open: ${failure?.message}`;
      return;
    }
    this.name.textContent = answer.name;
    this.status.textContent = answer.passages.length ? "" : "This passage is no longer in the file.";
    for (const p of answer.passages) {
      const block = node("div", "viewer-passage");
      block.dataset.test = "viewer-passage";
      if (p.marks?.length) block.classList.add("hit");
      block.append(...highlighted(p.text, p.marks));
      this.passages.append(block);
    }
    if (answer.media_type === "application/pdf" && Number.isInteger(citation.page)) {
      this.image.alt = `Page ${citation.page} of ${answer.name}`;
      this.image.src = `${base}/pages/${citation.page}.png`;
      this.image.hidden = false;
    }
    this.passages.querySelector("mark")?.scrollIntoView({ block: "center" });
  }
}
