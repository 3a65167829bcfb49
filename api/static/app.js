// The job dashboard: a jobs list and a job page, drawn from the same API clients use.
// No build step: plain JS, uPlot (vendored, MIT) for the charts. The API token lives in
// sessionStorage and travels in the Authorization header only, never in a URL; that is
// also why the event stream is read with fetch() rather than EventSource (which cannot
// send headers).
"use strict";

const API = "/v1";
const TOKEN_KEY = "pstar.token";
const LIST_REFRESH_MS = 3000;
const FAR = 3; // a budget more than this many times the data's peak is drawn off the scale
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d"];

// What the page holds, readable by the browser tests: the uPlot instances and, per chart,
// the raw series it plotted (steps and values by metric name).
const state = {
  token: sessionStorage.getItem(TOKEN_KEY),
  charts: {},
  plotted: {},
  stream: null,
  streamState: "idle", // idle | live | ended
  timers: [],
  job: null,
  metrics: new Map(), // step -> {name: value}
  memory: null,
  seenEvents: new Set(),
  view: 0, // counts route() calls: a page render that a newer one replaced stops
};
window.pstar = state;

class AuthError extends Error {}

const $ = (sel, root = document) => root.querySelector(sel);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fmtBytes(v) {
  if (v == null || Number.isNaN(v)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let x = Math.abs(v);
  while (x >= 1024 && i < units.length - 1) { x /= 1024; i += 1; }
  return `${(Math.sign(v) * x).toFixed(x >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

function fmtNum(v, digits = 4) {
  if (v == null || Number.isNaN(v)) return "–";
  return Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0)
    ? v.toExponential(2) : Number(v.toPrecision(digits)).toString();
}

function age(seconds) {
  const s = Math.max(0, Date.now() / 1000 - seconds);
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

async function api(path, opts = {}) {
  const headers = { Authorization: `Bearer ${state.token}`, ...(opts.headers || {}) };
  const r = await fetch(API + path, { ...opts, headers });
  if (r.status === 401) {
    signOut("The API token was not accepted (401). Sign in again.");
    throw new AuthError("401");
  }
  if (!r.ok) {
    let msg = r.statusText;
    try { msg = (await r.json()).error.message; } catch (_) { /* not our envelope */ }
    const err = new Error(msg);
    err.status = r.status;
    throw err;
  }
  return r.json();
}

// -- pages --------------------------------------------------------------------------------

function cleanup() {
  state.timers.forEach(clearInterval);
  state.timers = [];
  if (state.stream) state.stream.abort();
  state.stream = null;
  state.streamState = "idle";
  Object.values(state.charts).forEach((u) => u.destroy());
  state.charts = {};
  state.plotted = {};
  state.metrics = new Map();
  state.memory = null;
  state.job = null;
  state.seenEvents = new Set();
  state.graded = null;
  state.gradedStep = null;
}

function mount(tpl) {
  const main = $("#main");
  main.replaceChildren($(`#tpl-${tpl}`).content.cloneNode(true));
  return main;
}

function route() {
  cleanup();
  state.view += 1;
  $("#signout").hidden = !state.token;
  if (!state.token) return renderSignin();
  const m = location.hash.match(/^#\/jobs\/([A-Za-z0-9_-]+)$/);
  return m ? renderJob(m[1]) : renderList();
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = null;
  cleanup();
  $("#signout").hidden = true;
  renderSignin(message);
}

function renderSignin(message = "") {
  mount("signin");
  $("#signin-error").textContent = message;
  $("#signin").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const token = $("#token").value.trim();
    const r = await fetch(`${API}/fine_tuning/jobs?limit=1`, {
      headers: { Authorization: `Bearer ${token}` },
    });
    if (r.status === 401) {
      $("#signin-error").textContent = "The API token was not accepted (401).";
      return;
    }
    state.token = token;
    sessionStorage.setItem(TOKEN_KEY, token);
    route();
  });
}

