"""plan_pass: choose save, offload or recompute for each value a checkpointed region hands the backward.

Requires: a joint graph after the tag pass (and keep_decisions_pass); a memory budget in [0, 1] and/or a
:class:`~sacpass.plan.Plan`.
Ensures: every *candidate*, a forward node inside a checkpointed region (``PREFER_RECOMPUTE``) whose value a
backward node reads (directly or through a view), and that no policy selector tagged, is either tagged
``MUST_SAVE`` (kept on the device: reason ``budget`` or ``plan``), tagged ``MUST_SAVE`` and marked for offload
(reason ``offload``), or left to recompute. Must-save, offload and recompute selectors stay fixed.

How: each candidate costs ``recompute_ms`` (its own op plus an equal share of the forward ops only candidates
need, from the :class:`~sacpass.plan.CostModel`) and ``bytes``. Greedily by recompute time per byte, a
candidate is kept on the device while the device budget lasts, else offloaded while the host budget and the
copy window (``hide`` x the layer's estimated forward time, at the copy bandwidth) last and it is at least
``min_offload_bytes``, else recomputed. With ``memory_budget=f`` the device budget is f times all candidates'
bytes (0: recompute all; 1: keep all, as without activation checkpointing).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import warn
from ..nodes import backward_part, is_getitem, is_view, module_path, node_op, op_name, size_hint, unpackers
from ..plan import CostModel, Plan
from ..report import BUDGET, PLAN, Decision
from .tag_policy import OFFLOAD, TagResult

__all__ = ["plan_pass", "node_seconds"]


def _meta(val):
    """A meta tensor with ``val``'s dtype and hinted sizes (flop formulas need concrete shapes)."""
    if isinstance(val, torch.Tensor):
        return torch.empty([size_hint(s) for s in val.shape], dtype=val.dtype, device="meta")
    if isinstance(val, (list, tuple)):
        return type(val)(_meta(v) for v in val)
    if isinstance(val, (torch.SymInt, torch.SymFloat)):
        return size_hint(val)
    return val


def _arg_val(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _tensor_bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        n = 1
        for s in val.shape:
            n *= size_hint(s)
        return n * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_tensor_bytes(v) for v in val)
    return 0


def node_seconds(node: torch.fx.Node, cost: CostModel) -> float:
    """Estimated run time of one node (0 for views, getitems and placeholders)."""
    op = node_op(node)
    if op is None or is_view(node) or is_getitem(node):
        return 0.0
    from torch.utils.flop_counter import flop_registry

    flops = 0.0
    formula = flop_registry.get(op.overloadpacket)
    if formula is not None:
        try:
            args = [_meta(_arg_val(a)) for a in node.args]
            kwargs = {k: _meta(_arg_val(v)) for k, v in node.kwargs.items()}
            flops = float(formula(*args, out_val=_meta(node.meta.get("val")), **kwargs))
        except Exception:  # a formula that cannot read these arguments: count bytes only
            flops = 0.0
    ins = [_arg_val(a) for a in node.all_input_nodes]
    nbytes = sum(_tensor_bytes(v) for v in ins) + _tensor_bytes(node.meta.get("val"))
    tensors = [v for v in ins if isinstance(v, torch.Tensor)]
    dtype = tensors[0].dtype if tensors else torch.bfloat16
    return cost.seconds(flops, nbytes, dtype)


@dataclass
class _Candidate:
    node: torch.fx.Node
    outputs: list[torch.fx.Node]  # the node, or the getitems of a multi-output node the backward reads
    nbytes: int
    seconds: float = 0.0


def _in_region(node: torch.fx.Node) -> bool:
    return node.meta.get("recompute") is CheckpointPolicy.PREFER_RECOMPUTE


def _base(node: torch.fx.Node) -> torch.fx.Node:
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _candidates(graph: torch.fx.Graph, backward: set[torch.fx.Node]) -> dict[torch.fx.Node, _Candidate]:
    outputs = {n for n in graph.find_nodes(op="output")[0].all_input_nodes if n not in backward}
    needed: dict[torch.fx.Node, set[torch.fx.Node]] = defaultdict(set)  # producer -> outputs read by bw
    for node in graph.nodes:
        if node not in backward:
            continue
        for inp in node.all_input_nodes:
            if inp in backward or inp.op != "call_function":
                continue
            value = _base(inp)
            producer = value.args[0] if is_getitem(value) else value
            if isinstance(producer, torch.fx.Node) and producer.op == "call_function" and _in_region(producer) \
                    and (not is_getitem(value) or _in_region(value)) and value not in outputs:
                # (a forward output stays on the device for the caller anyway: nothing to plan)
                needed[producer].add(value)
    out = {}
    for producer, values in needed.items():
        if any(v.meta.get("recompute") is not CheckpointPolicy.PREFER_RECOMPUTE for v in values):
            continue
        outputs = sorted(values, key=lambda v: v.name)
        out[producer] = _Candidate(producer, outputs, sum(_tensor_bytes(v.meta.get("val")) for v in outputs))
    return out


