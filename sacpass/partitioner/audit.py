"""Audit a partition and describe it: what the backward still computes that it must not, what is saved, why.

Reads the joint graph's :class:`~sacpass.nodes.NodeFacts` (taken before the min-cut), the forward and
backward graphs, and the tag records; builds the one immutable :class:`~sacpass.report.Report`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx

from ..nodes import NodeFacts, dtype_text, op_name, recomputed_names, shape_text, tensor_nbytes, tag_name
from ..passes.plan import PlanResult
from ..passes.tag_policy import TagResult
from ..report import GRAPH_INPUT, MIN_CUT, OFFLOAD, PYTORCH_MUST_SAVE, Report, SavedTensor
from ..selectors import DiscreteSelector

__all__ = ["PartitionFacts", "Audit", "audit_partition", "describe_partition"]


@dataclass(frozen=True)
class PartitionFacts:
    """What one partition produced, as the audit and the report read it."""

    joint: torch.fx.GraphModule  # the joint graph, tagged
    nodes: dict[str, NodeFacts]  # its nodes' facts, taken before the min-cut
    final_tags: dict[str, str | None]  # its nodes' tags after the min-cut (which adds MUST_SAVE at region edges)
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    tags: TagResult  # what the tag pass (and the passes after it) tagged
    planned: PlanResult  # what the plan stage decided
    offloaded: dict[str, str]  # saved name -> selector, of what the offload pass moved to the host


@dataclass(frozen=True)
class Audit:
    violations: tuple[str, ...]  # must-save / offload values the partition did not honour (strict: raised)
    warnings: tuple[str, ...]  # discrete decisions the backward recomputes (asked for), offloads not done
    kept: tuple[str, ...]  # must-recompute values PyTorch saved anyway


def _calls(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes if n.op == "call_function"}


def _where(facts: NodeFacts | None, name: str) -> str:
    if facts is None:
        return name
    return f"{name} ({facts.op}, module {facts.module or '<root>'}, {facts.source or 'unknown source'})"


def audit_partition(partition: PartitionFacts) -> Audit:
    """What the partition did against the policy: violations (must-save or offload values it did not honour),
    warnings (discrete decisions the backward recomputes) and must-recompute values PyTorch kept."""
    joint, facts, fw, bw = partition.joint, partition.nodes, partition.forward, partition.backward
    tags, offloaded = partition.tags, partition.offloaded
    bw_calls = _calls(bw)
    recomputed = recomputed_names(fw, bw)
    in_backward = set(bw_calls) | set(recomputed.values())     # by name, or the same op on the same values
    bw_inputs = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    violations, warnings, kept = [], [], []
    for rec in tags.records:
        if rec.tag in ("MUST_SAVE", "MUST_CPU_OFFLOAD") and rec.name in in_backward:
            violations.append(f"{_where(facts.get(rec.name), rec.name)} is computed in the backward graph "
                              f"(selector {rec.selector})")
        if rec.tag == "MUST_CPU_OFFLOAD" and rec.name in bw_inputs and rec.name not in offloaded:
            violations.append(f"{_where(facts.get(rec.name), rec.name)} stays on the device between forward and "
                              f"backward (selector {rec.selector}): it is also a forward output or not a dense "
                              f"tensor")
        if rec.tag == "MUST_RECOMPUTE" and not rec.selector.startswith("derived") and rec.name in bw_inputs:
            why = ("PyTorch turns a value one checkpoint region passes to a later one into MUST_SAVE"
                   if tag_name(_joint_node(joint, rec.name)) == "MUST_SAVE" else "the partitioner kept it")
            kept.append(f"{rec.name} ({rec.op}, selector {rec.selector}; {why})")
    discrete = DiscreteSelector()
    joint_nodes = {n.name: n for n in joint.graph.nodes}
    for name in sorted(set(recomputed.values())):
        jn = joint_nodes.get(name)
        if jn is not None and name in facts and discrete(jn):
            warnings.append(f"the backward recomputes discrete decision {_where(facts[name], name)}: a recompute can "
                            f"choose differently from the forward ({_keep_decision_fix(tags, name, facts[name])} to "
                            f"keep the forward's choice)")
    return Audit(tuple(violations), tuple(warnings), tuple(kept))


def _keep_decision_fix(tags: TagResult, name: str, facts: NodeFacts) -> str:
    """What keeps a recomputed discrete decision: dropping the recompute= selector that chose it, or, with no
    selector on it (save_discrete=False), saving discrete decisions again or this op by name."""
    chosen = next((r.selector for r in tags.records if r.name == name and r.tag == "MUST_RECOMPUTE"), None)
    if chosen is not None and not chosen.startswith("derived"):
        return f"drop its recompute= selector {chosen}"
    op = facts.op.rsplit(".", 1)[0]
    return f"pass save_discrete=True (the default), or save=[{op!r}] for this op alone,"


def _joint_node(joint: torch.fx.GraphModule, name: str) -> torch.fx.Node | None:
    return next((n for n in joint.graph.nodes if n.name == name), None)


def _reasons(tags: TagResult, facts: dict[str, NodeFacts], final_tags: dict[str, str | None],
             offloaded: dict[str, str], chosen_by: str = MIN_CUT):
    """A function: saved node name -> (reason, selector)."""
    tagged = {r.name: (r.reason, r.selector, r.op) for r in tags.records
              if r.tag in ("MUST_SAVE", "MUST_CPU_OFFLOAD")}

    def reason(name: str) -> tuple[str, str, str | None]:
        """(reason, selector, the op to name: a kept decision is named after the op that decided)."""
        info = facts.get(name)
        if info is None:
            return MIN_CUT, "", None
        if name in offloaded:  # a model plan places activation inputs too
            return OFFLOAD, offloaded[name], None
        if info.is_input:
            return GRAPH_INPUT, "", None
        cur, hops = info, 0
        while cur is not None:  # a view or cast of a tagged value carries its reason
            if cur.name in tagged:
                why, sel, op = tagged[cur.name]
                return why, sel, (op if why == "discrete" else None)
            if not cur.cast_or_view or not cur.parent or hops >= 4:
                break
            cur, hops = facts.get(cur.parent), hops + 1
        if final_tags.get(name) == "MUST_SAVE":
            return PYTORCH_MUST_SAVE, "", None
        return chosen_by, "", None

    return reason


def describe_partition(partition: PartitionFacts, audit: Audit, *, graph_id: str, policy: str,
                       routed: tuple[str, ...]) -> Report:
    """The Report of one partition: one row per tensor the backward receives from the forward. A value no tag
    decided is chosen by the min-cut, or by PyTorch's budget solver when one ran."""
    facts, fw, bw, tags = partition.nodes, partition.forward, partition.backward, partition.tags
    planned = partition.planned
    reason_of = _reasons(tags, facts, partition.final_tags, partition.offloaded, planned.chosen_by)
    saved, symints = [], 0
    for node in bw.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        val = node.meta.get("sacpass_stashed", node.meta.get("val"))  # a stash's handle: the value it holds
        if not isinstance(val, torch.Tensor):
            symints += isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int))
            continue
        info = facts.get(node.name)
        reason, selector, decided_by = reason_of(node.name)
        saved.append(SavedTensor(
            name=node.name,
            op="input" if info is not None and info.is_input else (decided_by or (info.op if info else "?")),
            shape=shape_text(val), dtype=dtype_text(val.dtype), bytes=tensor_nbytes(val),
            module=info.module if info else "", source=info.source if info else "", reason=reason,
            selector=selector))
    bw_calls = _calls(bw)
    recomputed = Counter(op_name(bw_calls[b]) for b, f in recomputed_names(fw, bw).items() if f in facts)
    tagged = [dict(r.__dict__) for r in tags.records]
    return Report(graph=graph_id, policy=policy, torch_version=torch.__version__, saved=tuple(saved),
                  saved_symints=symints, recomputed=dict(recomputed), tagged=tuple(tagged),
                  decisions=planned.settled(bw, facts), unmatched=tuple(tags.unmatched), violations=audit.violations,
                  warnings=audit.warnings, routed_checkpoints=routed)
