"""The partition function: one pass through, in order.

    tag the policy -> keep discrete decisions -> plan (budget / planner; a model plan's activation inputs)
    -> PyTorch's min-cut -> offload -> audit -> Report

A thin layer over ``min_cut_rematerialization_partition``: sacpass only adds tags PyTorch already reads
(and, after the min-cut, moves offloaded values to the host). The partition finds its compile's
:class:`~sacpass.partitioner.context.CompileContext` and appends its result there; it never calls back.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx

from ..errors import MustSaveViolation, SacpassError, warn
from ..nodes import snapshot, tag_name
from ..passes.discrete import keep_decisions_pass
from ..passes.offload import activation_inputs, exact_marks, offload_marks, offload_pass
from ..passes.plan import expected_ms, has_region, plan_pass, release_regions
from ..passes.tag_policy import tag_policy_pass
from ..plan import ModelPlan
from ..selectors import DiscreteSelector
from .audit import audit_partition, describe_partition
from .context import CompileContext, PartitionResult, current

__all__ = ["partition", "SacpassPartitioner", "make_partitioner"]


def joint_text(gm: torch.fx.GraphModule) -> str:
    lines = []
    for node in gm.graph.nodes:
        tag = tag_name(node)
        suffix = f"  # {tag}" if tag is not None else ""
        if "sacpass_offload" in node.meta:
            suffix += " offload"
        if "ac_graph_id" in node.meta:
            suffix += f" ac={node.meta['ac_graph_id']}"
        lines.append(f"{node.format_node()}{suffix}")
    return "\n".join(lines) + "\n"


def _min_cut(gm, joint_inputs, budget: float | None, **kwargs):
    """PyTorch's min-cut; with sacpass's budget or plan in charge, PyTorch's own knapsack runs at ``budget``
    (the memory budget over released regions) or not at all (1.0: the plan's tags decide)."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    kwargs.setdefault("compiler", "inductor")
    if budget is None:
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
    with functorch_config.patch(activation_memory_budget=budget):
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


def _check_pytorch_budget(tags) -> None:
    from torch._functorch import config as functorch_config

    kept = tags.names("MUST_SAVE") | tags.names("MUST_CPU_OFFLOAD")
    if kept and functorch_config.activation_memory_budget == 0:
        raise SacpassError(
            "sacpass: torch._functorch.config.activation_memory_budget is 0, which makes PyTorch's partitioner "
            f"save only graph inputs and drop every MUST_SAVE tag ({len(kept)} from this policy). Use "
            "sacpass.backend(memory_budget=0) instead (recompute everything but the must-saves), or set "
            "PyTorch's budget above 0.")


def _settle(decisions, bw: torch.fx.GraphModule, facts) -> tuple:
    """A planned save or offload the partition did not need (the backward reads a value derived from it, kept
    for another reason) is reported as such, so decisions and saved bytes agree."""
    import dataclasses

    saved = {n.name for n in bw.graph.nodes if n.op == "placeholder"}

    def kept(name: str) -> bool:  # the node, or one of its getitems / views, is a backward input
        return any(s == name or (facts.get(s) is not None and facts[s].parent == name) for s in saved)

    return tuple(d if d.action == "recompute" or any(kept(n) for n in d.form or (d.name,)) else
                 dataclasses.replace(d, action="unneeded", why="the backward reads a value derived from it, "
                                     "which the partition keeps for another reason")
                 for d in decisions)


def partition(gm: torch.fx.GraphModule, joint_inputs: Sequence[Any], ctx: CompileContext,
              **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Partition an AOTAutograd joint graph with the context's policy honoured, or raise."""
    cfg = ctx.config
    tags = tag_policy_pass(gm, cfg.policy)
    keep_decisions_pass(gm, tags)
    model_plan = cfg.plan.key if isinstance(cfg.plan, ModelPlan) else ""  # registered by as_plan
    inputs = activation_inputs(gm, kwargs.get("static_lifetime_input_indices"), cfg.plan.min_offload_bytes) \
        if model_plan and cfg.plan.inputs and has_region(gm.graph) else []
    decisions = plan_pass(gm, tags, memory_budget=cfg.memory_budget, plan=cfg.plan, inputs=inputs)
    budget = None
    if cfg.plan is not None:
        budget = 1.0
    elif cfg.memory_budget is not None:
        budget = 1.0 if cfg.memory_budget == 0 else cfg.memory_budget
        if cfg.memory_budget > 0:
            release_regions(gm.graph)
    else:
        _check_pytorch_budget(tags)
    facts = snapshot(gm)
    text = joint_text(gm)
    marks, exact = offload_marks(gm), exact_marks(gm)
    fw, bw = _min_cut(gm, joint_inputs, budget, **kwargs)
    expected = (expected_ms(fw, cfg.plan.cost), expected_ms(bw, cfg.plan.cost)) if model_plan else (0.0, 0.0)
    offloaded = offload_pass(fw, bw, marks, kwargs.get("num_fwd_outputs", 0), model_plan, inputs, exact, expected)
    final_tags = {n.name: tag_name(n) for n in gm.graph.nodes}  # the min-cut adds MUST_SAVE at region edges
    decisions = _settle(decisions, bw, facts)
    audit = audit_partition(gm, facts, fw, bw, tags, offloaded)
    report = describe_partition(ctx.ids.next(), str(cfg.policy), facts, final_tags, fw, bw, tags, offloaded,
                                audit, decisions, ctx.routed_checkpoints,
                                chosen_by="budget" if cfg.memory_budget and cfg.plan is None else "min-cut")
    if ctx.uncached:  # the report says why this graph will be partitioned again at every compile
        note = f"compile caches bypassed: {ctx.uncached}"
        report = dataclasses.replace(report, warnings=report.warnings + (note,))
    ctx.results.append(PartitionResult(report, text, fw, bw))
    if audit.violations:
        msg = ("sacpass: the partition does not honour the policy: " + "; ".join(audit.violations) + ". The "
               "partitioner could not keep the value in the forward (it is only needed by the backward, or is a "
               "view); select the op whose output the forward uses, or pass strict=False to only warn.")
        if cfg.strict:
            raise MustSaveViolation(msg)
        warn(msg)
    if audit.warnings and any(isinstance(s, DiscreteSelector) for s in cfg.policy.defaults):
        warn("sacpass: " + "; ".join(audit.warnings) + ".")
    if audit.kept:
        warn("sacpass: must-recompute node(s) saved for backward anyway: " + "; ".join(audit.kept) + ". "
             "Move the checkpoint boundary, or drop the recompute selector for this op.")
    return fw, bw


def make_partitioner(open_context: Callable[[], CompileContext]):
    """The partitioner object (Inductor's ``custom_partitioner_fn`` slot or ``aot_autograd``'s
    ``partition_fn``). ``open_context()`` gives a context with the config and cache key as of now, for calls
    outside a compile the backend opened. Built lazily: its base class comes from Inductor, which
    ``import sacpass`` avoids."""
    return _partitioner_class()(open_context)


_CLASS = None


def _partitioner_class():
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class SacpassPartitioner(CustomPartitionerFn):
        """``custom_partitioner_fn`` object; ``uuid()`` carries the policy into the compile-cache keys. Both
        read the compile in progress: the key is the one its backend computed when that compile started."""

        def __init__(self, open_context: Callable[[], CompileContext]):
            self._open = open_context

        def _context(self) -> CompileContext:
            ctx = current()
            return ctx if ctx is not None and ctx.owner is self else self._open()

        def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
            return partition(gm, joint_inputs, self._context(), **kwargs)

        def uuid(self) -> str | None:
            # Inductor reads this for the AOTAutograd and FX-graph cache keys, at each compile
            uuid = self._context().uuid
            if uuid is not None:
                _LIVE[uuid] = self
            return uuid

        def __deepcopy__(self, memo):  # inductor deep-copies its config; this object is shared on purpose
            return self

        def __reduce__(self):
            # Inductor pickles its config into the cache keys; only the uuid identifies this object. Without
            # a uuid (an uncacheable predicate) pickling fails, which makes the caches bypass.
            uuid = self.uuid()
            if uuid is None:
                raise TypeError("sacpass partitioner without a cache key (uncacheable predicate selector)")
            return (_partitioner_for_uuid, (uuid,))

    _CLASS = SacpassPartitioner
    return _CLASS


def __getattr__(name: str):
    if name == "SacpassPartitioner":
        return _partitioner_class()
    raise AttributeError(name)


import weakref  # noqa: E402

_LIVE: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def _partitioner_for_uuid(uuid: str):
    try:
        return _LIVE[uuid]
    except KeyError:
        raise SacpassError(f"sacpass: no live partitioner with cache key {uuid}; build the backend in this "
                           f"process before loading compiled artifacts that reference it.") from None
