// HIGGS console: a small single-page app over the public REST API (/v1/...).
// The API key lives in sessionStorage (this tab only) and travels in the Authorization header;
// the event stream is read with fetch() so the header can be sent; downloads use short-lived
// signed links (POST .../link) so the key never appears in a URL.
"use strict";

const KEY_STORE = "higgs.apiKey";
const SVG_NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

const state = {
  jobsTimer: null,
  eventsAbort: null,
  jobId: null,
  links: {}, // format -> {url, expires}
};

// ------------------------------------------------------------------ API

function apiKey() {
  return sessionStorage.getItem(KEY_STORE);
}

class ApiError extends Error {
  constructor(status, problem) {
    super((problem && (problem.detail || problem.title)) || `HTTP ${status}`);
    this.status = status;
    this.problem = problem || {};
  }
}

async function api(method, path, body, key) {
  const headers = { Accept: "application/json" };
  const k = key || apiKey();
  if (k) headers.Authorization = `Bearer ${k}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let resp;
  try {
    resp = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
    });
  } catch (e) {
    throw new ApiError(0, { detail: `the service cannot be reached (${e.message})` });
  }
  const text = await resp.text();
  let data = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch (_) {
      data = { detail: text.slice(0, 300) };
    }
  }
  if (!resp.ok) {
    if (resp.status === 401 && !key) signOut("Your API key was refused: " + ((data && data.detail) || "401"));
    throw new ApiError(resp.status, data);
  }
  return data;
}

// ------------------------------------------------------------------ field errors

function clearErrors(form) {
  form.querySelectorAll(".field-error").forEach((p) => (p.textContent = ""));
  form.querySelectorAll("[aria-invalid]").forEach((el) => el.removeAttribute("aria-invalid"));
}

function showFieldError(inputId, message) {
  const input = $(inputId);
  const out = $(`${inputId}-error`);
  if (out) out.textContent = message;
  if (input) input.setAttribute("aria-invalid", "true");
}

// Which input a problem+json field name belongs to.
const FIELD_INPUTS = {
  model: "model",
  "model.id": "model",
  "model.revision": "model",
  target: "target-bits",
  "target.bits": "target-bits",
  "target.avg_bits": "target-bits",
  "target.max_ppl_increase": "target-bits",
  webhook_url: "webhook-url",
};

function showProblem(err, formErrorId) {
  const problem = err.problem || {};
  const fields = Array.isArray(problem.errors) ? problem.errors : [];
  let placed = false;
  let focus = null;
  for (const f of fields) {
    const input = FIELD_INPUTS[f.field];
    if (input) {
      showFieldError(input, `${problem.status || err.status} ${problem.title || ""}: ${f.message}`.trim());
      placed = true;
      focus = focus || input;
    }
  }
  if (!placed) {
    $(formErrorId).textContent = `${err.status ? err.status + " " : ""}${problem.title || "Error"}: ${err.message}`;
  }
  if (focus) $(focus).focus();
}

// ------------------------------------------------------------------ formatting

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1000 && i < units.length - 1) {
    v /= 1000;
    i++;
  }
  return `${v.toFixed(i === 0 ? 0 : 2)} ${units[i]}`;
}

function fmtNum(v, digits = 3) {
  return v === null || v === undefined || Number.isNaN(Number(v)) ? "-" : Number(v).toFixed(digits);
}

function fmtAge(iso) {
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

function fmtTarget(job) {
  const t = (job.request && job.request.target) || {};
  if (t.bits !== undefined && t.bits !== null) return `${t.bits} bits (uniform)`;
  if (t.avg_bits !== undefined && t.avg_bits !== null) return `${t.avg_bits} bits (average)`;
  if (t.max_ppl_increase !== undefined && t.max_ppl_increase !== null)
    return `+${(100 * t.max_ppl_increase).toFixed(1)}% perplexity`;
  return "-";
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svgEl(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// ------------------------------------------------------------------ charts (inline SVG)

function niceTicks(lo, hi, count = 5) {
  if (!(hi > lo)) hi = lo + 1;
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-12; v += step) ticks.push(Number(v.toPrecision(12)));
  return ticks;
}

// Predicted quality against bits, with the chosen point marked.
function curveChart(points, chosen, xLabel, yLabel, title) {
  const W = 640, H = 320, L = 60, R = 20, T = 20, B = 50;
  const xs = points.map((p) => p.x), ys = points.map((p) => p.y);
  if (chosen) { xs.push(chosen.x); ys.push(chosen.y); }
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const y0 = 0, y1 = Math.max(...ys) * 1.05 || 1;
  const sx = (x) => L + ((x - x0) / (x1 - x0 || 1)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0 || 1)) * (H - T - B);
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  svg.append(svgEl("title", {}, title));
  for (const t of niceTicks(y0, y1)) {
    svg.append(svgEl("line", { class: "grid", x1: L, x2: W - R, y1: sy(t), y2: sy(t) }));
    svg.append(svgEl("text", { x: L - 6, y: sy(t) + 4, "text-anchor": "end" }, t.toString()));
  }
  for (const t of niceTicks(x0, x1)) {
    svg.append(svgEl("text", { x: sx(t), y: H - B + 16, "text-anchor": "middle" }, t.toString()));
  }
  svg.append(svgEl("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  svg.append(svgEl("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  svg.append(svgEl("text", { x: (L + W - R) / 2, y: H - 10, "text-anchor": "middle" }, xLabel));
  svg.append(svgEl("text", { x: 14, y: (T + H - B) / 2, "text-anchor": "middle",
    transform: `rotate(-90 14 ${(T + H - B) / 2})` }, yLabel));
  const d = points.map((p, i) => `${i ? "L" : "M"}${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join(" ");
  svg.append(svgEl("path", { class: "curve", d }));
  if (chosen) {
    const c = svgEl("circle", { class: "chosen", cx: sx(chosen.x), cy: sy(chosen.y), r: 7 });
    c.append(svgEl("title", {}, chosen.label));
    svg.append(c);
    svg.append(svgEl("text", { x: sx(chosen.x) + 10, y: sy(chosen.y) - 10 }, chosen.label));
  }
  return svg;
}

// Bits chosen per layer (bars, left axis) and relative error per layer (dots, right axis).
function layersChart(layers) {
  const n = layers.length;
  const W = Math.max(640, 60 + n * 14 + 60), H = 340, L = 50, R = 60, T = 20, B = 40;
  const bw = (W - L - R) / Math.max(n, 1);
  const maxBits = Math.max(16, ...layers.map((l) => l.bits));
  const bitsTop = Math.max(...layers.map((l) => l.bits)) > 8 ? maxBits : 8;
  const errs = layers.map((l) => (l.rel_error === null ? 0 : l.rel_error));
  const errTop = Math.max(...errs) * 1.1 || 1;
  const sy = (v) => H - B - (v / bitsTop) * (H - T - B);
  const se = (v) => H - B - (v / errTop) * (H - T - B);
  const title = `Per-layer bits and relative error for ${n} layers`;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title, id: "layers-svg" });
  svg.append(svgEl("title", {}, title));
  for (const t of niceTicks(0, bitsTop, 4)) {
    svg.append(svgEl("line", { class: "grid", x1: L, x2: W - R, y1: sy(t), y2: sy(t) }));
    svg.append(svgEl("text", { x: L - 6, y: sy(t) + 4, "text-anchor": "end" }, t.toString()));
  }
  for (const t of niceTicks(0, errTop, 4)) {
    svg.append(svgEl("text", { x: W - R + 6, y: se(t) + 4 }, t.toPrecision(2)));
  }
  svg.append(svgEl("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  svg.append(svgEl("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle",
    transform: `rotate(-90 12 ${(T + H - B) / 2})` }, "bits per weight"));
  svg.append(svgEl("text", { x: W - 8, y: (T + H - B) / 2, "text-anchor": "middle",
    transform: `rotate(90 ${W - 8} ${(T + H - B) / 2})` }, "relative error"));
  svg.append(svgEl("text", { x: (L + W - R) / 2, y: H - 12, "text-anchor": "middle" }, "layer (in checkpoint order)"));
  layers.forEach((l, i) => {
    const x = L + i * bw;
    const bar = svgEl("rect", { class: "bar", x: x + bw * 0.1, width: bw * 0.8, y: sy(l.bits), height: H - B - sy(l.bits) });
    bar.append(svgEl("title", {}, `${l.name}: ${fmtNum(l.bits)} bits, relative error ${fmtNum(l.rel_error, 4)}`));
    svg.append(bar);
    if (l.rel_error !== null) {
      svg.append(svgEl("circle", { class: "err", cx: x + bw / 2, cy: se(l.rel_error), r: Math.min(4, bw / 2) }));
    }
  });
  return svg;
}