// the models in memory now: which deployment answers each, on which replicas
async function renderServed() {
  const models = await api("/models");
  const body = $("#served tbody");
  if (!body) return;
  const served = models.data.filter((m) => m.serving);
  body.replaceChildren(...served.map((m) => el("tr", {},
    el("td", {}, m.id),
    el("td", {}, m.serving.adapter ? `adapter on ${m.adapter_base}` : "own weights"),
    el("td", {}, m.serving.deployment),
    el("td", {}, m.serving.loaded_in.map((r) => `${r.replica} on ${r.node} (${r.device})`).join(", ")))));
  $("#served-empty").hidden = served.length > 0;
}

// the live training sessions (Tinker's API): each training model's progress
async function renderSessions() {
  const page = await api("/training_sessions");
  const body = $("#sessions tbody");
  if (!body) return;
  const rows = [];
  for (const s of page.data) {
    const models = s.models.length ? s.models : [null];
    models.forEach((m, i) => rows.push(el("tr", { "data-session": s.id },
      el("td", {}, i === 0 ? `${s.name ? `${s.name} · ` : ""}${s.id} (${s.samplers.length} sampler${s.samplers.length === 1 ? "" : "s"})` : ""),
      el("td", {}, m ? m.id : (s.samplers.length ? "samplers only" : "no training model yet")),
      el("td", {}, m ? m.base_model : ""),
      el("td", {}, m ? m.kind : ""),
      el("td", {}, m ? String(m.steps) : ""),
      el("td", {}, m ? m.tokens.toLocaleString() : ""),
      el("td", {}, m && m.last_loss !== null ? fmtNum(m.last_loss) : ""),
      el("td", {}, m ? `${m.last_op}, ${age(m.last_op_at)} ago` : ""),
      el("td", {}, m ? m.where : ""))));
  }
  body.replaceChildren(...rows);
  $("#sessions-empty").hidden = page.data.length > 0;
}

async function renderList() {
  const view = state.view;
  mount("list");
  const refresh = async () => {
    const page = await api("/fine_tuning/jobs?limit=100");
    const body = $("#jobs tbody");
    if (!body) return;
    body.replaceChildren(...page.data.map((j) => {
      const pct = j.progress.total ? (100 * j.progress.step) / j.progress.total : 0;
      const bar = el("span", { class: "bar" }, el("div", { style: `width:${pct.toFixed(1)}%` }));
      return el("tr", { class: "link", "data-job": j.id, onclick: () => { location.hash = `#/jobs/${j.id}`; } },
        el("td", {}, el("a", { href: `#/jobs/${j.id}` }, j.id)),
        el("td", {}, el("span", { class: `status ${j.status}` }, j.status)),
        el("td", {}, j.model),
        el("td", {}, bar, ` ${j.progress.step}/${j.progress.total}`),
        el("td", {}, age(j.created_at)));
    }));
    $("#jobs-empty").hidden = page.data.length > 0;
    await renderServed();
    await renderSessions();
  };
  await refresh().catch(showError);
  if (view !== state.view) return; // another page was opened meanwhile: no timer of ours
  state.timers.push(setInterval(() => refresh().catch(showError), LIST_REFRESH_MS));
}

function showError(e) {
  if (e instanceof AuthError) return;
  let p = $("#page-error");
  if (!p) {
    p = el("p", { id: "page-error", class: "error" });
    $("#main").prepend(p);
  }
  p.textContent = String(e.message || e);
}

