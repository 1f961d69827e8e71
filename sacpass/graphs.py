"""Normalised graph text: the forward and backward graphs of a partition, printed so that only a change of the
graphs themselves changes the text, on every run and every supported torch release.

:func:`normalized_graph` prints one line per node with its own printer (not ``print_readable``, whose layout,
node names and op spellings differ between torch releases):

- nodes are named by :class:`CanonicalNames`: a call's name is its op's, counted in graph order (``mm``,
  ``mm_1``), graph inputs keep AOTAutograd's positional names, and the backward's saved inputs their
  forward names (torch's own names carry process-wide counters: ``mul_88`` on one release, ``mul_10`` on the next);
- ops are spelled ``aten.mm.default`` (:func:`target_text`), values ``f32[24, 32]``, without strides;
- devices (``device('DEVICE')``) and addresses are abstracted, and deletion notes (``x = None``) dropped;
- size symbols are renamed by first appearance (``s77`` -> ``s0``, ``u12`` -> ``u0``);
- every node the partition tagged MUST_SAVE / MUST_RECOMPUTE is marked, with region ids renumbered from 0.

:func:`graph_text` adds the saved-set table of the :class:`~sacpass.report.Report` (node names as in the graphs,
source file names without paths or lines). It is what golden tests compare
(:func:`sacpass.testing.assert_graphs_match`).
"""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx

from .nodes import tag_name
from .report import Report, saved_table as _saved_rows

__all__ = ["readable", "normalized_graph", "saved_table", "graph_text", "report_text", "stable_symbols", "SymbolRenamer",
           "CanonicalNames", "target_text", "normalized_graphs",
           "module_of_source"]

_DEVICE = re.compile(r"device\(type='[A-Za-z0-9_]+'(?:, index=\d+)?\)")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")
_SYMBOL = re.compile(r"(?<![A-Za-z0-9_])([su])(\d+)(?![A-Za-z0-9_\[])")  # not a dtype like "u8[4]"
_SOURCE_LINE = re.compile(r":\d+$")


def readable(gm: torch.fx.GraphModule) -> str:
    """``print_readable`` without strides or devices (the raw form the dumps keep beside the normalised one)."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


_PRINTED_TAGS = ("MUST_SAVE", "MUST_RECOMPUTE", "MUST_CPU_OFFLOAD")


def _tag_of(node: torch.fx.Node) -> str | None:
    name = tag_name(node)
    return name if name in _PRINTED_TAGS else None


class CanonicalNames:
    """Node names that no torch release changes: a call's name is its op's (``aten.mm.default`` -> ``mm``,
    then ``mm_1``, ...) counted in graph order; graph inputs keep AOTAutograd's positional names (``primals_3``,
    ``tangents_1``); a backward input that the forward saved takes that value's forward name. One object
    names a forward and then its backward, so the two never reuse a name, and maps the raw names a report
    lists (:meth:`__call__`)."""

    def __init__(self):
        self.raw: dict[str, str] = {}         # torch's node name -> canonical, forward first
        self._used: set[str] = set()

    def fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self._used:
            i += 1
            name = f"{base}_{i}"
        self._used.add(name)
        return name

    def name_graph(self, gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
        names: dict[torch.fx.Node, str] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node.name in self.raw:
                names[node] = self.raw[node.name]
                continue
            if node.op == "placeholder" and _POSITIONAL.match(node.name):
                name = node.name
                self._used.add(name)
            elif node.op == "output":
                continue
            else:
                name = self.fresh(_base_name(node))
            names[node] = name
            self.raw.setdefault(node.name, name)
        return names

    def __call__(self, raw: str) -> str:
        return self.raw.get(raw, raw)


_POSITIONAL = re.compile(r"^(primals|tangents|arg\d+|args|bwd_seed|bwd_base_offset|fwd_seed|fwd_base_offset)"
                         r"(_\d+)*$")
_TRAILING_COUNT = re.compile(r"(_\d+)+$")


def target_text(target) -> str:
    """``aten.mm.default`` / ``glm52.fp8_quantize.default`` for an OpOverload, ``higher_order.<name>`` for a
    higher-order op, ``operator.getitem`` for a Python function: one spelling on every torch."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    module = {"_operator": "operator", "builtins": ""}.get(module, module)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}" if module else name


def _base_name(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return target._opname.lstrip("_") or "op"
        return target_text(target).rsplit(".", 1)[-1].lstrip("_") or "op"
    return _TRAILING_COUNT.sub("", node.name) or node.op


_DTYPE_ABBR = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
               torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
               torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
               torch.float8_e4m3fn: "f8e4m3fn", torch.float8_e5m2: "f8e5m2"}


def _value_type(val) -> str | None:
    if isinstance(val, torch.Tensor):
        dtype = _DTYPE_ABBR.get(val.dtype, str(val.dtype).removeprefix("torch."))
        return f"{dtype}[{', '.join(str(d) for d in val.shape)}]"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"Sym({val})"
    if isinstance(val, (int, float, bool)):
        return type(val).__name__
    if isinstance(val, (list, tuple)):
        parts = [_value_type(v) for v in val]
        return "(" + ", ".join(p or "?" for p in parts) + ("," if len(parts) == 1 else "") + ")"
    return None


