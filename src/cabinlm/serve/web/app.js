// cabinlm's page: a chat per seat over the server's public API, and a live panel of its figures.
//
//   POST   /v1/chat/completions   a turn, streamed (server-sent events), `user` = the seat's name
//   GET    /v1/models, /health    the model's name; backend, vision input, seats
//   GET    /v1/metrics.json       polled every POLL_MS: every seat's cache, the process's RSS
//   DELETE /v1/seats/NAME         "Free this seat"
//
// Each seat's conversation is kept here as the OpenAI messages sent and received; every request
// sends it whole, and the server feeds only what its seat does not hold yet. A request that fails
// adds nothing to the conversation: the server's error (its OpenAI error object's message) is shown
// and the next message goes out as if the failed one had never been sent.
// Text from the model is escaped before the little Markdown it may use is turned into tags.
"use strict";

const POLL_MS = 1000;
const MAX_SAMPLES = 900; // 15 minutes at one sample a second
const COLORS = ["#4aa3ff", "#f0883e", "#3fb950", "#db61a2", "#d2a8ff", "#e3b341", "#56d4dd", "#ff7b72"];

const state = {
  model: null, // the id /v1/models gives
  backend: "",
  vision: false,
  seat: null, // the seat shown
  chats: new Map(), // seat name -> {messages: [OpenAI messages], entries: [{el, ...}], sending: bool}
  seats: [], // the last /v1/metrics.json's seats
  samples: [], // [{t, rss, slots, answered, seats: {name: {cache, evicted, turns, busy, tok_s}}}]
  settings: { system: "", max_tokens: 128, temperature: 0, tools: null, tool_choice: "auto" },
  attached: null, // the frame to send, as a data: URL
  colors: new Map(),
  markdown, // exposed for tests and for the curious: window.cabinlm.markdown(text) -> HTML
};
window.cabinlm = state;

const $ = (id) => document.getElementById(id);

function element(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// -- Markdown: HTML escaped first, then code blocks, code spans, bold, italics, headings, lists ------

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(text) {
  // code spans keep their text as it is; the rest gets **bold** and *italics*
  return text.split(/(`[^`\n]+`)/).map((piece, i) => {
    if (i % 2) return "<code>" + escapeHtml(piece.slice(1, -1)) + "</code>";
    return escapeHtml(piece)
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^*\s][^*\n]*?)\*(?![*\w])/g, "$1<em>$2</em>");
  }).join("");
}

function blocks(text) {
  const out = [];
  let list = null; // "ul" or "ol" while inside a list
  let para = [];
  const flush = () => {
    if (para.length) out.push("<p>" + para.join("<br>") + "</p>");
    para = [];
  };
  const close = () => {
    if (list) out.push(`</${list}>`);
    list = null;
  };
  for (const line of text.split("\n")) {
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    const item = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line);
    if (!line.trim()) { flush(); close(); continue; }
    if (heading) { flush(); close(); out.push(`<h4>${inline(heading[2])}</h4>`); continue; }
    if (item) {
      flush();
      const kind = /\d/.test(item[1]) ? "ol" : "ul";
      if (list !== kind) { close(); out.push(`<${kind}>`); list = kind; }
      out.push(`<li>${inline(item[2])}</li>`);
      continue;
    }
    close();
    para.push(inline(line));
  }
  flush();
  close();
  return out.join("");
}

function markdown(src) {
  // ``` fences: every odd piece is code (an unclosed fence, mid-stream, runs to the end)
  return src.split("```").map((piece, i) => {
    if (!(i % 2)) return blocks(piece);
    const body = piece.replace(/^[\w+-]*\n/, "");
    return "<pre><code>" + escapeHtml(body) + "</code></pre>";
  }).join("");
}

// -- the server ----------------------------------------------------------------------------------

async function errorOf(res) {
  // The OpenAI error object's message, as the server gave it; the status line when there is none.
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) return { message: body.error.message, code: body.error.code, status: res.status };
  } catch (e) { /* not JSON: say the status */ }
  return { message: `${res.status} ${res.statusText}`, code: null, status: res.status };
}

async function getJSON(path) {
  const res = await fetch(path, { cache: "no-store" });
  if (!res.ok) throw new Error((await errorOf(res)).message);
  return res.json();
}