async function renderJob(id) {
  // Two renders of one page can overlap (a sign-in finishing while the address changes):
  // each one that a newer route() replaced stops at its next await, or both would draw
  // every chart into the same page, twice.
  const view = state.view;
  const current = () => view === state.view;
  mount("job");
  let job;
  try {
    job = await api(`/fine_tuning/jobs/${id}`);
    if (!current()) return;
  } catch (e) {
    if (!current()) return;
    if (e instanceof AuthError) return;
    $("#main").replaceChildren(el("section", { class: "card" },
      el("h1", {}, e.status === 404 ? "No such job" : "Cannot load the job"),
      el("p", { class: "error", id: "page-error" }, e.message),
      el("a", { href: "#/" }, "← all jobs")));
    return;
  }
  state.job = job;
  renderHead(job);
  renderTry(job);
  $("#cancel").addEventListener("click", async () => {
    if (!confirm(`Cancel ${id}? The run stops; its checkpoints stay.`)) return;
    try { renderHead(await api(`/fine_tuning/jobs/${id}/cancel`, { method: "POST" })); } catch (e) { showError(e); }
  });
  // pause: a checkpoint at the next step boundary, the workers freed; resume: from it
  for (const verb of ["pause", "resume"]) {
    $(`#${verb}`).addEventListener("click", async () => {
      try { renderHead(await api(`/fine_tuning/jobs/${id}/${verb}`, { method: "POST" })); } catch (e) { showError(e); }
    });
  }
  fetch("/readyz", { headers: { Authorization: `Bearer ${state.token}` } }).then((r) => r.json()).then((h) => {
    state.rayDashboard = h.ray_dashboard_url;
    renderHead(state.job);
  }).catch(() => {});

  const [metrics, memory, events, checkpoints] = await Promise.all([
    api(`/fine_tuning/jobs/${id}/metrics`),
    api(`/fine_tuning/jobs/${id}/memory`),
    api(`/fine_tuning/jobs/${id}/events?limit=200`),
    api(`/fine_tuning/jobs/${id}/checkpoints?limit=100`),
  ]).catch((e) => { showError(e); return []; });
  if (!metrics || !current()) return;
  addMetrics(metrics);
  state.memory = memory;
  makeCharts();
  renderTrace(memory);
  const ordered = events.data.slice().reverse(); // oldest first
  ordered.forEach(addEvent);
  renderCheckpoints(checkpoints);
  const newest = events.data.length ? events.data[0].id : null;
  follow(id, newest);
}

function renderHead(job) {
  if (!job || !$("#job-id")) return;
  state.job = job;
  $("#job-id").textContent = job.id;
  const st = $("#job-status");
  st.textContent = job.status;
  st.className = `status ${job.status}`;
  $("#job-detail").textContent = job.status_detail || "";
  const facts = [
    `model ${job.model}`,
    job.fine_tuned_model ? `→ ${job.fine_tuned_model}` : null,
    `step ${job.progress.step}/${job.progress.total}`,
    `attempt ${job.attempt}/${job.max_attempts}`,
    computeFact(job.hyperparameters_resolved),
    `created ${age(job.created_at)} ago`,
    job.estimated_finish && job.status === "running" ? `ETA ${new Date(job.estimated_finish * 1000).toLocaleTimeString()}` : null,
  ].filter(Boolean);
  $("#job-facts").textContent = facts.join(" · ");
  const pct = job.progress.total ? (100 * job.progress.step) / job.progress.total : 0;
  $("#job-bar").style.width = `${pct.toFixed(1)}%`;
  $("#job-error").textContent = job.error ? `${job.error.code}: ${job.error.message}` : "";
  const ended = ["succeeded", "failed", "cancelled"].includes(job.status);
  $("#cancel").hidden = ended;
  $("#pause").hidden = ended || job.status === "paused" || job.pause_requested;
  $("#resume").hidden = job.status !== "paused";
  $("#job-method").textContent = methodFacts(job).join(" · ");
  renderPlan(job.memory_plan);
  const link = $("#ray-link");
  if (state.rayDashboard && job.ray_submission_id) {
    link.href = `${state.rayDashboard}/#/jobs/${job.ray_submission_id}`;
    link.hidden = false;
  }
}

