// pagedllm's page: a chat over the server's own streaming endpoint, and the memory panel
// (the plan from /v1/plan, live figures from /metrics: one source for each number).
// No framework and nothing fetched from elsewhere: the page works on a machine with no network.
// Model output is untrusted: it is escaped before any markdown is applied.
"use strict";

const GIB = 2 ** 30;
const PLAN_PARTS = [
  ["baseline", "interpreter and libraries", "baseline_bytes"],
  ["weights", "weights", "weights_bytes"],
  ["kv_cache", "KV cache", "kv_cache_bytes"],
  ["activation", "activation peak", "activation_bytes"],
  ["overhead", "allocator overhead", "overhead_bytes"],
];
const RSS_POINTS = 300; // 5 minutes, one a second

const $ = (id) => document.getElementById(id);
const state = {
  key: localStorage.getItem("pagedllm.key") || "",
  needsKey: false,
  conversation: JSON.parse(localStorage.getItem("pagedllm.conversation") || "[]"),
  controller: null,
  rss: [],
  refreshing: false,
  model: "", // a server with several models (pagedllm serve --model A=... --model B=...): the one chosen
};

// ---- the API, with the key when the server wants one ------------------------------------------

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

async function api(path, options = {}) {
  if (state.needsKey && !state.key) throw new Error("this server needs its API key");
  const response = await fetch(path, { ...options, headers: headers(options.body !== undefined) });
  if (response.status === 401) {
    state.key = "";
    askForKey();
    throw new Error("wrong or missing API key");
  }
  return response;
}

// Where the server has several models, every request says which (a GET in its query).
function forModel(path) {
  if (!state.model) return path;
  return path + (path.includes("?") ? "&" : "?") + "model=" + encodeURIComponent(state.model);
}

// The server's models: one, the page as it always was; several, a picker in the header.
async function loadModels() {
  try {
    const models = (await (await api("/v1/models")).json()).data;
    const picker = $("model-picker");
    picker.hidden = models.length < 2;
    if (models.length < 2) {
      state.model = "";
      return;
    }
    const ids = models.map((m) => m.id);
    const labels = models.map((m) => m.id + " (" + m.state + ")");
    const saved = localStorage.getItem("pagedllm.model");
    state.model = ids.includes(state.model) ? state.model : ids.includes(saved) ? saved : ids[0];
    if ([...picker.options].map((o) => o.textContent).join("|") !== labels.join("|")) {
      // rebuilt only when a model's state changed: an open list is left alone
      picker.replaceChildren(
        ...models.map((m, i) => {
          const option = document.createElement("option");
          option.value = m.id;
          option.textContent = labels[i];
          return option;
        }),
      );
    }
    picker.value = state.model;
  } catch (e) {
    // the next refresh asks again (a missing key opens the key box)
  }
}

function chooseModel() {
  state.model = $("model-picker").value;
  localStorage.setItem("pagedllm.model", state.model);
  state.rss = [];
  refresh();
}

function askForKey() {
  $("keybox").hidden = false;
  $("key").focus();
}

function saveKey() {
  state.key = $("key").value.trim();
  localStorage.setItem("pagedllm.key", state.key);
  $("keybox").hidden = true;
  refresh();
}

// ---- markdown, safely -------------------------------------------------------------------------

