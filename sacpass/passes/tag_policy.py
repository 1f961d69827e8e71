"""tag_policy_pass: stamp PyTorch's own checkpoint tags on the joint-graph nodes a policy selects.

Requires: an AOTAutograd joint graph (placeholders ``primals_*`` and ``tangents_*``), before partitioning.
Ensures, for every forward node (never the backward part of the joint: those are not recomputations):

- selected to save (explicit, registered, or a default: discrete decisions, collectives): the node and every
  getitem that unpacks it (nested tuples included) have ``meta["recompute"] = CheckpointPolicy.MUST_SAVE``
  (a custom decision's floating outputs with the reason ``decision values``: nothing rebuilds them);
  along chains of cheap unary ops fed only by a saved value, links no smaller than what precedes them are
  ``MUST_RECOMPUTE`` and links narrower than everything before them are ``MUST_SAVE``, so the narrowest form
  (int32, never a widened int64) is what the backward loads;
- selected to offload: tagged like a save (the min-cut must keep it) and marked ``meta["sacpass_offload"]``
  with the selector, so the offload pass moves it to host memory after the min-cut;
- selected to recompute: ``MUST_RECOMPUTE``.

Nothing else changes: other tags, ``ac_graph_id`` and the graph's structure stay as they were. Explicit
selectors that match nothing in a graph that could hold them are listed (``unmatched``); whether that is an
error is decided once per compile, when the first backward runs (see sacpass.selector_check).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import SelectorError
from ..nodes import (backward_part, is_cheap_unary, is_getitem, is_view, module_path, module_stack, node_nbytes,
                     node_op, op_name, source_of, unpackers)
from ..policies import Policy
from ..selectors import VALUE_INDEX_OPS, DiscreteSelector, ModuleOpSelector

__all__ = ["TagRecord", "TagResult", "tag_policy_pass", "checkable", "has_checkpoint_region", "OFFLOAD_KEY", "EXACT_KEY"]

OFFLOAD_KEY = "sacpass_offload"  # node.meta key: the offload selector (or plan) that moves this value to host
EXACT_KEY = "sacpass_exact"  # node.meta key: the ModelPlan(exact=) selector that keeps this value unpacked on the host

# why a node was tagged (TagRecord.reason), also the report's reason for a saved tensor
MUST_SAVE, DISCRETE, OFFLOAD, RECOMPUTE = "must-save", "discrete", "offload", "recompute"
DECISION_VALUES = "decision values"  # a decision's floating outputs its integer ones cannot rebuild
_DISCRETE = DiscreteSelector()


@dataclass(frozen=True)
class TagRecord:
    """One node a pass tagged."""

    name: str  # node name in the joint graph
    op: str  # producing op, "ns::op.overload"
    tag: str  # the PyTorch policy set: "MUST_SAVE", "MUST_RECOMPUTE" or "MUST_CPU_OFFLOAD"
    reason: str  # must-save | discrete | decision values | offload | recompute | budget | plan | derived
    selector: str  # the selector (or pass) that chose it
    module: str  # module path relative to the compiled root
    source: str  # "file.py:line" of the user code that produced it
    previous: str | None  # the tag the node had before (PREFER_RECOMPUTE inside a checkpoint, None outside)


@dataclass
class TagResult:
    """What one run of the pass did."""

    records: list[TagRecord] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # explicit selectors matching nothing where they could
    absent: list[str] = field(default_factory=list)  # explicit selectors this graph cannot hold (no error)
    skipped_backward: list[str] = field(default_factory=list)  # matches inside the backward part, left alone

    def names(self, tag: str = "MUST_SAVE") -> set[str]:
        return {r.name for r in self.records if r.tag == tag}

    def add(self, node: torch.fx.Node, tag: CheckpointPolicy, reason: str, selector: str,
            offload: bool = False, op: str | None = None) -> None:
        previous = node.meta.get("recompute")
        node.meta["recompute"] = tag
        if offload:
            node.meta[OFFLOAD_KEY] = selector
        self.records.append(TagRecord(
            name=node.name, op=op or op_name(node), tag="MUST_CPU_OFFLOAD" if offload else tag.name, reason=reason,
            selector=selector, module=module_path(node), source=source_of(node),
            previous=getattr(previous, "name", None)))


def has_checkpoint_region(graph: torch.fx.Graph) -> bool:
    """Whether the joint graph holds a checkpointed region (nodes Dynamo's checkpoint tagged)."""
    return any("ac_graph_id" in n.meta or n.meta.get("recompute") is CheckpointPolicy.PREFER_RECOMPUTE
               for n in graph.nodes)


def checkable(selector, graph: torch.fx.Graph, has_region: bool | None = None) -> bool:
    """Whether an explicit selector that matched nothing in ``graph`` is an error there.

    The rule: a module-scoped selector must match in every graph that holds a node of its module; any other
    selector must match in every graph that holds a checkpointed region. A graph that cannot contain the
    selected module or op (the embedding graph before a graph break, a loss graph) is not an error.
    """
    if isinstance(selector, ModuleOpSelector):
        return any(selector.matches_module(module_stack(n)) for n in graph.nodes if n.op == "call_function")
    return has_checkpoint_region(graph) if has_region is None else has_region


def _has_tensor_output(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return any(isinstance(v, torch.Tensor) or isinstance(v, (list, tuple)) for v in vals) or val is None


def _cheap_derivatives(roots: list[torch.fx.Node], backward: set[torch.fx.Node]
                       ) -> list[tuple[torch.fx.Node, CheckpointPolicy]]:
    """Nodes computed from a must-save value by a chain of cheap unary ops (``ids.clamp(0).long()``).

    Left to the min-cut, such a chain can be saved in a widened form (int64 instead of int32). A link no
    smaller than the narrowest value before it is tagged MUST_RECOMPUTE (the backward rebuilds it); a link
    narrower than everything before it (``topk(...).indices.int()``), on a chain nothing else reads, is
    tagged MUST_SAVE, so the narrow form is what the backward loads and the wide producer need not be kept.
    """
    out: list[tuple[torch.fx.Node, CheckpointPolicy]] = []
    # (node, narrowest size so far, whether every link so far has this chain as its only user)
    frontier = [(r, node_nbytes(r), len(r.users) == 1) for r in roots]
    seen = set(roots)
    while frontier:
        node, narrowest, linear = frontier.pop()
        for user in node.users:
            if user in seen or user in backward or not is_cheap_unary(user):
                continue
            if user.meta.get("recompute") is CheckpointPolicy.MUST_SAVE:
                continue
            seen.add(user)
            size = node_nbytes(user)
            # a narrower link replaces the wide value only if nothing else reads the wide value
            if linear and size is not None and narrowest is not None and size < narrowest:
                out.append((user, CheckpointPolicy.MUST_SAVE))
                frontier.append((user, size, len(user.users) == 1))
            else:
                out.append((user, CheckpointPolicy.MUST_RECOMPUTE))
                frontier.append((user, narrowest, linear and len(user.users) == 1))
    return out


def _describe(node: torch.fx.Node) -> str:
    return f"{node.name} ({op_name(node)}, module {module_path(node) or '<root>'}, {source_of(node) or 'unknown source'})"


def _refuse_unsaveable(node: torch.fx.Node, sel) -> None:
    if is_view(node):
        raise SelectorError(
            f"sacpass: selector {sel} selects {node.name} ({op_name(node)}), a view. The partitioner cannot "
            f"ban a view from recomputation; select the op that produces its base.")
    if not _has_tensor_output(node):
        raise SelectorError(
            f"sacpass: selector {sel} selects {node.name} ({op_name(node)}), which produces no tensor; there "
            f"is nothing to save. Select the op producing the tensor to keep.")


def _save_reason(node: torch.fx.Node, action: str, sel) -> str:
    """Why a selected node is kept. A selection that returns (values, indices) and is saved explicitly is kept
    as a discrete decision too: its indices in their narrowest form, its values rebuilt by a gather."""
    if action == "offload":
        return OFFLOAD
    if isinstance(sel, DiscreteSelector):
        return DISCRETE
    op = node_op(node)
    if node.target is op and op._schema.name in VALUE_INDEX_OPS and _DISCRETE(node):
        return DISCRETE
    return MUST_SAVE


def _output_reason(out: torch.fx.Node, node: torch.fx.Node, reason: str, sel) -> tuple[str, str]:
    """(reason, selector text) for one output of a saved node. A discrete decision's floating outputs are
    rebuilt from its indices where sacpass knows how (ATen selections: keep_decisions_pass); a custom op's
    cannot be, and are kept as what they are, with a reason that says so."""
    val = out.meta.get("val")
    if reason != DISCRETE or out is node or not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point \
            or node_op(node)._schema.name in VALUE_INDEX_OPS:
        return reason, str(sel)
    return DECISION_VALUES, (f"{sel} (its floating output: sacpass cannot rebuild {op_name(node)}'s values from "
                             f"its integer outputs, so they are saved with them)")


def tag_policy_pass(gm: torch.fx.GraphModule, policy: Policy) -> TagResult:
    """Tag the nodes ``policy`` selects. Returns what was tagged; raises on refused or conflicting input."""
    graph = gm.graph
    backward = backward_part(graph)
    has_region = has_checkpoint_region(graph)  # before this pass adds tags of its own
    result = TagResult()
    matched: set[object] = set()

    for node in list(graph.nodes):
        if node.op != "call_function" or is_getitem(node):
            continue
        hit = policy.action(lambda s: s(node), lambda: f"node {_describe(node)}")
        if hit is None:
            continue
        action, sel = hit
        if node in backward:
            result.skipped_backward.append(node.name)
            continue
        matched.add(sel)
        if action == "recompute":
            result.add(node, CheckpointPolicy.MUST_RECOMPUTE, RECOMPUTE, str(sel))
            continue
        _refuse_unsaveable(node, sel)
        reason = _save_reason(node, action, sel)
        targets = [node] + unpackers(node)
        for t in targets:
            why, chosen_by = _output_reason(t, node, reason, sel)
            result.add(t, CheckpointPolicy.MUST_SAVE, why, chosen_by, offload=action == "offload")
        if action == "save":
            roots = targets
            if reason == DISCRETE and node_op(node)._schema.name in VALUE_INDEX_OPS:
                roots = [t for t in targets if not (is_getitem(t) and t.args[1] == 0)]  # values are rebuilt
            for d, d_tag in _cheap_derivatives(roots, backward):
                if d_tag is CheckpointPolicy.MUST_SAVE:  # a narrower form of the value: kept for the same reason
                    result.add(d, d_tag, reason, f"derived from {sel}", op=op_name(node))
                else:
                    result.add(d, d_tag, "derived", f"derived from {sel}")

    explicit = [s for s in policy.explicit if s not in matched]
    result.unmatched = [str(s) for s in explicit if checkable(s, graph, has_region)]
    result.absent = [str(s) for s in explicit if not checkable(s, graph, has_region)]
    return result

