// The conversation: its messages, one streamed answer at a time from /v1/chat/completions, and how each
// message is drawn. Model text reaches the page only through renderMarkdown (sanitized) or textContent.

import { ApiError, ConnectionError, streamEvents } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const NOT_RUN = "(the chat page does not run tools: no result was given)";

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function formatStats(stats) {
  const parts = [];
  if (stats.completionTokens !== null) parts.push(`${stats.approx ? "~" : ""}${stats.completionTokens} tokens`);
  if (stats.tokensPerS !== null) parts.push(`${stats.tokensPerS.toFixed(1)} tok/s`);
  if (stats.ttftMs !== null) parts.push(`TTFT ${Math.round(stats.ttftMs)} ms`);
  return parts.join(" · ");
}

/** Parse a JSON settings box: null when empty, else the value (throws SyntaxError with the box's name). */
function parseJsonBox(text, name) {
  if (!text.trim()) return null;
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new SyntaxError(`${name} is not valid JSON: ${err.message}`);
  }
}

/** One streamed assistant answer: accumulates deltas and redraws its message element. */
class Answer {
  constructor(node) {
    this.node = node;
    this.content = "";
    this.reasoning = "";
    this.toolCalls = []; // [{id, type, function: {name, arguments}}] by index
    this.startedMs = performance.now();
    this.firstMs = null;
    this.lastMs = null;
    this.numDeltas = 0;
    this.usage = null;
    this.finishReason = null;
    this.drawQueued = false;
    this.closed = false;
  }

  /** Fold one chat.completion.chunk into the answer. */
  add(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      if (choice.index) continue; // n > 1 is not asked for; choice 0 only
      const delta = choice.delta || {};
      // NOTE(ui): reasoning arrives as `reasoning_content` (llama.cpp, DeepSeek) or `reasoning` (vLLM); a
      // server may send both with the same text, so one of them is read per delta.
      const thought = delta.reasoning_content ?? delta.reasoning ?? "";
      const got = Boolean(delta.content || thought || delta.tool_calls);
      if (delta.content) this.content += delta.content;
      if (thought) this.reasoning += thought;
      for (const call of delta.tool_calls || []) {
        const slot = this.toolCalls[call.index ?? 0] ??= { id: "", type: "function", function: { name: "", arguments: "" } };
        if (call.id) slot.id = call.id;
        if (call.function?.name) slot.function.name += call.function.name;
        if (call.function?.arguments) slot.function.arguments += call.function.arguments;
      }
      if (got) {
        const now = performance.now();
        this.firstMs ??= now;
        this.lastMs = now;
        this.numDeltas += 1;
      }
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
    }
    this.queueDraw();
  }

  stats() {
    const exact = this.usage?.completion_tokens;
    const tokens = exact ?? (this.numDeltas || null);
    const ttftMs = this.firstMs === null ? null : this.firstMs - this.startedMs;
    // Decode speed: the tokens after the first over the time after the first (TTFT is shown apart).
    const spanS = this.firstMs === null ? 0 : (this.lastMs - this.firstMs) / 1000;
    const tokensPerS = tokens > 1 && spanS > 0 ? (tokens - 1) / spanS : null;
    return { completionTokens: tokens, approx: exact === undefined, tokensPerS, ttftMs };
  }

  /** The answer is complete: draw it a last time; later queued draws do nothing. */
  close() {
    this.draw();
    this.closed = true;
  }

  queueDraw() {
    if (this.drawQueued || this.closed) return;
    this.drawQueued = true;
    requestAnimationFrame(() => {
      this.drawQueued = false;
      if (!this.closed) this.draw();
    });
  }

  draw() {
    const body = this.node.querySelector(".body");
    body.innerHTML = renderMarkdown(this.content);
    const fold = this.node.querySelector(".reasoning");
    fold.hidden = !this.reasoning;
    fold.querySelector(".reasoning-body").innerHTML = renderMarkdown(this.reasoning);
    drawToolCalls(this.node.querySelector(".tool-calls"), this.toolCalls);
    const stats = this.stats();
    const line = this.node.querySelector(".stats");
    line.textContent = formatStats(stats);
    line.dataset.tokens = stats.completionTokens ?? "";
    line.dataset.tokensPerS = stats.tokensPerS ?? "";
    line.dataset.ttftMs = stats.ttftMs ?? "";
  }

  /** The assistant message for the history (content, and tool calls when the model made some). */
  message() {
    const message = { role: "assistant", content: this.content };
    const calls = this.toolCalls.filter(Boolean);
    if (calls.length) message.tool_calls = calls;
    return message;
  }
}