async function start() {
  try {
    const [models, health] = await Promise.all([getJSON("/v1/models"), getJSON("/health")]);
    state.model = models.data[0].id;
    state.backend = health.backend;
    state.vision = Boolean(health.vision);
    $("model").textContent = `${state.model} · ${state.backend}${state.vision ? " · vision" : ""}`;
    $("image-button").hidden = !state.vision;
    setHealth(true, "ok");
  } catch (e) {
    setHealth(false, `unreachable: ${e.message}`);
  }
  const first = location.hash.slice(1) || "driver";
  switchSeat(decodeURIComponent(first));
  poll();
}

function setHealth(ok, text) {
  const pill = $("health");
  pill.textContent = text;
  pill.className = "pill " + (ok ? "ok" : "bad");
}

// -- seats ---------------------------------------------------------------------------------------

function chatOf(name) {
  if (!state.chats.has(name)) state.chats.set(name, { messages: [], entries: [], sending: false });
  return state.chats.get(name);
}

function colorOf(name) {
  if (!state.colors.has(name)) state.colors.set(name, COLORS[state.colors.size % COLORS.length]);
  return state.colors.get(name);
}

function switchSeat(name) {
  state.seat = name;
  const chat = chatOf(name);
  $("seat-current").textContent = name;
  history.replaceState(null, "", "#" + encodeURIComponent(name));
  const box = $("messages");
  box.replaceChildren(...chat.entries.map((e) => e.el));
  box.scrollTop = box.scrollHeight;
  $("send").disabled = chat.sending;
  renderSeats();
}

function renderSeats() {
  const onServer = new Map(state.seats.map((s) => [s.name, s]));
  const names = [...new Set([...onServer.keys(), ...state.chats.keys()])].sort();
  const list = $("seat-list");
  list.replaceChildren(...names.map((name) => {
    const s = onServer.get(name);
    const b = element("button");
    b.type = "button";
    b.dataset.seat = name;
    if (name === state.seat) b.classList.add("current");
    const dot = element("span", "dot");
    dot.style.background = colorOf(name);
    b.append(dot, element("span", "name", name));
    if (s && s.busy) b.append(element("span", "busy", "answering"));
    else b.append(element("span", "state", s ? `${s.turns} turns` : "new"));
    b.addEventListener("click", () => switchSeat(name));
    const li = element("li");
    li.append(b);
    return li;
  }));
  const taken = state.seats.length;
  const total = state.samples.length ? state.samples[state.samples.length - 1].total : null;
  $("seat-count").textContent = total === null ? "" : `${taken} of ${total} taken`;
  const mine = onServer.get(state.seat);
  $("seat-info").textContent = mine
    ? `· ${mine.turns} turns · cache ${mine.cache_tokens} · evicted ${mine.evicted_tokens}`
    : "· not on the server yet";
}

async function freeSeat() {
  const name = state.seat;
  const res = await fetch(`/v1/seats/${encodeURIComponent(name)}`, { method: "DELETE" }).catch((e) => e);
  if (res instanceof Error) return showError(chatOf(name), { message: `the server cannot be reached (${res.message})` });
  if (!res.ok) return showError(chatOf(name), await errorOf(res));
  state.chats.delete(name);
  switchSeat(name);
  poll();
}

// -- the chat ------------------------------------------------------------------------------------

function addEntry(chat, entry) {
  chat.entries.push(entry);
  if (chat === state.chats.get(state.seat)) {
    const box = $("messages");
    box.append(entry.el);
    box.scrollTop = box.scrollHeight;
  }
  return entry;
}

function userEntry(chat, text, image) {
  const el = element("div", "msg user");
  if (image) {
    const img = element("img", "frame");
    img.src = image;
    img.alt = "the frame sent with this message";
    el.append(img);
  }
  const body = element("div", "text");
  body.innerHTML = markdown(text);
  el.append(body);
  return addEntry(chat, { kind: "user", el });
}

function showError(chat, err) {
  const el = element("div", "msg error");
  el.setAttribute("role", "alert");
  el.append(element("strong", null, err.status ? `Error ${err.status}${err.code ? ` (${err.code})` : ""}: ` : "Error: "));
  el.append(element("span", "message", err.message));
  return addEntry(chat, { kind: "error", el, error: err });
}

