// ocrstream web page: a task's answer (docs/tasks.md) as DOM nodes, safely. Nothing the model wrote is
// ever parsed into this page as HTML: text goes in as text nodes (textContent), Markdown is read by the
// small subset below (headings, paragraphs, lists, bold, inline code, code blocks, pipe tables), and the
// model's HTML tables are read by a small tokenizer here (never by the browser's HTML parser) and built
// from an allow-list: table, thead, tbody, tr, th, td, br, and colspan/rowspan as numbers up to 100.
// Everything else is dropped (script and style with their content; other tags keep their text).
"use strict";

(() => {  // nothing here is global but window.ocrRender (app.js has functions of its own names)
const TABLE_TAGS = new Set(["table", "thead", "tbody", "tr", "th", "td"]);
const DROPPED = new Set(["script", "style", "template", "noscript", "iframe", "object", "title", "textarea", "xmp"]);
const MAX_SPAN = 100;
// a tag (attribute values may hold ">" or "<" inside quotes; outside them a "<" ends the try, so a
// "<" that opens no tag is text and the scan stays linear), a comment, or a run of text
const TOKEN = /<!--[\s\S]*?(?:-->|$)|<(\/?)([a-zA-Z][a-zA-Z0-9-]*)((?:[^<>"']|"[^"]*"|'[^']*')*)>|[^<]+|</g;
const FENCE = /^\s*(```|~~~)\s*([\w+-]*)\s*$/;  // a fenced code block's opening line
const ENTITIES = { amp: "&", lt: "<", gt: ">", quot: "\"", apos: "'", nbsp: "\u00a0" };

/** Whether text[at] is backslash-escaped (an odd run of backslashes before it). */
function escaped(text, at) {
  let n = 0;
  while (at - n - 1 >= 0 && text[at - n - 1] === "\\") n++;
  return n % 2 === 1;
}

function el(tag, text) {
  const node = document.createElement(tag);
  if (text != null) node.textContent = text;
  return node;
}

/** Character references of HTML text: the named ones above and numeric ones; others stay as written. */
function decode(text) {
  return text.replace(/&(#[xX][0-9a-fA-F]{1,6}|#[0-9]{1,7}|[a-zA-Z]{2,8});/g, (whole, ref) => {
    if (ref[0] !== "#") return ENTITIES[ref.toLowerCase()] ?? whole;
    const code = ref[1] === "x" || ref[1] === "X" ? parseInt(ref.slice(2), 16) : parseInt(ref.slice(1), 10);
    return code > 0 && code <= 0x10ffff && !(code >= 0xd800 && code <= 0xdfff) ? String.fromCodePoint(code) : "\ufffd";
  });
}

/** The span attribute `name` from a tag's attribute text, as a number 2..MAX_SPAN, else null. */
function span(attrs, name) {
  const m = attrs.match(new RegExp(`(?:^|\\s)${name}\\s*=\\s*(?:["']\\s*)?(\\d+)`, "i"));  // one blank run: linear
  const n = m ? Number(m[1]) : 1;
  return n > 1 && n <= MAX_SPAN ? String(n) : null;
}

/** One model <table>...</table> (nested tables inside it) built as DOM elements by a tokenizer of
 *  our own, so the browser's HTML parser never sees the model's markup (and never compiles an
 *  event handler attribute). Only TABLE_TAGS and <br> become elements, with colspan/rowspan alone;
 *  DROPPED tags go with their content; any other tag is skipped and its text kept. */
function safeTable(html) {
  const root = document.createDocumentFragment();
  const stack = [];  // open allowed elements
  const top = () => stack[stack.length - 1];
  const open = (tag) => { const node = el(tag); (top() || root).append(node); stack.push(node); return node; };
  const closeTo = (tags) => {  // pop up to and including the nearest open element named in tags
    const at = stack.map((n) => n.localName).findLastIndex((t) => tags.includes(t));
    if (at >= 0) stack.length = at;
    return at >= 0;
  };
  let skip = null;  // inside a DROPPED element: its name
  for (const m of html.matchAll(TOKEN)) {
    const [token, closing, rawName, attrs = ""] = m;
    const name = rawName ? rawName.toLowerCase() : null;
    if (skip) { if (closing && name === skip) skip = null; continue; }
    if (token.startsWith("<!--")) continue;
    if (!name) {  // text
      const cell = stack.findLast((n) => n.localName === "td" || n.localName === "th");
      if (cell) cell.append(document.createTextNode(decode(token)));
      continue;
    }
    if (DROPPED.has(name)) { if (!closing && !/\/\s*$/.test(attrs)) skip = name; continue; }
    if (name === "br" && !closing) {
      const cell = stack.findLast((n) => n.localName === "td" || n.localName === "th");
      if (cell) cell.append(el("br"));
      continue;
    }
    if (!TABLE_TAGS.has(name)) continue;
    if (closing) {
      if (name === "table") { closeTo(["table"]); if (!stack.length) break; } else closeTo([name]);
      continue;
    }
    if (name === "table") {
      const cell = stack.findLast((n) => n.localName === "td" || n.localName === "th");
      if (stack.length && !cell) continue;  // a table not in a cell: its rows join this one
      if (cell && top() !== cell) stack.length = stack.indexOf(cell) + 1;
      open("table");
    } else if (name === "thead" || name === "tbody") {
      closeTo(["thead", "tbody"]) ; open(name);
    } else if (name === "tr") {
      const table = stack.findLast((n) => n.localName === "table");
      if (!table) continue;
      stack.length = stack.indexOf(table) + 1 + (["thead", "tbody"].includes(stack[stack.indexOf(table) + 1]?.localName) ? 1 : 0);
      if (top() === table) open("tbody");
      open("tr");
    } else {  // td, th
      const row = stack.findLast((n) => n.localName === "tr");
      if (!row) continue;
      stack.length = stack.indexOf(row) + 1;
      const cell = open(name);
      for (const a of ["colspan", "rowspan"]) { const n = span(attrs, a); if (n) cell.setAttribute(a, n); }
    }
  }
  return root.firstElementChild;
}

/** Inline Markdown: **bold**, `code` and backslash escapes (\* is a plain *: CommonMark's, as the
 *  CPU engine writes text that looks like Markdown or HTML); the rest as text. */
function inline(parent, text) {
  const re = /(\\[!-\/:-@[-`{-~]|\*\*[^*\n]+?\*\*|`[^`\n]+`)/g;
  let last = 0;
  for (const m of text.matchAll(re)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    const token = m[0];
    if (token[0] === "\\") parent.append(document.createTextNode(token[1]));
    else parent.append(token.startsWith("**") ? el("strong", token.slice(2, -2)) : el("code", token.slice(1, -1)));
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
    const fence = line.match(FENCE);
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

/** [start, end) of each fenced code block of `text` (``` or ~~~, as markdownBlocks reads them;
 *  an unclosed one runs to the end). */
function fencedRanges(text) {
  const ranges = [];
  let pos = 0;
  let open = null;  // [fence, start]
  for (const line of text.split("\n")) {
    const m = open ? null : line.match(FENCE);
    if (m) open = [m[1], pos];
    else if (open && line.trim().startsWith(open[0])) { ranges.push([open[1], pos + line.length]); open = null; }
    pos += line.length + 1;
  }
  if (open) ranges.push([open[1], text.length]);
  return ranges;
}

/** [start, end) of each outermost <table>...</table> in `text` (nested tables inside it; an
 *  unclosed one runs to the end). A <table> in a fenced code block, or escaped (\<table>: text),
 *  starts none. */
function tableSpans(text) {
  const re = /<(\/?)table\b[^<>]*>/gi;  // stops at "<" as TOKEN does: "<table" repeated is linear
  const fenced = fencedRanges(text);
  const spans = [];
  let depth = 0;
  let start = 0;
  for (const m of text.matchAll(re)) {
    if (!m[1]) {
      if (depth === 0 && (escaped(text, m.index) || fenced.some(([a, b]) => m.index >= a && m.index < b))) continue;
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
    const table = safeTable(text.slice(start, end));
    if (table) parent.append(table);
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
})();
