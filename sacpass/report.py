"""The saved-set report: one row per tensor the forward keeps for the backward, and why.

A :class:`Report` is built once per partition and never changed (a frozen dataclass; a copy rebuilt from a
compile cache is a new object). ``print(report)`` / :func:`format_report` print a table in the spirit of
JAX's ``print_saved_residuals``; :meth:`Report.to_json` is stable, versioned and diffable;
:meth:`Report.from_json` reads it back. This module imports torch only.
"""
from __future__ import annotations

import json
import sys
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import IO, Any, Callable, Mapping

from .errors import DumpError

__all__ = ["SavedTensor", "Decision", "Report", "REPORT_VERSION", "REASONS", "BOUNDS", "format_report",
           "print_report", "saved_table", "format_bytes"]

REPORT_VERSION = 2

# why a tensor is saved (SavedTensor.reason)
MUST_SAVE = "must-save"  # a sacpass selector: explicit save=, register_must_save, collectives
DISCRETE = "discrete"  # a discrete decision kept by default (save_discrete=True)
# a decision's floating outputs that its integer outputs cannot rebuild (a custom op's), kept beside them
DECISION_VALUES = "decision values"
PYTORCH_MUST_SAVE = "must-save (pytorch)"  # PyTorch's own tag: region boundary, collective, effectful op
OFFLOAD = "offload"  # moved to pinned host memory in the forward, brought back for the backward
BUDGET = "budget"  # kept on the device by the memory budget
PLAN = "plan"  # kept on the device by the planner
MIN_CUT = "min-cut"  # the partitioner's own choice
GRAPH_INPUT = "graph input"  # a parameter or input of the compiled graph
REASONS = (MUST_SAVE, DISCRETE, DECISION_VALUES, PYTORCH_MUST_SAVE, OFFLOAD, BUDGET, PLAN, MIN_CUT, GRAPH_INPUT)


@dataclass(frozen=True)
class SavedTensor:
    """One tensor saved for backward."""

    name: str  # node name in the forward graph (= placeholder name in the backward graph)
    op: str  # producing op ("ns::op.overload"), or "input" for a graph input
    shape: tuple[str, ...]  # sizes as text; symbolic where dynamic ("s0", "2*s0")
    dtype: str  # "int32", "bfloat16", ...
    bytes: int  # storage bytes of this tensor, symbolic sizes at their hints (unbacked: Inductor's fallback)
    module: str  # module path of the producer, relative to the compiled root ("" for the root)
    source: str  # "file.py:line" of the producing user code ("" when unknown)
    reason: str  # one of REASONS
    selector: str = ""  # the sacpass selector (or pass) behind a tagged row

    @property
    def on_host(self) -> bool:
        return self.reason == OFFLOAD


@dataclass(frozen=True)
class Decision:
    """One choice of the memory budget or the planner: what a candidate costs each way."""

    name: str  # joint-graph node
    op: str
    module: str
    bytes: int
    action: str  # "save" | "offload" | "recompute" | "unneeded" (planned, but the backward needs it no more)
    recompute_ms: float  # estimated time to recompute it (and what only it needs) in the backward
    copy_ms: float  # estimated time to move it to the host and back, each way
    why: str  # one line: the rule that decided
    form: tuple[str, ...] = ()  # kept in its place: the nodes of its smaller exact form (empty: the node itself)
    exact: str = ""  # the ModelPlan(exact=) selector that names it (sent to the host unpacked), if one does
    bound: str = ""  # a recomputed one: the budget that left no room to keep it (one of BOUNDS)


# what kept a planned value from being kept (Decision.bound of a recompute): raise it to keep more
HOST_BOUND = "host budget"  # the device budget was spent and the host budget could not hold it
COPY_BOUND = "copy window"  # its copy would not hide under the region's compute (Plan.hide)
SIZE_BOUND = "min_offload_bytes"  # smaller than a copy is worth, and the device budget was spent
BOUNDS = (HOST_BOUND, COPY_BOUND, SIZE_BOUND)


