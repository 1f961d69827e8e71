"""Audit a partition and describe it: which must-save nodes leaked into the backward, what is saved, why."""
from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx

from ..passes.must_save import TagResult, op_name_of, source_of
from ..report import (GRAPH_INPUT, MIN_CUT, MUST_SAVE, PYTORCH_MUST_SAVE, Report, SavedTensor, dtype_text,
                      shape_text, tensor_nbytes)
from ..selectors import module_path_of

__all__ = ["JointNodeInfo", "snapshot_joint", "refresh_tags", "audit_partition", "build_report", "saved_despite_recompute"]

_PASS_THROUGH = {  # ops through which a saved tensor still is "the must-save value"
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_to_copy", "aten::convert_element_type",
    "prims::convert_element_type", "aten::clone", "aten::alias", "aten::unsqueeze", "aten::squeeze",
    "aten::expand", "aten::permute", "aten::t", "aten::slice", "aten::select",
}


@dataclass(frozen=True)
class JointNodeInfo:
    """What the report needs of a joint-graph node, taken before the min-cut rewrites the graph."""

    name: str
    op: str
    is_input: bool
    module: str
    source: str
    recompute: str | None  # tag after the sacpass pass
    parent: str | None  # first tensor input (to see through views and casts)


def snapshot_joint(gm: torch.fx.GraphModule) -> dict[str, JointNodeInfo]:
    out = {}
    for node in gm.graph.nodes:
        tag = node.meta.get("recompute")
        parent = next((a.name for a in node.all_input_nodes), None)
        out[node.name] = JointNodeInfo(
            name=node.name, op=op_name_of(node), is_input=node.op == "placeholder",
            module=module_path_of(node), source=source_of(node),
            recompute=getattr(tag, "name", None), parent=parent)
    return out


def refresh_tags(joint: dict[str, JointNodeInfo], gm: torch.fx.GraphModule) -> dict[str, JointNodeInfo]:
    """The snapshot with each node's tag as the min-cut left it (it adds MUST_SAVE at region boundaries)."""
    final = {n.name: getattr(n.meta.get("recompute"), "name", None) for n in gm.graph.nodes}
    return {name: dataclasses.replace(info, recompute=final.get(name, info.recompute))
            for name, info in joint.items()}


def _call_names(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes if n.op == "call_function"}


def audit_partition(bw: torch.fx.GraphModule, tags: TagResult) -> list[str]:
    """Must-save nodes that the backward graph still computes, described for the user."""
    bw_nodes = _call_names(bw)
    violations = []
    for rec in tags.records:
        if rec.tag == "MUST_SAVE" and rec.name in bw_nodes:
            violations.append(
                f"{rec.name} ({rec.op}, module {rec.module or '<root>'}, {rec.source or 'unknown source'}; "
                f"selector {rec.selector}) is computed in the backward graph")
    return violations


def saved_despite_recompute(joint_gm: torch.fx.GraphModule, bw: torch.fx.GraphModule, tags: TagResult) -> list[str]:
    """Nodes a must-recompute selector tagged that the forward saves anyway (read after the min-cut)."""
    bw_inputs = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    final = {n.name: n.meta.get("recompute") for n in joint_gm.graph.nodes}
    out = []
    for rec in tags.records:
        if rec.tag != "MUST_RECOMPUTE" or rec.selector.startswith("derived from") or rec.name not in bw_inputs:
            continue
        why = ("PyTorch turns a value one checkpoint region passes to a later one into MUST_SAVE"
               if getattr(final.get(rec.name), "name", None) == "MUST_SAVE" else "the partitioner kept it")
        out.append(f"{rec.name} ({rec.op}, selector {rec.selector}; {why})")
    return out


def _reason(name: str, joint: dict[str, JointNodeInfo], selector_of: dict[str, str]) -> tuple[str, str]:
    info = joint.get(name)
    if info is None:
        return MIN_CUT, ""
    if info.is_input:
        return GRAPH_INPUT, ""
    if name in selector_of:
        return MUST_SAVE, selector_of[name]
    # a view or cast of a must-save value carries the same reason
    cur, hops = info, 0
    while cur is not None and hops < 4 and cur.op.split(".")[0] in _PASS_THROUGH and cur.parent:
        cur, hops = joint.get(cur.parent), hops + 1
        if cur is not None and cur.name in selector_of:
            return MUST_SAVE, selector_of[cur.name]
    if info.recompute == "MUST_SAVE":
        return PYTORCH_MUST_SAVE, ""
    return MIN_CUT, ""


def build_report(graph_id: str, policy: str, joint: dict[str, JointNodeInfo], fw: torch.fx.GraphModule,
                 bw: torch.fx.GraphModule, tags: TagResult, violations: list[str]) -> Report:
    selector_of = {r.name: r.selector for r in tags.records if r.tag == "MUST_SAVE"}
    saved, symints = [], 0
    for node in bw.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            symints += isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int))
            continue
        info = joint.get(node.name)
        reason, selector = _reason(node.name, joint, selector_of)
        saved.append(SavedTensor(
            name=node.name, op="input" if info is not None and info.is_input else (info.op if info else "?"),
            shape=shape_text(val), dtype=dtype_text(val.dtype), bytes=tensor_nbytes(val),
            module=info.module if info else "", source=info.source if info else "", reason=reason,
            selector=selector))
    fw_calls, bw_calls = _call_names(fw), _call_names(bw)
    recomputed = Counter(op_name_of(bw_calls[n]) for n in bw_calls if n in fw_calls and n in joint
                         and bw_calls[n].target is not operator.getitem)
    return Report(graph=graph_id, policy=policy, torch_version=torch.__version__, saved=saved,
                  saved_symints=symints, recomputed=dict(sorted(recomputed.items())),
                  tagged=[dict(r.__dict__) for r in tags.records], unmatched=list(tags.unmatched),
                  violations=list(violations))
