// Accounts on the page (AUTH=password or header, shared/API.md "People"): who is logged in, a
// logout button, and the user-name-and-password form. The ACCESS_TOKEN dialog stays app.js's.

const $ = (id) => document.getElementById(id);

// "password" | "header": accounts are on; "token": ACCESS_TOKEN (app.js asks); null: no login.
let mode = null;

/** Ask the server who is logged in; resolves true when the app may start, false while a login is due. */
export async function startAuth() {
  wire();
  let res;
  try {
    res = await fetch("/api/auth/me");
  } catch {
    return true; // the app's own requests will report the failure
  }
  if (res.ok) {
    showAccount(await res.json());
    return true;
  }
  if (res.status !== 401) return true;
  mode = (await res.json().catch(() => ({}))).login || null;
  if (mode === "token") return true;
  showAccountLogin();
  return false;
}

/** A 401 reached the app: show the account login and return true, or false for the token dialog. */
export function showAccountLogin() {
  if (mode === "account") {
    relearnMode();
    return true;
  }
  if (mode !== "password" && mode !== "header") return false;
  const dialog = $("account-login");
  $("account-login-form").hidden = mode !== "password";
  $("account-login-help").hidden = mode !== "header";
  if (!dialog.open) dialog.showModal();
  if (mode === "password") $("account-username").focus();
  return true;
}

/** The session ended while the page was open: the 401 of /api/auth/me says which login is due. */
async function relearnMode() {
  const res = await fetch("/api/auth/me").catch(() => null);
  if (res?.status !== 401) return;
  mode = (await res.json().catch(() => ({}))).login || null;
  showAccountLogin();
}

function showAccount(user) {
  // Without accounts everyone is "local" (the name is reserved): nothing to show, as before.
  if (user.username === "local") {
    mode = "token";
    return;
  }
  mode = "account";
  $("account-name").textContent = user.admin ? `${user.username} (admin)` : user.username;
  $("account").hidden = false;
}

async function logIn(event) {
  event.preventDefault();
  const status = $("account-login-status");
  status.textContent = "";
  const res = await fetch("/api/auth/login", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ username: $("account-username").value, password: $("account-password").value }),
  }).catch(() => null);
  if (res?.ok) {
    location.reload();
    return;
  }
  const detail = res ? await res.json().then((b) => b.detail).catch(() => res.statusText) : "";
  status.textContent = typeof detail === "string" && detail ? detail : "could not reach the server";
}

async function logOut() {
  await fetch("/api/auth/logout", { method: "POST" }).catch(() => null);
  location.reload();
}

let wired = false;

function wire() {
  if (wired) return;
  wired = true;
  $("account-login-form").addEventListener("submit", logIn);
  // Nothing works before logging in, so the dialog cannot be dismissed.
  $("account-login").addEventListener("cancel", (e) => e.preventDefault());
  $("logout").addEventListener("click", logOut);
}
