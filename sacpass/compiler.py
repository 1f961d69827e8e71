"""The compile: the :class:`Backend` that ``torch.compile(model, backend=sacpass.backend(...))`` calls.

One compile, in order: (warn about checkpointed regions Dynamo ran eagerly) -> ``repair_module_paths_pass``
and ``route_checkpoints_pass`` on the Dynamo graph -> open a :class:`~sacpass.partitioner.CompileContext`
-> ``compile_fx`` (``inner="inductor"``, sacpass in Inductor's ``custom_partitioner_fn`` slot, after
Inductor's joint passes) or ``aot_autograd`` with the same partition function (``inner="aot_eager"``, graphs
run eagerly) -> read the partitions off the context -> sinks: ``backend.reports`` / ``backend.results``,
dumps, the persisted copy for warm caches (:mod:`sacpass.report_store`), ``TORCH_TRACE``. The explicit
selectors are checked at the first backward (:mod:`sacpass.selector_check`); the options are checked by
:mod:`sacpass.options`. ``torch.compile(model, backend="sacpass", options=...)`` reaches
:func:`sacpass_backend`, registered as a ``torch_dynamo_backends`` entry point.
Dynamo and Inductor are imported when a compile starts, never at ``import sacpass``.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import torch
import torch.fx

from . import report_store
from ._version import sources_digest
from .dump import Dumper, trace_report
from .errors import warn
from .frames import running
from .options import check_mode, check_options, options_key
from .partitioner.context import CompileContext, GraphIds, PartitionConfig, PartitionResult, active
from .first_step import CountedGraph, FirstStep, checkpoint_regions_in, device_of, trains
from .offload.plans import declare
from .plan import ModelPlan, Plan, as_plan, check_memory_budget
from .policies import Policy, note_registry_used
from .report import Report
from .selector_check import SelectorCheck, plan_exact, unmatched

__all__ = ["Backend", "backend", "named_backend", "sacpass_backend"]


def _boxed_nop(gm: torch.fx.GraphModule, example_inputs: Any):
    from functorch.compile import make_boxed_func
    return make_boxed_func(gm.forward)


def _append_newest(items: list, item: Any, limit: int) -> None:
    """Append, keeping the newest ``limit`` items (0 keeps none)."""
    items.append(item)
    del items[:max(len(items) - max(limit, 0), 0)]


def _inside_eager_checkpoint() -> bool:
    """True when the compile was entered from inside an eager torch.utils.checkpoint.

    The non-reentrant checkpoint, in every form (``checkpoint(f, x)``, the decorator form
    ``@checkpoint(use_reentrant=False)`` of torch 2.14+, the recomputation in backward), runs ``f`` under
    saved-tensor hooks of its own: the innermost hooks are torch.utils.checkpoint's. The reentrant one pushes
    none (it runs ``f`` inside ``CheckpointFunction.forward``), nor does a non-reentrant one whose ``f`` pushed
    hooks of its own: those are told by the frames of torch.utils.checkpoint on the stack."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if hooks is not None and getattr(hooks[0], "__module__", None) == torch.utils.checkpoint.__name__:
        return True
    return running(torch.utils.checkpoint.__file__,
                   ("checkpoint", "forward", "_checkpoint_without_reentrant_generator", "_checkpoint_impl"))