// the capacity planner's plan of the job on its cluster (written once its data is
// prepared): each chunk list per tier at start, one iteration's forecast, and for a job
// that does not fit, the smallest change that would
function renderPlan(plan) {
  const card = $("#plan");
  if (!card || !plan) return;
  card.hidden = false;
  const rank = plan.per_rank;
  const change = plan.smallest_change;
  $("#plan-verdict").textContent = plan.fits
    ? `Fits: ${rank.workers} rank(s), ${fmtBytes(rank.chunk_bytes)} of chunks each (planned in ${plan.chunk_plan.dtype}).`
    : `Does not fit: ${plan.problems.join("; ")}` + (change ? ` Smallest change that fits: ${change.text}.` : "");
  $("#plan-verdict").className = plan.fits ? "" : "error";
  const body = $("#plan-lists tbody");
  body.replaceChildren(...Object.entries(rank.lists_at_start)
    .filter(([, row]) => row.device + row.host + row.disk + (row.over || 0) > 0)
    .map(([name, row]) => el("tr", { "data-list": name }, el("td", {}, name),
      ...["device", "host", "disk", "over"].map((t) => el("td", {}, fmtBytes(row[t] || 0))))));
  const it = rank.iteration;
  const parts = [
    `activations peak near ${fmtBytes(it.non_model_peak_bytes)} (${plan.non_model_source})`,
    `an iteration needs at least ${fmtBytes(it.least_device_bytes)} on the device`,
  ];
  if (it.device_peak_bytes != null) {
    parts.push(`device peak ${fmtBytes(it.device_peak_bytes)}, host peak ${fmtBytes(it.host_peak_bytes)}`,
      `moves ${fmtBytes(it.host_to_device_bytes)} host→device and ${fmtBytes(it.device_to_host_bytes)} back per step`,
      `${it.optimizer_chunks_on_device} of ${it.optimizer_chunks} optimizer-state chunks on the device`);
  }
  if (rank.workers > 1) parts.push(`${fmtBytes(it.collective_bytes)} in collectives per step`);
  $("#plan-iteration").textContent = parts.join(" · ");
}

// -- try it: the fine-tuned model and its base answer one prompt side by side -----------

function renderTry(job) {
  const form = $("#try");
  if (!form || !job.fine_tuned_model || !form.hidden) return;
  form.hidden = false;
  $("#try-ft-name").textContent = `fine-tuned: ${job.fine_tuned_model}`;
  $("#try-base-name").textContent = `base: ${job.model}`;
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const prompt = $("#try-prompt").value.trim();
    if (!prompt) return;
    $("#try-ask").disabled = true;
    await Promise.all([ask(job.fine_tuned_model, prompt, $("#try-ft")), ask(job.model, prompt, $("#try-base"))]);
    $("#try-ask").disabled = false;
    showServing(job.fine_tuned_model);
  });
  showServing(job.fine_tuned_model);
}

// stream one greedy answer into `out` (server-sent chunks, as the OpenAI SDK reads them)
async function ask(model, prompt, out) {
  out.textContent = "";
  out.classList.remove("error", "empty");
  out.dataset.done = "";
  try {
    const r = await fetch(`${API}/chat/completions`, {
      method: "POST",
      headers: { Authorization: `Bearer ${state.token}`, "Content-Type": "application/json" },
      body: JSON.stringify({ model, messages: [{ role: "user", content: prompt }], max_tokens: 128, temperature: 0, stream: true }),
    });
    if (!r.ok) {
      let msg = r.statusText;
      try { msg = (await r.json()).error.message; } catch (_) { /* not our envelope */ }
      throw new Error(msg);
    }
    for await (const ev of sseEvents(r)) {
      if (ev.data === "[DONE]") break;
      const chunk = JSON.parse(ev.data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const c of chunk.choices || []) if (c.delta && c.delta.content) out.textContent += c.delta.content;
    }
  } catch (e) {
    out.textContent = e.message;
    out.classList.add("error");
  }
  if (!out.textContent) out.classList.add("empty");
  out.dataset.done = "1";
}

async function showServing(model) {
  try {
    const m = await api(`/models/${encodeURIComponent(model)}`);
    const s = m.serving;
    $("#try-where").textContent = s && s.loaded_in.length
      ? `in memory: ${s.adapter ? "an adapter on" : "its own"} deployment ${s.deployment}, `
        + s.loaded_in.map((r) => `replica ${r.replica} on ${r.node} (${r.device})`).join(", ")
      : "not in memory now: the first answer starts its deployment (seconds)";
  } catch (_) { /* the box works without it */ }
}

