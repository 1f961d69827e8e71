"""plan_pass: choose save, offload or recompute for each value a checkpointed region hands the backward.

Requires: a joint graph after the tag pass (and keep_decisions_pass); a memory budget in [0, 1] and/or a
:class:`~sacpass.plan.Plan`.
Ensures: every *candidate*, a forward node inside a checkpointed region (``PREFER_RECOMPUTE``) whose value a
backward node reads (directly or through a view), and that no policy selector tagged, is either tagged
``MUST_SAVE`` (kept on the device: reason ``budget`` or ``plan``), tagged ``MUST_SAVE`` and marked for offload
(reason ``offload``), or left to recompute. Must-save, offload and recompute selectors stay fixed.

Candidates are the *heavy* nodes (matrix ops, custom ops) the backward's reads lead back to through cheap
ops: what no activation checkpointing saves too; the cheap ops between are recomputed from them.
How: each candidate costs ``recompute_ms`` (its own op plus an equal share of the cheap region ops only
candidates need, from the :class:`~sacpass.calibration.CostModel`) and ``bytes``. The device budget keeps the
candidates that hold the most recompute time within it; of the rest, those of at least ``min_offload_bytes``
that hold the most recompute time within the host budget and the copy window (``hide`` x the layer's
estimated forward time, at the copy bandwidth) are offloaded; the others are recomputed. Each is a whole-value
knapsack (:func:`~sacpass.passes.knapsack.best_subset`), not densest first, which can leave a share unused
beside a large value that would have held more. With ``memory_budget=f`` too, the device budget is f times all
candidates' bytes. The joint graph's duplicates are merged before (``cse_pass``), so each value is priced once.

``memory_budget`` without a plan is PyTorch's own budget solver over the released regions
(:func:`release_regions`): the must-saves and offloads stay fixed (PyTorch keeps MUST_SAVE out of its
knapsack), ``1.0`` partitions as without activation checkpointing, ``0`` keeps the regions as they are
(recompute everything but the must-saves). Under it, or under PyTorch's own ``activation_memory_budget`` below
1, random ops outside a checkpoint are must-save (:func:`keep_random_draws`): the solver would recompute them
without their RNG state.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import SacpassError, warn
from ..nodes import (backward_part, is_cast_or_view, is_cheap_unary, is_getitem, is_random, is_view, module_path,
                     node_op, op_name, size_hint, tensor_nbytes, unpackers)
from ..calibration import op_signature
from ..compression import packed_bytes
from ..offload.sizes import dense, host_pool_bytes, packs
from ..plan import CostModel, ModelPlan, Plan
from ..report import BUDGET, COPY_BOUND, HOST_BOUND, MIN_CUT, PLAN, SIZE_BOUND, Decision
from .knapsack import best_subset
from .tag_policy import EXACT_KEY, MUST_SAVE, OFFLOAD, OFFLOAD_KEY, TagResult

__all__ = ["plan_pass", "PlanResult", "release_regions", "keep_random_draws", "region_budget", "activation_inputs",
           "node_seconds", "expected_ms", "has_region"]


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
    """Bytes of a value: a tensor, or every tensor of a tuple of them."""
    if isinstance(val, torch.Tensor):
        return tensor_nbytes(val)
    if isinstance(val, (list, tuple)):
        return sum(_tensor_bytes(v) for v in val)
    return 0


def node_seconds(node: torch.fx.Node, cost: CostModel) -> float:
    """Estimated run time of one node (0 for views, getitems and placeholders): the cost model's measured time
    for this op at these input shapes, else its rates."""
    op = node_op(node)
    if op is None or is_view(node) or is_getitem(node):
        return 0.0
    if cost.op_seconds:  # measured at these shapes on this device
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        measured = cost.measured(op_signature(op, args, kwargs))
        if measured is not None:
            return measured
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


def expected_ms(gm: torch.fx.GraphModule, cost: CostModel) -> float:
    """The milliseconds ``cost`` expects one run of a partitioned graph to take: its ops one after another (a
    backward's recomputed ops included)."""
    return 1e3 * sum(node_seconds(n, cost) for n in gm.graph.nodes if n.op == "call_function")


@dataclass
class _Candidate:
    node: torch.fx.Node
    outputs: list[torch.fx.Node]  # the node, or the getitems of a multi-output node the backward reads
    nbytes: int
    seconds: float = 0.0
    form: list[torch.fx.Node] | None = None  # what is kept in its place: its smaller exact form (see _smallest_exact_form)
    reads: tuple[torch.fx.Node, ...] = ()  # the forward values the backward reads that lead back to it


def _in_region(node: torch.fx.Node) -> bool:
    return node.meta.get("recompute") is CheckpointPolicy.PREFER_RECOMPUTE


def has_region(graph: torch.fx.Graph) -> bool:
    """Whether the graph holds a checkpointed region the planner can plan."""
    return any(_in_region(n) for n in graph.nodes)


def _base(node: torch.fx.Node) -> torch.fx.Node:
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _heavy(node: torch.fx.Node) -> bool:
    """A node worth keeping: a matrix op (one with a FLOP formula) or a custom op. What no activation
    checkpointing would save too; the cheap ops between such nodes are recomputed from them for free."""
    op = node_op(node)
    if op is None or is_view(node) or is_getitem(node):
        return False
    from torch.utils.flop_counter import flop_registry

    return op.overloadpacket in flop_registry or op.namespace not in ("aten", "prims")


def _candidates(graph: torch.fx.Graph, backward: set[torch.fx.Node]) -> dict[torch.fx.Node, _Candidate]:
    """The heavy region nodes the backward's reads lead back to (through cheap ops), with the outputs of
    each that those reads need. A forward output stays on the device for the caller anyway: not planned."""
    outputs = {n for n in graph.find_nodes(op="output")[0].all_input_nodes if n not in backward}
    needed: dict[torch.fx.Node, set[torch.fx.Node]] = defaultdict(set)  # heavy producer -> its outputs used
    reads: dict[torch.fx.Node, set[torch.fx.Node]] = defaultdict(set)  # heavy producer -> backward reads from it
    seen: set[tuple[torch.fx.Node, torch.fx.Node]] = set()
    stack = [(inp, inp) for node in graph.nodes if node in backward for inp in node.all_input_nodes
             if inp not in backward and inp.op == "call_function"]
    while stack:  # (a value the trace reached, the backward read it started from)
        value, read = stack.pop()
        if (value, read) in seen or value in backward or value.op != "call_function" or value in outputs:
            continue
        seen.add((value, read))
        producer = value.args[0] if is_getitem(value) else value
        if not isinstance(producer, torch.fx.Node) or not _in_region(producer) or \
                (is_getitem(value) and not _in_region(value)):
            continue
        if _heavy(producer):
            needed[producer].add(value)
            reads[producer].add(read)
        else:
            stack.extend((inp, read) for inp in producer.all_input_nodes)
    out = {}
    for producer, values in needed.items():
        if any(v.meta.get("recompute") is not CheckpointPolicy.PREFER_RECOMPUTE for v in values):
            continue
        vals = sorted(values, key=lambda v: v.name)
        cand = _Candidate(producer, vals, sum(_tensor_bytes(v.meta.get("val")) for v in vals),
                          reads=tuple(sorted(reads[producer], key=lambda n: n.name)))
        cand.form = _smallest_exact_form(cand, reads[producer])
        if cand.form is not None:
            cand.nbytes = sum(_tensor_bytes(f.meta.get("val")) for f in cand.form)
        out[producer] = cand
    return out


def _smallest_exact_form(cand: _Candidate, reads: set[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """A smaller exact form of what the backward needs from ``cand``, or None. When every backward read that
    leads to the candidate does so through a chain of cheap one-input ops (views, casts, pointwise ops such as
    a comparison with a scalar), keeping the narrowest value of each chain is exact: the backward recomputes
    the rest of the chain from it, and never needs the candidate. A float mask ``(x > 0).float()`` is kept
    as its bool, an int64 widening of int32 IDs as the int32, a fp32 upcast of a bf16 value as the bf16."""
    size = lambda n: _tensor_bytes(n.meta.get("val"))  # noqa: E731
    form: dict[torch.fx.Node, None] = {}
    for read in sorted(reads, key=lambda n: n.name):
        chain, node = [], read
        while node not in cand.outputs:
            if not is_cheap_unary(node) or not _in_region(node):
                return None
            chain.append(node)
            node = node.all_input_nodes[0]
        chain.append(node)  # the candidate's own output ends the chain
        # the narrowest value, the candidate's output on a tie (nothing more to recompute)
        form[min(reversed(chain), key=size)] = None
    if sum(map(size, form)) >= cand.nbytes:
        return None
    return list(form)


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


def _from_tangents(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The joint graph's nodes computed from tangents: gradients, and what is computed from them."""
    grads: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or \
                any(inp in grads for inp in node.all_input_nodes):
            grads.add(node)
    return grads


_SUMS_VALUE_TIMES_GRADIENT = ("aten::_softmax_backward_data", "aten::_log_softmax_backward_data")


def _per_row(node: torch.fx.Node, val: torch.Tensor) -> bool:
    """Whether ``node`` returns a floating tensor of one value per row of ``val`` (a [R, d] value, d > 1): a
    per-row dot product, such as a gate's or a routing weight's gradient."""
    out = node.meta.get("val")
    outs = out if isinstance(out, (list, tuple)) else [out]
    return val.dim() >= 2 and val.shape[-1] > 1 and any(
        isinstance(o, torch.Tensor) and o.is_floating_point() and o.dim() >= 1 and o.numel() == val.shape[0]
        for o in outs)


def _sensitive(cand: _Candidate, grads: set[torch.fx.Node]) -> str:
    """Why the backward is sensitive to ``cand``'s values, or "": where it sums a value times its own gradient
    (attention's ``rowsum(out * dout)``, softmax's ``sum(y * dy)``, a routing weight's ``<row, dout>``), few
    terms or a difference of near-equal ones, which a lossy copy of the value disturbs most. Seen as: a custom op
    or a softmax backward that reads the value, or one the backward recomputes from it (its reads), with a
    gradient of the value's shape; a custom op that reads it with any gradient and returns one value per row of
    it; or a ``mul`` of the value and its gradient that a ``sum`` over a dimension reduces."""
    kept = cand.form if cand.form is not None else cand.outputs
    for value in dict.fromkeys([*kept, *cand.reads]):
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        seen, stack, readers = {value}, [value], []
        while stack:  # the value, and its views and casts (a detach, a layout copy)
            for user in stack.pop().users:
                if user in seen:
                    continue
                seen.add(user)
                if user not in grads and is_cast_or_view(user):
                    stack.append(user)
                else:
                    readers.append(user)
        for user in readers:
            op = node_op(user)
            if op is None or user not in grads:
                continue
            name = op_name(user).split(".")[0]
            custom = op.namespace not in ("aten", "prims")
            grad_in = [g for g in user.all_input_nodes if g not in seen and g in grads]
            if any(isinstance(g.meta.get("val"), torch.Tensor) and g.meta["val"].shape == val.shape for g in grad_in):
                if custom or name in _SUMS_VALUE_TIMES_GRADIENT:
                    return f"{name} reads it with its gradient"
                if name == "aten::mul" and any(node_op(u) is torch.ops.aten.sum.dim_IntList for u in user.users):
                    return "its backward sums it times its gradient"
            if custom and grad_in and _per_row(user, val):
                return f"{name} returns one value per row of it from its gradient"
    return ""


def _quantised(cand: _Candidate) -> str:
    """Why ``cand`` goes to the host as it is under any packing, or "": what is kept of it holds float8 elements
    (a quantised form such as an FP8 linear's weight-gradient operand, exact for the backward that reads it).
    Packing would round its fp32 scales, each of which multiplies a whole tile of elements, to save 1/128 of the
    elements' bytes."""
    for value in cand.form if cand.form is not None else cand.outputs:
        val = value.meta.get("val")
        if any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() == 1  # a float8 dtype
               for t in (val if isinstance(val, (list, tuple)) else [val])):
            return "quantised: float8 elements and their scales, exact as they are"
    return ""


def _tag(tags: TagResult, cand: _Candidate, reason: str, offload: bool, exact: str = "") -> None:
    kept = cand.form if cand.form is not None else [cand.node] + [u for u in unpackers(cand.node)]
    for t in kept:
        tags.add(t, CheckpointPolicy.MUST_SAVE, reason, "plan", offload=offload)
        if exact:
            t.meta[EXACT_KEY] = exact


def release_regions(graph: torch.fx.Graph) -> int:
    """Untag the checkpointed regions' ``PREFER_RECOMPUTE`` nodes (what no policy tagged), so that PyTorch's
    min-cut and its memory-budget solver treat them as they treat code outside any checkpoint. Random ops stay
    as they were: recomputed, the partition replays them with the RNG state it saves for them (a released one
    would be drawn again). Returns how many nodes it released."""
    n = 0
    for node in graph.nodes:
        if node.meta.get("recompute") is CheckpointPolicy.PREFER_RECOMPUTE and not is_random(node):
            del node.meta["recompute"]
            node.meta.pop("ac_graph_id", None)
            n += 1
    return n


def _check_host_limit(plan: Plan) -> None:
    """A plan whose host budget, over its layers, passes the offload runtime's limit would stop a step with an
    OffloadError once the pool reaches the limit: say so when the plan is made, not hours into a run."""
    from ..offload import host_limit
    per_step = plan.host_budget() * plan.layers
    if per_step > host_limit():
        warn(f"sacpass: Plan(host_bytes={plan.host_bytes}, layers={plan.layers}) may offload {per_step} bytes a step, "
             f"more than the host pool may hold ({host_limit()} bytes, sacpass.offload.set_host_limit); a step that "
             f"offloads that much raises OffloadError. Lower Plan(host_bytes=...) or raise the limit.")


def _host_cost(values: list[torch.fx.Node], compress: str | None) -> tuple[int, int]:
    """(pool bytes on the host, bytes copied each way) of ``values`` sent to the host one by one, packed where
    ``compress`` (a packing format, or None) packs them (floating values)."""
    pooled = copied = 0
    for v in values:
        val = v.meta.get("val")
        for t in val if isinstance(val, (list, tuple)) else [val]:
            if not isinstance(t, torch.Tensor):
                continue
            numel = tensor_nbytes(t) // t.element_size()
            pooled += host_pool_bytes(numel, t.dtype, compress)
            copied += packed_bytes(numel) if packs(t.dtype, compress) else tensor_nbytes(t)
    return pooled, copied


def _input_decisions(graph: torch.fx.Graph, inputs, cost: CostModel, compress: str | None
                     ) -> tuple[list[Decision], int, int]:
    """The activation inputs a model plan places (the offload pass stashes them): one Decision each, the pool
    bytes they take on the host and the bytes their copies move (in the region's copy window, like the rest)."""
    by_name = {n.name: n for n in graph.find_nodes(op="placeholder")}
    out, pooled, moved = [], 0, 0
    for name in inputs:
        nbytes = tensor_nbytes(by_name[name].meta["val"])
        on_host, copied = _host_cost([by_name[name]], compress)
        pooled += on_host
        moved += copied
        out.append(Decision(name=name, op="input", module="", bytes=nbytes, action="offload", recompute_ms=0.0,
                            copy_ms=1e3 * cost.copy_seconds(copied),
                            why="a region input: the model plan places it (device or host) per region"
                            + (f"; on the host {compress.upper()}-packed ({copied} bytes, lossy)"
                               if copied < nbytes else "")))
    return out, pooled, moved


@dataclass(frozen=True)
class PlanResult:
    """What the budget / planner stage hands on to the min-cut, the offload pass and the report."""

    decisions: tuple[Decision, ...] = ()  # one per candidate (and per activation input a model plan places)
    min_cut_budget: float | None = None  # PyTorch's activation_memory_budget for the min-cut; None: its own
    chosen_by: str = MIN_CUT  # the reason of a saved value no tag decided: the min-cut, or PyTorch's budget solver
    model_plan: str = ""  # the ModelPlan's key ("" without one): its values go through stash / unstash
    placed_inputs: tuple[str, ...] = ()  # the activation inputs the model plan places
    offload_marks: Mapping[str, str] = field(default_factory=dict)  # joint node -> selector, through views
    exact: frozenset = frozenset()  # joint nodes a compressing model plan sends to the host unpacked
    cost: CostModel | None = None  # the model plan's cost model: what each graph is expected to take

    def settled(self, backward: torch.fx.GraphModule, nodes: Mapping[str, object]) -> tuple[Decision, ...]:
        """The decisions as the partition took them: a planned save or offload the partition did not need (the
        backward reads a value derived from it, kept for another reason) is ``unneeded``, so decisions and saved
        bytes agree. ``nodes``: the joint graph's node facts."""
        saved = {n.name for n in backward.graph.nodes if n.op == "placeholder"}

        def kept(name: str) -> bool:  # the node, or one of its getitems / views, is a backward input
            return any(s == name or (nodes.get(s) is not None and nodes[s].parent == name) for s in saved)

        return tuple(d if d.action == "recompute" or any(kept(n) for n in d.form or (d.name,)) else
                     dataclasses.replace(d, action="unneeded", why="the backward reads a value derived from it, "
                                         "which the partition keeps for another reason")
                     for d in self.decisions)


def _through_views(joint: torch.fx.GraphModule, key: str) -> dict[str, object]:
    """{joint node name: node.meta[key]} of the nodes that carry ``key``, and of the views and casts of them."""
    marks: dict[str, object] = {}
    for node in joint.graph.nodes:
        if key in node.meta:
            marks[node.name] = node.meta[key]
        elif node.op == "call_function" and is_cast_or_view(node) and node.all_input_nodes:
            parent = node.all_input_nodes[0].name
            if parent in marks:
                marks[node.name] = marks[parent]
    return marks


def activation_inputs(joint: torch.fx.GraphModule, static_indices, min_bytes: int = 0) -> list[str]:
    """The joint graph's primal inputs that are activations: dense tensors of at least ``min_bytes`` that are not
    among ``static_indices`` (AOTAutograd's static inputs: parameters and buffers) and that the graph does not
    write into. With ``static_indices`` None (a caller that does not say which inputs are parameters) none are:
    a parameter must never be moved to the host."""
    if static_indices is None:
        return []
    static = set(static_indices)
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    written = {n.args[0] for n in joint.graph.nodes if n.op == "call_function" and
               getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable and n.args}
    return [n.name for i, n in enumerate(primals)
            if i not in static and n not in written and isinstance(n.meta.get("val"), torch.Tensor)
            and dense(n.meta["val"])
            and tensor_nbytes(n.meta["val"]) >= min_bytes]


RANDOM_DRAWS = "random op outside a checkpoint, under a memory budget"


def keep_random_draws(graph: torch.fx.Graph, tags: TagResult) -> int:
    """Under a memory budget (sacpass's, or PyTorch's own ``activation_memory_budget`` below 1) PyTorch's
    knapsack may recompute any forward value it can, a random op outside a checkpoint among them, whose RNG
    state nothing saved: the backward would draw a new dropout mask and the gradients would be wrong. Each such
    op (and the getitems that unpack it) is tagged ``MUST_SAVE``: the partition keeps what the backward reads of
    it. Returns how many nodes it tagged."""
    back = backward_part(graph)
    n = 0
    for node in list(graph.nodes):
        if node in back or not is_random(node) or node.meta.get("recompute") is not None:
            continue
        for target in [node] + unpackers(node):
            tags.add(target, CheckpointPolicy.MUST_SAVE, MUST_SAVE, RANDOM_DRAWS, op=op_name(node))
            n += 1
    return n


def region_budget(graph: torch.fx.Graph) -> float | None:
    """The budget ``torch.autograd.graph.region_activation_memory_budget`` annotated this graph's forward with
    (PyTorch's min-cut takes it over ``activation_memory_budget``), or None: none, or a torch without it."""
    try:
        from torch.fx.traceback import _get_memory_budget_annotation
    except ImportError:
        return None
    for node in graph.nodes:
        budget = _get_memory_budget_annotation(node)
        if budget is not None:
            return float(budget)
    return None


def _keep_tags_under_pytorch_budget(graph: torch.fx.Graph, tags: TagResult, annotated: float | None) -> None:
    """Where sacpass leaves PyTorch's min-cut its own budget (the region annotation, else
    ``activation_memory_budget``): below 1 its random ops outside a checkpoint are kept (:func:`keep_random_draws`);
    0, which drops every MUST_SAVE, is refused where anything is. ``annotated``: :func:`region_budget`."""
    from torch._functorch import config as functorch_config

    budget = functorch_config.activation_memory_budget if annotated is None else annotated
    drawn = keep_random_draws(graph, tags) if budget < 1 else 0
    kept = tags.names("MUST_SAVE") | tags.names("MUST_CPU_OFFLOAD")
    if kept and budget == 0:
        where = ("torch.autograd.graph.region_activation_memory_budget(0) annotates this graph" if annotated is not None
                 else "torch._functorch.config.activation_memory_budget is 0")
        what = (f"{len(kept)} tags: the policy's, and those of random ops outside a checkpoint, which the backward "
                "would draw again" if drawn else f"{len(kept)} from this policy")
        raise SacpassError(
            f"sacpass: {where}, which makes PyTorch's partitioner save only graph inputs and drop every MUST_SAVE "
            f"tag ({what}). Use sacpass.backend(memory_budget=0) instead (recompute everything but the "
            "must-saves), or set PyTorch's budget above 0.")


def _check_region_budget(annotated: float | None, memory_budget: float | None, plan: Plan | None) -> None:
    """sacpass's memory budget or plan runs PyTorch's min-cut at a budget of its own, which a region annotation
    (``annotated``) would override: refuse the two together."""
    if annotated is None or (memory_budget is None and plan is None):
        return
    mine = f"plan={type(plan).__name__}(...)" if plan is not None else f"memory_budget={memory_budget}"
    raise SacpassError(
        f"sacpass: torch.autograd.graph.region_activation_memory_budget({annotated}) annotates this graph, and "
        f"PyTorch's partitioner would take it over the backend's {mine}. Use one of them: drop the annotation, "
        "or the backend's option.")


def plan_pass(gm: torch.fx.GraphModule, tags: TagResult, *, memory_budget: float | None, plan: Plan | None,
              static_inputs=None) -> PlanResult:
    """The budget / planner stage (see the module docstring): tags the candidates and says how the min-cut runs.
    A memory budget without a plan is left to PyTorch's solver over the released regions (see
    :func:`release_regions`); without either, PyTorch's own budget (``activation_memory_budget``, or a
    ``region_activation_memory_budget`` annotation, which with either is refused) must keep the tags (0 drops
    them: refused). ``static_inputs``: AOTAutograd's static input indices (parameters, buffers), which
    tell a model plan the activation inputs it places from the weights it never moves."""
    annotated = region_budget(gm.graph)
    _check_region_budget(annotated, memory_budget, plan)
    model_plan = isinstance(plan, ModelPlan) and has_region(gm.graph)  # a graph without regions: nothing to place
    assert not model_plan or plan.resolved, "sacpass: a graph with regions partitioned before its model plan resolved"
    inputs = activation_inputs(gm, static_inputs, plan.min_offload_bytes) if model_plan and plan.inputs else []
    decisions = _choose(gm, tags, memory_budget=memory_budget, plan=plan, inputs=inputs)
    budget, chosen_by = None, MIN_CUT
    if plan is not None:
        budget = 1.0  # the plan's tags decide; PyTorch's knapsack does not run
    elif memory_budget is not None:
        budget = 1.0 if memory_budget == 0 else memory_budget
        if memory_budget > 0:
            release_regions(gm.graph)
            keep_random_draws(gm.graph, tags)
            chosen_by = BUDGET
    else:
        _keep_tags_under_pytorch_budget(gm.graph, tags, annotated)
    return PlanResult(decisions=decisions, min_cut_budget=budget, chosen_by=chosen_by,
                      model_plan=plan.key if model_plan else "", placed_inputs=tuple(inputs),
                      offload_marks=_through_views(gm, OFFLOAD_KEY), exact=frozenset(_through_views(gm, EXACT_KEY)),
                      cost=plan.cost if model_plan else None)


def _choose(gm: torch.fx.GraphModule, tags: TagResult, *, memory_budget: float | None,
            plan: Plan | None, inputs=()) -> tuple[Decision, ...]:
    """Tag the candidates (see the module docstring); returns one Decision per candidate. ``inputs``: the graph
    inputs a :class:`ModelPlan` places (their bytes come out of the region's share)."""
    graph = gm.graph
    if plan is None:
        return ()
    if not has_region(graph):
        warn("sacpass: the planner chooses what checkpointed regions keep; this graph has no checkpointed "
             "region, so PyTorch's partitioner decides it alone. Wrap the layers in torch.utils.checkpoint inside "
             "the compiled function to plan them.")
        return ()
    placed_inputs: list[Decision] = []
    inputs_copied = 0
    compress = plan.compress if isinstance(plan, ModelPlan) else None  # the packing format, if any
    exact = plan.exact if isinstance(plan, ModelPlan) else ()
    grads = _from_tangents(graph) if compress and exact is None else set()  # exact=None: the sensitive values
    if isinstance(plan, ModelPlan):  # the per-graph share; the runtime places it per region
        placed_inputs, on_host, inputs_copied = _input_decisions(graph, inputs, plan.cost, compress)
        plan = plan.region_plan(on_host)
    backward = backward_part(graph)
    cost = plan.cost if plan is not None else CostModel()
    cands = _candidates(graph, backward)
    _attribute_costs(graph, backward, cands, cost)
    total = sum(c.nbytes for c in cands.values())
    gpu_left = int(memory_budget * total) if memory_budget is not None else plan.gpu_bytes
    host_left = plan.host_budget()
    _check_host_limit(plan)
    forward_s = sum(node_seconds(n, cost) for n in graph.nodes if n.op == "call_function" and n not in backward)
    # the placed inputs go to the host in the same window (all regions but the last few, kept on the device)
    copy_left = plan.hide * forward_s * cost.copy_bytes_per_s - inputs_copied
    keep_reason = PLAN
    decisions = placed_inputs
    ordered = sorted(cands.values(), key=lambda c: (-c.seconds / max(c.nbytes, 1), c.node.name))
    # kept bit for bit, never packed: a quantised form, what exact= names, or by default what the backward is
    # sensitive to; then what the host pool really hands out for each (a block per tensor) and what its copy moves
    named = [(compress and _quantised(c)) or (
        next((str(sel) for sel in exact if sel(c.node)), "") if exact is not None else
        (f"sensitive: {reason}" if compress and (reason := _sensitive(c, grads)) else "")) for c in ordered]
    host_cost = [_host_cost(c.form if c.form is not None else c.outputs, None if nm else compress)
                 for c, nm in zip(ordered, named)]
    # the most recompute time the device budget holds, then the most the host budget and the copy window hold
    on_device = set(best_subset([c.seconds for c in ordered], [(c.nbytes,) for c in ordered], (gpu_left,)))
    movable = [i for i, c in enumerate(ordered) if i not in on_device and c.nbytes >= plan.min_offload_bytes]
    picked = best_subset([ordered[i].seconds for i in movable], [host_cost[i] for i in movable],
                         (host_left, max(copy_left, 0)))
    on_host = {movable[j] for j in picked}
    host_left -= sum(host_cost[i][0] for i in on_host)
    copy_left -= sum(host_cost[i][1] for i in on_host)
    for i, c in enumerate(ordered):
        (pooled, copied), copy_ms, bound = host_cost[i], 1e3 * cost.copy_seconds(host_cost[i][1]), ""
        if i in on_device:
            action, why = "save", "fits the device budget"
            _tag(tags, c, keep_reason, offload=False)
        elif i in on_host:
            action, why = "offload", "device budget spent; fits the host budget and the copy window"
            if copied < c.nbytes:
                why += f"; on the host {compress.upper()}-packed ({copied} bytes, lossy)"
            elif named[i].startswith(("sensitive: ", "quantised: ")):
                why += f"; on the host unpacked ({named[i].split(': ', 1)[1]})"
            elif named[i]:
                why += f"; on the host unpacked (exact={named[i]})"
            _tag(tags, c, OFFLOAD, offload=True, exact=named[i])
        else:
            action = "recompute"
            if c.nbytes < plan.min_offload_bytes:
                why, bound = f"device budget spent; under min_offload_bytes ({plan.min_offload_bytes})", SIZE_BOUND
            elif pooled > host_left:
                why, bound = "device and host budgets spent", HOST_BOUND
            else:
                why, bound = "device budget spent; the copy window is full", COPY_BOUND
        if c.form is not None:
            why += f"; its smaller exact form {', '.join(f.name for f in c.form)} is what the backward needs"
        decisions.append(Decision(name=c.node.name, op=op_name(c.node), module=module_path(c.node), bytes=c.nbytes,
                                  action=action, recompute_ms=1e3 * c.seconds, copy_ms=copy_ms, why=why,
                                  form=tuple(f.name for f in c.form or ()), exact=named[i], bound=bound))
    return tuple(decisions)