class Backend:
    """A torch.compile backend that partitions with sacpass. Reports land in ``self.reports``.

    The policy's registered part (``register_must_save``), predicate keys and the plan's host budget are read
    at each compile, so the cache key (:attr:`uuid`) follows them. A backend keeps the newest
    ``max_reports`` reports and ``max_results`` partition results (each holds a forward and a backward
    GraphModule); set them on the instance (or the class) to keep more or fewer, and :meth:`clear` drops both.
    """

    max_reports = 4096
    max_results = 64
    is_sacpass_backend = True  # how sacpass.graph_breaks tells a sacpass compile (it imports no backend)

    def __init__(self, save=None, recompute=None, offload=None, inner: str = "inductor", strict: bool = True,
                 dump_dir: str | os.PathLike | None = None, use_registered: bool = True,
                 save_collectives: bool = True, save_discrete: bool = True, memory_budget: float | None = None,
                 plan: Plan | str | None = None):
        check_options(inner, strict=strict, use_registered=use_registered, save_collectives=save_collectives,
                      save_discrete=save_discrete)
        self.inner, self.strict, self.use_registered = inner, strict, use_registered
        self._policy = Policy.build(save, recompute, offload, use_registered=False,
                                    save_collectives=save_collectives, save_discrete=save_discrete)
        self._config = PartitionConfig(policy=self._policy, strict=strict,
                                       memory_budget=check_memory_budget(memory_budget), plan=as_plan(plan))
        self._resolved_plan: ModelPlan | None = None  # the model plan with nothing left to decide (see resolve)
        self._first_step = FirstStep()  # where a model plan that counts its regions counts them
        dump_dir = dump_dir if dump_dir is not None else os.environ.get("SACPASS_DUMP_DIR") or None
        self.dumper = Dumper(dump_dir) if dump_dir else None
        self.reports: list[Report] = []
        self.results: list[PartitionResult] = []  # fw/bw graphs of partitions done in this process
        self._ids = GraphIds()
        self._lock = threading.Lock()
        self._warned_uncached: set[str] = set()
        self._partitioner = None
        self._selector_check = SelectorCheck(self)
        from .graph_breaks import watch
        watch()

    @property
    def config(self) -> PartitionConfig:
        """The config a compile starting now partitions under (the registry read now; the model plan as resolved,
        once it is)."""
        config = self._config
        if self._resolved_plan is not None:
            config = dataclasses.replace(config, plan=self._resolved_plan)
        if not self.use_registered:
            return config
        policy = self._policy.with_registry()
        return config if policy is self._policy else dataclasses.replace(config, policy=policy)

    @property
    def plan(self):
        """The plan compiles use: a model plan as resolved (its regions counted, its costs measured) once it is,
        else as given."""
        return self.config.plan

    def resolve_plan(self, device, regions: int | None = None, op_seconds: dict | None = None) -> None:
        """Fix what the model plan left open, for ``device`` (see :meth:`sacpass.ModelPlan.resolve`); once."""
        with self._lock:
            if self._resolved_plan is None:
                given = self._config.plan
                self._resolved_plan = declare(given.resolve(device, regions=regions, op_seconds=op_seconds), given)

    @property
    def policy(self) -> Policy:
        return self.config.policy

    @property
    def uuid(self) -> str | None:
        """The cache key a compile starting now runs under (None: the compile caches are bypassed)."""
        return self.open_context().uuid

    def open_context(self, routed_checkpoints: tuple[str, ...] = (), with_plan: bool = True) -> CompileContext:
        """A compile's context: the config as of now (without its plan for a counting plan's first step) and its
        cache key (see :func:`report_store.artifact_key`)."""
        config = self.config if with_plan else dataclasses.replace(self.config, plan=None)
        key = config.key()
        why = config.policy.uncacheable() if key is None else []
        return CompileContext(config, self._ids, routed_checkpoints, owner=self.partitioner,
                              uuid=None if key is None else f"sacpass-{sources_digest()}-{key}",
                              uncached="; ".join(why))

    @property
    def partitioner(self):
        """The partition function object (built at the first compile: it derives from an Inductor class)."""
        if self._partitioner is None:
            from .partitioner.partition_fn import make_partitioner
            self._partitioner = make_partitioner(self.open_context)
        return self._partitioner

    def clear(self) -> None:
        """Drop the reports and partition results kept so far (the compiled graphs are not affected)."""
        with self._lock:
            self.reports.clear()
            self.results.clear()

    # ------------------------------------------------------------------ compile
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        from .passes.checkpoint_regions import route_checkpoints_pass
        from .passes.module_paths import repair_module_paths_pass

        if _inside_eager_checkpoint():
            warn("sacpass: torch.compile was entered from inside an eager torch.utils.checkpoint "
                 "(checkpoint(compile(f))). The outer checkpoint discards what the compiled graph saves, so "
                 "sacpass's must-save tags have no effect. Put the checkpoint inside the compiled function: "
                 "compile(checkpoint(f)).")
        repair_module_paths_pass(gm)
        routed = tuple(route_checkpoints_pass(gm))
        plan = self._config.plan
        if isinstance(plan, ModelPlan) and not plan.resolved and self._resolved_plan is None and \
                checkpoint_regions_in(gm) and trains(example_inputs):
            if plan.counts_regions:  # the first step runs the policy alone, counted; the plan compiles at the second
                measuring = self._compile_graph(gm, example_inputs, routed, with_plan=False)
                return CountedGraph(gm, measuring, self._first_step,
                                    lambda inputs: self._compile_counted(gm, inputs, routed))
            self.resolve_plan(device_of(example_inputs))
        return self._compile_graph(gm, example_inputs, routed)

    def _compile_counted(self, gm: torch.fx.GraphModule, inputs: list, routed: tuple[str, ...]):
        """A counted graph's compile, after the first step: the plan resolved from what that step counted."""
        first = self._first_step
        self.resolve_plan(first.device or device_of(inputs), regions=first.regions, op_seconds=first.op_seconds())
        return self._compile_graph(gm, inputs, routed)

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any], routed: tuple[str, ...],
                       with_plan: bool = True):
        """One graph through sacpass's partition (see the module docstring), its results published;
        ``with_plan=False``: the policy alone (a counting plan's first step)."""
        ctx = self.open_context(routed, with_plan=with_plan)
        self._warn_uncached(ctx)
        key = report_store.artifact_key(gm, example_inputs, ctx.uuid, self.inner)
        hits = report_store.cache_hits()
        with active(ctx):
            compiled = self._compile(gm, example_inputs)
        if self.use_registered:
            note_registry_used()
        for result in ctx.results:
            self._publish(result, key)
        if (self.policy.explicit or plan_exact(self.plan)) and not self._selector_check.done:
            compiled = self._selector_check.wrap(compiled)
        self._account_unpartitioned(ctx, example_inputs, key, hit=report_store.cache_hits() > hits)
        return compiled

    def _warn_uncached(self, ctx: CompileContext) -> None:
        """Once per backend and reason: the compile caches are bypassed, and why."""
        if ctx.uncached and ctx.uncached not in self._warned_uncached:
            self._warned_uncached.add(ctx.uncached)
            warn(f"sacpass: the FX-graph and AOTAutograd caches are bypassed for this backend: {ctx.uncached}. "
                 f"Give the predicate a `cache_hash` attribute (a string that changes when its logic does), or "
                 f"make what it reads a plain value (number, string, bool, None, tuple) or an object with a "
                 f"`cache_hash`, to cache.")

    def _account_unpartitioned(self, ctx: CompileContext, example_inputs, key: str | None, hit: bool) -> None:
        """A compile that ran no partition: an inference graph (nothing to report), or a training graph served
        from AOTAutograd's cache (PyTorch's own signal: its hit counter), whose report is the persisted copy."""
        training = torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
        if ctx.results or not training:
            return
        if hit:
            report = report_store.load(key)
            if report is not None:
                self._keep(report.with_graph(self._ids.next(), from_cache=True))
        elif key is not None:  # AOTAutograd found no output needing a gradient: an inference graph
            report_store.persist(key, None)

    def _compile(self, gm, example_inputs):
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": self.partitioner})
        from torch._dynamo.backends.common import aot_autograd
        inner = aot_autograd(fw_compiler=_boxed_nop, bw_compiler=_boxed_nop, partition_fn=self.partitioner,
                             keep_inference_input_mutations=True)
        return inner(gm, example_inputs)

    # ------------------------------------------------------------------ sinks
    def _publish(self, result: PartitionResult, key: str | None) -> None:
        with self._lock:
            _append_newest(self.results, result, self.max_results)
        self._keep(result.report)
        if self.dumper is not None:
            self.dumper.write(result)
        trace_report(result.report)
        if key is not None:
            report_store.persist(key, result.report)

    def _keep(self, report: Report) -> None:
        with self._lock:
            _append_newest(self.reports, report, self.max_reports)

    def context_fn(self):
        """A ``context_fn`` for ``torch.utils.checkpoint`` with this backend's policy, for regions that run
        eagerly (see :func:`sacpass.context_fn`)."""
        from .context import _from_policy
        return _from_policy(self.policy)

    # ------------------------------------------------------------------ summaries
    def unmatched(self) -> list[str]:
        """Explicit selectors that have matched in no graph this backend partitioned so far."""
        return unmatched(self.reports, self.policy, plan_exact(self.config.plan))

    def print_reports(self, file=None) -> None:
        for r in self.reports:
            r.print(file=file)

    def __repr__(self) -> str:
        return f"sacpass.Backend(inner={self.inner!r}, strict={self.strict}, policy={self.policy})"


