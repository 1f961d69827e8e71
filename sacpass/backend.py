"""The torch.compile backend: ``torch.compile(model, backend=sacpass.backend(...))``.

One compile, in order: (warn about checkpointed regions Dynamo ran eagerly) -> ``route_checkpoints_pass`` on
the Dynamo graph -> open a :class:`~sacpass.partitioner.CompileContext` -> ``compile_fx`` (``inner="inductor"``,
sacpass in Inductor's ``custom_partitioner_fn`` slot, after Inductor's joint passes) or ``aot_autograd`` with
the same partition function (``inner="aot_eager"``, graphs run eagerly) -> read the partitions off the context
-> sinks: ``backend.reports`` / ``backend.results``, dumps, the persisted copy for warm caches, ``TORCH_TRACE``.
Dynamo and Inductor are imported when a compile starts, never at ``import sacpass``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import dataclasses
import sys
import threading
from typing import Any

import torch
import torch.fx

from ._version import PASS_VERSION, __version__
from .dump import Dumper, trace_report
from .errors import BackendOptionError, warn
from .partitioner.context import CompileContext, GraphIds, PartitionConfig, PartitionResult, active
from .plan import Plan, as_plan, check_memory_budget
from .policies import Policy, note_registry_used
from .report import Report

__all__ = ["Backend", "backend", "named_backend", "sacpass_backend", "VALID_OPTIONS", "INNERS"]

VALID_OPTIONS = ("save", "recompute", "offload", "inner", "strict", "dump_dir", "use_registered",
                 "save_collectives", "save_discrete", "memory_budget", "plan")
INNERS = ("inductor", "aot_eager")


@functools.lru_cache(maxsize=None)
def _files_digest() -> str:
    """sacpass's sources as this process read them: hashed once, so an edit on disk while a process runs
    (whose code stays what it imported) does not change its keys."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for sub in ("", "passes", "partitioner"):
        folder = os.path.join(root, sub)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()


def _sources_digest() -> str:
    return hashlib.sha256(f"{__version__}:{PASS_VERSION}:{_files_digest()}".encode()).hexdigest()[:16]


def _checkpoint_frames() -> bool:
    """True when called (at compile time) from inside an eager torch.utils.checkpoint."""
    frame = sys._getframe(2)
    ckpt_file = torch.utils.checkpoint.__file__
    while frame is not None:
        code = frame.f_code
        if code.co_filename == ckpt_file and code.co_name in ("checkpoint", "forward", "_checkpoint_without_reentrant_generator"):
            return True
        frame = frame.f_back
    return False


def _boxed_nop(gm: torch.fx.GraphModule, example_inputs: Any):
    from functorch.compile import make_boxed_func
    return make_boxed_func(gm.forward)


def _append_newest(items: list, item: Any, limit: int) -> None:
    """Append, keeping the newest ``limit`` items (0 keeps none)."""
    items.append(item)
    del items[:max(len(items) - max(limit, 0), 0)]


def _cache_hits() -> int:
    from torch._dynamo.utils import counters
    return counters["aot_autograd"]["autograd_cache_hit"]


