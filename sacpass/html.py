"""The partition page: one self-contained HTML file per dump (``DIR/index.html``) that draws every graph.

Forward and backward side by side, nodes grouped (collapsibly) by module path, saved tensors highlighted
with their bytes, recomputed nodes marked, must-save nodes labelled with their module path, and a search
box. No network, no external assets: CSS and JS are inline, a Content-Security-Policy allows only the page's
own script (by hash), and the data is JSON inside ``<script type="application/json">`` with ``<``, ``>`` and
``&`` escaped. The script builds the page with ``textContent``/``setAttribute`` only, so strings from user
code (node names, module paths, source lines) render as text and never run.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any

import torch.fx

from .nodes import code_line, module_path, op_name, recomputed_names, source_of, tag_name, value_text
from .report import Report

__all__ = ["graph_view", "view_from_report", "render_html", "VIEW_VERSION"]

VIEW_VERSION = 2  # 2: nodes carry "reason" (why saved) and "offload"


def _nodes(gm: torch.fx.GraphModule, saved: dict[str, tuple[int, str]], tagged: dict[str, tuple[str, str]],
           recomputed: set[str], side: str) -> list[dict[str, Any]]:
    out = []
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        is_saved = node.name in saved and (side == "forward" or node.op == "placeholder")
        tag, selector = tagged.get(node.name, ("", ""))
        out.append({
            "name": node.name,
            "op": "input" if node.op == "placeholder" else op_name(node),
            "value": value_text(node.meta.get("val")),
            "module": module_path(node),
            "source": source_of(node),
            "code": code_line(node),
            "tag": tag_name(node) or "",
            "saved_bytes": saved[node.name][0] if is_saved else None,
            "reason": saved[node.name][1] if is_saved else "",
            "must_save": tag == "MUST_SAVE",
            "offload": tag == "MUST_CPU_OFFLOAD",
            "selector": selector,
            "recomputed": node.name in recomputed,  # run in forward, run again in backward
        })
    return out


def _report_part(report: Report) -> dict[str, Any]:
    return {"graph": report.graph, "policy": report.policy, "torch_version": report.torch_version,
            "total_bytes": report.total_bytes, "saved_symints": report.saved_symints,
            "saved": [dict(s.__dict__, shape=list(s.shape)) for s in report.saved],
            "recomputed": dict(report.recomputed), "violations": list(report.violations),
            "warnings": list(report.warnings)}


def graph_view(result) -> dict[str, Any]:
    """What the page draws of one PartitionResult, as JSON-ready data (written to ``DIR/gN/graph.json``)."""
    report = result.report
    saved = {s.name: (s.bytes, s.reason) for s in report.saved}
    tagged = {t["name"]: (t["tag"], t["selector"]) for t in report.tagged
              if t["tag"] in ("MUST_SAVE", "MUST_CPU_OFFLOAD")}
    pairs = recomputed_names(result.forward, result.backward)
    recomputed = set(pairs) | set(pairs.values())      # the backward's copies and the forward nodes they repeat
    return {"kind": "sacpass.graph_view", "version": VIEW_VERSION, **_report_part(report),
            "forward": _nodes(result.forward, saved, tagged, recomputed, "forward"),
            "backward": _nodes(result.backward, saved, tagged, recomputed, "backward")}


def view_from_report(report: Report) -> dict[str, Any]:
    """A page entry for a graph whose dump has a report but no graph.json: the saved table only."""
    return {"kind": "sacpass.graph_view", "version": VIEW_VERSION, **_report_part(report),
            "forward": [], "backward": []}


def _escape_json(data: Any) -> str:
    text = json.dumps(data, sort_keys=True, ensure_ascii=False)
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_html(views: list[dict[str, Any]], *, title: str = "sacpass partition") -> str:
    """The whole page for a list of graph views (see :func:`graph_view`)."""
    script = _SCRIPT.strip()
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    csp = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{digest}'"
    safe_title = re.sub(r"[^A-Za-z0-9 _.,:()/-]", "", title)
    return (_PAGE.replace("@CSP@", csp).replace("@TITLE@", safe_title).replace("@STYLE@", _STYLE.strip())
            .replace("@DATA@", _escape_json({"graphs": views})).replace("@SCRIPT@", script))


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="@CSP@">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>@TITLE@</title>
<style>@STYLE@</style>
</head>
<body>
<header>
<h1>@TITLE@</h1>
<input id="search" type="search" placeholder="search nodes, ops, modules, source" autocomplete="off">
<button id="expand" type="button">expand all</button>
<button id="collapse" type="button">collapse all</button>
<span class="legend"><span class="badge saved">saved</span> forward output kept for backward
<span class="badge must">must-save</span> tagged by sacpass
<span class="badge discrete">discrete</span> a decision kept
<span class="badge offload">offload</span> kept in host memory
<span class="badge recomputed">recomputed</span> backward re-runs a forward op</span>
</header>
<main id="graphs"><noscript>This page draws the dump with JavaScript; the same data is in gN/report.json
and gN/graph.json.</noscript></main>
<script id="sacpass-data" type="application/json">@DATA@</script>
<script>@SCRIPT@</script>
</body>
</html>
"""