function assistantEntry(chat) {
  const el = element("div", "msg assistant streaming");
  const text = element("div", "text");
  const meta = element("div", "meta");
  el.append(text, meta);
  return addEntry(chat, { kind: "assistant", el, text, meta, content: "", calls: [], pieces: 0 });
}

function settingsBody() {
  const s = state.settings;
  const body = { model: state.model, stream: true, stream_options: { include_usage: true },
    max_tokens: s.max_tokens, temperature: s.temperature };
  if (s.tools) {
    body.tools = s.tools;
    body.tool_choice = s.tool_choice;
  }
  return body;
}

// One request: the seat's conversation plus `added` (a user message, or tool results). What comes
// back is shown as it streams; the conversation grows by `added` and the reply only when it succeeds.
async function turn(name, added, shown) {
  const chat = chatOf(name);
  chat.sending = true;
  if (name === state.seat) $("send").disabled = true;
  const system = state.settings.system ? [{ role: "system", content: state.settings.system }] : [];
  const body = { ...settingsBody(), user: name, messages: [...system, ...chat.messages, ...added] };
  let reply = null;
  try {
    reply = await request(chat, body);
  } finally {
    chat.sending = false;
    if (name === state.seat) $("send").disabled = false;
  }
  if (reply) {
    chat.messages.push(...added, reply);
  } else {
    for (const e of shown) e.el.classList.add("unsent");
  }
  poll();
}

async function request(chat, body) {
  let res;
  try {
    res = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
  } catch (e) {
    showError(chat, { message: `the server cannot be reached (${e.message})` });
    return null;
  }
  if (!res.ok) {
    showError(chat, await errorOf(res));
    return null;
  }
  const entry = assistantEntry(chat);
  const calls = []; // by index: {id, name, arguments}
  let usage = null;
  let failed = null;
  let done = false;
  const handle = (data) => {
    if (data === "[DONE]") { done = true; return; }
    const event = JSON.parse(data);
    if (event.error) { failed = { message: event.error.message, code: event.error.code, status: null }; return; }
    if (event.usage) usage = event.usage;
    for (const choice of event.choices || []) {
      const delta = choice.delta || {};
      if (delta.content) {
        entry.content += delta.content;
        entry.pieces += 1;
        entry.text.innerHTML = markdown(entry.content);
      }
      for (const c of delta.tool_calls || []) {
        const call = calls[c.index] || (calls[c.index] = { id: "", name: "", arguments: "" });
        if (c.id) call.id = c.id;
        if (c.function && c.function.name) call.name = c.function.name;
        if (c.function && c.function.arguments) call.arguments += c.function.arguments;
      }
    }
  };
  try {
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done: ended } = await reader.read();
      if (ended) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) if (line.startsWith("data: ")) handle(line.slice(6));
      }
      $("messages").scrollTop = $("messages").scrollHeight;
    }
  } catch (e) {
    failed = failed || { message: `the reply was cut off (${e.message})` };
  }
  entry.el.classList.remove("streaming");
  if (failed || !done) {
    entry.el.classList.add("unsent");
    showError(chat, failed || { message: "the reply ended before the server said it was done" });
    return null;
  }
  // A call the length limit cut (finish "length") streamed only part of its arguments: the reply's
  // calls are the whole ones, as the server keeps them.
  const whole = calls.filter((c) => { try { JSON.parse(c.arguments); return true; } catch (e) { return false; } });
  calls.length = 0;
  calls.push(...whole);
  entry.calls = calls;
  if (calls.length) toolCards(chat, entry, calls);
  if (usage) {
    const c = usage.cabinlm || {};
    entry.meta.textContent = `${usage.completion_tokens} tokens · ${c.decode_tok_s ?? "?"} tok/s · ` +
      `cache ${c.cache_tokens ?? "?"} · evicted ${c.evicted_tokens ?? "?"} · ${c.history ?? ""}`;
  }
  entry.el.dataset.state = "done";
  if (calls.length) {
    return { role: "assistant", content: entry.content || null,
      tool_calls: calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } })) };
  }
  return { role: "assistant", content: entry.content };
}