@dataclass(frozen=True)
class Report:
    """What one compiled graph saves for backward, what its backward recomputes, and what sacpass tagged."""

    graph: str  # id of the compiled graph ("g0", "g1", ... in compile order of the backend)
    policy: str  # the policy, printed
    torch_version: str
    saved: tuple[SavedTensor, ...] = ()
    saved_symints: int = 0  # symbolic sizes saved alongside the tensors
    recomputed: Mapping[str, int] = field(default_factory=dict)  # forward op -> times the backward recomputes it
    tagged: tuple[Mapping[str, Any], ...] = ()  # TagRecords as read-only dicts
    decisions: tuple[Decision, ...] = ()  # memory budget / planner choices
    unmatched: tuple[str, ...] = ()  # explicit selectors that matched nothing where they could
    violations: tuple[str, ...] = ()  # must-save or offload nodes the partition did not honour
    warnings: tuple[str, ...] = ()  # discrete decisions recomputed on request, offloads not possible
    # plain checkpoint bodies given torch 2.13's tagging on an older torch (passes/checkpoint_regions.py)
    routed_checkpoints: tuple[str, ...] = ()
    from_cache: bool = False  # rebuilt from a persisted report on an AOTAutograd cache hit

    def __post_init__(self) -> None:  # read-only containers, whatever the caller passed
        object.__setattr__(self, "saved", tuple(self.saved))
        object.__setattr__(self, "recomputed", MappingProxyType(dict(sorted(dict(self.recomputed).items()))))
        object.__setattr__(self, "tagged", tuple(MappingProxyType(dict(t)) for t in self.tagged))
        for name in ("decisions", "unmatched", "violations", "warnings", "routed_checkpoints"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    # ------------------------------------------------------------------ totals
    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.saved)

    @property
    def input_bytes(self) -> int:
        """Bytes of saved graph inputs (parameters, the layer input): alive anyway, not activations."""
        return sum(s.bytes for s in self.saved if s.reason == GRAPH_INPUT)

    @property
    def host_bytes(self) -> int:
        """Bytes offloaded to host memory between forward and backward."""
        return sum(s.bytes for s in self.saved if s.on_host)

    @property
    def host_pool_bytes(self) -> int:
        """Bytes of sacpass's host pool the offloaded tensors take per execution (their blocks, aligned); the
        pool's slabs, what the machine really gives up, are ``sacpass.offload.stats().host_bytes_held``."""
        from .offload.sizes import pool_bytes
        return sum(pool_bytes(s.bytes) for s in self.saved if s.on_host)

    @property
    def activation_bytes(self) -> int:
        """Bytes of activations kept on the device: everything saved that is neither an input nor offloaded."""
        return self.total_bytes - self.input_bytes - self.host_bytes

    def bytes_by_reason(self) -> dict[str, int]:
        out: Counter = Counter()
        for s in self.saved:
            out[s.reason] += s.bytes
        return dict(sorted(out.items()))

    def recompute_bounds(self) -> dict[str, tuple[int, float]]:
        """{bound: (values the planner left to recompute for it, their estimated recompute ms)}: what a larger
        budget of each kind would buy back, per run of this graph."""
        out: dict[str, tuple[int, float]] = {}
        for d in self.decisions:
            if d.action == "recompute" and d.bound:
                n, ms = out.get(d.bound, (0, 0.0))
                out[d.bound] = (n + 1, ms + d.recompute_ms)
        return out

    def saved_ops(self) -> list[str]:
        return [s.op for s in self.saved]

    def with_graph(self, graph: str, *, from_cache: bool) -> "Report":
        return replace(self, graph=graph, from_cache=from_cache)

    # ------------------------------------------------------------------ text
    def format(self, *, verbose: bool = False) -> str:
        return format_report(self, verbose=verbose)

    def __str__(self) -> str:
        return self.format()

    def print(self, file: IO[str] | None = None) -> None:
        print_report(self, file=file)

    # ------------------------------------------------------------------ json
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "sacpass.report", "version": REPORT_VERSION, "graph": self.graph, "policy": self.policy,
            "torch_version": self.torch_version,
            "saved": [dict(asdict(s), shape=list(s.shape)) for s in self.saved],
            "saved_symints": self.saved_symints, "recomputed": dict(self.recomputed),
            "tagged": [dict(t) for t in self.tagged], "decisions": [asdict(d) for d in self.decisions],
            "unmatched": list(self.unmatched), "violations": list(self.violations),
            "warnings": list(self.warnings), "routed_checkpoints": list(self.routed_checkpoints),
            "total_bytes": self.total_bytes, "host_bytes": self.host_bytes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "report") -> "Report":
        if not isinstance(d, dict) or d.get("kind") != "sacpass.report":
            raise DumpError(f"sacpass: {where} is not a sacpass report (no kind='sacpass.report').")
        version = d.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version > REPORT_VERSION:
            raise DumpError(
                f"sacpass: {where} has report version {version!r}; this sacpass reads up to "
                f"{REPORT_VERSION}. Upgrade sacpass to read it.")
        try:
            saved = tuple(SavedTensor(**dict(s, shape=tuple(s["shape"]))) for s in d["saved"])
            rep = cls(graph=d["graph"], policy=d["policy"], torch_version=d["torch_version"], saved=saved,
                      saved_symints=int(d.get("saved_symints", 0)), recomputed=dict(d.get("recomputed", {})),
                      tagged=tuple(d.get("tagged", [])),
                      decisions=tuple(Decision(**x) for x in d.get("decisions", [])),
                      unmatched=tuple(d.get("unmatched", [])), violations=tuple(d.get("violations", [])),
                      warnings=tuple(d.get("warnings", [])),
                      routed_checkpoints=tuple(d.get("routed_checkpoints", [])))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DumpError(f"sacpass: {where} is a corrupted sacpass report ({type(e).__name__}: {e}).") from e
        if "total_bytes" in d and d["total_bytes"] != rep.total_bytes:
            raise DumpError(f"sacpass: {where} is corrupted: total_bytes {d['total_bytes']} != sum of rows "
                            f"{rep.total_bytes}.")
        return rep

    @classmethod
    def from_json(cls, text: str, *, where: str = "report") -> "Report":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise DumpError(f"sacpass: {where} is not valid JSON ({e}).") from e
        return cls.from_dict(d, where=where)


