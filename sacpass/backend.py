"""The torch.compile backend: ``torch.compile(model, backend=sacpass.backend(...))``.

``inner="inductor"`` goes through ``compile_fx`` with sacpass's partitioner in Inductor's supported
``custom_partitioner_fn`` slot (Inductor's joint passes still run first). ``inner="aot_eager"`` runs the
same partition function under ``aot_autograd`` and executes the graphs eagerly.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import threading
import warnings
from typing import Any, Callable

import torch
import torch.fx

from ._version import PASS_VERSION, __version__
from .dump import Dumper
from .errors import BackendOptionError, SacpassWarning
from .partitioner import PartitionResult, SacpassPartitioner
from .passes.checkpoint_regions import route_checkpoints_pass
from .policies import Policy
from .report import Report

__all__ = ["Backend", "backend", "named_backend", "sacpass_backend", "VALID_OPTIONS", "INNERS"]

VALID_OPTIONS = ("save", "recompute", "inner", "strict", "dump_dir", "use_registered", "save_collectives")
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
            # dynamo's own tracing of checkpoint happens on a fake frame; real frames mean eager checkpoint
            return True
        frame = frame.f_back
    return False


def _boxed_nop(gm: torch.fx.GraphModule, example_inputs: Any):
    from functorch.compile import make_boxed_func
    return make_boxed_func(gm.forward)


class Backend:
    """A torch.compile backend that partitions with sacpass. Reports land in ``self.reports``."""

    def __init__(self, save=None, recompute=None, inner: str = "inductor", strict: bool = True,
                 dump_dir: str | os.PathLike | None = None, use_registered: bool = True,
                 save_collectives: bool = True):
        if inner not in INNERS:
            raise BackendOptionError(
                f"sacpass: inner={inner!r} is not supported; use one of {', '.join(map(repr, INNERS))}.")
        if not isinstance(strict, bool):
            raise BackendOptionError(f"sacpass: strict={strict!r} must be True or False.")
        self.inner, self.strict = inner, strict
        self.policy = Policy.build(save, recompute, use_registered=use_registered,
                                   save_collectives=save_collectives)
        dump_dir = dump_dir if dump_dir is not None else os.environ.get("SACPASS_DUMP_DIR") or None
        self.dumper = Dumper(dump_dir) if dump_dir else None
        self.reports: list[Report] = []
        self.results: list[PartitionResult] = []  # fw/bw graphs of partitions done in this process
        self._lock = threading.Lock()
        self._pending_key: str | None = None
        self._pending_routed: list[str] = []  # checkpoint bodies route_checkpoints_pass routed (this compile)
        key = self.policy.cache_key()
        self.uuid = None if key is None else f"sacpass-{_sources_digest()}-{key}-{int(strict)}"
        if self.uuid is None:
            warnings.warn(
                f"sacpass: selector(s) {', '.join(self.policy.uncacheable())} have no stable cache key (a "
                f"lambda or closure); the FX-graph and AOTAutograd caches are bypassed for this backend. Give "
                f"the predicate a `cache_hash` attribute (a string that changes when its logic does) to cache.",
                SacpassWarning, stacklevel=2)
        self.partitioner = SacpassPartitioner(self.policy, strict=strict, uuid=self.uuid,
                                              next_graph_id=self._next_graph_id, sink=self._sink)

    # ------------------------------------------------------------------ compile
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        if _checkpoint_frames():
            warnings.warn(
                "sacpass: torch.compile was entered from inside an eager torch.utils.checkpoint "
                "(checkpoint(compile(f))). The outer checkpoint discards what the compiled graph saves, so "
                "sacpass's must-save tags have no effect. Put the checkpoint inside the compiled function: "
                "compile(checkpoint(f)).", SacpassWarning, stacklevel=2)
        key = self._artifact_key(gm, example_inputs)
        n_before = len(self.reports)
        self._pending_key = key
        self._pending_routed = route_checkpoints_pass(gm)
        try:
            compiled = self._compile(gm, example_inputs)
        finally:
            self._pending_key, self._pending_routed = None, []
        if len(self.reports) == n_before and key is not None:
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

    # ------------------------------------------------------------------ reports
    def _next_graph_id(self) -> str:
        with self._lock:
            return f"g{len(self.reports)}"

    def _sink(self, result: PartitionResult) -> None:
        result.report.routed_checkpoints = list(self._pending_routed)
        with self._lock:
            self.reports.append(result.report)
            self.results.append(result)
        if self.dumper is not None:
            self.dumper.write(result)
        if self._pending_key is not None:
            self._persist(self._pending_key, result.report)

    def _artifact_key(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str | None:
        if self.uuid is None:
            return None
        from torch._functorch import config as fc
        parts = [self.uuid, self.inner, torch.__version__, str(fc.activation_memory_budget), gm.code]
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
            warnings.warn(f"sacpass: could not persist the report for a warm-cache rebuild ({e}).", SacpassWarning)

    def _load_persisted(self, key: str) -> None:
        path = os.path.join(self._report_dir(), f"{key}.json")
        if not os.path.exists(path):
            return
        with open(path) as f:
            report = Report.from_json(f.read(), where=path)
        with self._lock:
            report.graph = f"g{len(self.reports)}"
            report.from_cache = True
            self.reports.append(report)

    # ------------------------------------------------------------------ summaries
    def print_reports(self, file=None) -> None:
        for r in self.reports:
            r.print(file=file)

    def __repr__(self) -> str:
        return f"sacpass.Backend(inner={self.inner!r}, strict={self.strict}, policy={self.policy})"


def backend(save=None, recompute=None, inner: str = "inductor", strict: bool = True,
            dump_dir: str | os.PathLike | None = None, use_registered: bool = True,
            save_collectives: bool = True) -> Backend:
    """Build a sacpass backend for ``torch.compile(model, backend=...)``.

    save:      selectors whose outputs are MUST_SAVE (besides those declared with register_must_save)
    recompute: selectors forced to MUST_RECOMPUTE
    inner:     "inductor" (compile_fx) or "aot_eager" (same partition, eager execution)
    strict:    raise (True) or warn (False) on an unmatched explicit selector or a must-save violation
    dump_dir:  write per-graph dumps there (also SACPASS_DUMP_DIR)
    use_registered: include the selectors declared with register_must_save (default True)
    save_collectives: keep functional collectives must-save inside checkpoints too (PyTorch's rule
                   outside them); a recompute selector matching a collective wins
    """
    return Backend(save=save, recompute=recompute, inner=inner, strict=strict, dump_dir=dump_dir,
                   use_registered=use_registered, save_collectives=save_collectives)


_NAMED: dict[str, Backend] = {}


def _options_key(options: dict[str, Any]) -> str:
    def norm(v):
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        return str(v)
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