// ------------------------------------------------------------------ views

const VIEWS = ["signin", "new", "jobs", "job"];

function showView(name) {
  for (const v of VIEWS) $(`view-${v}`).hidden = v !== name;
  $("nav").hidden = name === "signin";
  for (const a of $("nav").querySelectorAll("a")) {
    const here = (name === "new" && a.hash === "#/new") || ((name === "jobs" || name === "job") && a.hash === "#/jobs");
    if (here) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
}

function stopLive() {
  if (state.jobsTimer) clearInterval(state.jobsTimer);
  state.jobsTimer = null;
  if (state.eventsAbort) state.eventsAbort.abort();
  state.eventsAbort = null;
}

function route() {
  stopLive();
  const hash = location.hash || "#/";
  if (!apiKey()) {
    showView("signin");
    $("signin-title").focus();
    return;
  }
  let m;
  if ((m = hash.match(/^#\/jobs\/([A-Za-z0-9-]+)$/))) {
    showView("job");
    openJob(m[1]);
  } else if (hash === "#/jobs") {
    showView("jobs");
    $("jobs-title").focus();
    loadJobs();
    state.jobsTimer = setInterval(loadJobs, 2000);
  } else {
    showView("new");
    $("new-title").focus();
  }
}

function signOut(message) {
  sessionStorage.removeItem(KEY_STORE);
  stopLive();
  if (location.hash !== "#/") location.hash = "#/";
  else route();
  if (message) showFieldError("api-key", message);
}

// ------------------------------------------------------------------ sign in

async function onSignIn(ev) {
  ev.preventDefault();
  const form = $("signin-form");
  clearErrors(form);
  const key = $("api-key").value.trim();
  if (!key) {
    showFieldError("api-key", "Enter an API key.");
    $("api-key").focus();
    return;
  }
  const button = form.querySelector("button");
  button.disabled = true;
  try {
    await api("GET", "/v1/jobs?limit=1", undefined, key);
    sessionStorage.setItem(KEY_STORE, key);
    $("api-key").value = "";
    location.hash = "#/jobs";
  } catch (err) {
    const p = err.problem || {};
    showFieldError("api-key", `${err.status || ""} ${p.title || "Error"}: ${err.message}`.trim());
    $("api-key").focus();
  } finally {
    button.disabled = false;
  }
}

// ------------------------------------------------------------------ new job

function readForm() {
  const mode = document.querySelector('input[name="mode"]:checked').value;
  const raw = $("target-bits").value.trim();
  const bits = raw === "" ? NaN : Number(raw);
  const body = { model: { id: $("model").value.trim() }, target: { [mode]: Number.isFinite(bits) ? bits : raw } };
  if ($("evaluate").checked) body.options = { evaluate: true };
  const output = document.querySelector('input[name="output"]:checked').value;
  if (output !== "higgs") body.options = { ...(body.options || {}), formats: [output] };
  const hook = $("webhook-url").value.trim();
  if (hook) body.webhook_url = hook;
  return { mode, bits, body };
}

async function onQuantize(ev) {
  ev.preventDefault();
  const form = $("job-form");
  clearErrors(form);
  const { body } = readForm();
  const button = $("quantize");
  button.disabled = true;
  try {
    const job = await api("POST", "/v1/jobs", body);
    location.hash = `#/jobs/${job.id}`;
  } catch (err) {
    showProblem(err, "job-form-error");
  } finally {
    button.disabled = false;
  }
}

async function onPreview() {
  const form = $("job-form");
  clearErrors(form);
  const { mode, bits, body } = readForm();
  const panel = $("preview-panel");
  panel.hidden = false;
  $("preview-chart").textContent = "";
  $("preview-text").textContent = "Loading the plan...";
  const req = { model: body.model };
  if (mode === "avg_bits") req.target = { avg_bits: body.target.avg_bits };
  try {
    const plan = await api("POST", "/v1/plans", req);
    const key = "predicted_ppl_increase";
    const points = (plan.pareto || []).map((p) => ({ x: p.avg_bits, y: 100 * p[key] }));
    points.sort((a, b) => a.x - b.x);
    let chosen = null;
    if (plan.allocation) {
      chosen = { x: plan.allocation.avg_bits, y: 100 * plan.allocation[key],
        label: `${fmtNum(plan.allocation.avg_bits, 2)} bits: +${fmtNum(100 * plan.allocation[key], 2)}%` };
    } else if (Number.isFinite(bits) && points.length) {
      // Uniform bits: read the curve at the chosen bits (the curve's x includes overheads).
      let y = points[points.length - 1].y;
      for (let i = 1; i < points.length; i++) {
        if (points[i].x >= bits) {
          const a = points[i - 1], b = points[i];
          y = a.y + ((bits - a.x) / (b.x - a.x || 1)) * (b.y - a.y);
          break;
        }
      }
      if (bits < points[0].x) y = points[0].y;
      chosen = { x: bits, y, label: `${bits} bits: about +${fmtNum(y, 2)}%` };
    }
    $("preview-text").textContent =
      `Predicted perplexity increase against average bits per weight for ${plan.model.id} ` +
      `(profile metric ${plan.metric}, ${points.length} points)` +
      (chosen ? `; chosen: ${chosen.label}.` : ".");
    $("preview-chart").append(
      curveChart(points, chosen, "average bits per weight", "predicted perplexity increase (%)",
        "Predicted quality against bits")
    );
  } catch (err) {
    if (err.status === 404) {
      $("preview-text").textContent = `No preview: ${err.message}`;
    } else {
      $("preview-text").textContent = "";
      panel.hidden = true;
      showProblem(err, "job-form-error");
    }
  }
}

// ------------------------------------------------------------------ jobs list

async function loadJobs() {
  try {
    const page = await api("GET", "/v1/jobs?limit=50");
    $("jobs-error").textContent = "";
    const body = $("jobs-body");
    const rows = page.data.map((j) => {
      const link = el("a", { href: `#/jobs/${j.id}` }, j.id.slice(0, 8));
      return el("tr", { "data-job-id": j.id },
        el("td", {}, link),
        el("td", {}, el("span", { class: `status status-${j.status}` }, j.status)),
        el("td", { class: "wrap" }, j.model.id),
        el("td", {}, fmtTarget(j)),
        el("td", { class: "num" }, fmtNum(j.summary && j.summary.bits_per_weight)),
        el("td", { class: "num" }, fmtAge(j.created_at)));
    });
    body.replaceChildren(...rows);
    $("jobs-empty").hidden = rows.length > 0;
  } catch (err) {
    $("jobs-error").textContent = `Could not load the jobs: ${err.message}`;
  }
}

// ------------------------------------------------------------------ one job

function renderJob(job) {
  $("job-title").textContent = `Job ${job.id}`;
  const status = $("job-status");
  status.replaceChildren("Status: ", el("span", { class: `status status-${job.status}`, id: "job-status-value" }, job.status));
  if (job.cancel_requested && (job.status === "running" || job.status === "queued"))
    status.append(" (cancel requested)");
  $("job-model").textContent = `Model ${job.model.id}, target ${fmtTarget(job)}`;
  renderProgress(job);
  $("job-cancel").hidden = !(job.status === "queued" || job.status === "running") || job.cancel_requested;
  $("job-failure").textContent = job.error ? `Failed (${job.error.code}): ${job.error.message}` : "";
  if (job.status === "succeeded") renderResult(job);
  else $("job-result").hidden = true;
  renderWebhooks(job);
}

// The job's webhook deliveries (GET /v1/jobs/{id}/webhooks), while it has a webhook_url.
async function renderWebhooks(job) {
  const section = $("job-webhooks");
  section.hidden = !job.webhook_url;
  if (!job.webhook_url) return;
  $("webhook-target").textContent = `Events go to ${job.webhook_url}`;
  try {
    const out = await api("GET", `/v1/jobs/${job.id}/webhooks`);
    const rows = out.data.map((d) => el("tr", {},
      el("td", {}, d.event),
      el("td", {}, d.state),
      el("td", { class: "num" }, d.attempts),
      el("td", {}, d.last_status_code ? `HTTP ${d.last_status_code}` : d.last_error || "-")));
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "4" }, "No event yet (one is sent when the job ends).")));
    $("webhooks-table").querySelector("tbody").replaceChildren(...rows);
    const pending = out.data.some((d) => d.state === "pending") ||
      (["succeeded", "failed", "cancelled"].includes(job.status) && !out.data.length);
    if (pending && state.jobId === job.id) setTimeout(() => state.jobId === job.id && renderWebhooks(job), 2000);
  } catch (_) {
    /* deliveries are informative only */
  }
}

