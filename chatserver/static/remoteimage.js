// What a click on a reply's image placeholder does (markdown.js builds the placeholder): load the
// image through this server's route for the open conversation, which fetches it under web_fetch's
// rules. Nothing is requested from the image's own host by the browser, before or after. An image
// once shown stays shown when its message is drawn again (streaming, switching back) in this tab.

import { hooks } from "./markdown.js";
import { store } from "./store.js";

const shown = new Set();

function routeFor(convId, raw) {
  return `/api/conversations/${encodeURIComponent(convId)}/remote-image?url=${encodeURIComponent(raw)}`;
}

function reveal(box, convId, { raw, alt }) {
  const src = routeFor(convId, raw);
  const img = document.createElement("img");
  img.className = "remote-image-shown";
  img.alt = alt || "image from the reply";
  img.dataset.test = "remote-image-shown";
  img.addEventListener("error", async () => {
    // The <img> cannot say why; the route's answer can (refused address, too large, not an image).
    let why = "it could not be loaded";
    try {
      const answer = await fetch(src, { credentials: "same-origin" });
      if (!answer.ok) why = (await answer.json()).detail || why;
    } catch {
      /* the reason stays general */
    }
    shown.delete(`${convId}\n${raw}`);
    const note = document.createElement("span");
    note.className = "remote-image-error";
    note.dataset.test = "remote-image-error";
    note.textContent = `Image not shown: ${why}`;
    img.replaceWith(note);
  });
  img.src = src;
  box.querySelector(".remote-image-load")?.replaceWith(img);
}

hooks.image = (box, image) => {
  const convId = store.conv?.id;
  if (!convId) return;
  const key = `${convId}\n${image.raw}`;
  if (shown.has(key)) {
    reveal(box, convId, image);
    return;
  }
  box.querySelector(".remote-image-load").addEventListener("click", () => {
    shown.add(key);
    reveal(box, convId, image);
  });
};