_STYLE = """
body { font: 13px/1.35 system-ui, sans-serif; margin: 0; color: #1d1d1f; background: #fafafa; }
header { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #ddd; padding: 6px 12px;
  display: flex; gap: 8px; align-items: center; flex-wrap: wrap; z-index: 1; }
header h1 { font-size: 15px; margin: 0 12px 0 0; }
#search { width: 28em; padding: 3px 6px; }
.legend { color: #555; }
section.graph { margin: 10px 12px 24px; }
section.graph h2 { font-size: 14px; margin: 6px 0; }
.policy, .summary { color: #444; font-family: ui-monospace, monospace; font-size: 12px; }
table.saved { border-collapse: collapse; margin: 6px 0; font-family: ui-monospace, monospace; font-size: 12px; }
table.saved td, table.saved th { border: 1px solid #ddd; padding: 1px 6px; text-align: left; }
tr.must-save td { background: #fff1c7; } tr.discrete td { background: #efe3ff; }
tr.offload td { background: #dcecff; }
.sides { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
.side { min-width: 0; }
.side h3 { font-size: 13px; margin: 4px 0; }
details.group { border: 1px solid #e3e3e3; border-radius: 4px; margin: 3px 0; background: #fff; }
details.group > summary { cursor: pointer; padding: 2px 6px; font-family: ui-monospace, monospace; }
.node { font-family: ui-monospace, monospace; font-size: 12px; padding: 1px 8px; border-top: 1px solid #f2f2f2;
  white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.node .op { color: #555; } .node .value { color: #888; } .node .code { color: #777; display: block;
  white-space: pre-wrap; overflow-wrap: anywhere; padding-left: 2em; }
.node.saved { background: #e3f4e3; } .node.recomputed { background: #fde8e8; }
.node.must-save { outline: 2px solid #e0a800; outline-offset: -2px; }
.node.offload { background: #dcecff; outline: 2px dashed #2f6fd0; outline-offset: -2px; }
.node.discrete { outline-color: #7d3cc8; }
.badge { display: inline-block; border-radius: 3px; padding: 0 4px; margin-left: 4px; font-size: 11px; }
.badge.saved { background: #3a8f3a; color: #fff; } .badge.must { background: #e0a800; color: #000; }
.badge.recomputed { background: #c83a3a; color: #fff; }
.badge.offload { background: #2f6fd0; color: #fff; } .badge.discrete { background: #7d3cc8; color: #fff; } .badge.count { background: #eee; color: #333; }
.hidden { display: none !important; }
.violations { color: #b00; }
"""

