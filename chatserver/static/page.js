// What every part of the page shares that is not the store: the passing toast, reporting an
// error (a 401 asks for a login), and the sidebar drawer of narrow screens.

import { showAccountLogin } from "./auth.js";

export const $ = (id) => document.getElementById(id);

let toastTimer = null;

export function toast(text) {
  const line = $("toast");
  line.textContent = text;
  line.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => {
    line.hidden = true;
  }, 5000);
}

export function showError(err) {
  console.error(err);
  if (err?.status === 401) showAccountLogin() || showLogin();
  else toast(err?.message || String(err));
}

/** A server with ACCESS_TOKEN answers 401 until the page trades the token for a login cookie. */
function showLogin() {
  const dialog = $("login");
  if (!dialog.open) dialog.showModal();
  $("login-token").focus();
}

export function openSidebar() {
  $("app").classList.add("sidebar-open");
  $("scrim").hidden = false;
  $("sidebar-toggle").setAttribute("aria-expanded", "true");
  $("conversation-list").querySelector(".active .conv-open, .conv-open")?.focus();
}

export function closeSidebar() {
  $("app").classList.remove("sidebar-open");
  $("scrim").hidden = true;
  $("sidebar-toggle").setAttribute("aria-expanded", "false");
}

export const sidebarOpen = () => $("app").classList.contains("sidebar-open");