// What a running stage's progress counts comes with it (progress.unit, docs/api.md).
function unitText(unit, total) {
  const u = unit || "step";
  return total === 1 ? u : `${u}s`;
}

function renderProgress(snap) {
  const p = snap.progress || {};
  const terminal = ["succeeded", "failed", "cancelled"].includes(snap.status);
  $("job-stage").textContent = `Stage: ${snap.stage || (terminal ? "finished" : snap.status)}`;
  const bar = $("job-progress");
  if (snap.status === "succeeded") {
    bar.max = 1;
    bar.value = 1;
  } else if (p.total) {
    bar.max = p.total;
    bar.value = p.done;
  } else if (!terminal) {
    bar.removeAttribute("value"); // indeterminate
  }
  $("job-progress-text").textContent = terminal
    ? ""
    : p.total
      ? `${p.done} of ${p.total} ${unitText(p.unit, p.total)}`
      : "";
}

async function renderResult(job) {
  $("job-result").hidden = false;
  const s = job.summary || {};
  const rows = [
    ["Bits per weight", fmtNum(s.bits_per_weight)],
    ["Bits per parameter (all)", fmtNum(s.bits_per_param_total)],
    ["Size before", fmtBytes(s.bytes_before)],
    ["Size after", fmtBytes(s.bytes_after)],
    ["Compression", s.bytes_before && s.bytes_after ? `${(s.bytes_before / s.bytes_after).toFixed(2)}x` : "-"],
  ];
  if (s.ppl_base !== null && s.ppl_base !== undefined) {
    rows.push(["Perplexity base / quantized", `${fmtNum(s.ppl_base, 3)} / ${fmtNum(s.ppl_quantized, 3)}`]);
    const measured = s.ppl_quantized / s.ppl_base - 1;
    rows.push(["Perplexity increase measured", `${fmtNum(100 * measured, 2)}%`]);
  }
  if (s.kl !== null && s.kl !== undefined) rows.push(["KL to base", fmtNum(s.kl, 5)]);
  if (s.predicted_ppl_increase !== null && s.predicted_ppl_increase !== undefined)
    rows.push(["Perplexity increase predicted", `${fmtNum(100 * s.predicted_ppl_increase, 2)}%`]);
  $("job-summary").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));

  const formats = new Set((job.artifacts || []).map((a) => a.format));
  renderDownloads(job.id, [...formats]);
  $("run-it").hidden = !formats.has("gguf") && !formats.has("compressed-tensors");
  if (formats.has("gguf")) renderRunIt(job);
  if (formats.has("compressed-tensors")) renderRunItCt(job);
  try {
    const layers = await api("GET", `/v1/jobs/${job.id}/layers`);
    $("layers-chart").replaceChildren(layersChart(layers.data));
    $("layers-table").querySelector("tbody").replaceChildren(
      ...layers.data.map((l) => el("tr", {},
        el("td", { class: "wrap" }, l.name),
        el("td", {}, l.type ? l.type : l.p === 0 ? "16-bit" : `p=${l.p} n=${l.n}`),
        el("td", { class: "num" }, fmtNum(l.bits)),
        el("td", { class: "num" }, fmtNum(l.rel_error, 5)))));
  } catch (err) {
    $("layers-chart").textContent = `Could not load the layers: ${err.message}`;
  }
  if (formats.has("native")) {
    try {
      const listing = await api("GET", `/v1/jobs/${job.id}/artifacts/native`);
      $("files-table").querySelector("tbody").replaceChildren(
        ...listing.files.map((f) => el("tr", {},
          el("td", { class: "wrap" }, f.path),
          el("td", { class: "num" }, f.bytes),
          el("td", { class: "wrap" }, el("code", {}, f.sha256)))));
    } catch (_) {
      /* the listing is optional here */
    }
  }
}