// A reply's tool calls as cards: the name, the arguments, a field for each call's result, and a
// button that sends the results back (the model then answers with them).
function toolCards(chat, entry, calls) {
  const fields = calls.map((call) => {
    const card = element("div", "card");
    card.append(element("div", "name", call.name));
    let args = call.arguments;
    try { args = JSON.stringify(JSON.parse(call.arguments), null, 2); } catch (e) { /* shown as sent */ }
    card.append(element("pre", "args", args));
    const input = element("input");
    input.value = '{"ok": true}';
    input.setAttribute("aria-label", `result of ${call.name}`);
    card.append(input);
    entry.el.insertBefore(card, entry.meta);
    return input;
  });
  const button = element("button", "send-results", calls.length > 1 ? "Send results" : "Send result");
  button.type = "button";
  button.addEventListener("click", () => {
    if (chatOf(state.seat) !== chat || chat.sending) return;
    button.disabled = true;
    const results = calls.map((call, i) => ({ role: "tool", tool_call_id: call.id, content: fields[i].value }));
    const shown = results.map((r, i) => {
      const el = element("div", "msg user");
      const card = element("div", "card result");
      card.append(element("div", "name", `${calls[i].name} →`), element("pre", null, r.content));
      el.append(card);
      return addEntry(chat, { kind: "tool", el });
    });
    turn(state.seat, results, shown).then(() => { button.disabled = false; });
  });
  entry.el.insertBefore(button, entry.meta);
}

function sendMessage(ev) {
  ev.preventDefault();
  const name = state.seat;
  const chat = chatOf(name);
  const text = $("input").value;
  if (chat.sending || (!text.trim() && !state.attached)) return;
  const image = state.attached;
  const content = image
    ? [{ type: "text", text }, { type: "image_url", image_url: { url: image } }]
    : text;
  const shown = userEntry(chat, text, image);
  $("input").value = "";
  attach(null);
  turn(name, [{ role: "user", content }], [shown]);
}

function attach(url) {
  state.attached = url;
  $("attached").hidden = !url;
  $("attached-img").src = url || "";
  $("image-input").value = "";
}

// -- settings ------------------------------------------------------------------------------------

function applySettings() {
  const error = $("settings-error");
  const tools = $("set-tools").value.trim();
  let parsed = null;
  if (tools) {
    try {
      parsed = JSON.parse(tools);
    } catch (e) {
      error.textContent = `the tools are not JSON: ${e.message}`;
      return;
    }
    if (!Array.isArray(parsed)) {
      error.textContent = "the tools must be a JSON list of {\"type\": \"function\", \"function\": {...}}";
      return;
    }
  }
  const maxTokens = Number($("set-max-tokens").value);
  const temperature = Number($("set-temperature").value);
  // sent as typed: the server says what it takes
  state.settings = { system: $("set-system").value, max_tokens: maxTokens, temperature, tools: parsed,
    tool_choice: $("set-tool-choice").value };
  error.textContent = "";
  toggleSettings(false);
}

function toggleSettings(open) {
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
}

// -- the live panel ------------------------------------------------------------------------------

let polling = null;

async function poll() {
  if (polling) return polling;
  polling = (async () => {
    try {
      const m = await getJSON("/v1/metrics.json");
      state.seats = m.data;
      const seats = {};
      for (const s of m.data) {
        seats[s.name] = { cache: s.cache_tokens, evicted: s.evicted_tokens, turns: s.turns, busy: s.busy,
          tok_s: s.last ? s.last.decode_tok_s : null };
      }
      state.samples.push({ t: m.time, rss: m.rss_bytes, slots: m.cache_slots, answered: m.requests_answered,
        total: m.seats.total, seats });
      if (state.samples.length > MAX_SAMPLES) state.samples.shift();
      setHealth(true, `${m.seats.busy} busy · ${m.seats.taken}/${m.seats.total} seats`);
      $("answered").textContent = `${m.requests_answered} answered`;
      renderSeats();
      drawPanel();
    } catch (e) {
      setHealth(false, `unreachable: ${e.message}`);
    } finally {
      polling = null;
    }
  })();
  return polling;
}

function seatNames() {
  const names = new Set();
  for (const s of state.samples) for (const n of Object.keys(s.seats)) names.add(n);
  return [...names].sort();
}

