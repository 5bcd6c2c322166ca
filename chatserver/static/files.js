// Attachments on the page: uploads (button, drop, paste) with progress and the server's reasons,
// chips on the composer until the message is sent and on sent messages, and the Files panel (this
// conversation's files, the personal library, the conversation's `library` setting).
// Images (issue 25) show their thumbnail on the chip and under the message that was sent with
// them; clicking one opens it full size. Every image comes from the server's own routes (the CSP
// allows nothing else), by ids only.
// File names are untrusted text: they only ever reach the page as textContent or attributes.

import { api, attachmentUrl, libraryUrl, thumbnailUrl, upload, uploadUrl } from "./api.js";
import { button, node } from "./ui.js";

const $ = (id) => document.getElementById(id);

const isImage = (file) => file?.kind === "image";

export function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(n < 10 * 1024 ? 1 : 0)} KB`;
  return `${(n / (1024 * 1024)).toFixed(1)} MB`;
}

function describe(file) {
  const parts = [formatBytes(file.bytes)];
  if (isImage(file)) parts.push(`${file.width} × ${file.height}`);
  if (file.pages != null) parts.push(`${file.pages} ${file.pages === 1 ? "page" : "pages"}`);
  // What of an accepted file could not be read (a PDF page that failed), as the server says it.
  if (file.warnings?.length) parts.push(`⚠ ${file.warnings.join("; ")}`);
  return parts.join(" · ");
}

/** An image's thumbnail, drawn by the server. */
function thumb(src, name) {
  const img = node("img", "file-thumb");
  img.dataset.test = "attachment-thumb";
  img.src = src;
  img.alt = name;
  img.loading = "lazy";
  return img;
}

/** A chip naming one file; `href` makes the name a download link; `thumbSrc` shows an image's thumbnail. */
function chip(file, { href, thumbSrc } = {}) {
  const el = node("span", "file-chip");
  el.dataset.test = "attachment-chip";
  if (file.id) el.dataset.id = file.id;
  const name = href ? node("a", "file-chip-name", file.name) : node("span", "file-chip-name", file.name);
  if (href) {
    name.href = href;
    name.download = "";
  }
  name.title = file.name;
  if (thumbSrc) el.classList.add("image-chip");
  el.append(thumbSrc ? thumb(thumbSrc, file.name) : node("span", "file-chip-icon", "📄"), name);
  return el;
}

/** The dialog showing one image full size (the original, through the download route). */
class ImageViewer {
  constructor() {
    this.dialog = $("image-viewer");
    this.img = $("image-viewer-img");
    $("image-viewer-close").addEventListener("click", () => this.dialog.close());
    this.dialog.addEventListener("click", (e) => {
      if (e.target === this.dialog) this.dialog.close();
    });
    this.dialog.addEventListener("close", () => this.img.removeAttribute("src"));
  }

  open(name, src) {
    $("image-viewer-name").textContent = name;
    $("image-viewer-name").title = name;
    $("image-viewer-download").href = src;
    $("image-viewer-download").setAttribute("aria-label", `Download ${name}`);
    this.img.alt = name;
    this.img.src = src;
    if (!this.dialog.open) this.dialog.showModal();
  }
}

export class Files {
  /** `app` supplies `conversation()`, `conversationChanged(conv)` and `toast(text)`. */
  constructor(app) {
    this.app = app;
    this.convId = null;
    this.list = [];
    this.library = [];
    // Uploads for the next message: {file?, meta?, progress, error?} in the order they were given.
    this.pending = [];
    this.strip = $("composer-files");
    this.dialog = $("files");
    this.libraryToggle = $("library-toggle");
    this.viewer = new ImageViewer();
    $("attach").addEventListener("click", () => $("attach-input").click());
    $("attach-input").addEventListener("change", (e) => {
      this.add([...e.target.files]);
      e.target.value = "";
    });
    $("library-add").addEventListener("click", () => $("library-input").click());
    $("library-input").addEventListener("change", (e) => {
      this.addToLibrary([...e.target.files]);
      e.target.value = "";
    });
    $("files-close").addEventListener("click", () => this.dialog.close());
    this.dialog.addEventListener("click", (e) => {
      if (e.target === this.dialog) this.dialog.close();
    });
    this.libraryToggle.addEventListener("change", () => this.setLibrary(this.libraryToggle.checked));
    this.wireDrop($("transcript"));
    this.wireDrop($("composer-form"));
    $("composer").addEventListener("paste", (e) => {
      const files = [...(e.clipboardData?.files || [])];
      if (!files.length) return;
      e.preventDefault();
      this.add(files);
    });
  }

  wireDrop(target) {
    const hasFiles = (e) => [...(e.dataTransfer?.types || [])].includes("Files");
    target.addEventListener("dragover", (e) => {
      if (!hasFiles(e)) return;
      e.preventDefault();
      e.dataTransfer.dropEffect = "copy";
      target.classList.add("dropping");
    });
    target.addEventListener("dragleave", (e) => {
      if (!target.contains(e.relatedTarget)) target.classList.remove("dropping");
    });
    target.addEventListener("drop", (e) => {
      target.classList.remove("dropping");
      const files = [...(e.dataTransfer?.files || [])];
      if (!files.length) return;
      e.preventDefault();
      this.add(files);
    });
  }

  /** The open conversation changed: read its files; chips not sent stay with the one they were for. */
  async load(convId) {
    if (convId !== this.convId) {
      this.pending = [];
      this.convId = convId;
      this.renderStrip();
    }
    this.list = convId ? await api.attachments(convId).catch(() => []) : [];
    if (this.convId !== convId) return;
    this.renderPanel();
    this.renderCount();
  }

  get count() {
    return this.list.length;
  }

  /** The uploaded files waiting for the next message. */
  ready() {
    return this.pending.filter((p) => p.meta).map((p) => p.meta);
  }

  /** A message that was rolled back takes its files back to the composer, with its text. */
  restore(convId, metas) {
    if (convId !== this.convId || !metas.length) return;
    const waiting = new Set(this.ready().map((m) => m.id));
    const back = metas.filter((m) => !waiting.has(m.id) && this.list.some((f) => f.id === m.id));
    this.pending = [...back.map((meta) => ({ meta, progress: 1, error: null })), ...this.pending];
    this.renderStrip();
  }

  /** The chips whose upload failed: sending would leave their files out. */
  failed() {
    return this.pending.filter((p) => p.error);
  }

  get uploading() {
    return this.pending.some((p) => !p.meta && !p.error);
  }

  clearPending() {
    this.pending = [];
    this.renderStrip();
  }

  /** Upload files to the open conversation, each with its own chip and progress. */
  add(files) {
    const convId = this.convId;
    if (!convId) return;
    for (const file of files) {
      const item = { file, progress: 0, error: null, meta: null };
      this.pending.push(item);
      upload(uploadUrl(convId), file, (fraction) => {
        item.progress = fraction;
        this.renderStrip();
      }).then((meta) => {
        item.meta = meta;
        if (this.convId === convId) this.list.push(meta);
        // Its chip was removed while it uploaded: the file was stored all the same, so it goes now.
        if (item.removed) this.remove(meta.id, convId).catch(() => {});
      }, (err) => {
        item.error = err.status === 401 ? "Sign in again to upload." : err.message;
      }).finally(() => {
        if (this.convId !== convId) return;
        this.renderStrip();
        this.renderPanel();
        this.renderCount();
      });
    }
    this.renderStrip();
  }

  renderStrip() {
    this.strip.replaceChildren(...this.pending.map((item) => {
      const name = item.meta?.name ?? item.file.name;
      const el = chip({ name }, { thumbSrc: isImage(item.meta) ? thumbnailUrl(this.convId, item.meta.id) : null });
      el.dataset.state = item.error ? "error" : item.meta ? "ready" : "uploading";
      if (item.meta) {
        el.dataset.id = item.meta.id;
        el.append(node("span", "file-chip-meta", describe(item.meta)));
      } else if (item.error) {
        const why = node("span", "file-chip-error", item.error);
        why.dataset.test = "attachment-error";
        el.append(why);
      } else {
        const bar = node("progress", "file-chip-progress");
        bar.max = 1;
        bar.value = item.progress;
        bar.setAttribute("aria-label", `Uploading ${name}`);
        el.append(bar);
      }
      const remove = button("✕", { className: "icon small file-chip-remove", label: `Remove ${name}` });
      remove.addEventListener("click", () => this.unpend(item));
      el.append(remove);
      return el;
    }));
    this.strip.hidden = !this.pending.length;
  }

  /** Take a chip off the composer; an uploaded file is deleted too (it was never sent). */
  unpend(item) {
    item.removed = true;
    this.pending = this.pending.filter((p) => p !== item);
    this.renderStrip();
    if (item.meta) this.remove(item.meta.id).catch((err) => this.app.toast(err.message));
  }

  /** The chips under a sent user message, from its `attachment_ids` and this conversation's files. */
  chipsFor(message) {
    const ids = message.attachment_ids || [];
    if (!ids.length) return null;
    const row = node("div", "message-files");
    for (const id of ids) {
      const meta = this.list.find((f) => f.id === id);
      if (isImage(meta)) row.append(this.imageButton(meta));
      else row.append(meta ? chip(meta, { href: attachmentUrl(this.convId, id) }) : chip({ id, name: "(file deleted)" }));
    }
    return row;
  }

  /** A sent image: its thumbnail, opening the image full size. */
  imageButton(meta) {
    const convId = this.convId;
    const b = button("", { className: "message-image", label: `Open ${meta.name}` });
    b.dataset.test = "message-image";
    b.dataset.id = meta.id;
    const img = node("img");
    img.src = thumbnailUrl(convId, meta.id);
    img.alt = meta.name;
    img.width = Math.min(240, meta.width);
    img.height = Math.round(img.width * meta.height / meta.width);
    b.append(img);
    b.addEventListener("click", () => this.viewer.open(meta.name, attachmentUrl(convId, meta.id)));
    return b;
  }

  // ------------------------------------------------------------ the panel

  async openPanel() {
    $("files-status").textContent = "";
    this.library = await api.library().catch(() => []);
    this.renderPanel();
    this.renderLibraryToggle();
    if (!this.dialog.open) this.dialog.showModal();
  }

  renderCount() {
    const count = $("files-count");
    count.textContent = this.list.length ? String(this.list.length) : "";
    count.hidden = !this.list.length;
  }

  renderPanel() {
    $("files-list").replaceChildren(...this.list.map((f) =>
      this.entry(f, attachmentUrl(this.convId, f.id), () => this.remove(f.id), thumbnailUrl(this.convId, f.id))));
    $("files-empty").hidden = this.list.length > 0;
    $("library-list").replaceChildren(...this.library.map((f) =>
      this.entry(f, libraryUrl(f.id), () => this.removeFromLibrary(f.id), thumbnailUrl(null, f.id))));
    $("library-empty").hidden = this.library.length > 0;
  }

  entry(file, href, onDelete, thumbSrc) {
    const li = node("li", "file-entry");
    li.dataset.test = "file-entry";
    li.dataset.id = file.id;
    const name = node("span", "file-name", file.name);
    name.title = file.name;
    const link = node("a", "small-link", "Download");
    link.dataset.test = "file-download";
    link.href = href;
    link.download = "";
    link.setAttribute("aria-label", `Download ${file.name}`);
    const del = button("Delete", { className: "small", label: `Delete ${file.name}` });
    del.dataset.test = "file-delete";
    del.addEventListener("click", () => {
      del.disabled = true;
      onDelete().catch((err) => {
        del.disabled = false;
        $("files-status").textContent = err.message;
      });
    });
    const icon = isImage(file) ? thumb(thumbSrc, file.name) : node("span", "file-chip-icon", "📄");
    li.append(icon, name, node("span", "file-meta", describe(file)), link, del);
    return li;
  }

  async remove(id, convId = this.convId) {
    await api.deleteAttachment(convId, id);
    if (convId !== this.convId) return;
    this.list = this.list.filter((f) => f.id !== id);
    this.pending = this.pending.filter((p) => p.meta?.id !== id);
    this.renderStrip();
    this.renderPanel();
    this.renderCount();
  }

  async removeFromLibrary(id) {
    await api.deleteFromLibrary(id);
    this.library = this.library.filter((f) => f.id !== id);
    this.renderPanel();
  }

  addToLibrary(files) {
    const status = $("files-status");
    for (const file of files) {
      const bar = $("library-progress");
      bar.hidden = false;
      bar.value = 0;
      upload(uploadUrl(null), file, (fraction) => {
        bar.value = fraction;
      }).then((meta) => {
        this.library.push(meta);
        status.textContent = `Added ${meta.name} to your library.`;
      }, (err) => {
        status.textContent = `${file.name}: ${err.message}`;
      }).finally(() => {
        bar.hidden = true;
        this.renderPanel();
      });
    }
  }

  renderLibraryToggle() {
    const conv = this.app.conversation();
    this.libraryToggle.checked = !!conv?.settings?.library;
    this.libraryToggle.disabled = !conv;
  }

  /** The conversation's `library` setting. */
  async setLibrary(on) {
    const conv = this.app.conversation();
    if (!conv) return;
    try {
      this.app.conversationChanged(await api.patchConversation(conv.id, { settings: { library: on } }));
      $("files-status").textContent = on
        ? "This conversation's tools also search your library."
        : "This conversation's tools no longer search your library.";
    } catch (err) {
      this.libraryToggle.checked = !on;
      $("files-status").textContent = err.message;
    }
  }
}