_SCRIPT = r"""
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("sacpass-data").textContent);
  const root = document.getElementById("graphs");

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0, v = n;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? String(v) : v.toFixed(2)) + " " + units[i];
  }
  function badge(cls, text) { return el("span", "badge " + cls, text); }

  function nodeRow(g, side, n) {
    const row = el("div", "node");
    row.setAttribute("data-graph", g.graph);
    row.setAttribute("data-side", side);
    row.setAttribute("data-name", n.name);
    row.setAttribute("data-saved", n.saved_bytes === null ? "" : String(n.saved_bytes));
    row.setAttribute("data-must-save", n.must_save ? "1" : "0");
    row.setAttribute("data-recomputed", n.recomputed ? "1" : "0");
    if (n.saved_bytes !== null) row.classList.add(n.reason === "offload" ? "offload" : "saved");
    if (n.must_save) row.classList.add("must-save");
    if (n.offload) row.classList.add("offload");
    if (n.reason === "discrete") row.classList.add("discrete");
    if (n.recomputed) row.classList.add("recomputed");
    row.appendChild(el("span", "name", n.name));
    row.appendChild(document.createTextNode(" = "));
    row.appendChild(el("span", "op", n.op));
    if (n.value) { row.appendChild(document.createTextNode(" ")); row.appendChild(el("span", "value", n.value)); }
    if (n.saved_bytes !== null) {
      if (n.reason === "offload") row.appendChild(badge("offload", "offloaded " + bytes(n.saved_bytes) + " to host"));
      else row.appendChild(badge("saved", "saved " + bytes(n.saved_bytes) + (n.reason ? " \u00b7 " + n.reason : "")));
    }
    if (n.reason === "discrete") row.appendChild(badge("discrete", "discrete decision"));
    if (n.must_save) row.appendChild(badge("must", "must-save \u00b7 " + (n.module || "<root>")));
    if (n.offload) row.appendChild(badge("offload", "offload \u00b7 " + (n.module || "<root>")));
    if (n.recomputed) row.appendChild(badge("recomputed", side === "forward" ? "recomputed in backward" : "recomputed"));
    if (n.tag && n.tag !== "PREFER_RECOMPUTE") row.appendChild(badge("count", n.tag));
    if ((n.must_save || n.offload) && (n.code || n.source)) {
      row.appendChild(el("span", "code", (n.source ? n.source + "  " : "") + n.code));
    }
    row.title = [n.module || "<root>", n.source, n.code].filter(Boolean).join("  |  ");
    row.setAttribute("data-search", [n.name, n.op, n.value, n.module, n.source, n.code, n.selector]
      .join(" ").toLowerCase());
    return row;
  }

  function sideColumn(g, side) {
    const col = el("div", "side " + side);
    const nodes = g[side] || [];
    col.appendChild(el("h3", null, side + " (" + nodes.length + " nodes)"));
    const groups = new Map();
    for (const n of nodes) {
      const key = n.module || "<root>";
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(n);
    }
    for (const [module, members] of groups) {
      const det = el("details", "group");
      det.setAttribute("data-module", module);
      const sum = el("summary", null, module);
      const nSaved = members.filter(n => n.saved_bytes !== null).length;
      const nMust = members.filter(n => n.must_save || n.offload).length;
      const nRec = members.filter(n => n.recomputed).length;
      sum.appendChild(badge("count", members.length + " nodes"));
      if (nSaved) sum.appendChild(badge("saved", nSaved + " saved"));
      if (nMust) sum.appendChild(badge("must", nMust + " must-save"));
      if (nRec) sum.appendChild(badge("recomputed", nRec + " recomputed"));
      det.appendChild(sum);
      for (const n of members) det.appendChild(nodeRow(g, side, n));
      det.open = nMust > 0 || (groups.size <= 3);
      col.appendChild(det);
    }
    return col;
  }

  function savedTable(g) {
    const t = el("table", "saved");
    const head = el("tr");
    for (const h of ["name", "dtype[shape]", "bytes", "reason", "op", "module", "source"]) head.appendChild(el("th", null, h));
    t.appendChild(head);
    for (const s of g.saved) {
      const cls = {"must-save": "must-save", "discrete": "discrete", "offload": "offload"}[s.reason] || null;
      const tr = el("tr", cls);
      tr.setAttribute("data-name", s.name);
      for (const c of [s.name, s.dtype + "[" + s.shape.join(", ") + "]", bytes(s.bytes), s.reason, s.op,
                       s.module || "<root>", s.source || "-"]) tr.appendChild(el("td", null, c));
      t.appendChild(tr);
    }
    return t;
  }

  for (const g of data.graphs) {
    const sec = el("section", "graph");
    sec.setAttribute("data-graph", g.graph);
    sec.appendChild(el("h2", null, "graph " + g.graph));
    sec.appendChild(el("div", "policy", g.policy + "   (torch " + g.torch_version + ")"));
    const rec = Object.values(g.recomputed).reduce((a, b) => a + b, 0);
    const host = g.saved.filter(s => s.reason === "offload").reduce((a, s) => a + s.bytes, 0);
    sec.appendChild(el("div", "summary", "saved " + g.saved.length + " tensors, " + bytes(g.total_bytes) +
      " (" + g.total_bytes + " bytes" + (host ? "; " + bytes(host) + " of it on the host" : "") +
      "); backward recomputes " + rec + " ops"));
    for (const v of g.violations) sec.appendChild(el("div", "violations", "violation: " + v));
    for (const w of (g.warnings || [])) sec.appendChild(el("div", "violations", "warning: " + w));
    const det = el("details");
    det.appendChild(el("summary", null, "saved set (" + g.saved.length + ")"));
    det.appendChild(savedTable(g));
    det.open = g.saved.length <= 40;
    sec.appendChild(det);
    const sides = el("div", "sides");
    sides.appendChild(sideColumn(g, "forward"));
    sides.appendChild(sideColumn(g, "backward"));
    sec.appendChild(sides);
    root.appendChild(sec);
  }

  const search = document.getElementById("search");
  search.addEventListener("input", function () {
    const q = search.value.trim().toLowerCase();
    for (const det of document.querySelectorAll("details.group")) {
      let hits = 0;
      for (const row of det.querySelectorAll(".node")) {
        const hit = !q || row.getAttribute("data-search").indexOf(q) >= 0;
        row.classList.toggle("hidden", !hit);
        hits += hit ? 1 : 0;
      }
      det.classList.toggle("hidden", hits === 0);
      if (q && hits) det.open = true;
    }
  });
  document.getElementById("expand").addEventListener("click", function () {
    for (const d of document.querySelectorAll("details")) d.open = true;
  });
  document.getElementById("collapse").addEventListener("click", function () {
    for (const d of document.querySelectorAll("details.group")) d.open = false;
  });
  document.body.setAttribute("data-rendered", String(data.graphs.length));
})();
"""
