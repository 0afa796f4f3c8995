// Markdown to safe HTML for the model's text: marked (vendor/marked.umd.js) parses, every raw HTML token the
// model wrote is escaped and shown as text, and DOMPurify (vendor/purify.min.js) cleans what marked made
// (javascript: links and the like). Nothing else in the page turns model text into HTML.

const { marked: markedLib, DOMPurify } = globalThis;

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

/** `text` with the five HTML-special characters escaped. */
export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const parser = new markedLib.Marked({ gfm: true, breaks: true });
parser.use({
  renderer: {
    // NOTE(ui): raw HTML in the model's answer (block or inline) is text, never markup: `<script>` shows as
    // `<script>`. A block keeps its own paragraph.
    html(token) {
      const text = escapeHtml(token.text);
      return token.block ? `<p>${text}</p>` : text;
    },
  },
});

const PURIFY = {
  ALLOWED_TAGS: ["a", "b", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4", "h5", "h6", "hr",
    "i", "input", "li", "ol", "p", "pre", "s", "span", "strong", "table", "tbody", "td", "th", "thead", "tr",
    "ul"],
  ALLOWED_ATTR: ["href", "title", "class", "type", "checked", "disabled", "align", "start"],
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:|#)/i,
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** The sanitized HTML of `text` read as Markdown (safe to assign to innerHTML). */
export function renderMarkdown(text) {
  return DOMPurify.sanitize(parser.parse(text ?? ""), { ...PURIFY, ADD_ATTR: ["target", "rel"] });
}
