// The flashstack console: one page, no framework, no network access but this gateway.
// Every value from the server is put into the page as text (textContent), never as HTML.
"use strict";

const state = { csrf: null, timer: null, groupBy: "model" };
const COLORS = ["#2f54eb", "#12805c", "#b54708", "#c4320a", "#7a5af8", "#0e9384", "#dd2590", "#667085"];

function el(tag, attrs, ...children) {
  const node = document.createElementNS(tag === "svg" || attrs?.svg ? "http://www.w3.org/2000/svg" : "http://www.w3.org/1999/xhtml", tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "svg" || v === null || v === undefined) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

async function api(path, opts = {}) {
  const headers = { "content-type": "application/json" };
  if (opts.method && opts.method !== "GET") headers["x-csrf-token"] = state.csrf || "";
  const resp = await fetch(path, { credentials: "same-origin", ...opts, headers });
  const body = await resp.json().catch(() => ({}));
  if (resp.status === 401 && path !== "/ui/api/login") { showSignIn(); throw new Error("signed out"); }
  if (!resp.ok) throw new Error(body?.error?.message || `HTTP ${resp.status}`);
  return body;
}

const fmt = {
  ms: (v) => (v === null || v === undefined ? "–" : `${Number(v).toFixed(1)} ms`),
  usd: (v) => (v === null || v === undefined ? "–" : `$${Number(v).toFixed(v && v < 0.01 ? 6 : 4)}`),
  pct: (v) => `${(100 * (v || 0)).toFixed(1)} %`,
  time: (s) => new Date(s * 1000).toISOString().replace("T", " ").slice(0, 19),
};

function table(columns, rows, onRow) {
  return el("table", {},
    el("thead", {}, el("tr", {}, columns.map((c) => el("th", { class: c.num ? "num" : null }, c.title)))),
    el("tbody", {}, rows.map((r) => el("tr", {
      class: onRow ? "clickable" : null, "data-id": r.id || r.deployment || null,
      onclick: onRow ? () => onRow(r) : null,
    }, columns.map((c) => el("td", { class: c.num ? "num" : null }, c.render ? c.render(r) : r[c.key]))))));
}

function badge(text, kind) { return el("span", { class: `badge ${kind}` }, text); }

// ---- pages ------------------------------------------------------------------------------------

async function deployments(view) {
  const data = await api("/ui/api/deployments");
  const rows = Object.entries(data.models).flatMap(([model, deps]) => deps.map((d) => ({ model, ...d })));
  view.replaceChildren(
    el("h1", {}, "Deployments"),
    el("p", { class: "muted" }, `Health probes, breakers and in-flight counts live; latency, TTFT and error rate over the last ${data.window} requests of this replica.`),
    table([
      { title: "Model", key: "model" }, { title: "Deployment", key: "deployment" }, { title: "Upstream", key: "provider" },
      { title: "Health", render: (d) => d.ok ? badge("healthy", "ok") : badge("unhealthy", "bad") },
      { title: "Breaker", render: (d) => badge(d.breaker, d.breaker === "closed" ? "ok" : d.breaker === "open" ? "bad" : "warn") },
      { title: "In flight", key: "in_flight", num: true },
      { title: "Attempts", render: (d) => d.attempts ?? 0, num: true },
      { title: "Errors", render: (d) => fmt.pct(d.error_rate), num: true },
      { title: "Latency p50 / p99", render: (d) => `${fmt.ms(d.latency_p50_ms)} / ${fmt.ms(d.latency_p99_ms)}`, num: true },
      { title: "TTFT p50 / p99", render: (d) => `${fmt.ms(d.ttft_p50_ms)} / ${fmt.ms(d.ttft_p99_ms)}`, num: true },
      { title: "Probe", render: (d) => d.detail || (d.latency_ms ? fmt.ms(d.latency_ms) : "") },
    ], rows));
  state.timer = setTimeout(() => route(), 1500);  // live
}

async function requests(view) {
  const params = new URLSearchParams(location.hash.split("?")[1] || "");
  const form = el("form", { class: "inline", id: "request-filter" },
    ["key", "model", "q"].map((name) => el("label", {}, name === "q" ? "request id" : name,
      el("input", { name, value: params.get(name) || "" }))),
    el("label", {}, "status", el("select", { name: "status" },
      ["", "ok", "error", "429", "502"].map((s) => el("option", { value: s, ...(params.get("status") === s ? { selected: "" } : {}) }, s || "any")))),
    el("button", { type: "submit", class: "primary" }, "Filter"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams([...new FormData(form)].filter(([, v]) => v));
    location.hash = `#requests?${q}`;
  });
  const data = await api(`/ui/api/requests?${params}`);
  const detail = el("div", { id: "request-detail" });
  view.replaceChildren(el("h1", {}, "Requests"), form, detail, table([
    { title: "Time", render: (r) => fmt.time(r.created) }, { title: "Request id", key: "request_id" },
    { title: "Key", render: (r) => r.key_id || "master" }, { title: "Model", key: "model" },
    { title: "Deployment", render: (r) => r.deployment || "–" }, { title: "Attempts", key: "attempts", num: true },
    { title: "Status", render: (r) => badge(r.status, r.status < 400 ? "ok" : r.status === 429 ? "warn" : "bad") },
    { title: "In / cached / out", render: (r) => `${r.input_tokens} / ${r.cache_read_tokens + r.cache_write_tokens} / ${r.output_tokens}`, num: true },
    { title: "Latency", render: (r) => fmt.ms(r.latency_ms), num: true },
    { title: "Cost", render: (r) => fmt.usd(r.cost_usd), num: true },
  ], data.data, (r) => openRequest(detail, r.id)));
}

async function openRequest(panel, id) {
  const r = await api(`/ui/api/requests/${encodeURIComponent(id)}`);
  panel.replaceChildren(el("div", { class: "panel", id: "request-open" },
    el("h2", {}, `Request ${r.request_id}`),
    el("p", {}, `${r.wire} ${r.path} · ${r.stream ? "stream" : "whole reply"} · status ${r.status} · ${fmt.ms(r.latency_ms)}` +
      (r.ttft_ms !== null ? ` · TTFT ${fmt.ms(r.ttft_ms)}` : "") + ` · ${fmt.usd(r.cost_usd)}`),
    r.error ? el("p", { class: "error" }, r.error) : null,
    r.dropped.length ? el("p", {}, "x-flashstack-dropped: ", el("code", {}, r.dropped.join(","))) : null,
    r.session_id ? el("p", {}, "session: ", el("code", {}, r.session_id)) : null,
    table([{ title: "Attempt", render: (a) => String(r.route.indexOf(a) + 1) }, { title: "Deployment", key: "deployment" },
      { title: "Result", render: (a) => badge(a.result, a.result === "ok" ? "ok" : "bad") },
      { title: "Time", render: (a) => fmt.ms(a.ms), num: true }], r.route)));
}

async function sessions(view) {
  const data = await api("/ui/api/sessions");
  const panel = el("div", { id: "session-detail" });
  view.replaceChildren(el("h1", {}, "Sessions"), panel, table([
    { title: "Created", render: (s) => fmt.time(s.created_at) }, { title: "Session", key: "id" },
    { title: "Owner", render: (s) => s.owner }, { title: "Model", render: (s) => s.model || "–" },
    { title: "Metadata", render: (s) => JSON.stringify(s.metadata) },
  ], data.data, async (s) => {
    const full = await api(`/ui/api/sessions/${encodeURIComponent(s.id)}`);
    panel.replaceChildren(el("div", { class: "panel", id: "session-open" }, el("h2", {}, `Session ${full.id}`),
      full.system ? el("div", { class: "msg" }, el("strong", {}, "system "), full.system) : null,
      full.messages.map((m) => el("div", { class: `msg ${m.role}` },
        el("strong", {}, `${m.role} `), el("span", { class: "muted" }, m.status === "completed" ? "" : `(${m.status}) `),
        el("pre", {}, m.content.map((p) => p.text ?? `[${p.type}]`).join("\n"))))));
  }));
}

async function keys(view) {
  const data = await api("/ui/api/keys");
  const out = el("div", { id: "key-created" });
  const field = (name, label, type = "text") => el("label", {}, label, el("input", { name, type, step: type === "number" ? "any" : null }));
  const form = el("form", { class: "inline", id: "key-form" }, field("name", "name"), field("models", "models (comma-separated)"),
    field("rpm", "rpm", "number"), field("tpm", "tpm", "number"), field("budget_day_usd", "USD / day", "number"),
    field("budget_month_usd", "USD / month", "number"), el("button", { type: "submit", class: "primary" }, "Create key"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = Object.fromEntries([...new FormData(form)].filter(([, v]) => v !== ""));
    const body = { name: f.name };
    if (f.models) body.models = f.models.split(",").map((m) => m.trim()).filter(Boolean);
    for (const k of ["rpm", "tpm"]) if (f[k]) body[k] = parseInt(f[k], 10);
    for (const k of ["budget_day_usd", "budget_month_usd"]) if (f[k]) body[k] = parseFloat(f[k]);
    try {
      const created = await api("/ui/api/keys", { method: "POST", body: JSON.stringify(body) });
      await keys(view);
      document.getElementById("key-created").replaceChildren(el("p", {}, `Key ${created.id} created. Copy it now: it is never shown again.`),
        el("div", { class: "secret", id: "new-secret" }, created.key));
    } catch (e) { out.replaceChildren(el("p", { class: "error" }, e.message)); }
  });
  view.replaceChildren(el("h1", {}, "API keys"), form, out, table([
    { title: "Key", key: "id" }, { title: "Name", key: "name" }, { title: "Prefix", key: "prefix" },
    { title: "Models", render: (k) => (k.models ? k.models.join(", ") : "all") },
    { title: "rpm / tpm", render: (k) => `${k.rpm ?? "–"} / ${k.tpm ?? "–"}` },
    { title: "Budget day / month", render: (k) => `${fmt.usd(k.budget_day_usd)} / ${fmt.usd(k.budget_month_usd)}` },
    { title: "Spent this month", render: (k) => fmt.usd(k.spent_month_usd), num: true },
    { title: "Status", render: (k) => (k.revoked_at ? badge("revoked", "bad") : badge("active", "ok")) },
    { title: "", render: (k) => (k.revoked_at ? "" : [el("button", { type: "button", "data-budget": k.id, onclick: () => editBudget(view, k, out) }, "Budget"),
      el("button", { class: "danger", type: "button", "data-revoke": k.id, onclick: async () => {
        if (!confirm(`Revoke ${k.id} (${k.name})? Requests with it will get 401.`)) return;
        await api(`/ui/api/keys/${encodeURIComponent(k.id)}`, { method: "DELETE" });
        await keys(view);
      } }, "Revoke")]) },
  ], data.data));
}

// "day / month" in USD; an empty side is no limit for that period.
async function editBudget(view, k, out) {
  const now = `${k.budget_day_usd ?? ""} / ${k.budget_month_usd ?? ""}`;
  const answer = prompt(`Budget of ${k.id} (${k.name}) in USD, "per day / per month" (leave a side empty for no limit):`, now);
  if (answer === null) return;
  const [day, month] = answer.split("/").map((v) => v.trim());
  const usd = (v) => (!v ? null : Number.isFinite(Number(v)) ? Number(v) : v); // not a number: the gateway's 400 says so
  try {
    await api(`/ui/api/keys/${encodeURIComponent(k.id)}`, { method: "POST", body: JSON.stringify({ budget_day_usd: usd(day), budget_month_usd: usd(month ?? "") }) });
    await keys(view);
  } catch (e) { out.replaceChildren(el("p", { class: "error" }, e.message)); }
}

async function spend(view) {
  const data = await api("/ui/api/spend?days=31");
  const by = el("select", { id: "group-by" }, ["model", "key_id"].map((g) => el("option", { value: g, ...(state.groupBy === g ? { selected: "" } : {}) }, g === "model" ? "per model" : "per key")));
  by.addEventListener("change", () => { state.groupBy = by.value; spend(view); });
  const total = data.data.reduce((s, r) => s + r.cost_usd, 0);
  view.replaceChildren(el("h1", {}, "Spend"), el("p", {}, `Last ${data.days} days (UTC), ${fmt.usd(total)} in all. `, by),
    chart(data, state.groupBy));
}

function chart(data, groupBy) {
  const days = [];
  const start = new Date(`${data.since}T00:00:00Z`);
  for (let i = 0; i < data.days; i++) days.push(new Date(start.getTime() + i * 86400000).toISOString().slice(0, 10));
  const groups = [...new Set(data.data.map((r) => r[groupBy] || "master"))].sort();
  const cell = {};
  for (const r of data.data) {
    const k = `${r.date}|${r[groupBy] || "master"}`;
    cell[k] = (cell[k] || 0) + r.cost_usd;
  }
  const totals = days.map((d) => groups.reduce((s, g) => s + (cell[`${d}|${g}`] || 0), 0));
  const max = Math.max(...totals, 1e-9);
  const W = 960, H = 280, left = 70, bottom = 30, bw = (W - left - 10) / days.length;
  const svg = el("svg", { svg: true, id: "spend-chart", viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img" });
  for (let t = 0; t <= 4; t++) {
    const y = H - bottom - (t / 4) * (H - bottom - 10);
    svg.append(el("line", { svg: true, x1: left, x2: W - 10, y1: y, y2: y, stroke: "#e4e7ec" }),
      el("text", { svg: true, x: left - 6, y: y + 4, "text-anchor": "end" }, fmt.usd((max * t) / 4)));
  }
  days.forEach((d, i) => {
    let y = H - bottom;
    groups.forEach((g, gi) => {
      const v = cell[`${d}|${g}`] || 0;
      if (!v) return;
      const h = (v / max) * (H - bottom - 10);
      y -= h;
      svg.append(el("rect", { svg: true, x: left + i * bw + 1, y, width: Math.max(bw - 2, 1), height: h, fill: COLORS[gi % COLORS.length] },
        el("title", { svg: true }, `${d} ${g}: ${fmt.usd(v)}`)));
    });
    if (i % 5 === 0 || i === days.length - 1) svg.append(el("text", { svg: true, x: left + i * bw, y: H - 10 }, d.slice(5)));
  });
  const legend = el("div", { class: "legend" }, groups.map((g, gi) => el("span", {},
    el("span", { class: "swatch", "data-color": gi }), g)));
  legend.querySelectorAll(".swatch").forEach((s) => { s.style.background = COLORS[Number(s.dataset.color) % COLORS.length]; });
  return el("div", { class: "panel" }, svg, legend);
}

// ---- frame ------------------------------------------------------------------------------------

const PAGES = { deployments, requests, sessions, keys, spend };

async function route() {
  clearTimeout(state.timer);
  const name = (location.hash.slice(1).split("?")[0]) || "deployments";
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.getAttribute("href") === `#${name}`));
  const view = document.getElementById("view");
  try { await (PAGES[name] || deployments)(view); } catch (e) {
    if (e.message !== "signed out") view.replaceChildren(el("p", { class: "error" }, e.message));
  }
}

function showSignIn(reason) {
  document.getElementById("nav").hidden = true;
  document.getElementById("view").hidden = true;
  document.getElementById("signin").hidden = false;
  if (reason) document.getElementById("signin-error").textContent = reason;
}

function showConsole(session) {
  state.csrf = session.csrf;
  document.getElementById("signin").hidden = true;
  document.getElementById("nav").hidden = false;
  document.getElementById("view").hidden = false;
  route();
}

document.addEventListener("DOMContentLoaded", async () => {
  window.addEventListener("hashchange", route);
  document.getElementById("signin-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      showConsole(await api("/ui/api/login", { method: "POST", body: JSON.stringify({ key: document.getElementById("master-key").value }) }));
    } catch (e) { document.getElementById("signin-error").textContent = e.message; }
  });
  document.getElementById("logout").addEventListener("click", async () => {
    await api("/ui/api/logout", { method: "POST" }).catch(() => {});
    state.csrf = null;
    showSignIn();
  });
  const session = await api("/ui/api/session");
  if (session.signed_in) showConsole(session); else showSignIn(session.enabled ? "" : session.reason);
});
