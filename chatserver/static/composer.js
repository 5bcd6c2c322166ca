// The composer: what is typed (kept per conversation as a draft in localStorage), its height, the
// files waiting for the next message, and the keys that send or stop.

import { Files } from "./files.js";
import { $, showError, toast } from "./page.js";
import { setOpen, store } from "./store.js";
import { send, stop } from "./turn.js";

const composer = $("composer");

export const files = new Files({
  conversation: () => store.conv,
  conversationChanged: setOpen,
  toast,
});

export const draftKey = (id) => `draft:${id}`;

export const draftOf = (id) => localStorage.getItem(draftKey(id)) || "";

export function forgetDraft(id) {
  localStorage.removeItem(draftKey(id));
}

function saveDraft() {
  if (!store.conv) return;
  const text = composer.value;
  if (text) localStorage.setItem(draftKey(store.conv.id), text);
  else localStorage.removeItem(draftKey(store.conv.id));
}

export const composerText = () => composer.value;

/** Set what the composer holds, and keep it as the open conversation's draft. */
export function setComposer(text) {
  composer.value = text;
  saveDraft();
  autosize();
}

/** Show conversation `id`'s draft (or nothing) without saving anything. */
export function showDraft(id) {
  composer.value = id == null ? "" : draftOf(id);
  autosize();
}

export function focusComposer() {
  composer.focus();
}

/** Put a rolled-back message back in its conversation's composer, keeping anything typed since. */
export function returnDraft(convId, text) {
  const open = store.conv?.id === convId;
  const current = open ? composer.value : draftOf(convId);
  const merged = current.trim() && current.trim() !== text.trim() ? `${text}\n\n${current}` : text;
  if (!open) {
    localStorage.setItem(draftKey(convId), merged);
    return;
  }
  setComposer(merged);
  composer.focus();
}

function autosize() {
  composer.style.height = "auto";
  composer.style.height = `${Math.min(composer.scrollHeight, window.innerHeight * 0.4)}px`;
}

export function wireComposer() {
  $("composer-form").addEventListener("submit", (e) => {
    e.preventDefault();
    if (store.turn) stop().catch(showError);
    else send().catch(showError);
  });
  composer.addEventListener("keydown", (e) => {
    if (e.key !== "Enter" || e.shiftKey) return;
    // Enter that confirms an IME candidate (Hangul, kana) must not send half a syllable. Safari
    // ends the composition before this keydown, so only its keyCode 229 tells.
    if (e.isComposing || e.keyCode === 229) return;
    e.preventDefault();
    if (!store.turn) send().catch(showError);
  });
  composer.addEventListener("input", () => {
    saveDraft();
    autosize();
  });
  for (const example of $("greeting").querySelectorAll("[data-test=example-prompt]")) {
    example.addEventListener("click", () => {
      setComposer(example.dataset.prompt || example.textContent);
      composer.focus();
    });
  }
}