// The llama.cpp and Ollama commands for a GGUF job's file, with its real file name.
async function renderRunIt(job) {
  $("run-it-hint").textContent =
    "The download is a tar holding gguf/ with the file (or its -0000k-of-0000N shards: give llama.cpp the first).";
  let file = "model.gguf";
  try {
    const listing = await api("GET", `/v1/jobs/${job.id}/artifacts/gguf`);
    const names = listing.files.map((f) => f.path).filter((p) => p.endsWith(".gguf")).sort();
    if (names.length) file = names[0];
  } catch (_) {
    /* keep the generic name */
  }
  const name = (job.model && job.model.id ? job.model.id : "model").split("/").pop().toLowerCase();
  $("run-it-commands").textContent = [
    `tar -xf ${job.id}-gguf.tar`,
    "# llama.cpp",
    `llama-cli -m gguf/${file} -p "Hello"`,
    `llama-server -m gguf/${file} --port 8080`,
    "# Ollama",
    `printf 'FROM ./gguf/${file}\\n' > Modelfile`,
    `ollama create ${name}-higgs -f Modelfile && ollama run ${name}-higgs`,
  ].join("\n");
}

// The vLLM and transformers commands for a compressed-tensors job's directory.
function renderRunItCt(job) {
  $("run-it-hint").textContent =
    "The download is a tar holding compressed-tensors/, a checkpoint vLLM, SGLang and transformers load.";
  $("run-it-commands").textContent = [
    `tar -xf ${job.id}-compressed-tensors.tar`,
    "# vLLM (a GPU server)",
    "vllm serve ./compressed-tensors",
    "# transformers (pip install compressed-tensors)",
    "python -c \"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('compressed-tensors')\"",
  ].join("\n");
}

