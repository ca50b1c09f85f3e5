// ocrstream web page: upload images to POST v1/ocr (with the task chosen), long-poll GET v1/ocr/{id}?wait=30,
// draw the result's line boxes over the image and list the text beside it; for a task other than ocr, show
// its answer beside the image (render.js). No dependencies, no external requests.
"use strict";

const KEY_STORE = "ocrstream.apiKey";
const WAIT_S = 30;              // long-poll length asked of the server, s (less when its links say less: waitOf)
const BOX_COLOR = "#ff00ff";    // every line's box; the tests look for this exact colour
const HOT_COLOR = "#00ffff";    // the box of the line under the pointer / keyboard focus
const MAX_CANVAS_SIDE = 2000;   // canvas pixels; larger pages are drawn scaled down
const UPLOADS_AT_ONCE = 2;      // browsers open ~6 connections per host: 2 uploads + 3 long-polls fit
const POLLS_AT_ONCE = 3;

/** A counting semaphore: run(fn) waits for a free slot, then runs fn. */
class Limiter {
  constructor(slots) { this.free = slots; this.waiting = []; }
  async run(fn) {
    while (this.free <= 0) await new Promise((wake) => this.waiting.push(wake));
    this.free--;
    try { return await fn(); } finally {
      this.free++;
      const wake = this.waiting.shift();
      if (wake) wake();
    }
  }
}

const uploads = new Limiter(UPLOADS_AT_ONCE);
const polls = new Limiter(POLLS_AT_ONCE);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// -- API key ------------------------------------------------------------------------------------
function apiKey() {
  try { return localStorage.getItem(KEY_STORE) || ""; } catch { return ""; }
}

function headers(extra = {}) {
  const h = { Accept: "application/json", ...extra };
  const key = apiKey();
  if (key) h["X-API-Key"] = key;
  return h;
}

function setupKeyForm() {
  const box = document.getElementById("key-box");
  const input = document.getElementById("api-key");
  const state = document.getElementById("key-state");
  input.value = apiKey();
  state.textContent = input.value ? "saved" : "";
  document.getElementById("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    try { localStorage.setItem(KEY_STORE, input.value.trim()); } catch { /* private mode: not kept */ }
    state.textContent = input.value.trim() ? "saved" : "cleared";
  });
  document.getElementById("key-forget").addEventListener("click", () => {
    try { localStorage.removeItem(KEY_STORE); } catch { /* nothing kept */ }
    input.value = "";
    state.textContent = "cleared";
  });
  return () => { box.open = true; input.focus(); state.textContent = "this server needs a valid key"; };
}
let askForKey = () => {};

// -- HTTP -----------------------------------------------------------------------------------------
/** An error shown on a card: the server's stable code and its message. */
class CardError extends Error {
  constructor(code, message, retryAfterS = null) { super(message); this.code = code; this.retryAfterS = retryAfterS; }
}

async function errorOf(res) {
  let code = `http_${res.status}`;
  let message = res.statusText || "request failed";
  try {
    const body = await res.json();
    if (body && body.error) { code = body.error.code || code; message = body.error.message || message; }
  } catch { /* not JSON (a proxy's page): keep the status */ }
  const ra = Number(res.headers.get("Retry-After"));
  return new CardError(code, message, Number.isFinite(ra) && ra > 0 ? ra : null);
}

const RETRIABLE = new Set([429, 502, 503, 504]);
const MAX_RETRY_WAIT_S = 60;    // a Retry-After longer than this is shown as the error, not waited out

/** A new id for one upload, sent as request_id and reused by its retries, so a retry after a lost
 *  answer gets the first attempt's state instead of sending the image twice. crypto.randomUUID
 *  needs a secure context (https or localhost); elsewhere 16 random bytes from getRandomValues. */