# ---------------------------------------------------------------------------------------------- text
def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def saved_table(report: Report, *, shape: Callable[[str], str] = str, source: Callable[[str], str] = str,
                name: Callable[[str], str] = str, source_header: str = "source",
                total_label: str = "total") -> list[str]:
    """The saved set as aligned rows, then the totals: inputs and activations apart, bytes by reason.
    ``shape``, ``name`` and ``source`` rewrite those columns (golden files rename symbols and nodes and drop
    line numbers)."""
    rows = [("name", "dtype[shape]", "bytes", "reason", "op", "module", source_header)]
    for s in report.saved:
        rows.append((name(s.name), shape(f"{s.dtype}[{', '.join(s.shape)}]"), str(s.bytes), s.reason, s.op,
                     s.module or "<root>", source(s.source) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    n_in = sum(s.reason == GRAPH_INPUT for s in report.saved)
    n_host = sum(s.on_host for s in report.saved)
    lines.append(f"{total_label}: {len(report.saved)} tensors, {report.total_bytes} bytes"
                 + (f", {report.saved_symints} symints" if report.saved_symints else ""))
    lines.append(f"  activations: {len(report.saved) - n_in - n_host} tensors, {report.activation_bytes} bytes "
                 f"on the device; graph inputs: {n_in} tensors, {report.input_bytes} bytes"
                 + (f"; offloaded: {n_host} tensors, {report.host_bytes} bytes on the host "
                    f"({report.host_pool_bytes} bytes of sacpass's host pool)" if n_host else ""))
    for reason, b in report.bytes_by_reason().items():
        lines.append(f"  {reason}: {b} bytes")
    return lines


def recomputed_lines(report: Report, width: int = 100) -> list[str]:
    """The ops the backward recomputes, grouped by namespace, most frequent first, wrapped."""
    total = sum(report.recomputed.values())
    if not total:
        return ["recomputed in backward: none"]
    lines = [f"recomputed in backward: {total} ops of {len(report.recomputed)} kinds"]
    groups: dict[str, list[tuple[str, int]]] = {}
    for op, n in report.recomputed.items():
        ns, _, rest = op.partition("::")
        groups.setdefault(ns if rest else "other", []).append((rest or op, n))
    for ns, ops in sorted(groups.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        items = ", ".join(f"{name} x{n}" for name, n in sorted(ops, key=lambda x: (-x[1], x[0])))
        head = f"  {ns} ({sum(n for _, n in ops)}): "
        lines.extend(textwrap.wrap(items, width=width, initial_indent=head, subsequent_indent=" " * len(head)))
    return lines


def format_report(report: Report, *, verbose: bool = False) -> str:
    """The report as a table: one line per saved tensor, then totals, recomputed ops and tags."""
    head = f"sacpass report {report.graph}  (torch {report.torch_version})"
    lines = [head + ("  [from cache]" if report.from_cache else ""), f"policy: {report.policy}"]
    lines += saved_table(report, total_label="saved")
    lines.append(f"  = {format_bytes(report.activation_bytes)} of activations on the device"
                 + (f", {format_bytes(report.host_bytes)} on the host" if report.host_bytes else ""))
    lines += recomputed_lines(report)
    counts = Counter(t["tag"] for t in report.tagged)
    lines.append("tagged: " + ", ".join(f"{n} {tag.lower().replace('_', '-')}" for tag, n in sorted(counts.items()))
                 if counts else "tagged: none")
    if verbose:
        for t in report.tagged:
            lines.append(f"  {t['tag']:<16} {t['name']} {t['op']} <- {t['selector']} "
                         f"({t['module'] or '<root>'} {t['source'] or '-'})")
    if report.decisions:
        by_action = Counter(d.action for d in report.decisions)
        lines.append("planned: " + ", ".join(f"{n} {a}" for a, n in sorted(by_action.items())))
        if bounds := report.recompute_bounds():
            lines.append("recomputed for want of: " + ", ".join(f"{bound} ({n} values, {ms:.3f} ms)"
                                                                 for bound, (n, ms) in sorted(bounds.items())))
        if verbose:
            for d in report.decisions:
                form = f" as {', '.join(d.form)}" if d.form and d.action in ("save", "offload") else ""
                lines.append(f"  {d.action:<9} {d.name}{form} {d.op} {format_bytes(d.bytes)}: recompute "
                             f"{d.recompute_ms:.3f} ms, copy {d.copy_ms:.3f} ms; {d.why}")
    if report.routed_checkpoints:
        lines.append(f"plain checkpoints tagged the torch 2.13 way (ops inside autograd.Functions recomputed): "
                     f"{', '.join(report.routed_checkpoints)}")
    if report.unmatched:
        lines.append(f"unmatched selectors: {', '.join(report.unmatched)}")
    for w in report.warnings:
        lines.append(f"warning: {w}")
    if report.violations:
        lines.append("VIOLATIONS: " + "; ".join(report.violations))
    return "\n".join(lines)


def print_report(report: Report, file: IO[str] | None = None) -> None:
    print(format_report(report), file=file or sys.stdout)