// A signed link for a plain <a download>: fetched with the key, valid for a few minutes,
// refreshed on click when it is about to expire.
// One download link per format the job's artifacts name: the names come from the API, never
// from a list here (only how a name is shown: llama.cpp's file format is spelled GGUF).
const FORMAT_LABELS = { gguf: "GGUF", "compressed-tensors": "compressed-tensors" };

function renderDownloads(jobId, formats) {
  $("downloads").replaceChildren(
    ...formats.map((fmt) => {
      const a = el("a", { id: `dl-${fmt}`, class: "button", href: "#", download: "" },
        `Download ${FORMAT_LABELS[fmt] || fmt}`);
      a.addEventListener("click", (ev) => onDownloadClick(ev, fmt));
      return a;
    }),
  );
  for (const fmt of formats) refreshLink(jobId, fmt);
}

async function refreshLink(jobId, fmt) {
  const a = $(`dl-${fmt}`);
  a.setAttribute("aria-disabled", "true");
  try {
    const link = await api("POST", `/v1/jobs/${jobId}/artifacts/${fmt}/link`);
    state.links[fmt] = { url: link.url, expires: link.expires_at, jobId };
    a.href = link.url;
    a.removeAttribute("aria-disabled");
  } catch (err) {
    $("job-error").textContent = `Could not make a download link: ${err.message}`;
  }
}