function drawPanel() {
  const samples = state.samples;
  if (!samples.length) return;
  const names = seatNames();
  const series = (key) => names.map((n) => ({
    color: colorOf(n),
    points: samples.filter((s) => s.seats[n] && s.seats[n][key] !== null).map((s) => [s.t, s.seats[n][key]]),
  }));
  const last = samples[samples.length - 1];
  plot($("plot-cache"), series("cache"), last.slots);
  plot($("plot-evicted"), series("evicted"), null);
  plot($("plot-rss"), [{ color: "#e6e8eb", points: samples.map((s) => [s.t, s.rss / 1048576]) }], null);
  plot($("plot-speed"), series("tok_s"), null);
  $("legend").replaceChildren(...names.map((n) => {
    const e = element("span", null, n);
    e.style.setProperty("--c", colorOf(n));
    return e;
  }));
  $("now").tBodies[0].replaceChildren(...names.filter((n) => last.seats[n]).map((n) => {
    const s = last.seats[n];
    const row = element("tr");
    for (const v of [n, s.turns, s.cache, s.evicted, s.tok_s === null ? "–" : s.tok_s]) row.append(element("td", null, String(v)));
    return row;
  }));
  $("rss-now").textContent = `RSS ${(last.rss / 1048576).toFixed(1)} MiB · cache slots per seat ${last.slots}`;
}

// Lines over time on a canvas: y from 0 to the largest value (or `ceiling`, drawn grey), x over the samples' span.
function plot(canvas, lines, ceiling) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (!w || !h) return;
  canvas.width = Math.round(w * ratio);
  canvas.height = Math.round(h * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, w, h);
  const all = lines.flatMap((l) => l.points);
  if (!all.length) return;
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]));
  const top = Math.max(ceiling || 0, ...all.map((p) => p[1])) * 1.1 || 1;
  const left = 38, right = 6, up = 6, down = 14;
  const x = (t) => left + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (w - left - right);
  const y = (v) => h - down - (v / top) * (h - up - down);
  g.font = "10px system-ui, sans-serif";
  g.fillStyle = "#8b949e";
  g.strokeStyle = "#2a3039";
  g.lineWidth = 1;
  for (const v of [0, top / 2.2, top / 1.1]) {
    g.beginPath(); g.moveTo(left, y(v)); g.lineTo(w - right, y(v)); g.stroke();
    g.fillText(v >= 100 ? Math.round(v).toString() : v.toFixed(1), 2, y(v) + 3);
  }
  g.fillText(`${Math.round(t1 - t0)} s`, w - right - 28, h - 2);
  if (ceiling) {
    g.strokeStyle = "#6e7681"; g.setLineDash([2, 3]);
    g.beginPath(); g.moveTo(left, y(ceiling)); g.lineTo(w - right, y(ceiling)); g.stroke();
  }
  g.setLineDash([]);
  g.lineWidth = 1.6;
  for (const l of lines) {
    if (!l.points.length) continue;
    g.strokeStyle = l.color;
    g.beginPath();
    l.points.forEach(([t, v], i) => (i ? g.lineTo(x(t), y(v)) : g.moveTo(x(t), y(v))));
    if (l.points.length === 1) g.lineTo(x(l.points[0][0]) - 2, y(l.points[0][1]));
    g.stroke();
  }
}

// -- wiring --------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", sendMessage);
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) sendMessage(ev);
  });
  $("seat-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const name = $("seat-name").value.trim();
    if (name) switchSeat(name); // the server checks the name with the seat's first request
    $("seat-name").value = "";
  });
  $("seat-free").addEventListener("click", freeSeat);
  $("image-input").addEventListener("change", () => {
    const file = $("image-input").files[0];
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => attach(reader.result);
    reader.onerror = () => showError(chatOf(state.seat), { message: `the file could not be read (${reader.error})` });
    reader.readAsDataURL(file);
  });
  $("attached-clear").addEventListener("click", () => attach(null));
  $("settings-toggle").addEventListener("click", () => toggleSettings($("settings").hidden));
  $("settings-apply").addEventListener("click", applySettings);
  window.addEventListener("resize", drawPanel);
  setInterval(poll, POLL_MS);
  start();
});