// what the job trains and how: the method (DPO's beta, LoRA's rank), the data's layout
// (packed rows and their fill), and early stopping's state
function methodFacts(job) {
  const out = [];
  const m = job.method || {};
  const section = m[m.type] || {};
  const lora = section.lora || (m.type === "lora" ? section : null);
  let what = `method ${m.type}`;
  if (m.type === "dpo") what += ` (β ${section.hyperparameters?.beta ?? "auto"})`;
  if (m.type === "reinforcement") {
    what += ` (${section.grader?.type} grader, ${section.hyperparameters?.group_size ?? "auto"} answers a prompt)`;
  }
  if (lora && lora.r) what += `, LoRA r ${lora.r}`;
  out.push(what);
  const d = job.data;
  if (d) {
    const fill = d.fill_ratio != null ? `${(100 * d.fill_ratio).toFixed(0)}% filled` : "";
    if (d.format === "preference") {
      out.push(`${d.rows} preference pairs, a row of ${d.seq_len} per answer, ${fill}`);
    } else if (d.format === "prompts") {
      out.push(`${d.rows} prompts, rows of ${d.seq_len} with room for the answer`);
    } else {
      const layout = d.packing?.packed
        ? `packed ${Number(d.examples_per_row).toFixed(1)} examples/row`
        : "one example per row";
      out.push(`${d.rows} rows of ${d.seq_len}, ${layout}, ${fill}`);
    }
  }
  const es = job.early_stopping;
  if (es) {
    let s = `early stopping (patience ${es.patience}, min Δ ${es.min_delta})`;
    const best = es.best_value ?? es.best_valid_loss, watched = es.watched || 'valid_loss';
    if (es.stopped) s += `: stopped at step ${es.stopped_at_step}, best step ${es.best_step} (${watched} ${fmtNum(best)})`;
    else if (es.best_step != null) s += `: best ${watched} ${fmtNum(best)} at step ${es.best_step}, ${es.evals_without_improvement} eval(s) without improvement`;
    else s += ": watching";
    out.push(s);
  }
  if (job.pause_requested) out.push("pausing at the next step boundary");
  return out;
}

// the compute dtype the engine chose (dtype 'auto') and on what: "bf16 (auto: CPU AVX512)"
function computeFact(hp) {
  if (!hp) return null;
  const rt = hp.runtime;
  if (!rt) return `dtype ${hp.compute_dtype || "auto"}`;
  const how = rt.dtype_requested === "auto" ? "auto, " : "";
  return `dtype ${rt.compute_dtype} (${how}${rt.cpu_capability}, ${rt.threads} thr, Adam ${rt.host_adam})`;
}

function addEvent(e) {
  if (state.seenEvents.has(e.id)) return;
  state.seenEvents.add(e.id);
  if (e.type === "metrics") return; // those are the charts
  if (e.data?.graded) renderGraded(e.data);
  const t = new Date(e.created_at * 1000).toLocaleTimeString();
  const li = el("li", { class: e.level, "data-event": e.id }, el("span", { class: "t" }, t), e.message);
  $("#events")?.prepend(li);
}

// a reinforcement job's evaluation: a few validation prompts, the answers sampled for them
// and what the grader (each of a multi's graders) gave them; the newest evaluation's show
function renderGraded(data) {
  if (state.gradedStep != null && data.step < state.gradedStep) return;
  state.gradedStep = data.step;
  state.graded = data.graded;
  const card = $("#card-graded");
  if (!card) return;
  card.hidden = false;
  $("#graded-step").textContent = `at step ${data.step}`;
  const scores = (g) => Object.entries(g.scores || {}).map(([k, v]) => `${k} ${fmtNum(v)}`).join(", ");
  $("#graded tbody").replaceChildren(...data.graded.map((g) => el(
    "tr", {}, el("td", {}, g.prompt), el("td", { class: "answer" }, g.answer),
    el("td", {}, fmtNum(g.reward)), el("td", {}, scores(g)),
  )));
}

function renderCheckpoints(page) {
  const body = $("#checkpoints tbody");
  if (!body) return;
  body.replaceChildren(...page.data.map((c) => el("tr", {},
    el("td", {}, c.step_number), el("td", {}, c.id),
    el("td", {}, fmtNum(c.metrics?.train_loss)),
    el("td", {}, new Date(c.created_at * 1000).toLocaleString()))));
}

