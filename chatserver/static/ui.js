// What every view module shares: building elements, and the page's few fixed words and lists.
// No state and no network access here.

/** An element with an optional class and text (text, never markup). */
export function node(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

/** A button; `label` is its accessible name and tooltip when the visible text is a symbol. */
export function button(text, { className = "small", label, onClick } = {}) {
  const b = node("button", className, text);
  b.type = "button";
  if (label) {
    b.setAttribute("aria-label", label);
    b.title = label;
  }
  if (onClick) b.addEventListener("click", onClick);
  return b;
}

/** What an untitled conversation is called, in the list and the header alike. */
export const UNTITLED = "New conversation";

/** The model tiers, in the order the picker and the lineup show them. */
export const TIERS = [
  ["fast", "Fast"],
  ["balanced", "Balanced"],
  ["frontier", "Frontier"],
];

export function tierLabel(tier) {
  return TIERS.find(([id]) => id === tier)?.[1] || tier;
}
