"""The saved-set report: one row per tensor the forward saves for the backward, and why.

``print(report)`` / :func:`format_report` print a table in the spirit of JAX's ``print_saved_residuals``;
:meth:`Report.to_json` is stable, versioned and diffable; :meth:`Report.from_json` reads it back.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import torch

from .errors import DumpError

__all__ = ["SavedTensor", "Report", "REPORT_VERSION", "format_report", "print_report"]

REPORT_VERSION = 1

# why a tensor is saved
MUST_SAVE = "must-save"  # tagged by sacpass (the producer, one of its getitems, or a view/cast of it)
PYTORCH_MUST_SAVE = "must-save (pytorch)"  # tagged by PyTorch: region boundary, collective, effectful op
MIN_CUT = "min-cut"  # the partitioner's own choice
GRAPH_INPUT = "graph input"  # a parameter or input of the compiled graph


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
    reason: str  # must-save | must-save (pytorch) | min-cut | graph input
    selector: str = ""  # the sacpass selector behind a must-save row


@dataclass
class Report:
    """What one compiled graph saves for backward, what its backward recomputes, and what sacpass tagged."""

    graph: str  # id of the compiled graph ("g0", "g1", ... in compile order of the backend)
    policy: str  # the policy, printed
    torch_version: str
    saved: list[SavedTensor] = field(default_factory=list)
    saved_symints: int = 0  # symbolic sizes saved alongside the tensors
    recomputed: dict[str, int] = field(default_factory=dict)  # forward op -> times the backward recomputes it
    tagged: list[dict[str, Any]] = field(default_factory=list)  # TagRecords as dicts
    unmatched: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)  # must-save nodes the backward still computes
    # plain checkpoint bodies given torch 2.13's tagging on an older torch (passes/checkpoint_regions.py)
    routed_checkpoints: list[str] = field(default_factory=list)
    from_cache: bool = False  # rebuilt from a persisted report on a compile-cache hit

    # ------------------------------------------------------------------ totals
    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.saved)

    @property
    def input_bytes(self) -> int:
        """Bytes of saved graph inputs (parameters, the layer input): alive anyway, not activations."""
        return sum(s.bytes for s in self.saved if s.reason == GRAPH_INPUT)

    @property
    def activation_bytes(self) -> int:
        """Bytes of saved activations: everything saved that is not a graph input."""
        return self.total_bytes - self.input_bytes

    def bytes_by_reason(self) -> dict[str, int]:
        out: Counter = Counter()
        for s in self.saved:
            out[s.reason] += s.bytes
        return dict(sorted(out.items()))

    def saved_ops(self) -> list[str]:
        return [s.op for s in self.saved]

    # ------------------------------------------------------------------ text
    def format(self, *, verbose: bool = False) -> str:
        return format_report(self, verbose=verbose)

    def __str__(self) -> str:
        return self.format()

    def print(self, file: IO[str] | None = None) -> None:
        print_report(self, file=file)

    # ------------------------------------------------------------------ json
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["saved"] = [dict(asdict(s), shape=list(s.shape)) for s in self.saved]
        d["total_bytes"] = self.total_bytes
        d["version"] = REPORT_VERSION
        d["kind"] = "sacpass.report"
        d.pop("from_cache")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "report") -> "Report":
        if not isinstance(d, dict) or d.get("kind") != "sacpass.report":
            raise DumpError(f"sacpass: {where} is not a sacpass report (no kind='sacpass.report').")
        version = d.get("version")
        if not isinstance(version, int) or version > REPORT_VERSION:
            raise DumpError(
                f"sacpass: {where} has report version {version!r}; this sacpass reads up to "
                f"{REPORT_VERSION}. Upgrade sacpass to read it.")
        try:
            saved = [SavedTensor(**dict(s, shape=tuple(s["shape"]))) for s in d["saved"]]
            rep = cls(graph=d["graph"], policy=d["policy"], torch_version=d["torch_version"], saved=saved,
                      saved_symints=int(d.get("saved_symints", 0)), recomputed=dict(d.get("recomputed", {})),
                      tagged=list(d.get("tagged", [])), unmatched=list(d.get("unmatched", [])),
                      violations=list(d.get("violations", [])),
                      routed_checkpoints=list(d.get("routed_checkpoints", [])))
        except (KeyError, TypeError, ValueError) as e:
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


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def format_report(report: Report, *, verbose: bool = False) -> str:
    """The report as a table: one line per saved tensor, then totals and recomputed ops."""
    lines = [f"sacpass report {report.graph}  (torch {report.torch_version}){'  [from cache]' if report.from_cache else ''}",
             f"policy: {report.policy}"]
    rows = [("name", "dtype[shape]", "bytes", "reason", "op", "module", "source")]
    for s in report.saved:
        rows.append((s.name, f"{s.dtype}[{', '.join(s.shape)}]", str(s.bytes), s.reason, s.op,
                     s.module or "<root>", s.source or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append(f"saved: {len(report.saved)} tensors, {report.total_bytes} bytes ({_fmt_bytes(report.total_bytes)})"
                 + (f", {report.saved_symints} symints" if report.saved_symints else ""))
    for reason, b in report.bytes_by_reason().items():
        lines.append(f"  {reason}: {b} bytes")
    rec = ", ".join(f"{op} x{n}" for op, n in sorted(report.recomputed.items())) or "none"
    lines.append(f"recomputed in backward: {sum(report.recomputed.values())} ops ({rec})")
    ms = [t for t in report.tagged if t["tag"] == "MUST_SAVE"]
    mr = [t for t in report.tagged if t["tag"] == "MUST_RECOMPUTE"]
    lines.append(f"tagged: {len(ms)} must-save, {len(mr)} must-recompute")
    if verbose:
        for t in report.tagged:
            lines.append(f"  {t['tag']:<14} {t['name']} {t['op']} <- {t['selector']} "
                         f"({t['module'] or '<root>'} {t['source'] or '-'})")
    if report.routed_checkpoints:
        lines.append(f"plain checkpoints tagged the torch 2.13 way (ops inside autograd.Functions recomputed): "
                     f"{', '.join(report.routed_checkpoints)}")
    if report.unmatched:
        lines.append(f"unmatched selectors: {', '.join(report.unmatched)}")
    if report.violations:
        lines.append("VIOLATIONS: " + "; ".join(report.violations))
    return "\n".join(lines)


def print_report(report: Report, file: IO[str] | None = None) -> None:
    print(format_report(report), file=file or sys.stdout)


def tensor_nbytes(val: Any) -> int:
    """Storage bytes of a (fake) tensor's own elements, symbolic sizes at their hints."""
    numel = 1
    for s in val.shape:
        numel *= size_hint(s)
    return numel * val.element_size()


def size_hint(s: Any) -> int:
    """A size at its hint; a data-dependent (unbacked) size has none and counts at Inductor's
    ``unbacked_symint_fallback`` (8192 by default), as Inductor's own estimates do."""
    if isinstance(s, int):
        return s
    node = getattr(s, "node", None)
    if node is None:
        return int(s)
    hint = getattr(node, "hint", None)
    if hint is None and getattr(node, "shape_env", None) is not None:
        hint = node.shape_env.size_hint(node.expr, allow_none=True)
    if hint is None:
        from torch._inductor import config as inductor_config
        return int(inductor_config.unbacked_symint_fallback)
    return int(hint)


def shape_text(val: Any) -> tuple[str, ...]:
    return tuple(str(s) for s in val.shape)


def dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