async function onDownloadClick(ev, fmt) {
  const link = state.links[fmt];
  if (link && link.jobId === state.jobId && link.expires - Date.now() / 1000 > 30) return;
  ev.preventDefault();
  await refreshLink(state.jobId, fmt);
  if (state.links[fmt]) $(`dl-${fmt}`).click();
}

function parseSse(chunk, onEvent) {
  // chunk: the text of one SSE message (lines); returns nothing.
  let event = "message";
  const data = [];
  for (const line of chunk.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
  }
  if (data.length) {
    try {
      onEvent(event, JSON.parse(data.join("\n")));
    } catch (_) {
      /* ignore malformed messages */
    }
  }
}

// The job's Server-Sent Events, read with fetch() (EventSource cannot send the header).
async function followEvents(jobId, signal) {
  while (!signal.aborted) {
    let finished = false;
    try {
      const resp = await fetch(`/v1/jobs/${jobId}/events`, {
        headers: { Authorization: `Bearer ${apiKey()}`, Accept: "text/event-stream" },
        signal,
        cache: "no-store",
      });
      if (!resp.ok) {
        const p = await resp.json().catch(() => ({}));
        throw new ApiError(resp.status, p);
      }
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value.replace(/\r\n/g, "\n");
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const msg = buf.slice(0, i);
          buf = buf.slice(i + 2);
          parseSse(msg, (event, snap) => {
            if (event === "state" || event === "progress") {
              renderProgress(snap);
              if (["succeeded", "failed", "cancelled"].includes(snap.status)) finished = true;
              if (event === "state") refreshJob(jobId);
            }
          });
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiError && err.status === 401) return signOut("Your API key was refused.");
      if (err instanceof ApiError && err.status === 404) {
        $("job-error").textContent = err.message;
        return;
      }
    }
    if (finished || signal.aborted) return;
    await new Promise((r) => setTimeout(r, 2000)); // the stream ended early: reconnect
  }
}