def _arg(a, names: dict) -> str:
    if isinstance(a, torch.fx.Node):
        return names.get(a, a.name)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x, names) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg(v, names)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.device):
        return "device('DEVICE')"
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, float):
        return repr(a)
    if isinstance(a, torch.fx.GraphModule) or callable(a) and not isinstance(a, type):
        return target_text(a)
    return repr(a)


def normalized_graph(gm: torch.fx.GraphModule, region_ids: dict[Any, int] | None = None,
                     names: CanonicalNames | None = None) -> str:
    """One graph as text that only a change of the graph itself changes: one line per node, named by
    :class:`CanonicalNames`, ops spelled by :func:`target_text`, values as ``dtype[shape]``, devices and addresses
    abstracted, no deletion notes; MUST_SAVE / MUST_RECOMPUTE / MUST_CPU_OFFLOAD nodes marked
    ``# MUST_SAVE (region N)``. ``region_ids`` maps raw ``ac_graph_id``s to renumbered ones, filled in
    first-appearance order (share it, and ``names``, across a forward and its backward)."""
    region_ids = {} if region_ids is None else region_ids
    names = CanonicalNames() if names is None else names
    canon = names.name_graph(gm)
    lines = []
    for node in gm.graph.nodes:
        if node.op == "output":
            lines.append(f"return {_arg(node.args[0], canon)}")
            continue
        kind = _value_type(node.meta.get("val"))
        head = f"{canon[node]}: \"{kind}\"" if kind else canon[node]
        if node.op == "placeholder":
            lines.append(f"{head} = input")
            continue
        if node.op == "get_attr":
            lines.append(f"{head} = self.{node.target}")
            continue
        args = [_arg(a, canon) for a in node.args] + [f"{k}={_arg(v, canon)}" for k, v in node.kwargs.items()]
        line = f"{head} = {target_text(node.target)}({', '.join(args)})"
        tag = _tag_of(node)
        if tag is not None:
            raw = node.meta.get("ac_graph_id")
            region = region_ids.setdefault(raw, len(region_ids)) if raw is not None else None
            line += f"  # {tag}" + (f" (region {region})" if region is not None else "")
        lines.append(line)
    text = "\n".join(lines) + "\n"
    text = _DEVICE.sub("device('DEVICE')", text)
    return _ADDRESS.sub("0xADDR", text)


def module_of_source(source: str) -> str:
    """'model.py:93' -> 'model.py' (line numbers move whenever the file is edited)."""
    return _SOURCE_LINE.sub("", source)


def saved_table(report: Report, symbols: "SymbolRenamer | None" = None,
                names: "CanonicalNames | None" = None) -> str:
    """The saved set as a stable table (the report's own rows, shapes through ``symbols``, node names through
    ``names``, file names without line numbers), then recomputed ops, tags and planner decisions."""
    symbols = symbols or SymbolRenamer()
    names = names or (lambda raw: raw)
    lines = _saved_rows(report, shape=symbols, name=names, source=module_of_source, source_header="file")
    lines.append("# recomputed in backward")
    lines.extend(f"{op} x{n}" for op, n in sorted(report.recomputed.items()))
    if not report.recomputed:
        lines.append("none")
    lines.append("# tagged")
    for t in report.tagged:
        lines.append(f"{t['tag']} {names(t['name'])} {t['op']} <- {t['selector']} ({t['module'] or '<root>'})")
    if not report.tagged:
        lines.append("none")
    if report.decisions:
        lines.append("# planned")
        lines.extend(f"{d.action} {names(d.name)} {d.op} {d.bytes}" for d in report.decisions)
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


def normalized_graphs(result, region_ids: dict[Any, int] | None = None):
    """A partition's forward and backward as :func:`normalized_graph` prints them, with one naming and one
    symbol renaming across both: (forward text, backward text, the SymbolRenamer, the CanonicalNames)."""
    region_ids = {} if region_ids is None else region_ids
    symbols, names = SymbolRenamer(), CanonicalNames()
    forward = symbols(normalized_graph(result.forward, region_ids, names))
    backward = symbols(normalized_graph(result.backward, region_ids, names))
    return forward, backward, symbols, names


def graph_text(result, *, region_ids: dict[Any, int] | None = None) -> str:
    """The golden text of one compiled graph (a ``PartitionResult``): ``# forward``, ``# backward`` and
    ``# saved`` sections, deterministic across runs and test order."""
    report = result.report
    forward, backward, symbols, names = normalized_graphs(result, region_ids)
    parts = [f"# graph {report.graph}", f"policy: {report.policy}", "# forward", forward.rstrip("\n"),
             "# backward", backward.rstrip("\n"), "# saved", saved_table(report, symbols, names).rstrip("\n")]
    return "\n".join(parts) + "\n"