// -- metrics and charts ---------------------------------------------------------------------

function addMetrics(resp) {
  for (const [name, s] of Object.entries(resp.series)) {
    s.steps.forEach((step, i) => {
      const row = state.metrics.get(step) || {};
      row[name] = s.values[i];
      state.metrics.set(step, row);
    });
  }
}

function lastStep() {
  let m = -1;
  for (const s of state.metrics.keys()) m = Math.max(m, s);
  return m;
}

// Each chart: which metric names it plots (a function of the names present), how
// (stacked or not), and its value format.
const CHART_DEFS = {
  loss: { names: () => ["train_loss", "valid_loss"], fmt: fmtNum },
  lr: { names: () => ["lr"], fmt: fmtNum },
  speed: { names: () => ["tokens_per_second", "tflops"], fmt: fmtNum, twoAxes: true },
  tiers: { names: (all) => ["device", "host", "disk"].map((t) => `model_data_bytes_${t}`).filter((n) => all.has(n)), fmt: fmtBytes, stacked: true },
  moved: { names: (all) => [...all].filter((n) => n.startsWith("bytes_moved_")).sort(), fmt: fmtBytes, stacked: true },
  peak: { names: () => ["peak_non_model_bytes"], fmt: fmtBytes, budget: true },
  // DPO only (its card shows once a reward arrives)
  rewards: { names: (all) => ["reward_margin", "chosen_reward", "rejected_reward", "valid_reward_margin"].filter((n) => all.has(n)), fmt: fmtNum, optional: true },
  accuracy: { names: (all) => ["reward_accuracy", "valid_reward_accuracy"].filter((n) => all.has(n)), fmt: fmtNum, optional: true },
  // reinforcement only: the mean reward of the sampled answers (and of each named grader)
  grades: { names: (all) => [...all].filter((n) => /^(full_)?(train|valid)_reward_mean/.test(n)).sort(), fmt: fmtNum, optional: true },
};

function seriesData(names) {
  const steps = [...state.metrics.keys()].sort((a, b) => a - b);
  const raw = names.map((n) => steps.map((s) => {
    const v = state.metrics.get(s)[n];
    return v == null ? null : v;
  }));
  return { steps, raw };
}

function stackedData(raw) {
  const out = [];
  let acc = null;
  for (const r of raw) {
    acc = r.map((v, i) => (v ?? 0) + (acc ? acc[i] : 0));
    out.push(acc);
  }
  return out;
}

function chartData(key) {
  const def = CHART_DEFS[key];
  const all = new Set();
  for (const row of state.metrics.values()) Object.keys(row).forEach((n) => all.add(n));
  const names = def.names(all);
  const { steps, raw } = seriesData(names);
  state.plotted[key] = { steps, series: Object.fromEntries(names.map((n, i) => [n, raw[i]])) };
  const ys = def.stacked ? stackedData(raw) : raw;
  const data = [steps, ...ys];
  if (def.budget) {
    const b = state.memory?.device_budget_bytes;
    data.push(steps.map(() => (b == null ? null : b)));
  }
  return { names, raw, data };
}

