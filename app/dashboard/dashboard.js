// sluice dashboard. No library: reads /dashboard/events (server-sent events, read with
// fetch so the API key can travel in a header) and /v1/requests/{rid}/trace.
// The API key comes from the URL fragment (#key=...) or the form, kept for the tab only.
"use strict";

const KEY_STORE = "sluice.apiKey";
const SVG = "http://www.w3.org/2000/svg";
const LANES = ["tokenize", "queue", "prefill", "decode", "kv_transfer"];
const MARKS = ["first_token", "retracted", "preempted", "abort_requested", "finished"];
let selected = null;          // rid whose timeline is shown
let selectedRunning = false;  // refresh it with every event while it runs

function apiKey() {
  const m = location.hash.match(/key=([^&]+)/);
  if (m) sessionStorage.setItem(KEY_STORE, decodeURIComponent(m[1]));
  return sessionStorage.getItem(KEY_STORE) || "";
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: "Bearer " + key } : {};
}

function setStatus(text, bad) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.classList.toggle("bad", !!bad);
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- numbers ------------------------------------------------------------------------
function lookup(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

function format(value, kind) {
  if (value == null) return "–";
  switch (kind) {
    case "pct": return (100 * value).toFixed(1) + " %";
    case "rate": return value.toFixed(1);
    case "ms": return (1000 * value).toFixed(1) + " ms";
    case "int": return String(Math.round(value));
    default: return String(value);
  }
}

function renderNumbers(snap) {
  for (const el of document.querySelectorAll("[data-key]")) {
    const value = lookup(snap, el.dataset.key);
    el.dataset.value = JSON.stringify(value === undefined ? null : value);
    el.textContent = format(value, el.dataset.format);
  }
  const usage = snap.server.token_usage || 0;
  document.getElementById("kv-bar").style.width = Math.min(100, 100 * usage).toFixed(1) + "%";
  document.getElementById("model").textContent = snap.model + " · " + snap.phase;
}

// ---- the requests table ---------------------------------------------------------------
function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
}

function renderRequests(requests) {
  const body = document.querySelector("#requests tbody");
  const rows = requests.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.rid = r.rid;
    tr.dataset.state = r.state;
    if (r.rid === selected) tr.classList.add("selected");
    [r.rid, r.state, r.prompt_tokens, r.cached_tokens, r.output_tokens, r.retractions,
      format(r.ttft, "ms"), format(r.e2e, "ms"), r.finish_reason || ""].forEach((v) => cell(tr, String(v)));
    tr.addEventListener("click", () => showTrace(r.rid));
    return tr;
  });
  body.replaceChildren(...rows);
  const mine = requests.find((r) => r.rid === selected);
  if (selectedRunning && mine) showTrace(selected);
}

// ---- one request's timeline -----------------------------------------------------------
function svg(tag, attrs, parent, title) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (title) {
    const t = document.createElementNS(SVG, "title");
    t.textContent = title;
    el.appendChild(t);
  }
  parent.appendChild(el);
  return el;
}

function describe(fields) {
  return Object.entries(fields).filter(([k]) => k !== "event" && k !== "t")
    .map(([k, v]) => `${k}=${v}`).join(" ");
}

