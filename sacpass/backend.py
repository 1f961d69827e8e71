"""The torch.compile backend: ``torch.compile(model, backend=sacpass.backend(...))``.

One compile, in order: (warn about checkpointed regions Dynamo ran eagerly) -> ``route_checkpoints_pass`` on
the Dynamo graph -> open a :class:`~sacpass.partitioner.CompileContext` -> ``compile_fx`` (``inner="inductor"``,
sacpass in Inductor's ``custom_partitioner_fn`` slot, after Inductor's joint passes) or ``aot_autograd`` with
the same partition function (``inner="aot_eager"``, graphs run eagerly) -> read the partitions off the context
-> sinks: ``backend.reports`` / ``backend.results``, dumps, the persisted copy for warm caches, ``TORCH_TRACE``.
Dynamo and Inductor are imported when a compile starts, never at ``import sacpass``.
"""
from __future__ import annotations

import hashlib
import json
import os
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
from .policies import Policy
from .report import Report

__all__ = ["Backend", "backend", "named_backend", "sacpass_backend", "VALID_OPTIONS", "INNERS"]

VALID_OPTIONS = ("save", "recompute", "offload", "inner", "strict", "dump_dir", "use_registered",
                 "save_collectives", "save_discrete", "memory_budget", "plan")
INNERS = ("inductor", "aot_eager")


def _sources_digest() -> str:
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(f"{__version__}:{PASS_VERSION}".encode())
    for sub in ("", "passes", "partitioner"):
        folder = os.path.join(root, sub)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


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


def _cache_hits() -> int:
    from torch._dynamo.utils import counters
    return counters["aot_autograd"]["autograd_cache_hit"]


class Backend:
    """A torch.compile backend that partitions with sacpass. Reports land in ``self.reports``."""

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
        self.inner, self.strict = inner, strict
        policy = Policy.build(save, recompute, offload, use_registered=use_registered,
                              save_collectives=save_collectives, save_discrete=save_discrete)
        self.config = PartitionConfig(policy=policy, strict=strict, memory_budget=check_memory_budget(memory_budget),
                                      plan=as_plan(plan))
        dump_dir = dump_dir if dump_dir is not None else os.environ.get("SACPASS_DUMP_DIR") or None
        self.dumper = Dumper(dump_dir) if dump_dir else None
        self.reports: list[Report] = []
        self.results: list[PartitionResult] = []  # fw/bw graphs of partitions done in this process
        self._ids = GraphIds()
        self._lock = threading.Lock()
        key = self.config.key()
        self.uuid = None if key is None else f"sacpass-{_sources_digest()}-{key}"
        self._partitioner = None
        self._selectors_checked = False
        from .graph_breaks import watch
        watch()

    @property
    def policy(self) -> Policy:
        return self.config.policy

    @property
    def partitioner(self):
        """The partition function object (built at the first compile: it derives from an Inductor class)."""
        if self._partitioner is None:
            from .partitioner.partition_fn import make_partitioner
            self._partitioner = make_partitioner(self.config, self.uuid)
        return self._partitioner

    # ------------------------------------------------------------------ compile
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        from .passes.checkpoint_regions import route_checkpoints_pass
        from .passes.module_paths import repair_module_paths_pass

        if _checkpoint_frames():
            warn("sacpass: torch.compile was entered from inside an eager torch.utils.checkpoint "
                 "(checkpoint(compile(f))). The outer checkpoint discards what the compiled graph saves, so "
                 "sacpass's must-save tags have no effect. Put the checkpoint inside the compiled function: "
                 "compile(checkpoint(f)).")
        key = self._artifact_key(gm, example_inputs)
        repair_module_paths_pass(gm)
        ctx = CompileContext(self.config, self._ids, routed_checkpoints=tuple(route_checkpoints_pass(gm)))
        hits = _cache_hits()
        with active(ctx):
            compiled = self._compile(gm, example_inputs)
        for result in ctx.results:
            self._publish(result, key)
        if self.policy.explicit and not self._selectors_checked:
            compiled = self._check_selectors_at_backward(compiled)
        training = torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
        if not ctx.results and training and _cache_hits() > hits:
            # PyTorch's own signal: AOTAutograd served the graphs from its cache, so no partition ran
            self._load_persisted(key)
        return compiled

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
               f"({len(self.reports)} graph(s); {', '.join(regions) or 'none'} held a checkpointed region). Check "
               f"the op name and module pattern against the graphs (module paths are relative to the module "
               f"given to torch.compile; dump_dir= writes the graphs).{hint()}")
        if self.strict:
            raise UnmatchedSelectorError(msg + " Pass strict=False to only warn.")
        warn(msg)

    # ------------------------------------------------------------------ sinks
    def _publish(self, result: PartitionResult, key: str | None) -> None:
        with self._lock:
            self.reports.append(result.report)
            self.results.append(result)
        if self.dumper is not None:
            self.dumper.write(result)
        trace_report(result.report)
        if key is not None:
            self._persist(key, result.report)

    def _artifact_key(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str | None:
        """Identifies one Dynamo graph under this backend: the key a persisted report is stored under."""
        if self.uuid is None:
            return None
        from torch._functorch import config as fc
        parts = [self.uuid, self.inner, torch.__version__, str(fc.activation_memory_budget),
                 str(torch.is_grad_enabled()), gm.code]
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                parts.append(f"{tuple(str(s) for s in x.shape)}:{x.dtype}:{x.requires_grad}")
            else:
                parts.append(repr(type(x)))
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]

    @staticmethod
    def _report_dir() -> str:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return os.path.join(cache_dir(), "sacpass_reports")

    def _persist(self, key: str, report: Report) -> None:
        folder = self._report_dir()
        try:
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f"{key}.json.tmp{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(report.to_json())
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
            report = Report.from_json(f.read(), where=path)
        with self._lock:
            self.reports.append(report.with_graph(self._ids.next(), from_cache=True))

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
