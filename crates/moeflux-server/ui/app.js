// The chat page of `moeflux serve`: talks to the server's own
// /v1/chat/completions with `stream: true` (server-sent events read from
// fetch's ReadableStream). Model output only ever enters the page as text
// nodes (textContent): the Content-Security-Policy's trusted types make
// every HTML-parsing sink throw, so a slip cannot become markup.
"use strict";

(() => {
  const STORE = {
    key: "moeflux.apiKey",
    conversation: "moeflux.conversation",
    settings: "moeflux.settings",
  };
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"), speed: $("speed"), log: $("log"), status: $("status"),
    input: $("input"), inputLabel: $("input-label"), composer: $("composer"),
    send: $("send"), stop: $("stop"), newChat: $("new-chat"),
    settingsToggle: $("settings-toggle"), settings: $("settings"),
    system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"),
    thinking: $("thinking"), tools: $("tools"), toolsError: $("tools-error"),
    forgetKey: $("forget-key"), keyForm: $("key-form"), apiKey: $("api-key"),
    keyError: $("key-error"),
  };

  // localStorage may be unavailable (disabled, full): the page then keeps
  // everything in memory only.
  function load(name, fallback) {
    try {
      const v = localStorage.getItem(name);
      return v === null ? fallback : JSON.parse(v);
    } catch {
      return fallback;
    }
  }
  function store(name, value) {
    try {
      if (value === null) localStorage.removeItem(name);
      else localStorage.setItem(name, JSON.stringify(value));
    } catch {
      // In memory only.
    }
  }

  /** The conversation in OpenAI's message form (the system prompt apart). */
  let messages = validMessages(load(STORE.conversation, []));
  let apiKey = load(STORE.key, null);
  let modelId = null;
  /** The generation in flight: its AbortController. */
  let controller = null;

  function validMessages(v) {
    const roles = ["user", "assistant", "tool"];
    return Array.isArray(v) && v.every((m) => m && roles.includes(m.role)) ? v : [];
  }

  function el(tag, className, text) {
    const e = document.createElement(tag);
    if (className) e.className = className;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ---- Text: minimal markdown (code fences, inline code), built as DOM
  // nodes from text; nothing is parsed as HTML.
  function renderText(target, text) {
    target.replaceChildren();
    const parts = text.split("```");
    parts.forEach((part, i) => {
      if (i % 2 === 1) {
        // A fenced block (still open while it streams): drop the language line.
        const nl = part.indexOf("\n");
        const code = nl >= 0 && /^[\w+.-]*$/.test(part.slice(0, nl)) ? part.slice(nl + 1) : part;
        const pre = el("pre");
        pre.append(el("code", "", code.replace(/\n$/, "")));
        target.append(pre);
        return;
      }
      // The line break after a closing fence is the block's own.
      if (i > 0) part = part.replace(/^\n/, "");
      part.split(/(`[^`\n]+`)/).forEach((piece) => {
        if (piece.length > 2 && piece.startsWith("`") && piece.endsWith("`")) {
          target.append(el("code", "", piece.slice(1, -1)));
        } else if (piece) {
          target.append(document.createTextNode(piece));
        }
      });
    });
  }

  // ---- Views of messages.
  function userView(m) {
    const root = el("div", "msg user");
    root.append(el("div", "role", "you"), el("div", "text", m.content ?? ""));
    return root;
  }

  function toolResultView(m) {
    const root = el("div", "msg tool");
    root.append(el("div", "role", `tool result${m.name ? ": " + m.name : ""}`), el("pre", "", m.content ?? ""));
    return root;
  }

  /** An assistant turn: reasoning (collapsible), text, tool calls, a note. */
  class AssistantView {
    constructor() {
      this.root = el("div", "msg assistant");
      this.reasoning = el("details", "reasoning");
      this.summary = el("summary", "", "Reasoning");
      this.reasoningText = el("div", "text");
      this.reasoning.append(this.summary, this.reasoningText);
      this.reasoning.hidden = true;
      this.userToggled = false;
      this.summary.addEventListener("click", () => { this.userToggled = true; });
      this.text = el("div", "text content");
      this.calls = el("div", "tool-calls");
      this.note = el("div", "note");
      this.root.append(el("div", "role", "assistant"), this.reasoning, this.text, this.calls, this.note);
    }

    /** Shows `turn` (see newTurn); `live` while it streams. */
    show(turn, live) {
      if (turn.reasoning) {
        this.reasoning.hidden = false;
        this.reasoningText.textContent = turn.reasoning;
        const answering = turn.content !== "" || turn.calls.length > 0;
        this.summary.textContent = live && !answering ? "Reasoning…" : "Reasoning";
        // Open while the model reasons, closed once it answers, unless the
        // reader chose.
        if (!this.userToggled) this.reasoning.open = live && !answering;
      }
      renderText(this.text, turn.content);
      this.calls.replaceChildren(...turn.calls.filter(Boolean).map((c) => {
        const box = el("div", "tool-call");
        box.append(el("span", "role", "tool call "), el("span", "name", c.function.name));
        box.append(el("pre", "", prettyArguments(c.function.arguments)));
        return box;
      }));
    }

    setNote(text, isError) {
      this.note.textContent = text;
      this.note.className = isError ? "note error" : "note";
    }
  }

  function prettyArguments(args) {
    try {
      return JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      return args; // Still streaming, or not JSON: as it came.
    }
  }

  function assistantFromMessage(m) {
    return {
      content: typeof m.content === "string" ? m.content : "",
      reasoning: m.reasoning_content ?? "",
      calls: Array.isArray(m.tool_calls) ? m.tool_calls : [],
    };
  }

  function renderConversation() {
    ui.log.replaceChildren();
    for (const m of messages) {
      if (m.role === "user") ui.log.append(userView(m));
      else if (m.role === "tool") ui.log.append(toolResultView(m));
      else {
        const v = new AssistantView();
        v.show(assistantFromMessage(m), false);
        ui.log.append(v.root);
      }
    }
    ui.log.scrollTop = ui.log.scrollHeight;
    updateComposer();
  }

  // ---- Tool calls the conversation has not answered yet: what is typed
  // next is the first one's result.
  function pendingCalls() {
    let last = -1;
    messages.forEach((m, i) => { if (m.role === "assistant") last = i; });
    if (last < 0 || !Array.isArray(messages[last].tool_calls)) return [];
    const answered = new Set(messages.slice(last + 1).filter((m) => m.role === "tool").map((m) => m.tool_call_id));
    return messages[last].tool_calls.filter((c) => !answered.has(c.id));
  }

  function updateComposer() {
    const pending = pendingCalls();
    ui.inputLabel.textContent = pending.length
      ? `Result of the tool call ${pending[0].function.name} (${pending[0].id})`
      : "Message";
  }

  // ---- Settings (kept in local storage).
  function readSettings() {
    return {
      system: ui.system.value, temperature: ui.temperature.value, maxTokens: ui.maxTokens.value,
      thinking: ui.thinking.value, tools: ui.tools.value,
    };
  }
  function applySettings(s) {
    if (!s || typeof s !== "object") return;
    for (const [k, field] of [["system", ui.system], ["temperature", ui.temperature],
      ["maxTokens", ui.maxTokens], ["thinking", ui.thinking], ["tools", ui.tools]]) {
      if (typeof s[k] === "string") field.value = s[k];
    }
  }

  /** The request's tools from the settings field; throws naming the field. */
  function parseTools(text) {
    if (!text.trim()) return undefined;
    let tools;
    try {
      tools = JSON.parse(text);
    } catch (e) {
      throw new Error(`Tools: not JSON (${e.message})`);
    }
    if (!Array.isArray(tools)) throw new Error("Tools: expected a JSON array of tools");
    return tools;
  }

  function requestBody() {
    const s = readSettings();
    const body = { messages: [], stream: true };
    if (modelId) body.model = modelId;
    if (s.system.trim()) body.messages.push({ role: "system", content: s.system });
    body.messages.push(...messages);
    if (s.temperature !== "") body.temperature = Number(s.temperature);
    if (s.maxTokens !== "") body.max_tokens = Number(s.maxTokens);
    if (s.thinking) body.chat_template_kwargs = { enable_thinking: s.thinking === "on" };
    const tools = parseTools(s.tools);
    if (tools) body.tools = tools;
    return body;
  }

  // ---- HTTP.
  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (apiKey) h.Authorization = `Bearer ${apiKey}`;
    return h;
  }

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  /** The server's error message from a failed response (OpenAI's shape). */
  async function httpError(resp) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const v = await resp.json();
      if (v && v.error && v.error.message) message = v.error.message;
    } catch {
      // Not JSON: the status line.
    }
    if (resp.status === 401) askForKey(apiKey ? "The server refused this API key." : "");
    return new HttpError(resp.status, message);
  }

  /** The `data:` payloads of an SSE body, as they arrive. */
  async function* sseData(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buf += decoder.decode(value, { stream: true });
        for (let m = /\r\n\r\n|\n\n|\r\r/.exec(buf); m; m = /\r\n\r\n|\n\n|\r\r/.exec(buf)) {
          const event = buf.slice(0, m.index);
          buf = buf.slice(m.index + m[0].length);
          const data = event.split(/\r\n|\n|\r/)
            .filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(l.startsWith("data: ") ? 6 : 5));
          if (data.length) yield data.join("\n");
        }
      }
    } finally {
      reader.releaseLock();
    }
  }

  async function connect() {
    ui.model.textContent = "connecting…";
    try {
      const resp = await fetch("/v1/models", { headers: headers(false) });
      if (!resp.ok) throw await httpError(resp);
      const v = await resp.json();
      const m = v.data && v.data[0];
      modelId = m ? m.id : null;
      ui.model.textContent = m ? `${m.id}${m.max_model_len ? ` · context ${m.max_model_len}` : ""}` : "no model";
      ui.keyForm.hidden = true;
    } catch (e) {
      ui.model.textContent = e instanceof HttpError ? `not connected: ${e.message}` : "cannot reach the server";
    }
  }

  function askForKey(error) {
    ui.keyForm.hidden = false;
    ui.keyError.textContent = error;
    ui.apiKey.focus();
  }

  // ---- One generation.
  function newTurn() {
    return { content: "", reasoning: "", calls: [], finish: null, usage: null, timings: null, pieces: 0, first: 0 };
  }

  /** Folds one stream chunk into `turn`. */
  function apply(turn, chunk) {
    if (chunk.error) throw new Error(chunk.error.message || "the server failed the request");
    for (const c of chunk.choices || []) {
      const d = c.delta || {};
      let piece = false;
      if (d.reasoning_content) { turn.reasoning += d.reasoning_content; piece = true; }
      if (d.content) { turn.content += d.content; piece = true; }
      for (const t of d.tool_calls || []) {
        const call = turn.calls[t.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } };
        if (t.id) call.id = t.id;
        if (t.function && t.function.name) call.function.name = t.function.name;
        if (t.function && t.function.arguments) call.function.arguments += t.function.arguments;
        piece = true;
      }
      if (piece) {
        turn.pieces += 1;
        if (!turn.first) turn.first = performance.now();
      }
      if (c.finish_reason) turn.finish = c.finish_reason;
    }
    if (chunk.usage) turn.usage = chunk.usage;
    if (chunk.timings) turn.timings = chunk.timings;
  }

  /** Tokens per second: the server's count and decode time once the answer
   * is complete, else streamed pieces over the time since the first. */
  function speed(turn) {
    const u = turn.usage, t = turn.timings;
    if (u && t && t.decode_ms > 0 && u.completion_tokens > 1) {
      const rate = (u.completion_tokens - 1) / (t.decode_ms / 1000);
      return `${rate.toFixed(1)} tok/s · ${u.completion_tokens} tokens`;
    }
    const secs = (performance.now() - turn.first) / 1000;
    if (turn.pieces > 1 && secs > 0) return `≈ ${((turn.pieces - 1) / secs).toFixed(1)} tok/s`;
    return "";
  }

  function assistantMessage(turn) {
    // A call cut short (stopped) has unfinished arguments: kept on screen,
    // not sent back.
    const calls = turn.calls.filter((c) => c && c.function.name && isJson(c.function.arguments));
    const m = { role: "assistant", content: turn.content || (calls.length ? null : "") };
    if (turn.reasoning) m.reasoning_content = turn.reasoning;
    if (calls.length) m.tool_calls = calls;
    return m;
  }

  function isJson(s) {
    try {
      JSON.parse(s);
      return true;
    } catch {
      return false;
    }
  }

  function setBusy(busy) {
    ui.send.hidden = busy;
    ui.stop.hidden = !busy;
    ui.newChat.disabled = busy;
    ui.log.setAttribute("aria-busy", busy ? "true" : "false");
    ui.status.textContent = busy ? "generating…" : "";
  }

  async function generate() {
    const turn = newTurn();
    const view = new AssistantView();
    ui.log.append(view.root);
    controller = new AbortController();
    setBusy(true);
    let ended = "closed";
    let error = null;
    let frame = 0;
    const paint = () => {
      frame = 0;
      const atBottom = ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 40;
      view.show(turn, true);
      ui.speed.textContent = speed(turn);
      if (atBottom) ui.log.scrollTop = ui.log.scrollHeight;
    };
    try {
      const body = requestBody();
      const resp = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!resp.ok) throw await httpError(resp);
      for await (const data of sseData(resp.body)) {
        if (data === "[DONE]") { ended = "done"; break; }
        apply(turn, JSON.parse(data));
        // At most one repaint per frame, however fast tokens come.
        if (!frame) frame = requestAnimationFrame(paint);
      }
    } catch (e) {
      if (e.name === "AbortError") ended = "stopped";
      else { ended = "error"; error = e.message; }
    }
    if (frame) cancelAnimationFrame(frame);
    controller = null;
    view.show(turn, false);
    ui.speed.textContent = speed(turn);
    const answered = turn.content || turn.reasoning || turn.calls.length;
    if (answered) messages.push(assistantMessage(turn));
    if (ended === "stopped") view.setNote("stopped", false);
    else if (ended === "error") view.setNote(error, true);
    else if (ended === "closed") view.setNote("the connection closed before the answer ended", true);
    else if (turn.finish === "length") view.setNote("stopped at the token limit", false);
    if (!answered && ended !== "stopped") {
      // Nothing to keep: the turn's view goes, its error stays in the status.
      view.root.remove();
    }
    store(STORE.conversation, messages);
    setBusy(false);
    if (!answered && ended === "error") ui.status.textContent = `error: ${error}`;
    updateComposer();
    ui.input.focus();
  }

  function submit() {
    if (controller) return;
    const text = ui.input.value;
    if (!text.trim()) return;
    const pending = pendingCalls();
    let m;
    if (pending.length) {
      const call = pending[0];
      m = { role: "tool", tool_call_id: call.id, name: call.function.name, content: text };
    } else {
      m = { role: "user", content: text };
    }
    messages.push(m);
    ui.log.append(m.role === "user" ? userView(m) : toolResultView(m));
    ui.log.scrollTop = ui.log.scrollHeight;
    ui.input.value = "";
    store(STORE.conversation, messages);
    // Every pending call's result goes in before the model is asked again.
    if (pending.length > 1) {
      updateComposer();
      return;
    }
    generate();
  }

  // ---- Events.
  ui.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  ui.input.addEventListener("keydown", (e) => {
    // Enter sends, Shift+Enter is a new line; an IME composing text keeps Enter.
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && controller) controller.abort();
  });
  ui.stop.addEventListener("click", () => {
    if (controller) controller.abort();
  });
  ui.newChat.addEventListener("click", () => {
    if (controller) return;
    messages = [];
    store(STORE.conversation, messages);
    ui.speed.textContent = "";
    ui.status.textContent = "";
    renderConversation();
    ui.input.focus();
  });
  ui.settingsToggle.addEventListener("click", () => {
    ui.settings.hidden = !ui.settings.hidden;
    ui.settingsToggle.setAttribute("aria-expanded", String(!ui.settings.hidden));
  });
  ui.settings.addEventListener("input", () => {
    store(STORE.settings, readSettings());
    try {
      parseTools(ui.tools.value);
      ui.toolsError.textContent = "";
    } catch (e) {
      ui.toolsError.textContent = e.message;
    }
  });
  ui.forgetKey.addEventListener("click", () => {
    apiKey = null;
    store(STORE.key, null);
    connect();
  });
  ui.keyForm.addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = ui.apiKey.value.trim();
    ui.apiKey.value = "";
    store(STORE.key, apiKey);
    connect();
  });

  applySettings(load(STORE.settings, null));
  renderConversation();
  connect();
  ui.input.focus();
})();