function drawToolCalls(box, calls) {
  box.replaceChildren();
  for (const call of calls.filter(Boolean)) {
    const card = el("div", "tool-call");
    card.append(el("span", "tool-label", "tool call"), el("span", "tool-name", call.function.name || "…"));
    let args = call.function.arguments;
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      // still streaming, or not JSON: show as sent
    }
    const pre = el("pre", "tool-args");
    pre.append(el("code", "", args));
    card.append(pre);
    box.append(card);
  }
}

export class Chat {
  /**
   * @param {object} ui elements: messages, prompt, send, stop, contextUsed
   * @param {() => object} readSettings the settings panel's values: system, temperature, maxTokens, tools, extra
   * @param {() => string} modelName
   * @param {() => Promise<boolean>} onUnauthorized asks for the key; true once one is given (retry)
   */
  constructor(ui, readSettings, modelName, onUnauthorized) {
    this.ui = ui;
    this.readSettings = readSettings;
    this.modelName = modelName;
    this.onUnauthorized = onUnauthorized;
    this.history = []; // the OpenAI messages sent so far, without the system prompt
    this.controller = null;
    this.maxModelLen = null;
  }

  get busy() {
    return this.controller !== null;
  }

  setMaxModelLen(value) {
    this.maxModelLen = value;
    this.showContext(null);
  }

  showContext(usage) {
    const node = this.ui.contextUsed;
    const used = usage ? usage.prompt_tokens + usage.completion_tokens : 0;
    node.dataset.used = usage ? String(used) : "";
    node.textContent = `context ${usage ? used : 0}${this.maxModelLen ? ` / ${this.maxModelLen}` : ""} tokens`;
  }