function makeChart(key) {
  const def = CHART_DEFS[key];
  const { names, raw, data } = chartData(key);
  // an optional chart's card (DPO's) is hidden until its first series arrives
  const target = $(def.optional ? `#opt-chart-${key}` : `#chart-${key}`);
  if (!target) return;
  if (def.optional) {
    $(`#card-${key}`).hidden = names.length === 0;
    if (names.length === 0) return;
  }
  if (state.charts[key]) { state.charts[key].destroy(); delete state.charts[key]; }
  target.replaceChildren(); // one chart per card, whoever drew here before
  const series = [{ label: "step" }];
  names.forEach((n, i) => {
    const color = COLORS[i % COLORS.length];
    series.push({
      label: n,
      stroke: color,
      width: 1.5,
      // stacked: the first series fills down to zero, each next one down to the one below
      fill: def.stacked && i === 0 ? `${color}66` : undefined,
      scale: def.twoAxes && i === 1 ? "right" : "y",
      // stacked charts draw cumulative sums; the legend shows each series' own value
      value: (u, v, si, idx) => def.fmt(def.stacked ? raw[si - 1]?.[idx] : v),
      spanGaps: true,
    });
  });
  if (def.budget) series.push({ label: "device budget", stroke: "#111827", dash: [6, 4], width: 1, value: (u, v) => fmtBytes(v) });
  const axes = [{ label: "step" }, { values: (u, vals) => vals.map((v) => def.fmt(v)), size: 70 }];
  if (def.twoAxes) axes.push({ side: 1, scale: "right", values: (u, vals) => vals.map((v) => fmtNum(v)), grid: { show: false }, size: 60 });
  const bands = def.stacked
    ? names.slice(1).map((_, i) => ({ series: [i + 2, i + 1], fill: `${COLORS[(i + 1) % COLORS.length]}66` }))
    : [];
  const width = Math.max(320, target.clientWidth || 560);
  const scales = { x: { time: false } };
  if (def.budget) scales.y = { range: budgetRange(data.slice(1, -1), state.memory?.device_budget_bytes) };
  const opts = { width, height: 220, series, axes, bands, scales, legend: { live: true } };
  const u = new uPlot(opts, data, target);
  state.charts[key] = u;
}

// y from 0 to the data's peak, or to the budget when it is near enough to compare with
// (a CPU job's device budget is the host's memory: it would flatten the data to zero)
function budgetRange(arrays, budget) {
  let peak = 0;
  for (const a of arrays) for (const v of a) if (v != null) peak = Math.max(peak, v);
  const top = budget != null && budget <= FAR * peak ? budget : peak;
  return () => [0, (top || 1) * 1.1];
}

function makeCharts() {
  Object.keys(CHART_DEFS).forEach(makeChart);
}

function refreshCharts() {
  for (const key of Object.keys(CHART_DEFS)) {
    const u = state.charts[key];
    if (!u) {
      if (CHART_DEFS[key].optional) makeChart(key); // its first series may have arrived
      continue;
    }
    const { names, data } = chartData(key);
    if (names.length !== u.series.length - 1 - (CHART_DEFS[key].budget ? 1 : 0)) {
      u.destroy();
      delete state.charts[key];
      makeChart(key); // a new series appeared (a new move direction, the first eval)
    } else {
      u.setData(data);
    }
  }
}

function renderTrace(memory) {
  const target = $("#chart-trace");
  if (!target) return;
  if (state.charts.trace) { state.charts.trace.destroy(); delete state.charts.trace; }
  target.replaceChildren();
  const note = $("#trace-note");
  if (!memory || !memory.available) {
    note.textContent = "The warm-up iteration's trace appears here once the first statistics arrive.";
    return;
  }
  const n = memory.moments;
  const x = [...Array(n).keys()];
  const budget = memory.device_budget_bytes;
  const series = {
    non_model_bytes: memory.non_model_bytes,
    chunk_bytes: memory.chunk_bytes,
    chunk_allowance_bytes: memory.chunk_allowance_bytes,
  };
  state.plotted.trace = { moments: x, names: memory.names, series };
  const far = budget != null && budget > FAR * Math.max(...series.chunk_bytes, ...series.non_model_bytes, 1);
  note.textContent = `${n} moments (operator starts) of the traced iteration; peak non-model ` +
    `${fmtBytes(memory.peak_non_model_bytes)}, device budget ${fmtBytes(budget)}` +
    `${far ? " (far above the scale, as is A_j)" : ""}. Hover to see each moment's operator.`;
  const label = (i) => (i == null ? "" : `${i}: ${memory.names[i] ?? ""}`);
  const u = new uPlot({
    width: Math.max(600, target.clientWidth || 1200),
    height: 260,
    scales: { x: { time: false }, y: { range: budgetRange([series.non_model_bytes, series.chunk_bytes], budget) } },
    series: [
      { label: "moment", value: (u, v) => label(v) },
      { label: "non-model N_i", stroke: COLORS[1], width: 1.5, value: (u, v) => fmtBytes(v) },
      { label: "chunks on device C_i", stroke: COLORS[0], fill: `${COLORS[0]}33`, width: 1.5, value: (u, v) => fmtBytes(v) },
      { label: "chunk allowance A_j", stroke: COLORS[2], width: 1, dash: [4, 3], value: (u, v) => fmtBytes(v) },
      { label: "device budget", stroke: "#111827", width: 1, dash: [6, 4], value: (u, v) => fmtBytes(v) },
    ],
    axes: [{ label: "moment" }, { values: (u, vals) => vals.map(fmtBytes), size: 70 }],
  }, [x, series.non_model_bytes, series.chunk_bytes, series.chunk_allowance_bytes, x.map(() => budget)], target);
  state.charts.trace = u;
}

