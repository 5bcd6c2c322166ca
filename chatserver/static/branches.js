// The branch switcher "‹ i/n ›" shown on a message that has siblings (`Conversation.branches`).
// It only draws and reports which sibling was asked for; app.js asks the server to switch.

import { button, node } from "./ui.js";

/**
 * The switcher for message `id`, or null when it has no siblings. `onSwitch(siblingId)` is called
 * by the arrows; `disabled` greys them (a turn is running).
 */
export function branchSwitcher(id, branches, { onSwitch, disabled = false }) {
  const siblings = branches?.[id];
  if (!siblings || siblings.length < 2) return null;
  const at = siblings.indexOf(id);
  if (at === -1) return null;
  const box = node("div", "branches");
  box.dataset.test = "branch-switcher";
  // The symbols and numbers are drawn by CSS, so a message's text stays what was written.
  const prev = button("", { className: "icon small branch-arrow", label: "Previous version" });
  prev.dataset.test = "branch-prev";
  const next = button("", { className: "icon small branch-arrow", label: "Next version" });
  next.dataset.test = "branch-next";
  const where = node("span", "branch-position");
  where.dataset.test = "branch-position";
  where.dataset.position = `${at + 1}/${siblings.length}`;
  where.setAttribute("aria-label", `Version ${at + 1} of ${siblings.length}`);
  prev.disabled = disabled || at === 0;
  next.disabled = disabled || at === siblings.length - 1;
  prev.addEventListener("click", () => onSwitch(siblings[at - 1]));
  next.addEventListener("click", () => onSwitch(siblings[at + 1]));
  box.append(prev, where, next);
  return box;
}