class Backend:
    """A torch.compile backend that partitions with sacpass. Reports land in ``self.reports``.

    The policy's registered part (``register_must_save``), predicate keys and the plan's host budget are read
    at each compile, so the cache key (:attr:`uuid`) follows them. A backend keeps the newest
    ``max_reports`` reports and ``max_results`` partition results (each holds a forward and a backward
    GraphModule); set them on the instance (or the class) to keep more or fewer, and :meth:`clear` drops both.
    """

    max_reports = 4096
    max_results = 64

    def __init__(self, save=None, recompute=None, offload=None, inner: str = "inductor", strict: bool = True,
                 dump_dir: str | os.PathLike | None = None, use_registered: bool = True,
                 save_collectives: bool = True, save_discrete: bool = True, memory_budget: float | None = None,
                 plan: Plan | str | None = None):
        if inner not in INNERS:
            raise BackendOptionError(
                f"sacpass: inner={inner!r} is not supported; use one of {', '.join(map(repr, INNERS))}.")
        for name, value in (("strict", strict), ("use_registered", use_registered),
                            ("save_collectives", save_collectives), ("save_discrete", save_discrete)):
            if not isinstance(value, bool):
                raise BackendOptionError(f"sacpass: {name}={value!r} must be True or False.")
        self.inner, self.strict, self.use_registered = inner, strict, use_registered
        self._policy = Policy.build(save, recompute, offload, use_registered=False,
                                    save_collectives=save_collectives, save_discrete=save_discrete)
        self._config = PartitionConfig(policy=self._policy, strict=strict,
                                       memory_budget=check_memory_budget(memory_budget), plan=as_plan(plan))
        dump_dir = dump_dir if dump_dir is not None else os.environ.get("SACPASS_DUMP_DIR") or None
        self.dumper = Dumper(dump_dir) if dump_dir else None
        self.reports: list[Report] = []
        self.results: list[PartitionResult] = []  # fw/bw graphs of partitions done in this process
        self._ids = GraphIds()
        self._lock = threading.Lock()
        self._warned_uncached: set[str] = set()
        self._partitioner = None
        self._selectors_checked = False
        from .graph_breaks import watch
        watch()

    @property
    def config(self) -> PartitionConfig:
        """The config a compile starting now partitions under (the registry read now)."""
        if not self.use_registered:
            return self._config
        policy = self._policy.with_registry()
        return self._config if policy is self._policy else dataclasses.replace(self._config, policy=policy)

    @property
    def policy(self) -> Policy:
        return self.config.policy

    @property
    def uuid(self) -> str | None:
        """The cache key a compile starting now runs under (None: the compile caches are bypassed)."""
        return self.open_context().uuid

    def open_context(self, routed_checkpoints: tuple[str, ...] = ()) -> CompileContext:
        """A compile's context: the config as of now and its cache key (see :meth:`_artifact_key`)."""
        config = self.config
        key = config.key()
        why = config.policy.uncacheable() if key is None else []
        return CompileContext(config, self._ids, routed_checkpoints, owner=self.partitioner,
                              uuid=None if key is None else f"sacpass-{_sources_digest()}-{key}",
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

        if _checkpoint_frames():
            warn("sacpass: torch.compile was entered from inside an eager torch.utils.checkpoint "
                 "(checkpoint(compile(f))). The outer checkpoint discards what the compiled graph saves, so "
                 "sacpass's must-save tags have no effect. Put the checkpoint inside the compiled function: "
                 "compile(checkpoint(f)).")
        repair_module_paths_pass(gm)
        ctx = self.open_context(tuple(route_checkpoints_pass(gm)))
        self._warn_uncached(ctx)
        key = self._artifact_key(gm, example_inputs, ctx.uuid)
        hits = _cache_hits()
        with active(ctx):
            compiled = self._compile(gm, example_inputs)
        if self.use_registered:
            note_registry_used()
        for result in ctx.results:
            self._publish(result, key)
        if self.policy.explicit and not self._selectors_checked:
            compiled = self._check_selectors_at_backward(compiled)
        self._account_unpartitioned(ctx, example_inputs, key, hit=_cache_hits() > hits)
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
            self._load_persisted(key)
        elif key is not None:  # AOTAutograd found no output needing a gradient: an inference graph
            self._persist(key, None)

    def _compile(self, gm, example_inputs):
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": self.partitioner})
        from torch._dynamo.backends.common import aot_autograd
        inner = aot_autograd(fw_compiler=_boxed_nop, bw_compiler=_boxed_nop, partition_fn=self.partitioner,
                             keep_inference_input_mutations=True)
        return inner(gm, example_inputs)

    # ------------------------------------------------------------------ selectors
    def _check_selectors_at_backward(self, compiled):
        """Check the explicit selectors once the model's forward is done: when the first backward through a
        graph of this backend starts, every graph of the step has been compiled. The rule: an explicit
        selector must match in at least one graph of the compile; a graph that does not hold the selected
        module or op (a graph before a graph break, a loss graph) is no error by itself."""
        from torch.utils._pytree import tree_leaves

        def run(*args):
            out = compiled(*args)
            if not self._selectors_checked:
                grads = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                if grads:
                    torch.autograd.graph.register_multi_grad_hook(grads, self._check_selectors, mode="any")
            return out

        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run

    def _check_selectors(self, *_grads) -> None:
        if self._selectors_checked:
            return
        self._selectors_checked = True
        missing = self.unmatched()
        if not missing:
            return
        from .errors import UnmatchedSelectorError
        from .graph_breaks import hint

        regions = [r.graph for r in self.reports if r.unmatched]
        msg = (f"sacpass: selector(s) {', '.join(missing)} matched no forward node in any graph of this compile "
               f"({len(self.reports)} graph(s); checked in {', '.join(regions) or 'none'}: the graphs holding its "
               f"module or, for a selector without one, a checkpointed region). Check the op name and module pattern against the graphs (module paths are "
               f"relative to the module given to torch.compile; dump_dir= writes the graphs).{self._present(missing)}"
               f"{hint()}")
        if self.strict:
            raise UnmatchedSelectorError(msg + " Pass strict=False to only warn.")
        warn(msg)

    def _present(self, missing: list[str]) -> str:
        """What the partitioned forward graphs hold, nearest to the unmatched selectors first."""
        from .nodes import module_stack, node_op
        from .selectors import nearest_first, selector_parts

        modules, ops = set(), set()
        for result in self.results:
            for node in result.forward.graph.nodes:
                op = node_op(node)
                if op is not None:
                    ops.add(op._schema.name)
                    modules.update(f"{path} ({cls})" if path else cls for path, cls in module_stack(node))
        parts = [selector_parts(s) for s in self.policy.explicit if str(s) in missing]
        pattern = " ".join(m for m, _ in parts if m)
        text = f" Ops present, nearest first: {', '.join(nearest_first(parts[0][1], ops)) or 'none'}." if parts else ""
        if pattern:
            text += f" Module paths present, nearest first: {', '.join(nearest_first(pattern, modules)) or 'none'}."
        return text

    # ------------------------------------------------------------------ sinks
    def _publish(self, result: PartitionResult, key: str | None) -> None:
        with self._lock:
            _append_newest(self.results, result, self.max_results)
        self._keep(result.report)
        if self.dumper is not None:
            self.dumper.write(result)
        trace_report(result.report)
        if key is not None:
            self._persist(key, result.report)

    def _keep(self, report: Report) -> None:
        with self._lock:
            _append_newest(self.reports, report, self.max_reports)

    def _artifact_key(self, gm: torch.fx.GraphModule, example_inputs: list[Any], uuid: str | None) -> str | None:
        """Identifies one Dynamo graph under this backend: the key a persisted report is stored under.

        Every input of a partition decision is in this key, and (through ``uuid``, the partitioner's
        ``uuid()``) in Inductor's FX-graph and AOTAutograd cache keys, or the caches are bypassed:

        - the policy: explicit save / recompute / offload selectors; predicate selectors by
          :func:`~sacpass.selectors.predicate_key` (source, defaults, closure cells, globals read; computed at
          each compile; a predicate without a stable key bypasses the caches, with a warning and a report line)
        - the registry (``register_must_save``), read at each compile when ``use_registered``
        - the defaults (``save_discrete``, ``save_collectives``), ``strict``, ``memory_budget``
        - the plan: its fields, its cost model, and its host budget as resolved on this host
          (``host_bytes=None``: a share of this machine's memory)
        - sacpass's sources and versions (``_sources_digest``), the torch version, ``inner`` (the inner
          compiler; Inductor's own config is in its keys)
        - PyTorch's ``activation_memory_budget`` (the whole functorch config is in AOTAutograd's key)
        - grad mode, autocast state, deterministic algorithms
        - the Dynamo graph's code, and per input: shape (symbolic where dynamic), strides, dtype, device,
          requires_grad; a non-tensor input by type
        Not in the key: ``dump_dir`` (it only writes files).
        With dynamic shapes the planner's byte counts are taken at the sizes of the compile that filled
        the cache, as PyTorch's own knapsack does.
        """
        if uuid is None:
            return None
        from torch._functorch import config as fc
        autocast = [(d, torch.get_autocast_dtype(d)) for d in torch._C._autocast_supported_devices()
                    if torch.is_autocast_enabled(d)]
        parts = [uuid, self.inner, torch.__version__, str(fc.activation_memory_budget), str(torch.is_grad_enabled()),
                 str(autocast), str(torch.are_deterministic_algorithms_enabled()), gm.code]
        placeholders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        for i, x in enumerate(example_inputs):
            fake = placeholders[i] if i < len(placeholders) else None
            t = fake if isinstance(fake, torch.Tensor) else x  # symbolic sizes where Dynamo made them dynamic
            if isinstance(t, torch.Tensor):
                parts.append(f"{tuple(map(str, t.shape))}:{tuple(map(str, t.stride()))}:{t.dtype}:"
                             f"{t.device}:{t.requires_grad}")
            else:
                parts.append(repr(type(x)))
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]

    @staticmethod
    def _report_dir() -> str:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return os.path.join(cache_dir(), "sacpass_reports")

    def _persist(self, key: str, report: Report | None) -> None:
        """Store ``report`` for a warm-cache rebuild; None: the graph is one without a partition."""
        folder = self._report_dir()
        try:
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f"{key}.json.tmp{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(_NO_PARTITION if report is None else report.to_json())
            os.replace(tmp, os.path.join(folder, f"{key}.json"))
        except OSError as e:  # the compile itself succeeded; losing the report is worth a warning only
            warn(f"sacpass: could not persist the report for a warm-cache rebuild ({e}).")

    def _load_persisted(self, key: str | None) -> None:
        path = os.path.join(self._report_dir(), f"{key}.json") if key is not None else None
        if path is None or not os.path.exists(path):
            warn("sacpass: PyTorch served this graph from its AOTAutograd cache, and no sacpass report was "
                 "persisted for it, so backend.reports has no entry for it. Clear the Inductor cache "
                 "(TORCHINDUCTOR_CACHE_DIR) once to rebuild it.")
            return
        with open(path) as f:
            text = f.read()
        if text != _NO_PARTITION:
            self._keep(Report.from_json(text, where=path).with_graph(self._ids.next(), from_cache=True))

    def context_fn(self):
        """A ``context_fn`` for ``torch.utils.checkpoint`` with this backend's policy, for regions that run
        eagerly (see :func:`sacpass.context_fn`)."""
        from .context import _from_policy
        return _from_policy(self.policy)

    # ------------------------------------------------------------------ summaries
    def unmatched(self) -> list[str]:
        """Explicit selectors that have matched in no graph this backend partitioned so far."""
        matched = {t["selector"] for r in self.reports for t in r.tagged}
        return [str(s) for s in self.policy.explicit if str(s) not in matched]

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
_NO_PARTITION = '{"kind": "sacpass.no_partition"}'  # persisted for a graph that had no partition to report


def _options_key(options: dict[str, Any]) -> str:
    def norm(v):
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        return repr(v)
    return json.dumps({k: norm(v) for k, v in sorted(options.items())}, sort_keys=True)


def named_backend(options: dict[str, Any] | None = None) -> Backend:
    """The Backend that ``torch.compile(m, backend="sacpass", options=options)`` uses (one per option set)."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(VALID_OPTIONS))
    if unknown:
        raise BackendOptionError(
            f"sacpass: unknown backend option(s) {', '.join(map(repr, unknown))}; valid options are "
            f"{', '.join(VALID_OPTIONS)}.")
    key = _options_key(options)
    if key not in _NAMED:
        _NAMED[key] = backend(**options)
    return _NAMED[key]


def sacpass_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                    mode: str | None = None):
    """Entry point registered as ``torch_dynamo_backends: sacpass``."""
    if mode not in (None, "default"):
        raise BackendOptionError(f"sacpass: mode={mode!r} is not supported by the sacpass backend; pass "
                                 f"Inductor settings through torch._inductor.config instead.")
    return named_backend(options)(gm, example_inputs)