// -- the live stream ------------------------------------------------------------------------

function parseBlock(block) {
  const ev = { event: "message", data: "", id: null };
  let any = false;
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const i = line.indexOf(":");
    const field = i < 0 ? line : line.slice(0, i);
    const value = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
    if (field === "data") ev.data += (ev.data ? "\n" : "") + value;
    else if (field === "event") ev.event = value;
    else if (field === "id") ev.id = value;
    any = true;
  }
  return any ? ev : null;
}

// the server-sent events of a response, parsed, as they arrive (the job's event stream,
// a chat completion's chunks)
async function* sseEvents(r) {
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let k;
    while ((k = buf.indexOf("\n\n")) >= 0) {
      const ev = parseBlock(buf.slice(0, k));
      buf = buf.slice(k + 2);
      if (ev) yield ev;
    }
  }
}

async function onEvent(id, type, event) {
  addEvent(event);
  if (type === "metrics") {
    const from = lastStep() + 1;
    addMetrics(await api(`/fine_tuning/jobs/${id}/metrics?step_from=${from}`));
    if (!state.memory?.available) {
      state.memory = await api(`/fine_tuning/jobs/${id}/memory`);
      renderTrace(state.memory);
    }
    refreshCharts();
    const step = event.data?.step;
    if (state.job && step != null) {
      state.job.progress.step = Math.max(state.job.progress.step, step);
      renderHead(state.job);
    }
  } else {
    renderHead(await api(`/fine_tuning/jobs/${id}`));
    if (/checkpoint/i.test(event.message)) renderCheckpoints(await api(`/fine_tuning/jobs/${id}/checkpoints?limit=100`));
  }
}

async function follow(id, after) {
  const ctrl = new AbortController();
  state.stream = ctrl;
  let last = after;
  while (!ctrl.signal.aborted) {
    try {
      const headers = { Authorization: `Bearer ${state.token}`, Accept: "text/event-stream" };
      if (last) headers["Last-Event-ID"] = last;
      const r = await fetch(`${API}/fine_tuning/jobs/${id}/events/stream`, { headers, signal: ctrl.signal });
      if (r.status === 401) { signOut("The API token was not accepted (401). Sign in again."); return; }
      if (!r.ok) throw new Error(`stream: ${r.status}`);
      state.streamState = "live";
      for await (const ev of sseEvents(r)) {
        if (ev.event === "end") {
          const job = JSON.parse(ev.data);
          renderHead(job);
          renderCheckpoints(await api(`/fine_tuning/jobs/${id}/checkpoints?limit=100`));
          state.memory = await api(`/fine_tuning/jobs/${id}/memory`);
          renderTrace(state.memory);
          refreshCharts();
          state.streamState = "ended";
          return;
        }
        if (ev.id) last = ev.id;
        await onEvent(id, ev.event, JSON.parse(ev.data));
      }
    } catch (e) {
      if (ctrl.signal.aborted || e instanceof AuthError) return;
    }
    state.streamState = "reconnecting";
    await sleep(2000);
  }
}

// -- start --------------------------------------------------------------------------------

$("#signout").addEventListener("click", () => signOut(""));
window.addEventListener("hashchange", route);
route();