def _attribute_costs(graph: torch.fx.Graph, backward: set[torch.fx.Node], cands: dict, cost: CostModel) -> None:
    """candidate.seconds = its own op + an equal share of the region ops that only candidates need."""
    owners: dict[torch.fx.Node, set[torch.fx.Node]] = defaultdict(set)
    for c in cands.values():
        stack, seen = list(c.node.all_input_nodes), set()
        while stack:
            n = stack.pop()
            if n in seen or n in cands or n in backward or n.op != "call_function" or not _in_region(n):
                continue
            seen.add(n)
            owners[n].add(c.node)
            stack.extend(n.all_input_nodes)
    for c in cands.values():
        c.seconds = node_seconds(c.node, cost)
    for n, who in owners.items():
        share = node_seconds(n, cost) / len(who)
        for w in who:
            cands[w].seconds += share


def _tag(tags: TagResult, cand: _Candidate, reason: str, offload: bool) -> None:
    for t in [cand.node] + [u for u in unpackers(cand.node)]:
        tags.add(t, CheckpointPolicy.MUST_SAVE, reason, "plan" if reason != BUDGET else "memory_budget",
                 offload=offload)


def plan_pass(gm: torch.fx.GraphModule, tags: TagResult, *, memory_budget: float | None,
              plan: Plan | None) -> tuple[Decision, ...]:
    """Tag the candidates (see the module docstring); returns one Decision per candidate."""
    if memory_budget is None and plan is None:
        return ()
    graph = gm.graph
    backward = backward_part(graph)
    cost = plan.cost if plan is not None else CostModel()
    cands = _candidates(graph, backward)
    if not any(_in_region(n) for n in graph.nodes):
        warn("sacpass: memory_budget / plan choose what checkpointed regions keep; this graph has no checkpointed "
             "region, so PyTorch's partitioner decides it alone. Wrap the layers in torch.utils.checkpoint inside "
             "the compiled function to plan them.")
        return ()
    _attribute_costs(graph, backward, cands, cost)
    total = sum(c.nbytes for c in cands.values())
    if memory_budget is not None:
        gpu_left = int(memory_budget * total)
    else:
        gpu_left = plan.gpu_bytes
    host_left = plan.host_budget() if plan is not None else 0
    forward_s = sum(node_seconds(n, cost) for n in graph.nodes if n.op == "call_function" and n not in backward)
    copy_left = (plan.hide * forward_s * cost.copy_bytes_per_s) if plan is not None else 0.0
    keep_reason = PLAN if plan is not None else BUDGET
    decisions = []
    for c in sorted(cands.values(), key=lambda c: (-c.seconds / max(c.nbytes, 1), c.node.name)):
        copy_ms = 1e3 * cost.copy_seconds(c.nbytes)
        if c.nbytes <= gpu_left:
            gpu_left -= c.nbytes
            action, why = "save", "fits the device budget"
            _tag(tags, c, keep_reason, offload=False)
        elif plan is not None and c.nbytes >= plan.min_offload_bytes and c.nbytes <= host_left \
                and c.nbytes <= copy_left:
            host_left -= c.nbytes
            copy_left -= c.nbytes
            action, why = "offload", "device budget spent; fits the host budget and the copy window"
            _tag(tags, c, OFFLOAD, offload=True)
        else:
            action = "recompute"
            if plan is None:
                why = "the device budget is spent"
            elif c.nbytes < plan.min_offload_bytes:
                why = f"device budget spent; under min_offload_bytes ({plan.min_offload_bytes})"
            elif c.nbytes > host_left:
                why = "device and host budgets spent"
            else:
                why = "device budget spent; the copy window is full"
        decisions.append(Decision(name=c.node.name, op=op_name(c.node), module=module_path(c.node), bytes=c.nbytes,
                                  action=action, recompute_ms=1e3 * c.seconds,
                                  copy_ms=copy_ms, why=why))
    return tuple(decisions)
