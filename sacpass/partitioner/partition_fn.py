"""The partition function: run the must-save pass, call PyTorch's min-cut, audit the result.

A thin layer over ``min_cut_rematerialization_partition``: sacpass only adds tags PyTorch already reads.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..errors import MustSaveViolation, SacpassError, SacpassWarning
from ..passes.must_save import TagResult, tag_must_save_pass
from ..policies import Policy
from ..report import Report
from .audit import audit_partition, build_report, refresh_tags, saved_despite_recompute, snapshot_joint

__all__ = ["PartitionResult", "partition", "SacpassPartitioner"]


@dataclass
class PartitionResult:
    """Everything one partition produced, handed to the backend's sink."""

    report: Report
    joint_text: str  # the joint graph with its tags, before the min-cut
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    tags: TagResult


def _joint_text(gm: torch.fx.GraphModule) -> str:
    lines = []
    for node in gm.graph.nodes:
        tag = node.meta.get("recompute")
        suffix = f"  # {tag.name}" if tag is not None else ""
        if "ac_graph_id" in node.meta:
            suffix += f" ac={node.meta['ac_graph_id']}"
        lines.append(f"{node.format_node()}{suffix}")
    return "\n".join(lines) + "\n"


def partition(gm: torch.fx.GraphModule, joint_inputs: Sequence[Any], *, policy: Policy, strict: bool = True,
              graph_id: str = "g0", sink: Callable[[PartitionResult], None] | None = None,
              **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Partition an AOTAutograd joint graph with ``policy``'s tags honoured, or raise."""
    tags = tag_must_save_pass(gm, policy, strict=strict)
    must_save = tags.names("MUST_SAVE")
    if must_save and functorch_config.activation_memory_budget == 0:
        raise SacpassError(
            "sacpass: torch._functorch.config.activation_memory_budget is 0, which makes the partitioner "
            f"save only graph inputs and drop every MUST_SAVE tag ({len(must_save)} from this policy). Set the "
            "budget above 0 (e.g. 1.0, the default) or compile without a must-save policy.")
    joint = snapshot_joint(gm)
    joint_text = _joint_text(gm)
    kwargs.setdefault("compiler", "inductor")
    fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
    joint = refresh_tags(joint, gm)  # PyTorch's own MUST_SAVE (region boundaries, collectives) lands in the min-cut
    violations = audit_partition(bw, tags)
    report = build_report(graph_id, str(policy), joint, fw, bw, tags, violations)
    if sink is not None:
        sink(PartitionResult(report, joint_text, fw, bw, tags))
    if violations:
        msg = ("sacpass: the backward graph recomputes must-save node(s): " + "; ".join(violations) +
               ". The partitioner could not honour the tag (the value is only needed by the backward, or is "
               "a view); select the op whose output the forward uses, or pass strict=False to only warn.")
        if strict:
            raise MustSaveViolation(msg)
        warnings.warn(msg, SacpassWarning, stacklevel=2)
    kept = saved_despite_recompute(gm, bw, tags)
    if kept:
        warnings.warn("sacpass: must-recompute node(s) saved for backward anyway: " + "; ".join(kept) + ". "
                      "Move the checkpoint boundary, or drop the recompute selector for this op.",
                      SacpassWarning, stacklevel=2)
    return fw, bw


class SacpassPartitioner(CustomPartitionerFn):
    """``torch._inductor.config.custom_partitioner_fn`` object; ``uuid()`` carries the policy into cache keys."""

    def __init__(self, policy: Policy, *, strict: bool, uuid: str | None,
                 next_graph_id: Callable[[], str], sink: Callable[[PartitionResult], None]):
        self.policy, self.strict, self._uuid = policy, strict, uuid
        self._next_graph_id, self._sink = next_graph_id, sink
        if uuid is not None:
            _LIVE[uuid] = self

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        return partition(gm, joint_inputs, policy=self.policy, strict=self.strict,
                         graph_id=self._next_graph_id(), sink=self._sink, **kwargs)

    def uuid(self) -> str | None:
        return self._uuid

    def __deepcopy__(self, memo):  # inductor deep-copies its config; this object is shared on purpose
        return self

    def __reduce__(self):
        # Inductor pickles its config into the FX-graph cache key; only the uuid identifies this object.
        # Without a uuid (an uncacheable predicate) pickling fails, which makes the caches bypass.
        if self._uuid is None:
            raise TypeError("sacpass partitioner without a cache key (uncacheable predicate selector)")
        return (_partitioner_for_uuid, (self._uuid,))


_LIVE: "weakref.WeakValueDictionary[str, SacpassPartitioner]" = weakref.WeakValueDictionary()


def _partitioner_for_uuid(uuid: str) -> SacpassPartitioner:
    try:
        return _LIVE[uuid]
    except KeyError:
        raise SacpassError(f"sacpass: no live partitioner with cache key {uuid}; build the backend in this "
                           f"process before loading compiled artifacts that reference it.") from None
