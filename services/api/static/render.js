// ocrstream web page: a task's answer (docs/tasks.md) as DOM nodes, safely. Nothing the model wrote is
// ever parsed into this page as HTML: text goes in as text nodes (textContent), Markdown is read by the
// small subset below (headings, paragraphs, lists, bold, inline code, code blocks, pipe tables), and the
// model's HTML tables are parsed in an inert document (DOMParser runs no script, loads nothing) and
// rebuilt here from an allow-list: table, thead, tbody, tr, th, td, and colspan/rowspan as numbers.
// Everything else is dropped (script and style with their content; other tags keep their text).
"use strict";

const TABLE_TAGS = new Set(["TABLE", "THEAD", "TBODY", "TR", "TH", "TD"]);
const DROPPED = new Set(["SCRIPT", "STYLE", "TEMPLATE", "NOSCRIPT", "IFRAME", "OBJECT", "TITLE", "HEAD"]);
const MAX_SPAN = 100;

function el(tag, text) {
  const node = document.createElement(tag);
  if (text != null) node.textContent = text;
  return node;
}

/** Copy what is allowed of `src` (a node of the inert document) under `dst` (a node of this page). */
function copySafe(src, dst) {
  for (const child of src.childNodes) {
    if (child.nodeType === Node.TEXT_NODE) {
      dst.append(document.createTextNode(child.data));
    } else if (child.nodeType === Node.ELEMENT_NODE) {
      const tag = child.tagName;
      if (DROPPED.has(tag)) continue;
      if (tag === "BR") { dst.append(el("br")); continue; }
      if (!TABLE_TAGS.has(tag)) { copySafe(child, dst); continue; }  // its text, not the tag
      const copy = el(tag.toLowerCase());
      for (const name of ["colspan", "rowspan"]) {
        const n = Number.parseInt(child.getAttribute(name) || "", 10);
        if ((tag === "TD" || tag === "TH") && n > 1 && n <= MAX_SPAN) copy.setAttribute(name, String(n));
      }
      copySafe(child, copy);
      dst.append(copy);
    }
  }
}

/** The `<table>` elements of a piece of model HTML, rebuilt from the allow-list. */
function safeTables(html) {
  const inert = new DOMParser().parseFromString(`<body>${html}</body>`, "text/html");
  const out = [];
  for (const table of inert.body.querySelectorAll("table")) {
    if (table.parentElement && table.parentElement.closest("table")) continue;  // nested: its text goes in the cell
    const holder = document.createDocumentFragment();
    copySafe({ childNodes: [table] }, holder);
    out.push(holder.firstElementChild);
  }
  return out;
}

