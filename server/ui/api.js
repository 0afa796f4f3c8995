// The page's HTTP client: the API key (kept in this browser's localStorage), authorized fetches, the SSE
// reader for /v1/chat/completions, and errors as one readable line. Same origin only: the page is served by
// the server it talks to.

const KEY_STORAGE = "ortserve.apiKey";

export const apiKey = {
  get: () => localStorage.getItem(KEY_STORAGE) || "",
  set: (key) => localStorage.setItem(KEY_STORAGE, key),
  clear: () => localStorage.removeItem(KEY_STORAGE),
};

/** An HTTP error answer (status, the OpenAI error body's message and code, Retry-After). */
export class ApiError extends Error {
  constructor(status, message, code, retryAfter) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }

  /** One line for the page, e.g. "429 server_overloaded: ... (retry after 1 s)". */
  describe() {
    const code = this.code ? ` ${this.code}` : "";
    const retry = this.retryAfter ? ` (retry after ${this.retryAfter} s)` : "";
    return `${this.status}${code}: ${this.message}${retry}`;
  }
}

/** The connection failed or dropped: no HTTP answer, or a stream cut before its end. */
export class ConnectionError extends Error {}

/** fetch(path) with the stored key as a Bearer token; network failures become ConnectionError. */
export async function apiFetch(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const key = apiKey.get();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  try {
    return await fetch(path, { ...init, headers });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ConnectionError(`cannot reach the server (${err.message})`);
  }
}

/** An ApiError from a non-2xx response (its OpenAI-shaped body, or the status text). */
export async function errorFrom(response) {
  let message = response.statusText || "request failed";
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || body.error.type || null;
    }
  } catch {
    // not JSON: keep the status text
  }
  return new ApiError(response.status, message, code, response.headers.get("Retry-After"));
}

/** GET a JSON document; throws ApiError or ConnectionError. */
export async function getJson(path) {
  const response = await apiFetch(path);
  if (!response.ok) throw await errorFrom(response);
  return response.json();
}

/**
 * POST `body` to `path` and yield each SSE event's parsed JSON data until `data: [DONE]`.
 *
 * Throws ApiError for a non-2xx answer or an error event inside the stream, ConnectionError when the stream
 * ends without [DONE] (the connection dropped), and AbortError when `signal` is aborted (the stop button).
 */
export async function* streamEvents(path, body, signal) {
  const response = await apiFetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorFrom(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ConnectionError(`the connection was lost mid-answer (${err.message})`);
    }
    if (chunk.done) throw new ConnectionError("the connection was lost mid-answer (the stream ended early)");
    buffer += chunk.value;
    // NOTE(ui): events end with a blank line; a partial event stays in the buffer for the next read.
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      const data = event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue; // a keep-alive comment
      if (data === "[DONE]") return;
      const parsed = JSON.parse(data);
      if (parsed.error) {
        throw new ApiError("stream", parsed.error.message || "error", parsed.error.code || parsed.error.type);
      }
      yield parsed;
    }
  }
}
