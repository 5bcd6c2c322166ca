// The usage page: the person's spend drawn from GET /api/usage (spend per day stacked by model,
// cached share of prompt tokens, tokens by kind), a table by conversation with its CSV, and the
// month's budget. Admins choose whose usage to see and set budgets. Charts are uPlot (vendored);
// every text goes in with textContent, and uPlot sizes its elements through the CSSOM, which the
// page's Content-Security-Policy allows.

import { money, renderStanding } from "./budget.js";
import uPlot from "./vendor/uplot/uPlot.esm.js";

const $ = (id) => document.getElementById(id);
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];
const KIND_LABELS = { reply: "Replies", tool: "Tool rounds", vision: "Vision", title: "Titles", summary: "Summaries" };
const SOURCES = ["reported", "reconciled", "priced", "estimated"];
const number = new Intl.NumberFormat("en-US");
let charts = [];
let me = null;

class Unauthorized extends Error {}

async function request(method, path, body) {
  const init = { method, headers: {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  if (res.status === 401) throw new Unauthorized();
  if (!res.ok) {
    let detail = res.statusText;
    try {
      detail = (await res.json()).detail || detail;
    } catch {
      // not JSON: the status text says it
    }
    throw new Error(typeof detail === "string" ? detail : JSON.stringify(detail));
  }
  return res.json();
}

const isoDay = (date) => date.toISOString().slice(0, 10);

function span() {
  return { from: $("usage-from").value, to: $("usage-to").value };
}

function person() {
  return $("usage-person-label").hidden ? "" : $("usage-person").value;
}

function usageUrl(group, extra = {}) {
  const params = new URLSearchParams({ ...span(), group, ...extra });
  if (person()) params.set("person", person());
  return `/api/usage?${params}`;
}

function daysOf(from, to) {
  const out = [];
  for (let d = new Date(`${from}T00:00:00Z`); isoDay(d) <= to; d.setUTCDate(d.getUTCDate() + 1)) out.push(isoDay(d));
  return out;
}

function chartWidth(el) {
  return Math.max(320, Math.min(1100, el.clientWidth || 800));
}

function draw(el, options, data) {
  const chart = new uPlot({ width: chartWidth(el), height: 240, ...options }, data, el);
  charts.push(chart);
  return chart;
}

/** Spend per day stacked by model: each model's bar stands on the ones before it. */
function drawSpend(rows, days) {
  const el = $("chart-spend");
  const byDay = new Map(rows.map((r) => [r.key, r.by_model || {}]));
  const models = [...new Set(rows.flatMap((r) => Object.keys(r.by_model || {})))].sort();
  const xs = days.map((d) => Date.parse(`${d}T00:00:00Z`) / 1000);
  const own = models.map((m) => days.map((d) => byDay.get(d)?.[m] || 0));
  let below = days.map(() => 0);
  const stacked = own.map((values) => (below = below.map((v, i) => v + values[i])));
  // Tallest stack first, so each shorter one is drawn over it and every model's part shows.
  const order = models.map((_, i) => i).reverse();
  const bars = uPlot.paths.bars({ size: [0.7, 48] });
  draw(el, {
    scales: { x: { time: true } },
    axes: [{}, { values: (u, ticks) => ticks.map((t) => money(t)) , size: 70 }],
    series: [
      { value: (u, ts) => (ts == null ? "" : new Date(ts * 1000).toISOString().slice(0, 10)) },
      ...order.map((i) => ({
        label: models[i], stroke: PALETTE[i % PALETTE.length], fill: PALETTE[i % PALETTE.length], paths: bars,
        points: { show: false },
        value: (u, v, s, idx) => (idx == null ? "" : money(own[i][idx])),
      })),
    ],
  }, [xs, ...order.map((i) => stacked[i])]);
}

function drawCached(rows, days) {
  const byDay = new Map(rows.map((r) => [r.key, r]));
  const xs = days.map((d) => Date.parse(`${d}T00:00:00Z`) / 1000);
  const share = days.map((d) => {
    const r = byDay.get(d);
    return r && r.input_tokens > 0 ? (100 * r.cached_tokens) / r.input_tokens : null;
  });
  draw($("chart-cached"), {
    scales: { x: { time: true }, y: { range: [0, 100] } },
    axes: [{}, { values: (u, ticks) => ticks.map((t) => `${t}%`) }],
    series: [
      { value: (u, ts) => (ts == null ? "" : new Date(ts * 1000).toISOString().slice(0, 10)) },
      { label: "cached share of prompt tokens", stroke: PALETTE[2], width: 2, spanGaps: true,
        value: (u, v) => (v == null ? "" : `${v.toFixed(1)}%`) },
    ],
  }, [xs, share]);
}

function drawKinds(rows) {
  const kinds = rows.map((r) => r.key);
  const xs = kinds.map((_, i) => i);
  const series = [["input", "Prompt tokens", PALETTE[0], -1], ["output", "Output tokens", PALETTE[3], 1]];
  draw($("chart-kinds"), {
    scales: { x: { time: false, range: [-0.5, kinds.length - 0.5] } },
    axes: [
      { values: (u, ticks) => ticks.map((t) => (Number.isInteger(t) ? KIND_LABELS[kinds[t]] || kinds[t] || "" : "")),
        splits: () => xs },
      { values: (u, ticks) => ticks.map((t) => number.format(t)), size: 70 },
    ],
    series: [
      { value: (u, i) => (i == null ? "" : KIND_LABELS[kinds[i]] || kinds[i]) },
      ...series.map(([key, label, color, align]) => ({
        label, stroke: color, fill: color, points: { show: false },
        paths: uPlot.paths.bars({ size: [0.35, 60], align }),
        value: (u, v) => (v == null ? "" : number.format(v)),
      })),
    ],
  }, [xs, rows.map((r) => r.input_tokens), rows.map((r) => r.output_tokens)]);
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function renderTable(rows) {
  const body = $("usage-rows");
  body.replaceChildren(...rows.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.test = "usage-row";
    tr.dataset.key = r.key;
    tr.append(cell(r.label || r.key), cell(number.format(r.input_tokens), "num"), cell(number.format(r.cached_tokens), "num"),
      cell(number.format(r.output_tokens), "num"), cell(r.cost.toFixed(6), "num"), cell(String(r.turns), "num"));
    return tr;
  }));
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = cell("Nothing was spent in this span.");
    td.colSpan = 6;
    tr.append(td);
    body.append(tr);
  }
  $("usage-csv").href = usageUrl("conversation", { format: "csv" });
}

