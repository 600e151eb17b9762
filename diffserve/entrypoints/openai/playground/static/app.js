// diffserve playground: a form built from GET /v1/models, requests to the public API only.
// No build step and no dependencies: this file is served as it is.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "diffserve.apiKey";
// Capability (model card) -> the endpoint that serves it, and how the page labels it.
const ENDPOINTS = {
  "text-to-image": "/v1/images/generations",
  "image-edit": "/v1/images/edits",
  "text-to-video": "/v1/videos",
};
const MODE_LABELS = { "text-to-image": "Image", "image-edit": "Edit", "text-to-video": "Video" };
// Parameters with their own controls in index.html; any other parameter a model card lists
// gets a generic control in #extra.
const OWN_CONTROLS = new Set(["negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale",
  "size", "n", "partial_images", "seed"]);
const LABELS = { negative_prompt: "Negative prompt", num_inference_steps: "Steps", guidance_scale: "Guidance",
  true_cfg_scale: "True CFG", scheduler: "Sampler", clip_skip: "Clip skip", eta: "Eta (DDIM)" };
const labelOf = (name) => LABELS[name] || name.replace(/_/g, " ").replace(/^./, (c) => c.toUpperCase());
const PREVIEWS_WANTED = 2;      // partial_images asked for by default (capped by the model card)
const METRICS_EVERY_MS = 2000;
const RATE_WINDOW_MS = 10000;   // images/s is measured over about this long
const THUMB_PX = 128;           // gallery images are enlarged up to this (crisp pixels)
const PREVIEW_PX = 96;

const state = {
  models: [], card: null, mode: null, lastSeed: null,
  apiKey: sessionStorage.getItem(KEY_STORAGE), keyPrompt: null, keyRefused: false,
  metricsSamples: [],
};

// ----------------------------------------------------------------------------- helpers
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

const sleep = (ms, signal) => new Promise((resolve, reject) => {
  const timer = setTimeout(resolve, ms);
  signal?.addEventListener("abort", () => { clearTimeout(timer); reject(signal.reason); }, { once: true });
});

const announce = (text) => { $("announce").textContent = text; };

function base64Blob(b64, type) {
  const binary = atob(b64);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return new Blob([bytes], { type });
}

// Enlarge small images by a whole factor with crisp pixels (the built-in model makes 8x8).
function fitImage(img, box) {
  const fit = () => {
    const factor = Math.floor(box / Math.max(img.naturalWidth, img.naturalHeight, 1));
    if (factor >= 2) {
      img.width = img.naturalWidth * factor;
      img.height = img.naturalHeight * factor;
      img.classList.add("pixelated");
    }
  };
  if (img.complete && img.naturalWidth) fit(); else img.addEventListener("load", fit, { once: true });
}

// ------------------------------------------------------------------- API and API key
// fetch() with the stored API key; on 401 asks for a key (one dialog for all concurrent
// requests) and tries again. Once the dialog was cancelled, a 401 is an error until the
// "API key" button is used.
async function api(path, init = {}) {
  for (;;) {
    const headers = new Headers(init.headers);
    const sentKey = state.apiKey;
    if (sentKey) headers.set("Authorization", `Bearer ${sentKey}`);
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    if (state.keyRefused) throw new Error("the server needs an API key: use the API key button at the top");
    if (state.apiKey === sentKey) await askKey(sentKey ? "The server did not accept that key." : "");
  }
}

