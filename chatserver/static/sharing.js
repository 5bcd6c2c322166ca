// Shared read-only copies (docs/API.md "Shared read-only copies"): "Share a read-only copy…" in the
// conversation's ⋯ menu makes a link (files' names and costs only when ticked); Settings lists
// the person's links with Revoke. With ALLOW_SHARING=false (`/healthz` says) all of it stays hidden.

import { api } from "./api.js";
import { $, showError, toast } from "./page.js";
import { store, subscribe } from "./store.js";
import { button, node } from "./ui.js";
import { copyText } from "./views.js";

let sharingOn = false;

/** Whether this server shares at all (ALLOW_SHARING, as `/healthz` says). */
export function setSharing(health) {
  sharingOn = health?.sharing === true;
  renderMenu();
}

function renderMenu() {
  $("menu-share").hidden = !sharingOn || !store.conv;
}

function openDialog() {
  $("conv-menu").open = false;
  $("share-result").hidden = true;
  $("share-status").textContent = "";
  $("share-attachments").checked = false;
  $("share-costs").checked = false;
  $("share-dialog").showModal();
}

async function create() {
  const link = await api.share(store.conv.id, {
    attachments: $("share-attachments").checked, costs: $("share-costs").checked,
  });
  $("share-url").value = new URL(link.url, location.origin).href;
  $("share-result").hidden = false;
  $("share-url").select();
  $("share-status").textContent = "Anyone with this link can read the copy.";
}

/** The Settings section: the person's links, newest first, each with Open and Revoke. */
export async function renderShares() {
  $("shares-section").hidden = !sharingOn;
  if (!sharingOn) return;
  const links = await api.shares();
  $("share-list").replaceChildren(...links.map((link) => {
    const li = node("li", "file-item");
    li.dataset.shareId = link.id;
    const extras = [link.attachments && "file names", link.costs && "costs"].filter(Boolean);
    const open = node("a", "file-name", `${link.title} · ${link.created_at.slice(0, 10)}` +
      (extras.length ? ` · with ${extras.join(" and ")}` : ""));
    open.href = link.url;
    open.target = "_blank";
    open.rel = "noopener noreferrer";
    const revoke = button("Revoke", { className: "small danger", label: `Revoke the link to “${link.title}”`,
      onClick: () => api.revokeShare(link.id).then(() => {
        toast("The link no longer works.");
        return renderShares();
      }).catch(showError) });
    revoke.dataset.test = "share-revoke";
    li.append(open, revoke);
    return li;
  }));
  $("share-list-empty").hidden = links.length > 0;
}

export function wireSharing() {
  subscribe((change) => {
    if (change.type === "open") renderMenu();
  });
  $("menu-share").addEventListener("click", openDialog);
  $("share-create").addEventListener("click", () => create().catch(showError));
  $("share-copy").addEventListener("click", () => copyText($("share-url").value).then(() => toast("Link copied.")));
  $("share-close").addEventListener("click", () => $("share-dialog").close());
  $("settings-open").addEventListener("click", () => renderShares().catch(showError));
}
