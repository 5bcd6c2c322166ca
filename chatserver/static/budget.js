// The month's spend against the person's budget (GET /api/usage/budget): a line, and a warning from
// 80% of the budget, on the usage page and above the chat's composer alike.

export const money = (usd) => `$${(usd || 0).toFixed(usd >= 1 ? 2 : 4)}`;

/** The month's standing, and the warning from 80% of the budget. */
export function renderStanding(standing, line, warning, whose = "your") {
  const resets = standing.resets_at.slice(0, 10);
  if (standing.budget == null) {
    line.textContent = `${money(standing.spent)} spent this month; no monthly budget.`;
  } else {
    line.textContent = `${money(standing.spent)} of ${whose} ${money(standing.budget)} monthly budget spent ` +
      `(${Math.round(100 * standing.share)}%); it resets on ${resets}.`;
  }
  warning.hidden = !standing.warning;
  if (standing.exceeded) {
    warning.textContent = `The monthly budget is spent (${money(standing.spent)} of ${money(standing.budget)}): ` +
      `new messages are refused until ${resets}.`;
  } else if (standing.warning) {
    warning.textContent = `${Math.round(100 * standing.share)}% of the monthly budget is spent ` +
      `(${money(standing.spent)} of ${money(standing.budget)}); at 100% new messages are refused until ${resets}.`;
  }
}

/** The chat page's warning: read at start and after each turn ends (its cost counts at once). */
export async function checkBudget(warning) {
  try {
    const res = await fetch("/api/usage/budget");
    if (!res.ok) return;
    renderStanding(await res.json(), document.createElement("span"), warning);
  } catch {
    // the warning is a nicety: a failed read leaves it as it was
  }
}