function newRequestId() {
  if (window.crypto && typeof crypto.randomUUID === "function") return crypto.randomUUID();
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return "web-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** fetch + JSON, retrying transient failures (network, 429 rate_limited, 5xx) a few times with
 *  back-off. Not retried: quota_exceeded (the day's quota is gone) and a Retry-After over
 *  MAX_RETRY_WAIT_S; their error is thrown for the card to show. A POST is only retried safely
 *  when its URL carries a request_id (follow() sets one). */
async function call(url, init, onRetry) {
  for (let attempt = 1; ; attempt++) {
    let res;
    try {
      res = await fetch(url, init);
    } catch (err) {
      if (attempt >= 5) {
        throw new CardError("network_error", `the server could not be reached (${err.message}); ` +
          "an upload over the server's size limit is also cut off this way");
      }
      onRetry(`connection failed, retry ${attempt}`);
      await sleep(Math.min(8000, 500 * 2 ** attempt));
      continue;
    }
    if (res.ok) return { status: res.status, body: await res.json() };
    const err = await errorOf(res);
    if (res.status === 401) askForKey();
    if (!RETRIABLE.has(res.status) || attempt >= 5 || err.code === "quota_exceeded") throw err;
    if (err.retryAfterS != null && err.retryAfterS > MAX_RETRY_WAIT_S) {
      err.message += ` (retry after ${err.retryAfterS} s)`;
      throw err;
    }
    onRetry(`${err.code}, retry ${attempt}`);
    await sleep(1000 * (err.retryAfterS ?? Math.min(8, 2 ** (attempt - 1))));
  }
}

// -- cards ----------------------------------------------------------------------------------------
function newCard(file) {
  const node = document.getElementById("card-template").content.firstElementChild.cloneNode(true);
  node.querySelector(".name").textContent = file.name || "pasted image";
  document.getElementById("cards").prepend(node);
  return node;
}

function setState(card, state, label = state) {
  card.dataset.state = state;
  card.querySelector(".state").textContent = label;
}

function showError(card, code, message) {
  setState(card, "error", "error");
  const p = card.querySelector(".error");
  p.querySelector(".code").textContent = code;
  p.querySelector(".message").textContent = message;
  p.hidden = false;
}

/** Upload one file and follow it to its result. */
async function follow(file) {
  const card = newCard(file);
  const started = performance.now();
  const note = (label) => { card.querySelector(".state").textContent = label; };
  try {
    const type = file.type.startsWith("image/") || file.type === "application/pdf" ? file.type : "application/octet-stream";
    const query = new URLSearchParams({ source: "web", request_id: newRequestId() });  // the same on every retry
    if (file.name) query.set("filename", file.name);
    for (const [k, v] of Object.entries(chosenTask())) query.set(k, v);
    let { body } = await uploads.run(() => {
      setState(card, "uploading");
      return call(`v1/ocr?${query}`, { method: "POST", body: file, headers: headers({ "Content-Type": type }) }, note);
    });
    card.dataset.requestId = body.request_id;
    if (body.status === "pending") setState(card, "queued");
    const wait = waitOf(body);
    while (body.status === "pending") {
      const url = `v1/ocr/${encodeURIComponent(body.request_id)}?wait=${wait}`;
      body = (await polls.run(() => call(url, { headers: headers() }, note))).body;
    }
    if (body.status === "error") {
      const e = body.error || (body.result && body.result.error) || { code: "error", message: "failed" };
      showError(card, e.code, e.message);
    } else {
      await showResult(card, file, body.result);
    }
    if (body.result) offerDownload(card, file, body.result);
  } catch (err) {
    if (err instanceof CardError) showError(card, err.code, err.message);
    else showError(card, "page_error", String(err && err.message || err));
  } finally {
    card.dataset.clientMs = String(Math.round(performance.now() - started));
  }
}

/** The long-poll length to ask for: WAIT_S, or the server's longest when that is shorter (its
 *  links.wait carries it, OCRSTREAM_HTTP_WAIT_MAX_S; a longer wait is refused with 400). */
function waitOf(body) {
  const query = String((body.links && body.links.wait) || "").split("?")[1] || "";
  const most = Number(new URLSearchParams(query).get("wait"));
  return Number.isFinite(most) && most > 0 ? Math.min(WAIT_S, most) : WAIT_S;
}

function offerDownload(card, file, doc) {
  const a = card.querySelector(".download");
  const blob = new Blob([JSON.stringify(doc, null, 2)], { type: "application/json" });
  a.href = URL.createObjectURL(blob);
  a.download = `${(file.name || "image").replace(/\.[^.]*$/, "")}.ocr.json`;
  a.hidden = false;
}

async function showResult(card, file, doc) {
  setState(card, "done");
  card.querySelector(".cache").hidden = !doc.cache_hit;
  card.querySelector(".near").hidden = !doc.near_duplicate_of;
  const total = doc.timings_ms && doc.timings_ms.total;
  if (total != null) {
    const ms = card.querySelector(".ms");
    ms.textContent = `${Math.round(total)} ms`;
    ms.title = "submit to result, measured by the server";
    ms.hidden = false;
  }
  card.querySelector(".body").hidden = false;
  if (doc.task && doc.task !== "ocr") {
    card.dataset.task = doc.task;
    card.querySelector(".lines").hidden = true;
    const answer = card.querySelector(".answer");
    answer.dataset.slot = window.ocrRender.renderAnswer(answer, doc) || "none";
    if (answer.dataset.slot === "none") answer.textContent = doc.text || "(no answer)";
    answer.hidden = false;
    await drawPage(card, file, doc);
    return;
  }

  const list = card.querySelector(".lines");
  let page = null;
  doc.lines.forEach((line, i) => {
    const li = document.createElement("li");
    li.textContent = line.text;
    li.tabIndex = 0;
    li.dataset.index = String(i);
    li.dataset.page = String(line.page);
    li.title = `page ${line.page}, confidence ${line.confidence.toFixed(2)}`;
    if (page !== null && line.page !== page) li.classList.add("page-start");
    page = line.page;
    list.append(li);
  });
  if (!doc.lines.length) {
    const li = document.createElement("li");
    li.className = "empty";
    li.textContent = "(no text found)";
    list.append(li);
  }
  await drawPage(card, file, doc);
}

// -- drawing --------------------------------------------------------------------------------------
async function decode(file) {
  try {
    return await createImageBitmap(file, { imageOrientation: "from-image" });
  } catch {
    try { return await createImageBitmap(file); } catch { return null; }
  }
}

/** Draw page 1 with every box of its lines; boxes are in pixels of the upright page. */
async function drawPage(card, file, doc) {
  const canvas = card.querySelector("canvas");
  const noteEl = card.querySelector(".note");
  const pages = doc.pages && doc.pages.length ? doc.pages : [{ index: 1, width: doc.width, height: doc.height }];
  const bitmap = await decode(file);
  const task = doc.task && doc.task !== "ocr";
  if (!bitmap) {
    canvas.hidden = true;
    noteEl.textContent = `This browser cannot draw ${file.type || "this file"}; ` + (task ? "the result is shown alone." :
      `the text of ${pages.length} page${pages.length === 1 ? "" : "s"} is listed instead.`);
    noteEl.hidden = false;
    return;
  }
  const first = pages[0];
  const pageW = first.width || bitmap.width;
  const pageH = first.height || bitmap.height;
  const fit = Math.min(1, MAX_CANVAS_SIDE / Math.max(bitmap.width, bitmap.height));
  canvas.width = Math.max(1, Math.round(bitmap.width * fit));
  canvas.height = Math.max(1, Math.round(bitmap.height * fit));
  const sx = canvas.width / pageW;
  const sy = canvas.height / pageH;
  const lines = doc.lines.map((line, i) => ({ line, i })).filter(({ line }) => line.page === first.index);
  canvas.setAttribute("aria-label", task ? `${file.name || "image"}, ${doc.task}` :
    `${file.name || "image"} with ${lines.length} text line box${lines.length === 1 ? "" : "es"}`);
  if (pages.length > 1) {
    noteEl.textContent = `Page 1 of ${pages.length} shown; the text of every page is listed.`;
    noteEl.hidden = false;
  }
  const width = Math.max(2, Math.round(Math.max(canvas.width, canvas.height) / 500));
  const ctx = canvas.getContext("2d");

  const draw = (hot) => {
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
    for (const { line, i } of lines) {
      ctx.beginPath();
      line.box.forEach(([x, y], k) => (k ? ctx.lineTo(x * sx, y * sy) : ctx.moveTo(x * sx, y * sy)));
      ctx.closePath();
      if (i === hot) {
        ctx.fillStyle = "rgba(0, 255, 255, 0.18)";
        ctx.fill();
      }
      ctx.strokeStyle = i === hot ? HOT_COLOR : BOX_COLOR;
      ctx.lineWidth = i === hot ? width * 2 : width;
      ctx.stroke();
    }
  };
  draw(-1);
  canvas.dataset.drawn = "true";

  const list = card.querySelector(".lines");
  const hover = (ev) => {
    const li = ev.target.closest("li[data-index]");
    list.querySelectorAll("li.hot").forEach((el) => el.classList.remove("hot"));
    if (li && ev.type !== "mouseleave" && ev.type !== "focusout") {
      li.classList.add("hot");
      draw(Number(li.dataset.index));
    } else {
      draw(-1);
    }
  };
  for (const type of ["mouseover", "focusin", "mouseleave", "focusout"]) list.addEventListener(type, hover);
  // pointing at a box highlights its line
  canvas.addEventListener("mousemove", (ev) => {
    const r = canvas.getBoundingClientRect();
    const x = (ev.clientX - r.left) * (canvas.width / r.width);
    const y = (ev.clientY - r.top) * (canvas.height / r.height);
    const hit = lines.find(({ line }) => {
      ctx.beginPath();
      line.box.forEach(([bx, by], k) => (k ? ctx.lineTo(bx * sx, by * sy) : ctx.moveTo(bx * sx, by * sy)));
      ctx.closePath();
      return ctx.isPointInPath(x, y);
    });
    list.querySelectorAll("li.hot").forEach((el) => el.classList.remove("hot"));
    if (hit) list.querySelector(`li[data-index="${hit.i}"]`).classList.add("hot");
    draw(hit ? hit.i : -1);
  });
  canvas.addEventListener("mouseleave", () => {
    list.querySelectorAll("li.hot").forEach((el) => el.classList.remove("hot"));
    draw(-1);
  });
}

// -- a job: progress from GET v1/jobs/{id} (polled: EventSource cannot send the API key), then the failures
function jobLine(p) {
  const codes = Object.entries(p.failed_by_code).map(([c, n]) => `${c} ${n}`).join(", ");
  return `${p.state}: ${p.done}/${p.total ?? "?"} done, ${p.ok} ok, ${p.failed} failed` + (codes ? ` (${codes})` : "") +
    `, ${p.cache_hits} cache hits, ${p.pages} pages` + (p.rate_per_s ? `, ${p.rate_per_s}/s` : "") +
    (p.eta_s && p.state !== "completed" ? `, ETA ${Math.round(p.eta_s)} s` : "");
}

async function followJob(id) {
  const view = document.getElementById("job-view");
  const bar = document.getElementById("job-progress");
  const state = document.getElementById("job-state");
  const failures = document.getElementById("job-failures");
  const report = document.getElementById("job-report");
  view.hidden = false;
  failures.replaceChildren();
  report.hidden = true;
  const base = `v1/jobs/${encodeURIComponent(id)}`;
  for (;;) {
    const r = await fetch(base, { headers: headers() });
    if (r.status === 401) { askForKey(); state.textContent = "this server needs a valid key"; return; }
    if (r.status === 404) { state.textContent = "no such job yet"; await sleep(1000); continue; }
    if (!r.ok) { state.textContent = `error ${r.status}`; await sleep(2000); continue; }
    const p = await r.json();
    bar.max = p.total || 1;
    bar.value = p.done;
    state.textContent = jobLine(p);
    if (p.state === "completed") break;
    await sleep(1000);
  }
  const rows = await fetch(`${base}/report?format=jsonl`, { headers: headers() });
  for (const line of (await rows.text()).split("\n")) {
    if (!line) continue;
    const row = JSON.parse(line);
    if (row.status === "ok") continue;
    const li = document.createElement("li");
    li.textContent = `${row.name ?? row.request_id}: ${row.error_code ?? row.status}`;
    failures.append(li);
  }
  report.href = `${base}/report?format=csv`;
  report.hidden = false;
}

function setupJob() {
  const input = document.getElementById("job-id");
  document.getElementById("job-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (input.value.trim()) followJob(input.value.trim());
  });
  const given = new URLSearchParams(location.search).get("job");
  if (given) { input.value = given; followJob(given); }
}

// -- input ----------------------------------------------------------------------------------------
/** The task chosen above the drop zone, as the door's query fields (none for the default, ocr). */
function chosenTask() {
  const task = document.getElementById("task").value;
  if (task === "ocr") return {};
  if (task === "extract") return { task, fields: document.getElementById("fields").value };
  if (task === "translate") return { task, to: document.getElementById("to").value };
  return { task };
}

function setupTaskForm() {
  const task = document.getElementById("task");
  const sync = () => {
    document.getElementById("fields-box").hidden = task.value !== "extract";
    document.getElementById("to-box").hidden = task.value !== "translate";
  };
  task.addEventListener("change", sync);
  sync();
  return sync;
}

/** Grey out the menu's tasks this deployment does not run (GET v1/tasks: its engine and OCRSTREAM_TASKS),
 *  each with the reason the door would refuse it; listed below the menu too. Unanswered: the menu stays whole. */
async function loadTasks(sync) {
  let info;
  try {
    const res = await fetch("v1/tasks", { headers: headers() });
    if (!res.ok) return;
    info = await res.json();
  } catch { return; }
  const menu = document.getElementById("task");
  const list = document.getElementById("tasks-off-list");
  list.replaceChildren();
  for (const t of info.tasks) {
    const option = [...menu.options].find((o) => o.value === t.name);
    if (!option) continue;
    option.disabled = !t.runs;
    option.title = t.reason || "";
    option.dataset.reason = t.reason || "";
    if (t.runs) continue;
    if (!option.textContent.endsWith(" (not here)")) option.textContent += " (not here)";
    const li = document.createElement("li");
    li.dataset.task = t.name;
    const name = document.createElement("code");
    name.textContent = t.name;
    li.append(name, `: ${t.reason}`);
    list.append(li);
  }
  if (menu.selectedOptions[0] && menu.selectedOptions[0].disabled) menu.value = info.default;
  document.getElementById("tasks-off").hidden = !list.children.length;
  menu.dataset.engine = info.engine;
  sync();
}

function take(files) {
  for (const file of files) follow(file);
}

function setup() {
  askForKey = setupKeyForm();
  loadTasks(setupTaskForm());
  setupJob();
  const drop = document.getElementById("drop");
  const input = document.getElementById("files");
  input.addEventListener("change", () => {
    take([...input.files]);
    input.value = "";  // choosing the same file again is a new upload
  });
  for (const type of ["dragenter", "dragover"]) {
    drop.addEventListener(type, (ev) => { ev.preventDefault(); drop.classList.add("over"); });
  }
  for (const type of ["dragleave", "dragend"]) drop.addEventListener(type, () => drop.classList.remove("over"));
  drop.addEventListener("drop", (ev) => {
    ev.preventDefault();
    drop.classList.remove("over");
    take([...ev.dataTransfer.files]);
  });
  // a file dropped beside the zone must not navigate away from the page
  window.addEventListener("dragover", (ev) => ev.preventDefault());
  window.addEventListener("drop", (ev) => ev.preventDefault());
  document.addEventListener("paste", (ev) => {
    const files = [...(ev.clipboardData ? ev.clipboardData.files : [])];
    if (files.length) take(files);
  });
}

setup();
