// People in Settings, for administrators of a server with AUTH=password (docs/API.md "People"):
// the list, adding a person, a new password, promote or demote, remove (asked once, in place).
// For anyone else the section stays hidden (and the server would answer 403 or 404).

import { api } from "./api.js";
import { $, showError } from "./page.js";
import { button, node } from "./ui.js";

function status(text, isError = false) {
  const line = $("people-status");
  line.textContent = text;
  line.classList.toggle("error-text", isError);
}

/** The section, for an administrator with accounts on (the one person of AUTH=none is "local"). */
export async function renderPeople() {
  const me = await fetch("/api/auth/me").then((res) => (res.ok ? res.json() : null)).catch(() => null);
  const shown = !!me?.admin && me.username !== "local";
  $("people-section").hidden = !shown;
  if (shown) $("people-list").replaceChildren(...(await api.people()).map(row));
}

function row(person) {
  const li = node("li", "file-item person");
  li.dataset.name = person.name;
  li.append(node("span", "file-name", person.admin ? `${person.name} (admin)` : person.name));
  const act = (promise, done) => promise.then(() => {
    status(done);
    return renderPeople();
  }).catch((err) => status(err.message, true));
  const role = button(person.admin ? "Make non-admin" : "Make admin", { onClick: () =>
    act(api.setAdmin(person.name, !person.admin), `${person.name} is ${person.admin ? "no longer" : "now"} an admin.`) });
  const reset = button("New password…", { onClick: () => {
    const password = prompt(`A new password for ${person.name} (at least 8 characters). Their sessions end.`);
    if (password) act(api.resetPassword(person.name, password), `${person.name}'s password was changed.`);
  } });
  const remove = button("Remove", { className: "small danger" });
  remove.addEventListener("click", () => {
    if (remove.dataset.armed !== "true") {
      remove.dataset.armed = "true";
      remove.textContent = "Remove with all their data?";
      return;
    }
    act(api.removePerson(person.name), `${person.name} and their data were removed.`);
  });
  for (const [b, test] of [[role, "person-role"], [reset, "person-reset"], [remove, "person-remove"]]) {
    b.dataset.test = test;
    li.append(b);
  }
  return li;
}

async function add(event) {
  event.preventDefault();
  const name = $("person-name").value.trim();
  try {
    await api.addPerson({ name, password: $("person-password").value, admin: $("person-admin").checked });
  } catch (err) {
    status(err.message, true);
    return;
  }
  $("person-add").reset();
  status(`Added ${name}.`);
  await renderPeople();
}

export function wirePeople() {
  $("person-add").addEventListener("submit", (e) => add(e).catch(showError));
  $("settings-open").addEventListener("click", () => renderPeople().catch(showError));
}