function renderTimeline(trace) {
  const elapsed = Date.now() / 1000 - trace.arrival_time;
  const ends = trace.spans.map((s) => (s.end == null ? elapsed : s.end));
  const last = trace.events.length ? trace.events[trace.events.length - 1].t : 0;
  const tmax = Math.max(1e-6, last, ...ends);
  const lanes = LANES.filter((name) => trace.spans.some((s) => s.name === name));
  const W = 960, left = 90, right = 20, laneH = 24, top = 8, axisH = 24;
  const H = top + lanes.length * laneH + axisH;
  const x = (t) => left + (t / tmax) * (W - left - right);
  const root = document.createElementNS(SVG, "svg");
  root.setAttribute("viewBox", `0 0 ${W} ${H}`);
  lanes.forEach((name, i) => {
    svg("text", { x: 4, y: top + i * laneH + 16 }, root).textContent = name;
  });
  for (const s of trace.spans) {
    const i = lanes.indexOf(s.name);
    const end = s.end == null ? elapsed : s.end;
    const title = `${s.name} ${(1000 * (end - s.start)).toFixed(2)} ms ${describe(s.attributes)}`;
    svg("rect", { class: `span span-${s.name}`, x: x(s.start), y: top + i * laneH + 3,
      width: Math.max(1, x(end) - x(s.start)), height: laneH - 6, "data-name": s.name }, root, title);
  }
  const prefillLane = lanes.indexOf("prefill");
  for (const e of trace.events) {
    if (e.event === "prefill_chunk" && prefillLane >= 0) {
      const y = top + prefillLane * laneH;
      svg("line", { class: "chunk", x1: x(e.t), x2: x(e.t), y1: y + 1, y2: y + laneH - 1 }, root,
        `chunk: ${describe(e)}`);
    } else if (MARKS.includes(e.event)) {
      svg("line", { class: `mark mark-${e.event}`, x1: x(e.t), x2: x(e.t), y1: top, y2: top + lanes.length * laneH }, root,
        `${e.event} at ${(1000 * e.t).toFixed(2)} ms ${describe(e)}`);
    }
  }
  const axisY = top + lanes.length * laneH + 4;
  svg("line", { class: "axis", x1: left, x2: W - right, y1: axisY, y2: axisY }, root);
  for (let k = 0; k <= 4; k++) {
    const t = (tmax * k) / 4;
    svg("text", { x: x(t) - (k === 4 ? 40 : 0), y: axisY + 14 }, root).textContent = (1000 * t).toFixed(1) + " ms";
  }
  document.getElementById("timeline").replaceChildren(root);

  const rows = trace.events.map((e) => {
    const tr = document.createElement("tr");
    cell(tr, (1000 * e.t).toFixed(2) + " ms");
    cell(tr, e.event);
    cell(tr, describe(e));
    return tr;
  });
  document.querySelector("#trace-events tbody").replaceChildren(...rows);
}

async function showTrace(rid) {
  selected = rid;
  for (const tr of document.querySelectorAll("#requests tbody tr")) tr.classList.toggle("selected", tr.dataset.rid === rid);
  const r = await fetch(`/v1/requests/${encodeURIComponent(rid)}/trace`, { headers: authHeaders(), cache: "no-store" });
  if (!r.ok || rid !== selected) return;
  const trace = await r.json();
  selectedRunning = trace.state === "running";
  document.getElementById("trace").hidden = false;
  document.getElementById("trace-rid").textContent = rid;
  document.getElementById("trace-state").textContent =
    `${trace.state}${trace.finish_reason ? " (" + trace.finish_reason + ")" : ""}, ${trace.prompt_tokens} prompt tokens, ` +
    `${trace.cached_tokens} cached, ${trace.output_tokens} output, ${trace.retractions} retractions`;
  renderTimeline(trace);
}

// ---- the event stream -------------------------------------------------------------------
async function follow() {
  for (;;) {
    try {
      const r = await fetch("/dashboard/events", { headers: authHeaders(), cache: "no-store" });
      if (r.status === 401) {
        setStatus("API key needed", true);
        document.getElementById("key-form").hidden = false;
        await sleep(2000);
        continue;
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      setStatus("live");
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          if (!event.startsWith("data: ")) continue;
          const snap = JSON.parse(event.slice(6));
          renderNumbers(snap);
          renderRequests(snap.requests);
          document.body.dataset.updated = String(snap.time);
        }
      }
      setStatus("reconnecting…", true);
    } catch (err) {
      setStatus("disconnected: " + err.message, true);
    }
    await sleep(1000);
  }
}

document.getElementById("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, document.getElementById("key-input").value);
  document.getElementById("key-form").hidden = true;
});
follow();
