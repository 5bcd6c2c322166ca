// The facts a compression took for memory, shown in its notice for the person to accept, edit or
// drop (facts can come from fetched pages, and memory rides in every conversation's prompt).
import { api } from "./api.js";
import { button, node } from "./ui.js";

/** The review panel of one compression notice, or null when it proposed no facts. */
export function renderFacts(notice) {
  const data = notice.compression;
  if (!data?.facts?.length || data.facts_reviewed) return data?.facts_reviewed ? reviewed(data.facts) : null;
  const panel = node("div", "facts");
  panel.dataset.test = "facts-review";
  panel.append(node("p", "facts-head", data.facts_pending
    ? "Proposed for your memory — nothing is kept until you say so:"
    : "Saved to your memory — untick or edit anything wrong:"));
  const list = node("ul", "facts-list");
  const rows = data.facts.map((fact) => {
    const keep = node("input");
    keep.type = "checkbox";
    keep.checked = true;
    keep.setAttribute("aria-label", "Keep this fact");
    const text = node("input", "fact-text");
    text.type = "text";
    text.value = fact; // a value, never markup
    text.maxLength = 500;
    const li = node("li");
    li.append(keep, text);
    list.append(li);
    return { keep, text };
  });
  const status = node("span", "facts-status");
  status.setAttribute("role", "status");
  const save = button("Keep these", { className: "small primary", onClick: async () => {
    const keep = rows.filter((r) => r.keep.checked).map((r) => r.text.value.trim()).filter(Boolean);
    save.disabled = true;
    try {
      const updated = await api.reviewFacts(conversationId(), notice.id, keep);
      panel.replaceWith(reviewed(updated.compression.facts));
    } catch (err) {
      status.textContent = `Not saved: ${err.message}`;
      save.disabled = false;
    }
  } });
  save.dataset.test = "facts-save";
  panel.append(list, save, status);
  return panel;
}

function reviewed(facts) {
  const done = node("div", "facts reviewed");
  done.dataset.test = "facts-reviewed";
  done.append(node("p", "facts-head", facts.length ? "Kept in your memory:" : "No fact was kept."));
  if (facts.length) {
    const list = node("ul", "facts-list");
    for (const fact of facts) list.append(node("li", null, fact));
    done.append(list);
  }
  return done;
}

function conversationId() {
  try {
    return decodeURIComponent(location.hash.slice(1));
  } catch {
    return "";
  }
}