/** Inline Markdown: **bold** and `code`; the rest as text. */
function inline(parent, text) {
  const re = /(\*\*[^*\n]+?\*\*|`[^`\n]+`)/g;
  let last = 0;
  for (const m of text.matchAll(re)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    const token = m[0];
    parent.append(token.startsWith("**") ? el("strong", token.slice(2, -2)) : el("code", token.slice(1, -1)));
    last = m.index + token.length;
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  return parent;
}

const cellsOf = (line) => line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());

function pipeTable(lines) {
  const table = el("table");
  const head = el("thead");
  const tr = el("tr");
  for (const c of cellsOf(lines[0])) tr.append(inline(el("th"), c));
  head.append(tr);
  const body = el("tbody");
  for (const line of lines.slice(2)) {
    const row = el("tr");
    for (const c of cellsOf(line)) row.append(inline(el("td"), c));
    body.append(row);
  }
  table.append(head, body);
  return table;
}

/** Markdown text without HTML tables, block by block, appended to `parent`. */
function markdownBlocks(parent, text) {
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  const para = [];
  const flush = () => {
    if (para.length) parent.append(inline(el("p"), para.join(" ")));
    para.length = 0;
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([\w+-]*)\s*$/);
    if (fence) {
      flush();
      const code = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) code.push(lines[i]);
      i++;
      const pre = el("pre");
      const c = el("code", code.join("\n"));
      if (fence[2]) c.dataset.lang = fence[2];
      pre.append(c);
      parent.append(pre);
      continue;
    }
    const heading = line.match(/^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/);
    if (heading) { flush(); parent.append(inline(el(`h${Math.min(6, heading[1].length + 3)}`), heading[2])); i++; continue; }
    if (/^\s*\|.*\|\s*$/.test(line) && i + 1 < lines.length && /^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$/.test(lines[i + 1])) {
      flush();
      const rows = [line, lines[i + 1]];
      for (i += 2; i < lines.length && /^\s*\|.*\|\s*$/.test(lines[i]); i++) rows.push(lines[i]);
      parent.append(pipeTable(rows));
      continue;
    }
    const item = line.match(/^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/);
    if (item) {
      flush();
      const ordered = /\d/.test(item[1]);
      const list = el(ordered ? "ol" : "ul");
      while (i < lines.length) {
        const m = lines[i].match(/^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/);
        if (!m || /\d/.test(m[1]) !== ordered) break;
        list.append(inline(el("li"), m[2]));
        i++;
      }
      parent.append(list);
      continue;
    }
    if (!line.trim()) flush(); else para.push(line.trim());
    i++;
  }
  flush();
}

/** [start, end) of each outermost <table>...</table> in `text` (nested tables inside it; an
 *  unclosed one runs to the end). */
function tableSpans(text) {
  const re = /<(\/?)table\b[^>]*>/gi;
  const spans = [];
  let depth = 0;
  let start = 0;
  for (const m of text.matchAll(re)) {
    if (!m[1]) {
      if (depth++ === 0) start = m.index;
    } else if (depth > 0 && --depth === 0) {
      spans.push([start, m.index + m[0].length]);
    }
  }
  if (depth > 0) spans.push([start, text.length]);
  return spans;
}

/** Markdown whose tables may be HTML (HunyuanOCR's doc_parse), appended to `parent`. */
function renderMarkdown(parent, text) {
  let last = 0;
  for (const [start, end] of tableSpans(text)) {
    markdownBlocks(parent, text.slice(last, start));
    for (const t of safeTables(text.slice(start, end))) parent.append(t);
    last = end;
  }
  markdownBlocks(parent, text.slice(last));
  return parent;
}

/** extract's fields as a two-column table; a field not on the image shows an em dash. */
function fieldsTable(fields) {
  const table = el("table");
  table.className = "fields";
  const head = el("thead");
  const tr = el("tr");
  tr.append(el("th", "field"), el("th", "value"));
  head.append(tr);
  const body = el("tbody");
  for (const [name, value] of Object.entries(fields)) {
    const row = el("tr");
    const v = el("td", value == null ? "—" : String(value));
    if (value == null) { v.className = "absent"; v.title = "not on the image"; }
    row.append(el("th", name), v);
    body.append(row);
  }
  table.append(head, body);
  return table;
}

/** The answer of a result document of a task other than ocr, into `box` (emptied first). Returns the
 *  slot shown: markdown, html, latex, fields, translation, or null when the document has none. */
function renderAnswer(box, doc) {
  box.replaceChildren();
  if (doc.fields != null) { box.append(fieldsTable(doc.fields)); return "fields"; }
  if (doc.markdown != null) { renderMarkdown(box, doc.markdown); return "markdown"; }
  if (doc.html != null) { renderMarkdown(box, doc.html); return "html"; }
  if (doc.latex != null) {
    const pre = el("pre");
    pre.append(el("code", doc.latex));
    box.append(pre);
    return "latex";
  }
  if (doc.translation != null) { box.append(el("p", doc.translation)); box.lastChild.className = "translation"; return "translation"; }
  return null;
}

window.ocrRender = { renderAnswer };
