"""offload_pass: move the saved values marked for offload to host memory between forward and backward.

Runs on the partitioned graphs, after the min-cut (the only pass that does).
Requires: the forward and backward graphs of one partition; the plan stage's
:class:`~sacpass.passes.plan.PlanResult` (the values marked for offload, seen through views and casts; the model
plan's key and the activation inputs it places; its exact values; its cost model); the number of real forward
outputs (``num_fwd_outputs``; the saved values follow them in the forward's output tuple).
Ensures: for each saved tensor that is a marked value, or a view or cast of one, the forward computes
``host = sacpass::offload(value, i, after)`` as its last op, after every use of the value and, through
``after`` (the forward's other outputs, which it does not read), after all of the forward's work, so no
compiler can move it up and reuse the value's memory while the copy reads it (the copy then overlaps the next
layer's forward), and saves ``host`` instead (real outputs keep the device tensor); the backward's placeholder
becomes that host tensor, and ``sacpass::reload(host, device)`` before its first use feeds every former user.
With a model plan, the values the planner chose, and the placed activation inputs the backward receives (a
layer's hidden states, never its parameters), go through ``sacpass::stash`` / ``sacpass::unstash`` instead: the
forward saves a handle, and the runtime places each value per call (device or host), so layers that share the
graph place theirs differently (:mod:`sacpass.offload`). Under a dynamic-shape compile, unstash's sizes and
strides are built from the backward's own inputs (a SymInt input, or a dimension of a tensor input that keeps its
value); a placed value with a size none of them carries goes through ``sacpass::offload`` instead (to the host in
every layer), with a warning that names it. The forward's node is re-tagged ``MUST_CPU_OFFLOAD`` (PyTorch's
vocabulary) for printing.
Returns {saved name: selector} of what it offloaded.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from ..offload import ops as _ops  # noqa: F401  (declares torch.ops.sacpass.*)
from ..nodes import is_cast_or_view
from .plan import PlanResult, expected_ms

__all__ = ["offload_pass"]


def _warn_offloaded(name: str, missing: str) -> None:
    import warnings

    from ..errors import SacpassWarning
    warnings.warn(f"sacpass: the model plan's value {name} has {missing} that its backward graph cannot "
                  f"rebuild from its own inputs (a dynamic-shape compile), so it goes to the host at every layer "
                  f"(sacpass::offload) instead of where the plan places it. Mark that dimension static "
                  f"(torch._dynamo.mark_static) or compile with dynamic=False to place it.", SacpassWarning,
                  stacklevel=2)


def _insert(graph: torch.fx.Graph, before: torch.fx.Node, op, args: tuple, name: str) -> torch.fx.Node:
    """``op(*args)`` as a node before ``before``, its ``val`` from the op's fake on the arguments' values."""
    with graph.inserting_before(before):
        node = graph.call_function(op, args, name=name)
    node.meta["val"] = op(*torch.fx.node.map_arg(args, lambda a: a.meta["val"]))
    return node


class _SymSizes:
    """Sizes and strides of saved values as backward nodes where they are symbolic (a graph compiled for dynamic
    shapes): each symbol from a SymInt input of the backward, else from a dimension of one of its tensor inputs
    that keeps its value (``aten.sym_size.int``), and sums, products and powers of them built with ``operator``.
    ``keep``: the placeholders whose values stay what they were (not rewritten to handles or host tensors)."""

    def __init__(self, backward: torch.fx.GraphModule, keep: list[torch.fx.Node]):
        self.graph = backward.graph
        self.sources: dict[object, object] = {}  # symbol -> the node that yields it, or (placeholder, dim)
        for ph in keep:
            val = ph.meta.get("val")
            if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
                self.sources.setdefault(val.node.expr, ph)
        for ph in keep:
            val = ph.meta.get("val")
            if isinstance(val, torch.Tensor):
                for d, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                        self.sources.setdefault(size.node.expr, (ph, d))
        placeholders = backward.graph.find_nodes(op="placeholder")
        self.start = placeholders[-1].next if placeholders else next(iter(backward.graph.nodes))

    def _symbol(self, sym) -> torch.fx.Node:
        src = self.sources[sym]
        if isinstance(src, tuple):  # a dimension of a tensor input: read once, at the graph's start
            ph, d = src
            with self.graph.inserting_before(self.start):
                node = self.graph.call_function(torch.ops.aten.sym_size.int, (ph, d))
            node.meta["val"] = ph.meta["val"].shape[d]
            self.sources[sym] = src = node
        return src

    def _build(self, expr, before: torch.fx.Node):
        import operator

        import sympy
        if expr.is_Integer:
            return int(expr)
        if expr.is_Symbol:
            return self._symbol(expr)
        if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
            terms, op = [expr.base] * int(expr.exp), operator.mul
        elif isinstance(expr, (sympy.Mul, sympy.Add)):
            terms, op = list(expr.args), operator.mul if isinstance(expr, sympy.Mul) else operator.add
        else:
            raise AssertionError(f"sacpass: {expr} cannot be built (missing() said it can)")
        out = self._build(terms[0], before)
        for term in terms[1:]:
            rhs = self._build(term, before)
            with self.graph.inserting_before(before):
                node = self.graph.call_function(op, (out, rhs))
            node.meta["val"] = op(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in (out, rhs)))
            out = node
        return out

    def missing(self, sizes, strides) -> str | None:
        """The first size or stride (ints and SymInts) that cannot be rebuilt, as text ("size 0 (s3)"); None when
        all can."""
        import sympy

        def ok(expr) -> bool:
            if expr.is_Integer:
                return True
            if expr.is_Symbol:
                return expr in self.sources
            if isinstance(expr, sympy.Pow):
                return expr.exp.is_Integer and expr.exp > 0 and ok(expr.base)
            return isinstance(expr, (sympy.Mul, sympy.Add)) and all(ok(a) for a in expr.args)
        return next((f"{what} {d} ({v})" for what, values in (("size", sizes), ("stride", strides))
                     for d, v in enumerate(values) if isinstance(v, torch.SymInt) and not ok(v.node.expr)), None)

    def ints(self, values, before: torch.fx.Node) -> list:
        """``values`` (ints and SymInts that :meth:`missing` passed) as unstash's argument: ints stay, SymInts
        become nodes before ``before``."""
        return [v if not isinstance(v, torch.SymInt) else self._build(v.node.expr, before) for v in values]


def offload_pass(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, planned: PlanResult,
                 num_fwd_outputs: int) -> dict[str, str]:
    """Rewrite ``forward`` and ``backward`` (see the module docstring) as ``planned`` says: its offload marks, its
    model plan and the activation inputs it places, and its exact values (their stash says ``pack=False``). With
    a model plan, the first stash carries the (forward, backward) ms its cost model expects of these graphs, for
    the run time's per-region report."""
    marks, model_plan, exact = planned.offload_marks, planned.model_plan, planned.exact
    inputs = set(planned.placed_inputs) if model_plan else set()
    if not marks and not inputs:
        return {}
    expected = (expected_ms(forward, planned.cost), expected_ms(backward, planned.cost)) if model_plan else (0.0, 0.0)
    out_node = forward.graph.find_nodes(op="output")[0]
    outputs = list(out_node.args[0])
    real_outputs = {n for n in outputs[:num_fwd_outputs] if isinstance(n, torch.fx.Node)}
    bw_inputs = {n.name: n for n in backward.graph.find_nodes(op="placeholder")}
    done: dict[str, str] = {}
    index = 0
    fw_order = {n: i for i, n in enumerate(forward.graph.nodes)}
    bw_order = {n: i for i, n in enumerate(backward.graph.nodes)}
    def chosen(node) -> bool:  # a marked value, or an activation input the model plan places (not returned)
        return node.name in inputs and node not in real_outputs if node.op == "placeholder" else node.name in marks

    saved = sorted(((pos, node) for pos, node in enumerate(outputs) if pos >= num_fwd_outputs
                    and isinstance(node, torch.fx.Node) and chosen(node)
                    and isinstance(node.meta.get("val"), torch.Tensor) and node.name in bw_inputs),
                   key=lambda pn: fw_order[pn[1]])

    def is_placed(node: torch.fx.Node) -> bool:
        """A model plan's value waits where its runtime places it; a value the caller also gets back (or a view
        of one) is never handed to the backward as its own, so it is offloaded."""
        if node.op == "placeholder":
            return True
        return bool(model_plan) and node not in real_outputs and marks[node.name] == "plan" and \
            not (is_cast_or_view(node) and node.all_input_nodes and node.all_input_nodes[0] in real_outputs)

    placed = {node for _, node in saved if is_placed(node)}
    rewritten = {node.name for _, node in saved}
    sym = _SymSizes(backward, [ph for name, ph in bw_inputs.items() if name not in rewritten])
    for _, node in saved:  # a placed value whose symbolic size the backward cannot rebuild goes to the host
        val = bw_inputs[node.name].meta["val"]
        missing = sym.missing(val.shape, val.stride()) if node in placed else None
        if missing is not None:
            placed.discard(node)
            _warn_offloaded(node.name, missing)
    after = [n for n in dict.fromkeys(outputs) if isinstance(n, torch.fx.Node) and n.op != "placeholder"
             and isinstance(n.meta.get("val"), torch.Tensor) and n not in placed]
    stashed = 0
    for pos, node in saved:
        placeholder = bw_inputs[node.name]
        val = placeholder.meta["val"]
        if node in placed:
            args = (node, stashed, model_plan, after) + ((False,) if node.name in exact else ())
            if stashed == 0:  # the region's first: it also carries the graphs' expected times
                args = (node, stashed, model_plan, after, node.name not in exact) + expected
            host = _insert(forward.graph, out_node, torch.ops.sacpass.stash.default, args, f"{node.name}_stash")
            placeholder.meta["sacpass_stashed"] = val  # what the handle stands for (the report's row)
            stashed += 1
        else:
            host = _insert(forward.graph, out_node, torch.ops.sacpass.offload.default, (node, index, after),
                           f"{node.name}_offload")
            index += 1
        if node.op != "placeholder":
            node.meta["recompute"] = CheckpointPolicy.MUST_CPU_OFFLOAD
        outputs[pos] = host
        placeholder.meta["val"] = host.meta["val"]
        first = min(placeholder.users, key=bw_order.__getitem__, default=None)
        if first is None:
            continue
        if node in placed:
            args = (placeholder, sym.ints(val.shape, first), sym.ints(val.stride(), first), val.dtype, val.device)
            back = _insert(backward.graph, first, torch.ops.sacpass.unstash.default, args, f"{node.name}_unstash")
        else:
            back = _insert(backward.graph, first, torch.ops.sacpass.reload.default, (placeholder, val.device),
                           f"{node.name}_reload")
        for user in list(placeholder.users):
            if user is not back:
                user.replace_input_with(placeholder, back)
        done[node.name] = marks.get(node.name, "plan")
    out_node.args = (tuple(outputs),) + tuple(out_node.args[1:])
    forward.graph.lint()
    backward.graph.lint()
    forward.recompile()
    backward.recompile()
    return done