function escapeHtml(text) {
  const entities = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  return text.replace(/[&<>"']/g, (c) => entities[c]);
}

function inlineMarkdown(text) {
  return text
    .split(/\n{2,}/)
    .filter((p) => p.trim())
    .map((p) => {
      const html = escapeHtml(p)
        .replace(/`([^`\n]+)`/g, "<code>$1</code>")
        .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
        .replace(/\n/g, "<br>");
      return "<p>" + html + "</p>";
    })
    .join("");
}

// Fenced code blocks and paragraphs; everything escaped first, so no tag of the text survives.
function renderMarkdown(text) {
  return text
    .split("```")
    .map((part, i) => {
      if (i % 2 === 0) return inlineMarkdown(part);
      const newline = part.indexOf("\n");
      const code = newline >= 0 ? part.slice(newline + 1) : part;
      return "<pre><code>" + escapeHtml(code) + "</code></pre>";
    })
    .join("");
}

// ---- the conversation -------------------------------------------------------------------------

function saveConversation() {
  localStorage.setItem("pagedllm.conversation", JSON.stringify(state.conversation));
}

function messageElement(message) {
  const div = document.createElement("div");
  div.className = "message " + message.role;
  fillMessage(div, message);
  return div;
}

function fillMessage(div, message) {
  let html = "";
  if (message.reasoning) html += '<div class="reasoning">' + escapeHtml(message.reasoning) + "</div>";
  html += '<div class="content">' + renderMarkdown(message.content || "") + "</div>";
  if (message.note) html += '<div class="note">' + escapeHtml(message.note) + "</div>";
  div.innerHTML = html;
}

function renderConversation() {
  const box = $("messages");
  box.replaceChildren(...state.conversation.map(messageElement));
  box.scrollTop = box.scrollHeight;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function requestBody() {
  const body = {
    messages: state.conversation.slice(0, -1).map(({ role, content }) => ({ role, content })),
    stream: true,
  };
  for (const [field, id] of [["temperature", "temperature"], ["top_p", "top_p"], ["max_tokens", "max_tokens"]]) {
    const value = $(id).value.trim();
    if (value !== "") body[field] = Number(value);
  }
  const schema = $("schema").value.trim();
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schema) } };
  }
  return body;
}

async function send() {
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  showError("");
  const reply = { role: "assistant", content: "" };
  state.conversation.push({ role: "user", content: text }, reply);
  let body;
  try {
    body = requestBody();
  } catch (e) {
    state.conversation.splice(-2);
    showError("JSON schema: " + e.message);
    return;
  }
  $("input").value = "";
  renderConversation();
  const element = $("messages").lastElementChild;
  state.controller = new AbortController();
  setBusy(true);
  try {
    if (state.model) body.model = state.model;
    const response = await api("/v1/chat/completions", {
      method: "POST",
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error((await response.json()).error.message);
    await readStream(response, (delta) => {
      reply.content += delta.content || "";
      reply.reasoning = (reply.reasoning || "") + (delta.reasoning_content || "");
      fillMessage(element, reply);
      $("messages").scrollTop = $("messages").scrollHeight;
    });
  } catch (e) {
    reply.note = e.name === "AbortError" ? "stopped" : "error: " + e.message;
    fillMessage(element, reply);
  } finally {
    state.controller = null;
    setBusy(false);
    saveConversation();
  }
}

// The server's SSE chunks: each delta as it comes; an error event ends the answer.
async function readStream(response, onDelta) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta) onDelta(delta);
      }
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function stop() {
  if (state.controller) state.controller.abort(); // the server sees the connection go and aborts
}

function newConversation() {
  stop();
  state.conversation = [];
  saveConversation();
  renderConversation();
  showError("");
}

// ---- the memory panel -------------------------------------------------------------------------

function gib(bytes) {
  return (bytes / GIB).toFixed(3) + " GiB";
}

// Prometheus text to {name: value} (labels dropped: one model per server).
function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const space = line.lastIndexOf(" ");
    values[line.slice(0, space).split("{")[0]] = Number(line.slice(space + 1));
  }
  return values;
}

function segment(className, bytes, total, title) {
  const div = document.createElement("div");
  div.className = className;
  div.style.width = (100 * Math.max(0, bytes) / Math.max(1, total)).toFixed(3) + "%";
  div.title = title;
  return div;
}

function showPlan(plan) {
  $("model").textContent = plan.model;
  $("budget").textContent = gib(plan.budget_bytes);
  $("budget-source").textContent = "(" + plan.budget_source + ")";
  const bar = $("plan-bar");
  const legend = $("plan-legend");
  bar.replaceChildren();
  legend.replaceChildren();
  for (const [part, label, field] of PLAN_PARTS) {
    const bytes = plan[field];
    bar.append(segment("part-" + part, bytes, plan.budget_bytes, label + ": " + gib(bytes)));
    const item = document.createElement("li");
    item.className = "part-" + part;
    item.dataset.part = part;
    item.dataset.bytes = String(bytes);
    item.style.background = "none";
    item.textContent = label + " " + gib(bytes);
    legend.append(item);
  }
}

