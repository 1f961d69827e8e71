"""The partition function: one pass through, in order.

    merge duplicates (as the min-cut does first) -> tag the policy -> keep discrete decisions
    -> plan (budget / planner; a model plan's activation inputs) -> PyTorch's min-cut -> offload -> audit -> Report

Each pass hands the next a record: ``TagResult`` (tag), ``PlanResult`` (plan: the decisions, the min-cut's
budget, what to offload or stash), ``PartitionFacts`` (all of it, for the audit and the report).

A thin layer over ``min_cut_rematerialization_partition``: sacpass only adds tags PyTorch already reads
(and, after the min-cut, moves offloaded values to the host). The partition finds its compile's
:class:`~sacpass.partitioner.context.CompileContext` and appends its result there; it never calls back.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx

from ..errors import MustSaveViolation, SacpassError, warn
from ..nodes import snapshot, tag_name
from ..passes.cse import cse_pass
from ..passes.discrete import keep_decisions_pass
from ..passes.offload import offload_pass
from ..passes.plan import plan_pass
from ..passes.tag_policy import tag_policy_pass
from ..selectors import DiscreteSelector
from .audit import PartitionFacts, audit_partition, describe_partition
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
    with _must_saves_through_the_min_cut():
        if budget is None:
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        with functorch_config.patch(activation_memory_budget=budget):
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


@contextlib.contextmanager
def _must_saves_through_the_min_cut():
    """For the min-cut's own call. Under an ``activation_memory_budget`` below 1, PyTorch before 2.15, when
    nothing but MUST_SAVE nodes is left to its knapsack, saves the graph inputs and the must-saves it had banned
    from recompute, as they are: a multi-output op's tuple node (which cannot cross to the backward) and not a
    must-save it had not banned (a decision's int32 form), so the partition computes them again in the backward.
    That answer is replaced by the one torch 2.15 gives there: the min-cut with every ban but the reductions'
    lifted (what its knapsack would return with nothing to trade), which keeps every must-save the backward
    reads. Scoped to this call: the partitioner module is as it was after it."""
    from torch._functorch import config as functorch_config
    from torch._functorch import partitioners
    from torch.utils.checkpoint import CheckpointPolicy

    choose = partitioners.choose_saved_values_set

    def must_save(node) -> bool:
        return node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE

    def must_saves_left_out(joint_graph, saved, node_info) -> bool:
        """``saved`` is the graph inputs and must-saves only, and a must-save is not among them."""
        n = len(node_info.inputs)
        if list(saved[:n]) != list(node_info.inputs) or not all(must_save(v) for v in saved[n:]):
            return False
        kept = set(saved)
        return any(must_save(node) and node not in kept for node in joint_graph.nodes)

    def chosen(joint_graph, node_info, memory_budget=1, *args, **kwargs):
        saved = choose(joint_graph, node_info, memory_budget, *args, **kwargs)
        if 0 < memory_budget < 1 and must_saves_left_out(joint_graph, saved, node_info):
            lifted = {f.name: False for f in dataclasses.fields(partitioners.MinCutOptions)}
            if "ban_if_reduction" in lifted:
                lifted["ban_if_reduction"] = functorch_config.ban_recompute_reductions
            saved, _ = partitioners.solve_min_cut(joint_graph, node_info, partitioners.MinCutOptions(**lifted))
        return saved

    partitioners.choose_saved_values_set = chosen
    try:
        yield
    finally:
        partitioners.choose_saved_values_set = choose


def partition(gm: torch.fx.GraphModule, joint_inputs: Sequence[Any], ctx: CompileContext,
              **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Partition an AOTAutograd joint graph with the context's policy honoured, or raise."""
    cfg = ctx.config
    cse_pass(gm)
    tags = tag_policy_pass(gm, cfg.policy)
    keep_decisions_pass(gm, tags)
    planned = plan_pass(gm, tags, memory_budget=cfg.memory_budget, plan=cfg.plan,
                        static_inputs=kwargs.get("static_lifetime_input_indices"))
    nodes, text = snapshot(gm), joint_text(gm)
    fw, bw = _min_cut(gm, joint_inputs, planned.min_cut_budget, **kwargs)
    offloaded = offload_pass(fw, bw, planned, kwargs.get("num_fwd_outputs", 0))
    final_tags = {n.name: tag_name(n) for n in gm.graph.nodes}  # the min-cut adds MUST_SAVE at region edges
    facts = PartitionFacts(gm, nodes, final_tags, fw, bw, tags, planned, offloaded)
    audit = audit_partition(facts)
    report = describe_partition(facts, audit, graph_id=ctx.ids.next(), policy=str(cfg.policy),
                                routed=ctx.routed_checkpoints)
    if ctx.uncached:  # the report says why this graph will be partitioned again at every compile
        note = f"compile caches bypassed: {ctx.uncached}"
        report = dataclasses.replace(report, warnings=report.warnings + (note,))
    ctx.results.append(PartitionResult(report, text, fw, bw))
    _raise_or_warn(audit, cfg)
    return fw, bw


def _raise_or_warn(audit, cfg) -> None:
    """What the audit found, as the config says: a violation raises (strict) or warns; a recomputed decision
    warns where the defaults keep decisions; a must-recompute value PyTorch kept warns."""
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
            # a uuid (an uncacheable predicate) this compile's caches bypass. Not by a TypeError: Inductor's
            # pickler would mark the class unpicklable for the rest of the process, and every later backend's
            # compiles, cacheable or not, would bypass too.
            uuid = self.uuid()
            if uuid is None:
                raise _bypass("sacpass partitioner without a cache key (uncacheable predicate selector)")
            return (_partitioner_for_uuid, (uuid,))

    _CLASS = SacpassPartitioner
    return _CLASS


def _bypass(why: str) -> Exception:
    """The exception Inductor's and AOTAutograd's caches take as "bypass this compile" (a TypeError where this
    torch has none)."""
    try:
        from torch._inductor.codecache import BypassFxGraphCache
    except ImportError:  # pragma: no cover - every supported torch has it
        return TypeError(why)
    return BypassFxGraphCache(why)


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
