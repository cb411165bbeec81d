// The chat page of `mlx-ferrum serve`: talks to the same server's /v1/models and streaming
// /v1/chat/completions. Conversations and settings live in this browser's localStorage;
// the API key (when the server has one) in sessionStorage, so it is gone with the tab.
"use strict";

(function () {
  const STORE_CONVERSATIONS = "mlx-ferrum.conversations";
  const STORE_CURRENT = "mlx-ferrum.current";
  const STORE_SETTINGS = "mlx-ferrum.settings";
  const STORE_KEY = "mlx-ferrum.api-key";
  const EXPORT_FORMAT = "mlx-ferrum-conversations";
  const ROLES = ["system", "user", "assistant"];

  const $ = function (id) { return document.getElementById(id); };
  const ui = {
    model: $("model"), keyForm: $("key-form"), keyMessage: $("key-message"), apiKey: $("api-key"),
    sidebar: $("sidebar"), list: $("conversation-list"), settings: $("settings"),
    toggleConversations: $("toggle-conversations"), toggleSettings: $("toggle-settings"),
    system: $("system"), temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"),
    seed: $("seed"), extra: $("extra"), messages: $("messages"), error: $("error"),
    composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
    regenerate: $("regenerate"), editLast: $("edit-last"), importInput: $("import-conversations"),
  };

  let conversations = [];
  let currentId = null;
  let controller = null; // the AbortController of the request in flight
  let keyNeeded = false;

  // ---- storage -------------------------------------------------------------------------

  function readJSON(key, fallback) {
    try {
      const raw = localStorage.getItem(key);
      return raw === null ? fallback : JSON.parse(raw);
    } catch (e) {
      return fallback;
    }
  }

  function save() {
    try {
      localStorage.setItem(STORE_CONVERSATIONS, JSON.stringify(conversations));
      localStorage.setItem(STORE_CURRENT, currentId || "");
    } catch (e) {
      showError("Could not save the conversations in this browser: " + e.message);
    }
  }

  function saveSettings() {
    localStorage.setItem(STORE_SETTINGS, JSON.stringify({
      model: ui.model.value, temperature: ui.temperature.value, top_p: ui.topP.value,
      max_tokens: ui.maxTokens.value, seed: ui.seed.value, extra: ui.extra.value,
    }));
  }

  function newId() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  function current() {
    return conversations.find(function (c) { return c.id === currentId; });
  }

  function newConversation() {
    const conversation = { id: newId(), title: "New conversation", system: "", messages: [], updated: Date.now() };
    conversations.unshift(conversation);
    currentId = conversation.id;
    save();
    return conversation;
  }

  // ---- drawing ---------------------------------------------------------------------------

  function showError(message) {
    ui.error.textContent = message;
    ui.error.hidden = false;
  }

  function clearError() {
    ui.error.textContent = "";
    ui.error.hidden = true;
  }

  function drawList() {
    ui.list.replaceChildren();
    for (const c of conversations) {
      const li = document.createElement("li");
      const button = document.createElement("button");
      button.type = "button";
      button.className = "conversation";
      button.textContent = c.title;
      if (c.id === currentId) button.setAttribute("aria-current", "true");
      button.addEventListener("click", function () {
        if (controller) return;
        currentId = c.id;
        save();
        clearError();
        draw();
      });
      li.append(button);
      ui.list.append(li);
    }
  }

  function statsText(stats) {
    const parts = [];
    if (stats.completion_tokens !== undefined) parts.push(stats.completion_tokens + " tokens");
    if (stats.tokens_per_second !== undefined) parts.push(stats.tokens_per_second.toFixed(1) + " tokens/s");
    if (stats.ttft_ms !== undefined) parts.push("first token " + Math.round(stats.ttft_ms) + " ms");
    if (stats.finish_reason) parts.push(stats.finish_reason === "stopped" ? "stopped" : "finish: " + stats.finish_reason);
    return parts.join(" · ");
  }

  function messageNode(message) {
    const box = document.createElement("article");
    box.className = "message " + message.role;
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = message.role === "assistant" ? (message.model || "assistant") : "you";
    const body = document.createElement("div");
    body.className = "content";
    if (message.role === "assistant") {
      body.append(window.FerrumMarkdown.render(message.content));
    } else {
      body.classList.add("plain");
      body.textContent = message.content;
    }
    box.append(role, body);
    if (message.stats) {
      const stats = document.createElement("div");
      stats.className = "stats";
      stats.textContent = statsText(message.stats);
      box.append(stats);
    }
    return box;
  }

  function drawMessages() {
    const c = current();
    ui.messages.replaceChildren();
    if (!c.messages.length) {
      const empty = document.createElement("p");
      empty.className = "empty";
      empty.textContent = "Send a message to start.";
      ui.messages.append(empty);
    }
    for (const m of c.messages) ui.messages.append(messageNode(m));
    ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  function drawButtons() {
    const busy = controller !== null;
    const c = current();
    const last = c.messages[c.messages.length - 1];
    ui.send.hidden = busy;
    ui.stop.hidden = !busy;
    ui.regenerate.disabled = busy || !last;
    ui.editLast.disabled = busy || !c.messages.some(function (m) { return m.role === "user"; });
  }

  function draw() {
    const c = current();
    ui.system.value = c.system || "";
    drawList();
    drawMessages();
    drawButtons();
  }

  // ---- the server ------------------------------------------------------------------------

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(STORE_KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorMessage(response) {
    let text = "";
    try {
      text = await response.text();
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON: the text itself */ }
    return text || response.statusText || "no message";
  }

  function askForKey(message) {
    keyNeeded = true;
    ui.keyMessage.textContent = message;
    ui.keyForm.hidden = false;
    ui.apiKey.focus();
  }

  async function loadModels() {
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (e) {
      showError("Cannot reach the server to list its models (" + e.message + ").");
      return false;
    }
    if (response.status === 401) {
      const hadKey = sessionStorage.getItem(STORE_KEY) !== null;
      askForKey(hadKey ? "The server refused this API key: " + await errorMessage(response)
                       : "This server needs an API key.");
      return false;
    }
    if (!response.ok) {
      showError("The server refused to list its models (" + response.status + "): " + await errorMessage(response));
      return false;
    }
    const body = await response.json();
    const wanted = readJSON(STORE_SETTINGS, {}).model;
    ui.model.replaceChildren();
    for (const card of body.data || []) {
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.parent ? card.id + " (adapter of " + card.parent + ")" : card.id;
      ui.model.append(option);
    }
    if (wanted && Array.from(ui.model.options).some(function (o) { return o.value === wanted; })) ui.model.value = wanted;
    keyNeeded = false;
    ui.keyForm.hidden = true;
    return true;
  }

  function numberField(input, name, body, integer) {
    const raw = input.value.trim();
    if (raw === "") return;
    const value = Number(raw);
    if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
      throw new Error(name + " must be " + (integer ? "a whole number" : "a number") + ", got " + JSON.stringify(raw));
    }
    body[name] = value;
  }

  function requestBody(c) {
    const messages = [];
    if (c.system && c.system.trim()) messages.push({ role: "system", content: c.system });
    for (const m of c.messages) messages.push({ role: m.role, content: m.content });
    const body = {};
    const extra = ui.extra.value.trim();
    if (extra) {
      let parsed;
      try {
        parsed = JSON.parse(extra);
      } catch (e) {
        throw new Error("Extra request fields are not valid JSON: " + e.message);
      }
      if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
        throw new Error("Extra request fields must be a JSON object, like {\"stop\": [\"\\n\"]}");
      }
      Object.assign(body, parsed);
    }
    numberField(ui.temperature, "temperature", body, false);
    numberField(ui.topP, "top_p", body, false);
    numberField(ui.maxTokens, "max_tokens", body, true);
    numberField(ui.seed, "seed", body, true);
    Object.assign(body, {
      model: ui.model.value, messages: messages, stream: true, stream_options: { include_usage: true },
    });
    return body;
  }

  // Reads the server-sent events of ``response``; calls onEvent with each parsed JSON data.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, cut).replace(/\r$/, "");
        buffer = buffer.slice(cut + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return true;
        onEvent(JSON.parse(data));
      }
    }
    return false;
  }

  async function generate() {
    const c = current();
    clearError();
    if (keyNeeded) {
      showError("Enter the server's API key first.");
      drawButtons();
      ui.apiKey.focus();
      return;
    }
    let body;
    try {
      body = requestBody(c);
    } catch (e) {
      showError(e.message);
      drawButtons();
      return;
    }
    saveSettings();
    const reply = { role: "assistant", content: "", model: body.model };
    const node = messageNode(reply);
    const content = node.querySelector(".content");
    const stats = document.createElement("div");
    stats.className = "stats";
    node.append(stats);
    ui.messages.querySelectorAll(".empty").forEach(function (n) { n.remove(); });
    ui.messages.append(node);
    controller = new AbortController();
    drawButtons();
    const started = performance.now();
    let firstAt = null;
    let lastAt = null;
    let usage = null;
    let finish = null;
    let kept = false;
    let drawPending = false;
    const redraw = function () {
      drawPending = false;
      content.replaceChildren(window.FerrumMarkdown.render(reply.content));
      ui.messages.scrollTop = ui.messages.scrollHeight;
    };
    // at most one Markdown render per frame, however fast the deltas come
    const scheduleRedraw = function () {
      if (!drawPending) {
        drawPending = true;
        requestAnimationFrame(redraw);
      }
    };
    ui.messages.setAttribute("aria-busy", "true"); // screen readers read the reply once it is whole
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) {
        const message = await errorMessage(response);
        node.remove();
        if (response.status === 401) askForKey("The server refused the request: " + message);
        showError("The server refused the request (" + response.status + "): " + message);
        return;
      }
      const ended = await readEvents(response, function (event) {
        if (event.error) throw new Error("the server ended the reply with an error: " + (event.error.message || "unknown"));
        if (event.usage) usage = event.usage;
        for (const choice of event.choices || []) {
          const delta = (choice.delta && choice.delta.content) || "";
          if (delta) {
            const now = performance.now();
            if (firstAt === null) firstAt = now;
            lastAt = now;
            reply.content += delta;
            scheduleRedraw();
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      });
      if (!ended) throw new Error("the reply ended before the server finished it");
      kept = true;
    } catch (e) {
      if (e.name === "AbortError") {
        finish = "stopped";
        kept = true;
      } else if (e instanceof TypeError) {
        // fetch and stream reads fail with TypeError when the connection is lost
        showError("Lost the connection to the server (" + e.message + "). The conversation is kept: " +
                  "press Regenerate when the server is back.");
      } else {
        showError(e.message);
      }
      if (!kept && reply.content) kept = true; // keep what arrived before the failure
      if (!kept) node.remove();
    } finally {
      controller = null;
      ui.messages.setAttribute("aria-busy", "false");
      if (kept) {
        redraw();
        reply.stats = {};
        if (usage && usage.completion_tokens !== undefined) reply.stats.completion_tokens = usage.completion_tokens;
        if (firstAt !== null) {
          reply.stats.ttft_ms = firstAt - started;
          const tokens = reply.stats.completion_tokens;
          // decode speed: the tokens after the first over the time they took
          if (tokens > 1 && lastAt > firstAt) reply.stats.tokens_per_second = (tokens - 1) / ((lastAt - firstAt) / 1000);
        }
        if (finish) reply.stats.finish_reason = finish;
        c.messages.push(reply);
        c.updated = Date.now();
        save();
        stats.textContent = statsText(reply.stats);
      }
      drawButtons();
      ui.prompt.focus();
    }
  }

  // ---- actions ---------------------------------------------------------------------------

  function send() {
    if (controller) return;
    const text = ui.prompt.value;
    if (!text.trim()) return;
    const c = current();
    c.messages.push({ role: "user", content: text });
    if (c.title === "New conversation") c.title = text.trim().split("\n")[0].slice(0, 40);
    c.updated = Date.now();
    ui.prompt.value = "";
    save();
    drawList();
    drawMessages();
    generate();
  }

  function stop() {
    if (controller) controller.abort();
  }

  function regenerate() {
    if (controller) return;
    const c = current();
    if (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
    if (!c.messages.length) return;
    save();
    drawMessages();
    generate();
  }

  function editLast() {
    if (controller) return;
    const c = current();
    let i = c.messages.length - 1;
    while (i >= 0 && c.messages[i].role !== "user") i -= 1;
    if (i < 0) return;
    ui.prompt.value = c.messages[i].content;
    c.messages.splice(i);
    save();
    draw();
    ui.prompt.focus();
  }

  function exportConversations() {
    const data = JSON.stringify({ format: EXPORT_FORMAT, version: 1, conversations: conversations }, null, 2);
    const link = document.createElement("a");
    link.href = URL.createObjectURL(new Blob([data], { type: "application/json" }));
    link.download = "mlx-ferrum-conversations.json";
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(function () { URL.revokeObjectURL(link.href); }, 1000);
  }

  // The conversations of an export file's text; throws an Error saying what is wrong.
  function parseImport(text) {
    let data;
    try {
      data = JSON.parse(text);
    } catch (e) {
      throw new Error("The file is not JSON: " + e.message);
    }
    const list = Array.isArray(data) ? data : data && data.conversations;
    if (!Array.isArray(list)) throw new Error("The file holds no \"conversations\" list: export one from this page.");
    return list.map(function (c, i) {
      if (!c || !Array.isArray(c.messages)) throw new Error("Conversation " + i + " has no \"messages\" list.");
      const messages = c.messages.map(function (m, j) {
        if (!m || !ROLES.includes(m.role) || typeof m.content !== "string") {
          throw new Error("Conversation " + i + ", message " + j + ": needs a role (system, user or assistant) and a text content.");
        }
        const kept = { role: m.role, content: m.content };
        if (m.model && typeof m.model === "string") kept.model = m.model;
        if (m.stats && typeof m.stats === "object") kept.stats = m.stats;
        return kept;
      });
      return {
        id: typeof c.id === "string" ? c.id : newId(),
        title: typeof c.title === "string" && c.title ? c.title : "Imported conversation",
        system: typeof c.system === "string" ? c.system : "",
        messages: messages,
        updated: typeof c.updated === "number" ? c.updated : Date.now(),
      };
    });
  }

  async function importConversations(file) {
    try {
      const imported = parseImport(await file.text());
      for (const c of imported) {
        if (conversations.some(function (o) { return o.id === c.id; })) c.id = newId();
      }
      conversations = imported.concat(conversations.filter(function (c) { return c.messages.length; }));
      if (!conversations.length) newConversation();
      currentId = conversations[0].id;
      save();
      clearError();
      draw();
    } catch (e) {
      showError("Import failed: " + e.message);
    }
  }

  function toggle(button, panel) {
    const open = panel.hidden;
    panel.hidden = !open;
    button.setAttribute("aria-expanded", String(open));
  }

  // ---- wiring ----------------------------------------------------------------------------

  ui.composer.addEventListener("submit", function (e) { e.preventDefault(); send(); });
  ui.prompt.addEventListener("keydown", function (e) {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", function (e) {
    if (e.key === "Escape" && controller) {
      e.preventDefault();
      stop();
    }
  });
  ui.stop.addEventListener("click", stop);
  ui.regenerate.addEventListener("click", regenerate);
  ui.editLast.addEventListener("click", editLast);
  $("new-conversation").addEventListener("click", function () {
    if (controller) return;
    const c = current();
    if (!c.messages.length) return; // already an empty one
    newConversation();
    clearError();
    draw();
    ui.prompt.focus();
  });
  $("rename-conversation").addEventListener("click", function () {
    const c = current();
    const title = window.prompt("New name of this conversation", c.title);
    if (title === null || !title.trim()) return;
    c.title = title.trim();
    save();
    drawList();
  });
  $("delete-conversation").addEventListener("click", function () {
    if (controller) return;
    const c = current();
    if (!window.confirm("Delete the conversation \"" + c.title + "\"?")) return;
    conversations = conversations.filter(function (o) { return o.id !== c.id; });
    if (!conversations.length) newConversation();
    currentId = conversations[0].id;
    save();
    clearError();
    draw();
  });
  $("export-conversations").addEventListener("click", exportConversations);
  $("import-button").addEventListener("click", function () { ui.importInput.click(); });
  ui.importInput.addEventListener("change", function () {
    const file = ui.importInput.files[0];
    ui.importInput.value = "";
    if (file) importConversations(file);
  });
  ui.toggleConversations.addEventListener("click", function () {
    toggle(ui.toggleConversations, ui.sidebar);
  });
  ui.toggleSettings.addEventListener("click", function () { toggle(ui.toggleSettings, ui.settings); });
  ui.system.addEventListener("input", function () {
    current().system = ui.system.value;
    save();
  });
  for (const input of [ui.temperature, ui.topP, ui.maxTokens, ui.seed, ui.extra, ui.model]) {
    input.addEventListener("change", saveSettings);
  }
  ui.keyForm.addEventListener("submit", async function (e) {
    e.preventDefault();
    sessionStorage.setItem(STORE_KEY, ui.apiKey.value);
    ui.apiKey.value = "";
    clearError();
    await loadModels();
  });
  ui.messages.addEventListener("click", async function (e) {
    const button = e.target.closest(".copy-code");
    if (!button) return;
    const codeNode = button.closest(".code-block").querySelector("code");
    try {
      await navigator.clipboard.writeText(codeNode.textContent);
      button.textContent = "Copied";
    } catch (err) {
      // no clipboard API outside secure contexts (http to another machine): select the
      // code instead, so that Ctrl+C / Cmd+C copies it
      const range = document.createRange();
      range.selectNodeContents(codeNode);
      window.getSelection().removeAllRanges();
      window.getSelection().addRange(range);
      button.textContent = "Selected: press Ctrl+C";
    }
    setTimeout(function () { button.textContent = "Copy"; }, 1500);
  });

  // ---- start -----------------------------------------------------------------------------

  const settings = readJSON(STORE_SETTINGS, {});
  ui.temperature.value = settings.temperature || "";
  ui.topP.value = settings.top_p || "";
  ui.maxTokens.value = settings.max_tokens || "";
  ui.seed.value = settings.seed || "";
  ui.extra.value = settings.extra || "";
  const stored = readJSON(STORE_CONVERSATIONS, []);
  try {
    conversations = Array.isArray(stored) ? parseImport(JSON.stringify(stored)) : [];
  } catch (e) {
    conversations = [];
    showError("The conversations stored in this browser could not be read (" + e.message + "); starting afresh.");
  }
  currentId = localStorage.getItem(STORE_CURRENT);
  if (!current()) {
    if (!conversations.length) newConversation();
    currentId = conversations[0].id;
  }
  draw();
  if (window.matchMedia("(min-width: 700px)").matches) {
    ui.toggleConversations.setAttribute("aria-expanded", "true");
  } else {
    ui.sidebar.hidden = true;
  }
  // for tests: the promise of the first model listing, and whether a reply is streaming
  window.ferrumChat = { ready: loadModels(), busy: function () { return controller !== null; } };
  ui.prompt.focus();
})();