  newChat() {
    this.stop();
    this.history = [];
    this.ui.messages.replaceChildren();
    this.showContext(null);
    this.ui.prompt.focus();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  showError(text) {
    const node = el("div", "msg error", text);
    node.setAttribute("role", "alert");
    this.ui.messages.append(node);
    node.scrollIntoView({ block: "end" });
  }

  addUserMessage(text) {
    const node = el("div", "msg user");
    node.append(el("div", "role", "You"), el("div", "body", text));
    this.ui.messages.append(node);
    return node;
  }

  addAnswerNode() {
    const node = el("div", "msg assistant");
    node.dataset.state = "waiting";
    const fold = el("details", "reasoning");
    fold.hidden = true;
    fold.append(el("summary", "", "Thinking"), el("div", "reasoning-body md"));
    node.append(el("div", "role", "Assistant"), fold, el("div", "body md"), el("div", "tool-calls"),
      el("div", "stats"));
    this.ui.messages.append(node);
    return node;
  }

  /** Build the request body from the history and the settings panel (throws SyntaxError on bad JSON). */
  requestBody(settings) {
    const messages = settings.system.trim() ? [{ role: "system", content: settings.system }] : [];
    messages.push(...this.history);
    const body = {
      model: this.modelName(),
      messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    if (settings.temperature !== "") body.temperature = Number(settings.temperature);
    if (settings.maxTokens !== "") body.max_tokens = Number(settings.maxTokens);
    const tools = parseJsonBox(settings.tools, "Tools");
    if (tools) body.tools = tools;
    const extra = parseJsonBox(settings.extra, "Extra request fields");
    if (extra !== null && (typeof extra !== "object" || Array.isArray(extra))) {
      throw new SyntaxError("Extra request fields must be a JSON object");
    }
    return { ...body, ...(extra || {}) };
  }

  /** Send the text in the prompt box (after tool results typed into unanswered calls, if any). */
  async send() {
    const text = this.ui.prompt.value;
    if (this.busy || (!text.trim() && !this.pendingToolCalls().length)) return;
    this.answerToolCalls();
    this.lastUserNode = null;
    if (text.trim()) {
      this.history.push({ role: "user", content: text });
      this.lastUserNode = this.addUserMessage(text);
    }
    this.ui.prompt.value = "";
    await this.run(text);
  }

  pendingToolCalls() {
    const last = this.history[this.history.length - 1];
    return last?.role === "assistant" && last.tool_calls ? last.tool_calls : [];
  }

  /** Follow an assistant turn's tool calls with one tool message each (from the call cards' result boxes). */
  answerToolCalls() {
    const calls = this.pendingToolCalls();
    const boxes = [...this.ui.messages.querySelectorAll(".msg.assistant:last-of-type .tool-result")];
    calls.forEach((call, i) => {
      const result = boxes[i]?.value.trim() || NOT_RUN;
      this.history.push({ role: "tool", tool_call_id: call.id, content: result });
      if (boxes[i]) boxes[i].disabled = true;
    });
  }

  async run(userText, retried = false) {
    let body;
    try {
      body = this.requestBody(this.readSettings());
    } catch (err) {
      this.unsend(userText);
      this.showError(err.message);
      return;
    }
    const node = this.addAnswerNode();
    const answer = new Answer(node);
    this.controller = new AbortController();
    this.setBusy(true);
    let outcome = "done";
    try {
      for await (const chunk of streamEvents("/v1/chat/completions", body, this.controller.signal)) {
        if (node.dataset.state === "waiting") node.dataset.state = "streaming";
        answer.add(chunk);
      }
    } catch (err) {
      outcome = this.failed(err, answer);
    } finally {
      this.controller = null;
      this.setBusy(false);
    }
    if (outcome === "unauthorized") {
      node.remove();
      // The key dialog; once a key is given the same request goes again (once).
      if (!retried && await this.onUnauthorized()) {
        await this.run(userText, true);
        return;
      }
      this.showError("The server needs an API key: none was given, or it was refused.");
      outcome = "unanswered";
    }
    if (outcome === "unanswered") {
      node.remove();
      this.unsend(userText);
      return;
    }
    answer.close();
    this.history.push(answer.message());
    if (answer.toolCalls.length) this.addToolResultBoxes(node);
    if (answer.usage) this.showContext(answer.usage);
    // Last, so that whoever waits for the state sees the finished message.
    if (outcome === "done" && answer.finishReason) node.dataset.finishReason = answer.finishReason;
    node.dataset.state = outcome;
  }

  /** Nothing came back: the question leaves the history and the view, and goes back into the prompt box. */
  unsend(userText) {
    if (!userText.trim()) return;
    this.history.pop();
    this.lastUserNode?.remove();
    this.ui.prompt.value ||= userText;
  }

  /** Show what went wrong; returns the answer's outcome: stopped, unauthorized, dropped, error or unanswered. */
  failed(err, answer) {
    if (err.name === "AbortError") return "stopped";
    const started = answer.firstMs !== null;
    if (err instanceof ApiError && err.status === 401) return "unauthorized";
    if (err instanceof ApiError) {
      this.showError(`The server answered ${err.describe()}`);
      return started ? "error" : "unanswered";
    }
    if (err instanceof ConnectionError) {
      this.showError(`Connection problem: ${err.message}`);
      return started ? "dropped" : "unanswered";
    }
    this.showError(`Unexpected error: ${err.message}`);
    return started ? "error" : "unanswered";
  }

  addToolResultBoxes(node) {
    for (const card of node.querySelectorAll(".tool-call")) {
      const input = el("input", "tool-result");
      input.placeholder = "tool result (sent with your next message)";
      card.append(input);
    }
  }

  setBusy(busy) {
    this.ui.send.hidden = busy;
    this.ui.stop.hidden = !busy;
    this.ui.prompt.disabled = false;
  }
}
