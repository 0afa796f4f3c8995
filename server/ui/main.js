// The page's wiring: the model's name and context length (a picker of the chat models, loaded ones marked, where
// the server serves several), the settings panel (kept in localStorage), the API-key dialog, the chat/status tabs
// and the keyboard.

import { apiKey, ApiError, getJson } from "./api.js";
import { Chat } from "./chat.js";
import { Status } from "./status.js";

const SETTINGS_STORAGE = "ortserve.settings";
const $ = (id) => document.getElementById(id);

const settingsFields = {
  system: $("system-prompt"), temperature: $("temperature"), maxTokens: $("max-tokens"),
  tools: $("tools"), extra: $("extra"),
};

function readSettings() {
  return Object.fromEntries(Object.entries(settingsFields).map(([name, field]) => [name, field.value]));
}

function restoreSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
  } catch {
    // a damaged entry: start from the defaults
  }
  for (const [name, field] of Object.entries(settingsFields)) {
    if (typeof saved[name] === "string") field.value = saved[name];
    field.addEventListener("change", () => localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(readSettings())));
  }
}

/** Show the key dialog; resolves true once a key is saved, false if the user cancels. */
function askForKey(message) {
  const dialog = $("key-dialog");
  $("key-message").textContent = message;
  $("key-input").value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const key = $("key-input").value.trim();
      if (dialog.returnValue === "save" && key) {
        apiKey.set(key);
        resolve(true);
      } else {
        resolve(false);
      }
    }, { once: true });
  });
}

const MODEL_STORAGE = "ortserve.model";
const MODELS_POLL_MS = 3000; // how often the picker re-reads which models are loaded

let modelName = "";
let shownModels = ""; // the picker's contents as last drawn (ids and loaded marks)
let shownMaxModelLen;
let lastModels = []; // /v1/models' data as last read

/**
 * Show /v1/models: the chat models (embedding models cannot chat) in the picker, loaded ones marked, the chosen one
 * selected (the last one picked in this browser, else the server's default, its first); a one-model server shows
 * its name alone. The context length is the chosen model's (unknown until it is loaded).
 */
function showModels(chat, data) {
  lastModels = data;
  let cards = data.filter((card) => card.kind !== "embedding");
  if (!cards.length) cards = data.slice(0, 1);
  if (!cards.some((card) => card.id === modelName)) {
    const saved = localStorage.getItem(MODEL_STORAGE);
    modelName = (cards.find((card) => card.id === saved) ?? cards[0]).id;
  }
  const picker = $("model-picker");
  const drawn = JSON.stringify(cards.map((card) => [card.id, Boolean(card.loaded)]));
  if (drawn !== shownModels) { // NOTE(ui): redrawn only on a change, so an open drop-down is not reset
    picker.replaceChildren(...cards.map((card) => {
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.loaded ? `${card.id} (loaded)` : card.id;
      option.dataset.loaded = String(Boolean(card.loaded));
      return option;
    }));
    shownModels = drawn;
  }
  picker.value = modelName;
  picker.hidden = cards.length < 2;
  $("model-name").hidden = !picker.hidden;
  $("model-name").textContent = modelName;
  const maxModelLen = cards.find((card) => card.id === modelName)?.max_model_len ?? null;
  if (maxModelLen !== shownMaxModelLen) {
    shownMaxModelLen = maxModelLen;
    chat.setMaxModelLen(maxModelLen);
  }
}

/** Re-read /v1/models every MODELS_POLL_MS (the loaded marks change as models load and idle out). */
function pollModels(chat) {
  setInterval(async () => {
    try {
      showModels(chat, (await getJson("/v1/models")).data);
    } catch {
      // the status view and the next request say what is wrong
    }
  }, MODELS_POLL_MS);
}

/** /v1/models: the served names and context length; asks for the key while the server refuses it. */
async function loadModel(chat) {
  for (;;) {
    try {
      const models = await getJson("/v1/models");
      showModels(chat, models.data);
      $("forget-key").hidden = !apiKey.get();
      pollModels(chat);
      return;
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) {
        const message = apiKey.get() ? "The server refused this API key. Enter another:"
          : "This server needs an API key (ortserve serve --api-key). It is kept in this browser only.";
        if (await askForKey(message)) continue;
        $("model-name").textContent = "no API key";
        return;
      }
      $("model-name").textContent = "server unavailable";
      chat.showError(`Cannot read /v1/models: ${err.describe ? err.describe() : err.message}`);
      return;
    }
  }
}

function showView(name, status) {
  for (const view of ["chat", "status"]) {
    $(`${view}-view`).hidden = view !== name;
    $(`tab-${view}`).classList.toggle("active", view === name);
    $(`tab-${view}`).setAttribute("aria-selected", String(view === name));
  }
  if (name === "status") status.resize();
}

function main() {
  restoreSettings();
  const chat = new Chat(
    { messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"), contextUsed: $("context-used") },
    readSettings, () => modelName,
    () => askForKey(apiKey.get() ? "The server refused this API key. Enter another:"
      : "This server needs an API key. It is kept in this browser only."),
  );
  const status = new Status({
    running: $("stat-running"), waiting: $("stat-waiting"), kv: $("stat-kv"), kvLabel: $("stat-kv-label"),
    tps: $("stat-tps"), requestsChart: $("chart-requests"), speedChart: $("chart-speed"), error: $("status-error"),
  });

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    chat.send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      chat.send();
    }
  });
  $("stop").addEventListener("click", () => chat.stop());
  $("model-picker").addEventListener("change", (event) => {
    modelName = event.target.value;
    localStorage.setItem(MODEL_STORAGE, modelName);
    showModels(chat, lastModels);
  });
  $("new-chat").addEventListener("click", () => chat.newChat());
  $("tab-chat").addEventListener("click", () => showView("chat", status));
  $("tab-status").addEventListener("click", () => showView("status", status));
  $("forget-key").addEventListener("click", () => {
    apiKey.clear();
    $("forget-key").hidden = true;
  });
  window.addEventListener("resize", () => status.resize());

  showView(location.hash === "#status" ? "status" : "chat", status);
  status.start();
  loadModel(chat);
}

main();