function renderSummary(total) {
  const parts = [["Spent", money(total.cost)], ["Turns", number.format(total.turns)],
    ["Prompt tokens", number.format(total.input_tokens)], ["Cached", number.format(total.cached_tokens)],
    ["Output tokens", number.format(total.output_tokens)]];
  const sources = SOURCES.filter((s) => total.cost_by_source[s]).map((s) => `${s} ${money(total.cost_by_source[s])}`);
  if (sources.length) parts.push(["Of which", sources.join(", ")]);
  if (total.unreported) parts.push(["Cost unknown", `${total.unreported} request${total.unreported === 1 ? "" : "s"}`]);
  $("usage-summary").replaceChildren(...parts.flatMap(([term, value]) => {
    const dt = document.createElement("dt");
    dt.textContent = term;
    const dd = document.createElement("dd");
    dd.textContent = value;
    return [dt, dd];
  }));
}

async function renderPeople() {
  const people = await request("GET", "/api/usage/people");
  const select = $("usage-person");
  const chosen = select.value;
  select.replaceChildren(...people.map((p) => new Option(p.name, p.person, false, p.person === (chosen || me))));
  $("usage-people-rows").replaceChildren(...people.map((p) => {
    const tr = document.createElement("tr");
    tr.dataset.test = "usage-person-row";
    const input = document.createElement("input");
    input.type = "number";
    input.min = "0";
    input.step = "0.01";
    input.value = p.budget == null ? "" : String(p.budget);
    input.setAttribute("aria-label", `Monthly budget of ${p.name}`);
    const save = document.createElement("button");
    save.type = "button";
    save.className = "small";
    save.textContent = "Set";
    save.addEventListener("click", async () => {
      const value = input.value.trim();
      try {
        await request("PUT", `/api/usage/budgets/${encodeURIComponent(p.person)}`, { budget: value === "" ? null : Number(value) });
        status(`Budget of ${p.name} set.`);
        await renderPeople();
      } catch (err) {
        status(err.message, true);
      }
    });
    const budgetCell = document.createElement("td");
    budgetCell.append(input);
    const action = document.createElement("td");
    action.append(save);
    tr.append(cell(p.name), cell(`${money(p.spent)}${p.warning ? " ⚠" : ""}`, "num"), budgetCell, action);
    return tr;
  }));
}

function status(text, error = false) {
  const el = $("usage-status");
  el.textContent = text;
  el.classList.toggle("error", error);
}

async function show() {
  for (const chart of charts) chart.destroy();
  charts = [];
  const { from, to } = span();
  const [byDay, byKind, byConversation] = await Promise.all(
    ["day", "kind", "conversation"].map((group) => request("GET", usageUrl(group))));
  const days = daysOf(from, to);
  drawSpend(byDay.rows, days);
  drawCached(byDay.rows, days);
  drawKinds(byKind.rows);
  renderTable(byConversation.rows);
  renderSummary(byDay.total);
  const mine = !person() || person() === me;
  if (mine) {
    renderStanding(await request("GET", "/api/usage/budget"), $("usage-budget"), $("budget-warning"));
  } else {
    const standing = (await request("GET", "/api/usage/people")).find((p) => p.person === person());
    if (standing) renderStanding(standing, $("usage-budget"), $("budget-warning"), `${standing.name}'s`);
  }
  document.body.dataset.drawn = String(Number(document.body.dataset.drawn || 0) + 1);
}

async function boot() {
  const today = new Date();
  const start = new Date(today);
  start.setUTCDate(start.getUTCDate() - 29);
  $("usage-from").value = isoDay(start);
  $("usage-to").value = isoDay(today);
  const standing = await request("GET", "/api/usage/budget");
  me = (await request("GET", usageUrl("kind"))).person;
  try {
    await request("GET", "/api/usage/people");
    $("usage-person-label").hidden = false;
    $("usage-people").hidden = false;
    await renderPeople();
  } catch {
    // not an admin: their own usage only
  }
  renderStanding(standing, $("usage-budget"), $("budget-warning"));
  $("usage-range").addEventListener("submit", (e) => {
    e.preventDefault();
    show().catch((err) => status(err.message, true));
  });
  $("usage-person").addEventListener("change", () => show().catch((err) => status(err.message, true)));
  await show();
  document.body.dataset.ready = "true";
}

boot().catch((err) => {
  if (err instanceof Unauthorized) location.assign("/");
  else status(err.message, true);
});