function askKey(message) {
  if (!state.keyPrompt) {
    state.keyPrompt = new Promise((resolve, reject) => {
      const dialog = $("key-dialog");
      const input = $("key-input");
      $("key-error").textContent = message;
      input.value = "";
      dialog.addEventListener("close", () => {
        state.keyPrompt = null;
        $("key-button").hidden = false;
        if (dialog.returnValue === "ok" && input.value) {
          state.apiKey = input.value;
          state.keyRefused = false;
          sessionStorage.setItem(KEY_STORAGE, input.value);
          resolve();
        } else {
          state.keyRefused = true;
          reject(new Error("the server needs an API key: use the API key button at the top"));
        }
      }, { once: true });
      dialog.returnValue = "";
      dialog.showModal();
    });
  }
  return state.keyPrompt;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body?.error?.message) return body.error.message;
  } catch { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}`;
}

// Server-Sent Events of a fetch() response body: yields {event, data} with data parsed.
async function* readEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: JSON.parse(data.join("\n")) };
    }
  }
}

// ------------------------------------------------------------------ model card -> form
async function loadModels() {
  for (;;) {
    try {
      const response = await api("/v1/models");
      if (response.ok) {
        const models = (await response.json()).data;
        if (models.some((m) => m.capabilities?.length)) return setModels(models);
        $("model-state").textContent = "the model is loading…";
      } else {
        $("model-state").textContent = await errorMessage(response);
      }
    } catch (err) {
      $("model-state").textContent = `cannot reach the server (${err.message}); retrying…`;
    }
    await sleep(1000);
  }
}

function setModels(models) {
  state.models = models.filter((m) => m.capabilities?.some((c) => c in ENDPOINTS));
  const select = $("model");
  select.replaceChildren(...state.models.map((m) => el("option", { value: m.id, text: m.id })));
  select.disabled = state.models.length < 2;
  if (!state.models.length) {
    $("model-state").textContent = "no model this page can drive";
    return;
  }
  applyCard(state.models[0]);
}

function applyCard(card) {
  state.card = card;
  $("model-state").textContent = card.capabilities.filter((c) => c in ENDPOINTS).join(", ");
  const modes = card.capabilities.filter((c) => c in ENDPOINTS);
  for (const label of document.querySelectorAll("#modes [data-mode]")) {
    label.hidden = !modes.includes(label.dataset.mode);
  }
  $("modes").hidden = modes.length < 2;
  const p = card.parameters || {};
  const number = (id, info, value = info?.default) => {
    if (!info) return;
    const input = $(id);
    input.min = info.minimum ?? "";
    input.max = info.maximum ?? "";
    if (value !== null && value !== undefined) input.value = value;
  };
  number("num_inference_steps", p.num_inference_steps);
  number("guidance_scale", p.guidance_scale);
  number("true_cfg_scale", p.true_cfg_scale);
  number("n", p.n);
  number("partial_images", p.partial_images,
    p.partial_images && Math.min(PREVIEWS_WANTED, p.partial_images.maximum ?? PREVIEWS_WANTED));
  if (p.size) {
    const [w, h] = (p.size.default || "").split("x");
    for (const [id, value, max] of [["width", w, p.size.max_width], ["height", h, p.size.max_height]]) {
      const input = $(id);
      input.step = p.size.multiple_of || 1;
      input.min = p.size.multiple_of || 1;
      input.max = max ?? "";
      input.value = value ?? "";
    }
  }
  buildExtraControls(p);
  setMode(modes.includes(state.mode) ? state.mode : modes[0]);
  $("generate").disabled = false;
}

function buildExtraControls(parameters) {
  const fields = [];
  for (const [name, info] of Object.entries(parameters)) {
    if (OWN_CONTROLS.has(name)) continue;
    const id = `param-${name}`;
    const label = labelOf(name);
    let input;
    if (info.type === "boolean") {
      input = el("input", { id, type: "checkbox", title: info.description });
      input.checked = Boolean(info.default);
    } else if (info.enum) {  // e.g. scheduler: the samplers the model offers; "" = the model's default
      input = el("select", { id, title: info.description },
        el("option", { value: "", text: info.default ?? "model default" }),
        ...info.enum.map((value) => el("option", { value, text: value })));
    } else if (info.type === "integer" || info.type === "number") {
      input = el("input", { id, type: "number", title: info.description, min: info.minimum, max: info.maximum,
        step: info.type === "integer" ? 1 : "any", inputmode: info.type === "integer" ? "numeric" : "decimal" });
      if (info.default !== null && info.default !== undefined) input.value = info.default;
    } else {
      input = el("input", { id, type: "text", title: info.description, autocomplete: "off" });
      if (info.default !== null && info.default !== undefined) input.value = info.default;
    }
    fields.push(el("div", { class: "field", "data-param": name }, el("label", { for: id, text: label }), input));
  }
  $("extra").replaceChildren(...fields);
}

function applies(name) {
  const info = state.card?.parameters?.[name];
  return Boolean(info) && (!info.capabilities || info.capabilities.includes(state.mode));
}

function setMode(mode) {
  state.mode = mode;
  for (const radio of document.querySelectorAll("#modes input")) radio.checked = radio.value === mode;
  for (const field of document.querySelectorAll("[data-param]")) field.hidden = !applies(field.dataset.param);
  for (const part of document.querySelectorAll("[data-for]")) part.hidden = part.dataset.for !== mode;
  $("generate").textContent = { "image-edit": "Edit", "text-to-video": "Generate video" }[mode] || "Generate";
}

// ----------------------------------------------------------------- form -> request
// The settings of a request: {mode, model, prompt, params: {name: typed value}, files}.
function readSettings() {
  const params = {};
  const put = (name, value) => { if (applies(name) && value !== "" && !Number.isNaN(value)) params[name] = value; };
  put("negative_prompt", $("negative_prompt").value.trim());
  put("num_inference_steps", $("num_inference_steps").valueAsNumber);
  put("guidance_scale", $("guidance_scale").valueAsNumber);
  put("true_cfg_scale", $("true_cfg_scale").valueAsNumber);
  put("n", $("n").valueAsNumber);
  put("partial_images", $("partial_images").valueAsNumber);
  if (applies("size") && $("width").value && $("height").value) params.size = `${$("width").value}x${$("height").value}`;
  if (!$("seed-random").checked) put("seed", $("seed").valueAsNumber);
  for (const field of $("extra").children) {
    const name = field.dataset.param;
    const input = field.querySelector("input, select");
    if (!applies(name)) continue;
    if (input.type === "checkbox") params[name] = input.checked;
    else if (input.type === "number") put(name, input.valueAsNumber);
    else put(name, input.value.trim());
  }
  const files = state.mode === "image-edit" ? { image: [...$("image").files], mask: $("mask").files[0] } : null;
  return { mode: state.mode, model: state.card.id, prompt: $("prompt").value, params, files };
}

function requestInit(settings, signal) {
  const { mode, model, prompt, params, files } = settings;
  if (mode === "text-to-image") {
    const body = { model, prompt, ...params, stream: true, stream_progress: true, output_format: "png" };
    return { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal };
  }
  // image-edit and text-to-video: multipart/form-data, as OpenAI's clients send them
  const form = new FormData();
  form.append("model", model);
  form.append("prompt", prompt);
  for (const [name, value] of Object.entries(params)) form.append(name, String(value));
  if (mode === "image-edit") {
    form.append("stream", "true");
    form.append("stream_progress", "true");
    form.append("output_format", "png");
    for (const file of files.image) form.append(files.image.length > 1 ? "image[]" : "image", file);
    if (files.mask) form.append("mask", files.mask);
  }
  return { method: "POST", body: form, signal };
}

// ------------------------------------------------------------------------------ jobs
function startJob(settings) {
  const count = settings.mode === "text-to-video" ? 1 : settings.params.n || 1;
  const job = { settings, controller: new AbortController(), slots: [], videoId: null };
  const cancel = el("button", { type: "button", class: "cancel", text: "Cancel" });
  const slotList = el("ol", { class: "slots" });
  for (let i = 0; i < count; i++) {
    const text = el("span", { class: "state", text: "sending…" });
    const bar = el("progress", { max: 1, "aria-label": `progress of image ${i + 1}` });
    const preview = el("img", { class: "preview", alt: "", hidden: true });
    const item = el("li", { class: "slot", "data-state": "sending" }, preview, bar, text);
    const set = (kind, label) => { item.dataset.state = kind; text.textContent = label; };
    job.slots.push({
      accepted: () => set("accepted", "accepted"),
      queued: (place) => { set("queued", place ? `queued: place ${place}` : "queued"); bar.removeAttribute("value"); },
      progress: (step, total, unit = "step") => {
        set("running", unit === "%" ? `${step}%` : `step ${step} / ${total}`);
        bar.max = total; bar.value = step;
      },
      preview: (src) => { preview.src = src; preview.hidden = false; fitImage(preview, PREVIEW_PX); },
      done: () => { set("done", "done"); bar.max = 1; bar.value = 1; },
    });
    slotList.append(item);
  }
  const title = `${MODE_LABELS[settings.mode]}: ${settings.prompt}`;
  const status = el("p", { class: "job-status", text: "" });
  job.card = el("li", { class: "job", "data-state": "active", "aria-label": title },
    el("p", { class: "job-title", text: title }), slotList, status, cancel);
  $("jobs").prepend(job.card);
  const end = (kind, message) => {
    job.card.dataset.state = kind;
    status.textContent = message;
    cancel.textContent = "Dismiss";
    cancel.onclick = () => { const focus = job.card.contains(document.activeElement); job.card.remove(); if (focus) $("prompt").focus(); };
    announce(message);
  };
  cancel.onclick = () => {
    job.controller.abort(new DOMException("cancelled", "AbortError"));
    if (job.videoId) api(`/v1/videos/${encodeURIComponent(job.videoId)}`, { method: "DELETE" }).catch(() => {});
  };
  const run = settings.mode === "text-to-video" ? runVideo : runImages;
  run(job).then(
    () => { job.card.remove(); },
    (err) => {
      if (job.controller.signal.aborted) end("cancelled", "Cancelled.");
      else end("failed", `Failed: ${err.message}`);
    },
  );
}

async function runImages(job) {
  const response = await api(ENDPOINTS[job.settings.mode], requestInit(job.settings, job.controller.signal));
  if (!response.ok) throw new Error(await errorMessage(response));
  for (const slot of job.slots) slot.accepted();
  let completed = 0;
  for await (const { event, data } of readEvents(response.body)) {
    const slot = job.slots[data.image_index ?? 0];
    if (event === "diffserve.queued") slot.queued(data.queue_position);
    else if (event === "diffserve.progress") slot.progress(data.step, data.num_inference_steps);
    else if (event.endsWith(".partial_image")) slot.preview(`data:image/${data.output_format};base64,${data.b64_json}`);
    else if (event.endsWith(".completed")) {
      completed++;
      slot.done();
      const type = `image/${data.output_format || "png"}`;
      addResult(job.settings, { kind: "image", blob: base64Blob(data.b64_json, type), seed: data.seed,
        timings: data.timings, size: data.size, index: data.image_index ?? 0 });
    } else if (event === "error") throw new Error(data.error?.message || "the server reported an error");
  }
  if (completed < job.slots.length) throw new Error("the stream ended before every image was done");
}

async function runVideo(job) {
  const signal = job.controller.signal;
  const response = await api(ENDPOINTS["text-to-video"], requestInit(job.settings, signal));
  if (!response.ok) throw new Error(await errorMessage(response));
  let video = await response.json();
  job.videoId = video.id;
  const path = `/v1/videos/${encodeURIComponent(video.id)}`;
  while (video.status === "queued" || video.status === "in_progress") {
    if (video.status === "queued") job.slots[0].queued(video.queue_position);
    else job.slots[0].progress(video.progress ?? 0, 100, "%");
    await sleep(1000, signal);
    const poll = await api(path, { signal });
    if (!poll.ok) throw new Error(await errorMessage(poll));
    video = await poll.json();
  }
  if (video.status !== "completed") throw new Error(video.error?.message || `the video job ${video.status}`);
  const content = await api(`${path}/content`, { signal });
  if (!content.ok) throw new Error(await errorMessage(content));
  job.slots[0].done();
  addResult(job.settings, { kind: "video", blob: await content.blob(), seed: video.seed, timings: video.timings,
    size: video.size, index: 0, id: video.id });
}

// ---------------------------------------------------------------------------- gallery
const seconds = (s) => (typeof s === "number" ? `${s.toFixed(2)} s` : "–");

function addResult(settings, result) {
  const seed = result.seed ?? settings.params.seed;
  if (typeof seed === "number") {
    state.lastSeed = seed;
    $("seed-reuse").disabled = false;
  }
  const url = URL.createObjectURL(result.blob);
  const label = `${settings.prompt} (seed ${seed ?? "?"})`;
  let media;
  if (result.kind === "video") {
    media = el("video", { src: url, controls: true, loop: true, "aria-label": label });
    media.addEventListener("loadedmetadata", () => {
      if (Math.max(media.videoWidth, media.videoHeight) * 2 <= THUMB_PX) media.classList.add("pixelated");
    }, { once: true });
  } else {
    media = el("img", { src: url, alt: label });
    fitImage(media, THUMB_PX);
  }
  const t = result.timings || {};
  const rows = [["prompt", "Prompt", settings.prompt], ["seed", "Seed", seed ?? "–"]];
  for (const [name, value] of Object.entries(settings.params)) {
    if (["seed", "n", "partial_images", "size"].includes(name)) continue;
    rows.push([name, labelOf(name), value]);
  }
  rows.push(["size", "Size", result.size || settings.params.size || "–"], ["model", "Model", settings.model]);
  if (result.timings) {
    rows.push(["timings", "Time", `${seconds(t.total_s)} (queue ${seconds(t.queue_s)}, encode ${seconds(t.encode_s)}, `
      + `denoise ${seconds(t.denoise_s)}, decode ${seconds(t.decode_s)})`]);
  }
  const meta = el("dl", {}, ...rows.map(([key, term, value]) =>
    el("div", { "data-key": key }, el("dt", { text: term }), el("dd", { text: String(value) }))));
  const ext = result.kind === "video" ? "mp4" : (result.blob.type.split("/")[1] || "png");
  const name = `diffserve-${seed ?? result.id ?? Date.now()}.${ext}`;
  const reused = { ...settings, params: { ...settings.params, seed, n: 1 } };
  const reuse = result.kind === "video"
    ? el("button", { type: "button", class: "reuse", text: "Reuse settings", onclick: () => reuseSettings(reused) })
    : el("button", { type: "button", class: "thumb", "aria-label": `Reuse the settings of ${label}`,
      title: "Reuse these settings", onclick: () => reuseSettings(reused) }, media);
  const item = el("li", { class: "result", "data-kind": result.kind },
    result.kind === "video" ? media : null, reuse, meta,
    el("a", { href: url, download: name, class: "download", text: "Download" }));
  $("gallery").prepend(item);
  $("gallery-empty").hidden = true;
  announce(`${MODE_LABELS[settings.mode]} ready: ${label}`);
}

function reuseSettings(settings) {
  if (state.card?.capabilities.includes(settings.mode)) setMode(settings.mode);
  $("prompt").value = settings.prompt;
  const p = settings.params;
  const set = (id, value) => { $(id).value = value ?? ""; };
  set("negative_prompt", p.negative_prompt);
  for (const id of ["num_inference_steps", "guidance_scale", "true_cfg_scale", "n", "partial_images"]) {
    if (p[id] !== undefined) set(id, p[id]);
  }
  if (p.size) [$("width").value, $("height").value] = p.size.split("x");
  if (typeof p.seed === "number") {
    $("seed-random").checked = false;
    $("seed").disabled = false;
    set("seed", p.seed);
  }
  for (const field of $("extra").children) {
    const input = field.querySelector("input, select");
    const value = p[field.dataset.param];
    if (value === undefined) continue;
    if (input.type === "checkbox") input.checked = Boolean(value); else input.value = value;
  }
  if (settings.files && settings.mode === "image-edit") {
    for (const [id, files] of [["image", settings.files.image], ["mask", settings.files.mask ? [settings.files.mask] : []]]) {
      const transfer = new DataTransfer();
      for (const file of files) transfer.items.add(file);
      $(id).files = transfer.files;
    }
  }
  $("prompt").focus();
  announce(`Settings restored (seed ${p.seed ?? "random"}).`);
}

// --------------------------------------------------------------------- status strip
// Prometheus text -> {name: sum over its label sets}; samples with `skip` in their labels are left out.
function parseMetrics(text, skip = 'backend="none"') {
  const sums = {};
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (match && !(match[2] || "").includes(skip)) sums[match[1]] = (sums[match[1]] ?? 0) + Number(match[3]);
  }
  return sums;
}

async function pollMetrics() {
  try {
    if (!document.hidden) {
      const response = await api("/metrics");
      if (response.ok) showMetrics(parseMetrics(await response.text()));
    }
  } catch { /* the strip keeps its last values */ }
  setTimeout(pollMetrics, METRICS_EVERY_MS);
}

function showMetrics(m) {
  const show = (name, text) => { document.querySelector(`[data-metric="${name}"]`).textContent = text; };
  const percent = (part, whole) => (whole > 0 ? `${Math.round((100 * part) / whole)}%` : "–");
  show("running", m.diffserve_num_requests_running ?? "–");
  show("waiting", m.diffserve_num_requests_waiting ?? "–");
  const samples = state.metricsSamples;
  samples.push({ images: m.diffserve_images_generated_total ?? 0, time: performance.now() });
  while (samples.length > 2 && samples.at(-1).time - samples[1].time >= RATE_WINDOW_MS) samples.shift();
  if (samples.length > 1) {
    const [first, last] = [samples[0], samples.at(-1)];
    show("images-per-s", ((last.images - first.images) / ((last.time - first.time) / 1000)).toFixed(1));
  }
  const hits = m.diffserve_prompt_embed_cache_hits_total;
  show("prompt-cache", hits === undefined ? "off" : percent(hits, hits + m.diffserve_prompt_embed_cache_misses_total));
  const calls = m.diffserve_cache_backend_transformer_calls_total;
  document.querySelector('[data-needs="step-cache"]').hidden = calls === undefined;
  if (calls !== undefined) show("step-cache", percent(m.diffserve_cache_backend_skipped_total, calls));
}

// ---------------------------------------------------------------------------- wiring
function wire() {
  const form = $("form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    $("form-error").textContent = "";
    if (!state.card || !form.reportValidity()) return;
    const settings = readSettings();
    if (settings.mode === "image-edit" && !settings.files.image.length) {
      $("form-error").textContent = "Choose an image to edit.";
      $("image").focus();
      return;
    }
    startJob(settings);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  $("key-button").addEventListener("click", () => {
    state.keyRefused = false;
    askKey("").catch(() => {});
  });
  $("modes").addEventListener("change", (event) => setMode(event.target.value));
  $("model").addEventListener("change", (event) => applyCard(state.models.find((m) => m.id === event.target.value)));
  $("seed-random").addEventListener("change", (event) => {
    const random = event.target.checked;
    $("seed").disabled = random;
    if (!random && $("seed").value === "") $("seed").value = state.lastSeed ?? Math.floor(Math.random() * 2 ** 31);
  });
  $("seed-reuse").addEventListener("click", () => {
    $("seed-random").checked = false;
    $("seed").disabled = false;
    $("seed").value = state.lastSeed;
    $("seed").focus();
  });
}

wire();
loadModels();
pollMetrics();