async function refreshJob(jobId) {
  try {
    const job = await api("GET", `/v1/jobs/${jobId}`);
    if (state.jobId === jobId) renderJob(job);
  } catch (err) {
    $("job-error").textContent = err.message;
  }
}

async function openJob(jobId) {
  state.jobId = jobId;
  state.links = {};
  $("job-title").textContent = `Job ${jobId}`;
  $("job-title").focus();
  $("job-error").textContent = "";
  $("job-result").hidden = true;
  $("layers-details").open = false;
  try {
    const job = await api("GET", `/v1/jobs/${jobId}`);
    renderJob(job);
    if (!["succeeded", "failed", "cancelled"].includes(job.status)) {
      state.eventsAbort = new AbortController();
      followEvents(jobId, state.eventsAbort.signal);
    }
  } catch (err) {
    $("job-status").textContent = "Status: unknown";
    $("job-error").textContent = `${err.status || ""} ${err.message}`.trim();
  }
}

async function onCancel() {
  const button = $("job-cancel");
  button.disabled = true;
  try {
    const job = await api("POST", `/v1/jobs/${state.jobId}/cancel`);
    renderJob(job);
  } catch (err) {
    $("job-error").textContent = `Could not cancel: ${err.message}`;
  } finally {
    button.disabled = false;
  }
}

// ------------------------------------------------------------------ start

document.addEventListener("DOMContentLoaded", () => {
  $("signin-form").addEventListener("submit", onSignIn);
  $("job-form").addEventListener("submit", onQuantize);
  $("preview").addEventListener("click", onPreview);
  $("job-cancel").addEventListener("click", onCancel);
  $("sign-out").addEventListener("click", () => signOut());
  window.addEventListener("hashchange", route);
  route();
});
