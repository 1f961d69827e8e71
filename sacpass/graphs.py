"""Normalised graph text: the forward and backward graphs of a partition, printed the same way on every run.

Built on PyTorch's own printers: ``GraphModule.print_readable`` prints each graph, and
``torch._dynamo.testing.normalize_gm`` strips its comments (file paths, line numbers, process-global
``ac_graph_id``s) and trailing blanks. On top of that, :func:`graph_text`

- abstracts devices (``device(type='cuda', index=0)`` -> ``device(type='DEVICE')``) and addresses,
- renames hash-derived size symbols by first appearance (``s77`` -> ``s0``, ``u12`` -> ``u0``),
- marks every node the partition tagged MUST_SAVE / MUST_RECOMPUTE, with region ids renumbered from 0,
- appends the saved-set table of the :class:`~sacpass.report.Report` (source file names, no paths or lines).

The result is what golden tests compare (:func:`sacpass.testing.assert_graphs_match`).
"""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx

from .nodes import tag_name
from .report import Report, saved_table as _saved_rows

__all__ = ["readable", "normalized_graph", "saved_table", "graph_text", "report_text", "stable_symbols", "SymbolRenamer",
           "module_of_source"]

_DEVICE = re.compile(r"device\(type='[A-Za-z0-9_]+'(?:, index=\d+)?\)")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")
_SYMBOL = re.compile(r"(?<![A-Za-z0-9_])([su])(\d+)(?![A-Za-z0-9_\[])")  # not a dtype like "u8[4]"
_NODE_LINE = re.compile(r"^(\s+)([A-Za-z_][A-Za-z0-9_]*)(?::| =)")
_SOURCE_LINE = re.compile(r":\d+$")


def readable(gm: torch.fx.GraphModule) -> str:
    """``print_readable`` without strides or devices (the raw form the dumps keep beside the normalised one)."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


_PRINTED_TAGS = ("MUST_SAVE", "MUST_RECOMPUTE", "MUST_CPU_OFFLOAD")


def _tag_of(node: torch.fx.Node) -> str | None:
    name = tag_name(node)
    return name if name in _PRINTED_TAGS else None


def normalized_graph(gm: torch.fx.GraphModule, region_ids: dict[Any, int] | None = None) -> str:
    """One graph as stable text: ``print_readable`` -> ``normalize_gm``, devices and addresses abstracted,
    MUST_SAVE / MUST_RECOMPUTE nodes marked ``# MUST_SAVE (region N)``. ``region_ids`` maps raw
    ``ac_graph_id``s to renumbered ones and is filled in first-appearance order (share it across graphs)."""
    from torch._dynamo.testing import normalize_gm  # Dynamo only when graphs are printed

    region_ids = {} if region_ids is None else region_ids
    nodes = {n.name: n for n in gm.graph.nodes}
    lines = []
    for line in normalize_gm(readable(gm)).splitlines():
        m = _NODE_LINE.match(line)
        node = nodes.get(m.group(2)) if m else None
        if node is not None and node.op != "placeholder":
            tag = _tag_of(node)
            if tag is not None:
                raw = node.meta.get("ac_graph_id")
                region = region_ids.setdefault(raw, len(region_ids)) if raw is not None else None
                line += f"  # {tag}" + (f" (region {region})" if region is not None else "")
        lines.append(line)
    text = "\n".join(lines).strip("\n") + "\n"
    text = _DEVICE.sub("device(type='DEVICE')", text)
    return _ADDRESS.sub("0xADDR", text)


def module_of_source(source: str) -> str:
    """'model.py:93' -> 'model.py' (line numbers move whenever the file is edited)."""
    return _SOURCE_LINE.sub("", source)


def saved_table(report: Report, symbols: "SymbolRenamer | None" = None) -> str:
    """The saved set as a stable table (the report's own rows, shapes through ``symbols``, file names
    without line numbers), then recomputed ops, tags and planner decisions."""
    symbols = symbols or SymbolRenamer()
    lines = _saved_rows(report, shape=symbols, source=module_of_source, source_header="file")
    lines.append("# recomputed in backward")
    lines.extend(f"{op} x{n}" for op, n in sorted(report.recomputed.items()))
    if not report.recomputed:
        lines.append("none")
    lines.append("# tagged")
    for t in report.tagged:
        lines.append(f"{t['tag']} {t['name']} {t['op']} <- {t['selector']} ({t['module'] or '<root>'})")
    if not report.tagged:
        lines.append("none")
    if report.decisions:
        lines.append("# planned")
        lines.extend(f"{d.action} {d.name} {d.op} {d.bytes}" for d in report.decisions)
    if report.unmatched:
        lines.append("# unmatched selectors")
        lines.extend(report.unmatched)
    if report.violations:
        lines.append("# violations")
        lines.extend(_SOURCE_PATHS.sub(lambda m: module_of_source(m.group(0)), v) for v in report.violations)
    return "\n".join(lines) + "\n"


_SOURCE_PATHS = re.compile(r"[A-Za-z0-9_.\-]+\.py:\d+")


class SymbolRenamer:
    """Renames size symbols by first appearance: the first ``s<N>`` seen becomes ``s0``, the next ``s1``; the
    same for unbacked ``u<N>``. Dynamo derives N from hashes and global counters, so it differs between runs.
    One renamer keeps one mapping across every text it is called on."""

    def __init__(self):
        self.mapping: dict[str, str] = {}
        self._counts = {"s": 0, "u": 0}

    def _rename(self, m: re.Match) -> str:
        sym = m.group(0)
        if sym not in self.mapping:
            self.mapping[sym] = f"{m.group(1)}{self._counts[m.group(1)]}"
            self._counts[m.group(1)] += 1
        return self.mapping[sym]

    def __call__(self, text: str) -> str:
        return _SYMBOL.sub(self._rename, text)


def stable_symbols(text: str) -> str:
    """``text`` with its size symbols renamed by first appearance (see :class:`SymbolRenamer`)."""
    return SymbolRenamer()(text)


def report_text(report: Report) -> str:
    """The golden text of a report alone (no graphs): header and saved set."""
    return f"# graph {report.graph}\npolicy: {report.policy}\n# saved\n{saved_table(report)}"


def graph_text(result, *, region_ids: dict[Any, int] | None = None) -> str:
    """The golden text of one compiled graph (a ``PartitionResult``): ``# forward``, ``# backward`` and
    ``# saved`` sections, deterministic across runs and test order."""
    region_ids = {} if region_ids is None else region_ids
    report, symbols = result.report, SymbolRenamer()
    forward = symbols(normalized_graph(result.forward, region_ids))
    backward = symbols(normalized_graph(result.backward, region_ids))
    parts = [f"# graph {report.graph}", f"policy: {report.policy}", "# forward", forward.rstrip("\n"),
             "# backward", backward.rstrip("\n"), "# saved", saved_table(report, symbols).rstrip("\n")]
    return "\n".join(parts) + "\n"