// A mixture whose experts stay in the file: how many are resident (the plan's slots, of all of
// them) and what the router's choices cost (hits, misses, bytes read from the file).
function showExperts(plan, m) {
  const slots = m.pagedllm_expert_slots || 0;
  $("experts").hidden = slots === 0;
  $("experts-slots").textContent = slots;
  $("experts-total").textContent = plan.routed_experts || slots;
  $("experts-hits").textContent = m.pagedllm_expert_cache_hits_total || 0;
  $("experts-misses").textContent = m.pagedllm_expert_cache_misses_total || 0;
  $("experts-read").textContent = gib(m.pagedllm_expert_cache_read_bytes_total || 0);
}

// The prefix cache's disk tier (--prefix-cache-dir): its files against their bound, and what it
// saved (blocks read back instead of computed) and cost (bytes written).
function showDiskTier(m) {
  const budget = m.pagedllm_prefix_disk_budget_bytes || 0;
  $("disk-tier").hidden = budget === 0;
  $("disk-used").textContent = gib(m.pagedllm_prefix_disk_bytes || 0);
  $("disk-budget").textContent = gib(budget);
  $("disk-hits").textContent = m.pagedllm_prefix_disk_hit_blocks_total || 0;
  $("disk-misses").textContent = m.pagedllm_prefix_disk_misses_total || 0;
  $("disk-written").textContent = gib(m.pagedllm_prefix_disk_written_bytes_total || 0);
}

function showMetrics(m, budget) {
  const total = m.pagedllm_kv_blocks_total || 0;
  const used = m.pagedllm_kv_blocks_used || 0;
  const cached = m.pagedllm_kv_blocks_cached_free || 0;
  $("kv-used").textContent = used;
  $("kv-cached").textContent = cached;
  $("kv-free").textContent = Math.max(0, total - used - cached);
  $("kv-bar").replaceChildren(segment("kv-used", used, total, "used"), segment("kv-cached", cached, total, "cached"));
  const windowTotal = m.pagedllm_kv_window_blocks_total || 0;
  $("kv-window").hidden = windowTotal === 0;
  $("kv-window-used").textContent = m.pagedllm_kv_window_blocks_used || 0;
  $("kv-window-total").textContent = windowTotal;
  $("running").textContent = m.pagedllm_requests_running;
  $("waiting").textContent = m.pagedllm_requests_waiting;
  $("tps").textContent = (m.pagedllm_generation_tokens_per_second || 0).toFixed(1);
  const rss = m.pagedllm_resident_bytes || 0;
  $("rss").textContent = gib(rss);
  state.rss.push(rss);
  if (state.rss.length > RSS_POINTS) state.rss.shift();
  const top = Math.max(budget, ...state.rss) * 1.05;
  const y = (bytes) => (100 - (100 * bytes) / top).toFixed(2);
  $("rss-line").setAttribute("points", state.rss.map((b, i) => i + "," + y(b)).join(" "));
  $("rss-budget").setAttribute("y1", y(budget));
  $("rss-budget").setAttribute("y2", y(budget));
}

async function refresh() {
  if (state.refreshing) return; // the last tick still waits (a model loading): no pile of them
  state.refreshing = true;
  try {
    await loadModels();
    const plan = await (await api(forModel("/v1/plan"))).json();
    showPlan(plan);
    const metrics = parseMetrics(await (await api(forModel("/metrics"))).text());
    showMetrics(metrics, plan.budget_bytes);
    showExperts(plan, metrics);
    showDiskTier(metrics);
  } catch (e) {
    // shown again on the next tick: a missing key opens the key box, a restart passes
  } finally {
    state.refreshing = false;
  }
}

async function setBudget(event) {
  event.preventDefault();
  const memory = $("new-budget").value.trim();
  if (!memory) return;
  try {
    const response = await api(forModel("/v1/memory"), { method: "POST", body: JSON.stringify({ memory }) });
    const answer = await response.json();
    $("budget-result").textContent = response.ok ? "applied" : answer.error.message;
    refresh();
  } catch (e) {
    $("budget-result").textContent = e.message;
  }
}

// ---- start ------------------------------------------------------------------------------------

async function start() {
  const config = await (await fetch("/web/config.json")).json();
  state.needsKey = config.api_key_required;
  if (state.needsKey && !state.key) askForKey();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-conversation").addEventListener("click", newConversation);
  $("save-key").addEventListener("click", saveKey);
  $("budget-form").addEventListener("submit", setBudget);
  $("model-picker").addEventListener("change", chooseModel);
  renderConversation();
  refresh();
  setInterval(refresh, 1000);
}

start();