def backend(save=None, recompute=None, offload=None, inner: str = "inductor", strict: bool = True,
            dump_dir: str | os.PathLike | None = None, use_registered: bool = True, save_collectives: bool = True,
            save_discrete: bool = True, memory_budget: float | None = None,
            plan: Plan | str | None = None) -> Backend:
    """Build a sacpass backend for ``torch.compile(model, backend=...)``.

    save:       selectors whose outputs are MUST_SAVE (besides those declared with register_must_save)
    recompute:  selectors forced to MUST_RECOMPUTE (wins over every default)
    offload:    selectors whose outputs go to pinned host memory between forward and backward
    inner:      "inductor" (compile_fx) or "aot_eager" (same partition, eager execution)
    strict:     raise (True) or warn (False) on an unmatched explicit selector or a policy the partition breaks
    dump_dir:   write per-graph dumps there (also SACPASS_DUMP_DIR)
    use_registered:   include the selectors declared with register_must_save (default True)
    save_collectives: keep functional collectives must-save inside checkpoints too (PyTorch's rule outside
                      them); a recompute selector matching a collective wins
    save_discrete:    keep discrete decisions (top-k, sort, argmax, routers, integer-valued custom ops) the
                      backward needs, as their narrowest integer form; a recompute selector wins
    memory_budget:    share in [0, 1] of what no checkpointing would keep that checkpointed regions keep on the
                      device (0: recompute all but the must-saves); None: off
    plan:       "auto" or a sacpass.Plan: choose save / offload / recompute per value under budgets
    """
    return Backend(save=save, recompute=recompute, offload=offload, inner=inner, strict=strict, dump_dir=dump_dir,
                   use_registered=use_registered, save_collectives=save_collectives, save_discrete=save_discrete,
                   memory_budget=memory_budget, plan=plan)


_NAMED: dict[str, Backend] = {}


def named_backend(options: dict[str, Any] | None = None) -> Backend:
    """The Backend that ``torch.compile(m, backend="sacpass", options=options)`` uses (one per option set)."""
    options = dict(options or {})
    key = options_key(options)
    if key not in _NAMED:
        _NAMED[key] = backend(**options)
    return _NAMED[key]


def sacpass_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                    mode: str | None = None):
    """Entry point registered as ``torch_dynamo_backends: sacpass``."""
    check_mode(mode)
    return named_backend(options)(gm, example_inputs)


sacpass_backend.is_sacpass_backend = True  # see Backend.is_sacpass_backend
