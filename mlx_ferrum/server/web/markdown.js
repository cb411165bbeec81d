// A small Markdown renderer for model output that cannot inject markup: it builds DOM
// nodes and puts every piece of the model's text in with textContent / text nodes, so a
// <script> tag or any other HTML in the output shows as text and never runs.
// Covers what chat models write: fenced code blocks (with a Copy button), headings,
// lists, block quotes, rules, paragraphs, `code`, **bold**, *italic* and [links](http...).
// A fence still open at the end (a reply mid-stream) renders as a code block.
"use strict";

(function () {
  const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;
  const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=[^\s*])([\s\S]*?[^\s*])\*|\[([^\]\n]+)\]\(([^()\s]+)\)/g;
  const SAFE_URL = /^(https?:|mailto:)/i;

  function element(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  function appendInline(parent, text) {
    let last = 0;
    INLINE.lastIndex = 0;
    const matches = [];
    let m;
    while ((m = INLINE.exec(text)) !== null) matches.push(m);
    for (const match of matches) {
      if (match.index > last) parent.append(document.createTextNode(text.slice(last, match.index)));
      last = match.index + match[0].length;
      if (match[1] !== undefined) {
        const code = element("code");
        code.textContent = match[2];
        parent.append(code);
      } else if (match[3] !== undefined || match[4] !== undefined) {
        const strong = element("strong");
        appendInline(strong, match[3] !== undefined ? match[3] : match[4]);
        parent.append(strong);
      } else if (match[5] !== undefined) {
        const em = element("em");
        appendInline(em, match[5]);
        parent.append(em);
      } else if (SAFE_URL.test(match[7])) {
        const a = element("a");
        a.href = match[7];
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        appendInline(a, match[6]);
        parent.append(a);
      } else {
        parent.append(document.createTextNode(match[0])); // javascript: and other schemes stay text
      }
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  }

  function appendLines(parent, lines) {
    lines.forEach(function (line, i) {
      if (i > 0) parent.append(element("br"));
      appendInline(parent, line);
    });
  }

  function codeBlock(language, code) {
    const box = element("div", "code-block");
    const head = element("div", "code-head");
    const label = element("span", "code-language");
    label.textContent = language || "code";
    const copy = element("button", "copy-code");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "Copy code");
    head.append(label, copy);
    const pre = element("pre");
    const codeNode = element("code");
    codeNode.textContent = code;
    pre.append(codeNode);
    box.append(head, pre);
    return box;
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || LIST_ITEM.test(line) || QUOTE.test(line);
  }

  function renderBlocks(parent, lines) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i += 1;
      } else if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const body = [];
        i += 1;
        while (i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length)) &&
                                      lines[i].trim().replace(/[`~]/g, "") === "")) {
          body.push(lines[i]);
          i += 1;
        }
        i += 1; // the closing fence
        parent.append(codeBlock(m[2], body.join("\n")));
      } else if ((m = HEADING.exec(line))) {
        const h = element("h" + Math.min(6, m[1].length + 2)); // h3..h6: the page owns h1/h2
        appendInline(h, m[2]);
        parent.append(h);
        i += 1;
      } else if (RULE.test(line)) {
        parent.append(element("hr"));
        i += 1;
      } else if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          inner.push(m[1]);
          i += 1;
        }
        const quote = element("blockquote");
        renderBlocks(quote, inner);
        parent.append(quote);
      } else if ((m = LIST_ITEM.exec(line))) {
        const ordered = /\d/.test(m[2]);
        const list = element(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[2], 10) !== 1) list.start = parseInt(m[2], 10);
        const indent = m[1].length;
        let item = null;
        let itemLines = [];
        const flush = function () {
          if (item) {
            renderBlocks(item, itemLines);
            list.append(item);
          }
        };
        while (i < lines.length) {
          const current = lines[i];
          const im = LIST_ITEM.exec(current);
          if (im && im[1].length <= indent + 1 && /\d/.test(im[2]) === ordered) {
            flush();
            item = element("li");
            itemLines = [im[3]];
          } else if (current.trim() && (/^\s+/.test(current) || !startsBlock(current))) {
            itemLines.push(current.replace(/^\s{1,4}/, "")); // a continuation or nested list
          } else if (!current.trim() && i + 1 < lines.length && /^\s+\S/.test(lines[i + 1])) {
            itemLines.push("");
          } else {
            break;
          }
          i += 1;
        }
        flush();
        parent.append(list);
      } else {
        const para = [];
        while (i < lines.length && lines[i].trim() && (para.length === 0 || !startsBlock(lines[i]))) {
          para.push(lines[i]);
          i += 1;
        }
        const p = element("p");
        appendLines(p, para);
        parent.append(p);
      }
    }
  }

  /** The Markdown ``text`` (a string) as a DocumentFragment; no part of the text is parsed as HTML. */
  function render(text) {
    const fragment = document.createDocumentFragment();
    renderBlocks(fragment, String(text).replace(/\r\n?/g, "\n").split("\n"));
    return fragment;
  }

  /** The HTML that ``render(text)`` builds (for tests and debugging). */
  function toHTML(text) {
    const box = document.createElement("div");
    box.append(render(text));
    return box.innerHTML;
  }

  window.FerrumMarkdown = { render: render, toHTML: toHTML };
})();
