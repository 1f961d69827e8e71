"""The cost model, measured on the device a plan runs on.

:func:`calibrate` times a few micro-benchmarks on the device: a bf16, an fp32 and (on a GPU that has it) an FP8
matrix multiply, a device-to-device copy (memory bandwidth), pinned copies each way between host and device, and
a tiny kernel (the launch overhead); a :class:`~sacpass.CostModel` holds the rates they reached (efficiency 1).
:class:`OpTimer` times the heavy ops (matrix ops, custom ops) of a step as they run, by :func:`op_signature`
(the op and its tensor inputs' dtypes and shapes), those of the compiled backwards it is told of
(:meth:`OpTimer.time_backward`) too; the cost model's ``op_seconds`` holds those times, and the planner uses them
instead of the rates for a node of that signature.

Both are kept in ``<compile cache dir>/sacpass_calibration/`` per device name and torch version: a restart reads
them back instead of measuring anew, so its plan, which enters the compile caches' key, is the same and the
compile caches are reused. Measurements a store already has are never replaced (delete the file to re-measure).
"""
from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .nodes import size_hint
from .offload.clocks import clock, elapsed_ms

__all__ = ["CostModel", "calibrate", "op_signature", "is_heavy", "OpTimer", "CalibrationStore", "device_name",
           "BENCHMARKS", "compiled_backwards"]


@dataclass(frozen=True)
class CostModel:
    """Seconds an op takes: max(FLOPs / matrix rate, bytes moved / memory bandwidth) + a launch overhead.

    FLOPs come from ``torch.utils.flop_counter``'s formulas (ATen matmuls, attention, ``_scaled_mm``, and
    whatever a model registers for its custom ops with ``register_flop_formula``); bytes are the op's input
    and output tensor bytes. The defaults are the H200's datasheet-like rates: dense bf16 GEMMs at 790 TFLOP/s,
    blockwise FP8 at 1170, device copies at 4.3 TB/s, pinned host copies at 51.5 GiB/s each way; ``efficiency``
    scales the rates to what whole kernels reach. :func:`sacpass.calibration.calibrate` measures them on the
    device a plan runs on instead (efficiency 1: the rates are what kernels reached), and ``op_seconds`` holds
    the measured time of ops at given input shapes (``op_signature``), which wins over the rates for them.
    """

    name: str = "h200"
    bf16_flops: float = 790e12  # dense bf16/fp16 matrix FLOP/s
    fp8_flops: float = 1170e12  # blockwise-scaled e4m3 matrix FLOP/s
    fp32_flops: float = 60e12  # fp32 (no TF32) matrix FLOP/s
    memory_bytes_per_s: float = 4.3e12  # device memory, read + write
    copy_bytes_per_s: float = 51.5 * 2**30  # pinned host <-> device, each way
    efficiency: float = 0.7  # share of the peak rates real kernels reach
    launch_s: float = 4e-6  # per kernel
    op_seconds: tuple[tuple[str, float], ...] = ()  # (op_signature, measured seconds), sorted

    @functools.cached_property
    def _measured(self) -> dict[str, float]:
        return dict(self.op_seconds)

    def measured(self, signature: str) -> float | None:
        """The measured seconds of the op call of ``signature`` (:func:`sacpass.calibration.op_signature`)."""
        return self._measured.get(signature)

    def flop_rate(self, dtype: torch.dtype) -> float:
        if dtype in (torch.float32, torch.float64):
            return self.fp32_flops * self.efficiency
        if dtype.itemsize == 1:
            return self.fp8_flops * self.efficiency
        return self.bf16_flops * self.efficiency

    def seconds(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        return max(flops / self.flop_rate(dtype), nbytes / (self.memory_bytes_per_s * self.efficiency)) + self.launch_s

    def copy_seconds(self, nbytes: float) -> float:
        return nbytes / self.copy_bytes_per_s


# name -> what one run of it does: the work its rate is measured in
BENCHMARKS = ("bf16_mm", "fp8_mm", "fp32_mm", "memory", "h2d", "d2h", "launch")


def device_name(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{platform.machine() or 'unknown'}"


def is_heavy(op) -> bool:
    """An op worth timing and keeping: a matrix op (one with a FLOP formula) or a custom op."""
    from torch.utils.flop_counter import flop_registry

    if not isinstance(op, torch._ops.OpOverload):
        return False
    return op.overloadpacket in flop_registry or op.namespace not in ("aten", "prims")


def op_signature(op, args, kwargs=None) -> str:
    """``op`` called on ``args`` and ``kwargs`` (tensors in any nesting), as ``ns::op|dtype[shape];...``: what the
    cost model's measured times are keyed by. The overload is left out and so is an ``out=`` tensor, so a
    compiled graph's ``aten.mm.out(a, b, out=c)`` keys as the joint graph's ``aten.mm.default(a, b)``. Symbolic
    sizes count at their hints."""
    kwargs = {k: v for k, v in (kwargs or {}).items() if k != "out"}
    tensors = [v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    name = op._schema.name if isinstance(op, torch._ops.OpOverload) else str(op)
    return f"{name}|" + ";".join(f"{str(t.dtype).removeprefix('torch.')}{[size_hint(s) for s in t.shape]}"
                                 for t in tensors)


# ------------------------------------------------------------------------------------------------ timing
def _elapsed(start, end) -> float:
    """Seconds between two :func:`~sacpass.offload.clocks.clock` marks (CUDA marks must have completed)."""
    return elapsed_ms(start, end) / 1e3


class OpTimer(TorchDispatchMode):
    """Times every heavy op run under it (:func:`is_heavy`), by :func:`op_signature`: timing events around each on
    a GPU (read once the work is done), the host clock on the CPU."""

    def __init__(self):
        super().__init__()
        self.marks: list[tuple[str, torch.device, object, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_heavy(func):
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        start = clock(device)
        out = func(*args, **kwargs)
        self.marks.append((op_signature(func, args, kwargs), device, start, clock(device)))
        return out

    def time_backward(self, outputs) -> int:
        """Also time the heavy ops of the compiled backward that ``outputs`` (tensors a compiled graph returned)
        lead back to, when autograd runs it. A backward runs in autograd's thread under the dispatch modes of the
        ``backward()`` call, not this timer's, so a pre-hook of each compiled-backward node pushes the timer on
        that thread's mode stack and its post-hook pops it; the engine restores the thread's state after the node
        either way (an error in it included). Returns the nodes hooked (0 where ``outputs`` lead to none)."""
        nodes = compiled_backwards(outputs)
        for node in nodes:
            node.register_prehook(self._push)
            node.register_hook(self._pop)
        return len(nodes)

    def _push(self, grad_outputs):
        if not _compiled_autograd():  # there hooks run in its trace, on fake values: nothing to time
            torch._C._push_on_torch_dispatch_stack(self)

    def _pop(self, grad_inputs, grad_outputs):
        depth = torch._C._len_torch_dispatch_stack()
        if depth and torch._C._get_dispatch_stack_at(depth - 1) is self:
            torch._C._pop_torch_dispatch_stack(None)

    def seconds(self) -> dict[str, float]:
        """{signature: median seconds} of what ran (waits for the GPU's work)."""
        if any(device.type == "cuda" for _, device, _, _ in self.marks):
            torch.cuda.synchronize()
        runs: dict[str, list[float]] = {}
        for sig, _, start, end in self.marks:
            runs.setdefault(sig, []).append(_elapsed(start, end))
        return {sig: statistics.median(ts) for sig, ts in runs.items()}


def _compiled_autograd() -> bool:
    """Whether compiled autograd is tracing or running the backward now."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    flag = getattr(ca, "in_compiled_autograd_region", False)
    return bool(flag() if callable(flag) else flag)


def compiled_backwards(outputs, depth: int = 4) -> list:
    """The autograd nodes of AOTAutograd's compiled backwards (``CompiledFunctionBackward``) that ``outputs`` lead
    back to, through at most ``depth`` nodes (the views and aliases AOTAutograd rebuilds outside its graph)."""
    seen, found = set(), []
    frontier = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for _ in range(depth):
        later = []
        for node in frontier:
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if node.name().startswith("CompiledFunction"):
                found.append(node)
            else:
                later.extend(n for n, _ in node.next_functions)
        frontier = later
    return found


def _sizes(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {"n": 4096, "memory": 1 << 30, "copy": 512 << 20}
    return {"n": 256, "memory": 32 << 20, "copy": 32 << 20}


def _fp8_mm(device: torch.device, n: int):
    """A callable FP8 matrix multiply on ``device``, or None where it has none (before sm89, the CPU)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _benchmarks(device: torch.device) -> dict[str, tuple[float, Callable[[], object] | None]]:
    """{name: (its work: FLOPs, bytes or launches, a callable that runs it once or None where the device has
    none)}."""
    size = _sizes(device)
    n = size["n"]
    a16, b16 = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    a32, b32 = (torch.randn(n, n, device=device) for _ in range(2))
    src = torch.empty(size["memory"], dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    pinned = device.type == "cuda"
    host = torch.empty(size["copy"], dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(size["copy"], dtype=torch.uint8, device=device)
    tiny = torch.zeros(1, device=device)
    fp8 = _fp8_mm(device, n)
    return {
        "bf16_mm": (2.0 * n ** 3, lambda: a16 @ b16),
        "fp8_mm": (2.0 * n ** 3, fp8),
        "fp32_mm": (2.0 * n ** 3, lambda: a32 @ b32),
        "memory": (2.0 * size["memory"], lambda: dst.copy_(src)),
        "h2d": (float(size["copy"]), lambda: dev.copy_(host, non_blocking=True)),
        "d2h": (float(size["copy"]), lambda: host.copy_(dev, non_blocking=True)),
        "launch": (1.0, lambda: tiny.add_(1)),
    }


def time_on(device: torch.device, fn: Callable[[], object], repeats: int = 5) -> float:
    """Median seconds of one call of ``fn`` on ``device`` (after a warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock(device)
        fn()
        end = clock(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(_elapsed(start, end))
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------- store
class CalibrationStore:
    """Measured rates and op times, one JSON file per device name and torch version under ``root``."""

    def __init__(self, root: str | None = None):
        if root is None:
            from torch._inductor.runtime.cache_dir_utils import cache_dir
            root = os.path.join(cache_dir(), "sacpass_calibration")
        self.root = root

    def path(self, name: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{name}-torch{torch.__version__}")
        return os.path.join(self.root, safe + ".json")

    def read(self, name: str) -> dict:
        try:
            with open(self.path(name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) and data.get("device") == name else {}

    def write(self, name: str, data: dict) -> None:
        os.makedirs(self.root, exist_ok=True)
        tmp = self.path(name) + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({**data, "device": name, "torch": torch.__version__}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path(name))

    def merged_ops(self, name: str, measured: dict[str, float]) -> dict[str, float]:
        """``measured`` op times under the ones the store already has (those win: a restart keys as before);
        the union is written back."""
        data = self.read(name)
        known = data.get("op_seconds", {})
        merged = {**measured, **known}
        if merged != known:
            self.write(name, {**data, "op_seconds": merged})
        return merged


_DEFAULT = object()


def calibrate(device, timer: Callable[[str, Callable], float] | None = None, store=_DEFAULT,
              op_seconds: dict[str, float] | None = None) -> CostModel:
    """The cost model of ``device``: each benchmark's rate (its work over the seconds ``timer(name, fn)`` says
    one run takes; by default :func:`time_on`, measured), read from ``store`` where it has them (by default
    the compile cache's directory; None: neither read nor written), and ``op_seconds`` (measured op times,
    merged under the store's). Where the device has no FP8 multiply, FP8 counts at the bf16 rate."""
    device = torch.device(device)
    name = device_name(device)
    store = CalibrationStore() if store is _DEFAULT else store
    rates = store.read(name).get("rates") if store is not None else None
    if not rates:
        time_fn = timer or (lambda bench, fn: time_on(device, fn))
        rates = {}
        for bench, (work, fn) in _benchmarks(device).items():
            if fn is not None:
                rates[bench] = work / max(time_fn(bench, fn), 1e-12)
        if store is not None:
            store.write(name, {**store.read(name), "rates": rates})
    ops = dict(op_seconds or {})
    if store is not None:
        ops = store.merged_ops(name, ops)
    bf16 = rates["bf16_mm"]
    return CostModel(name=name, bf16_flops=bf16, fp8_flops=rates.get("fp8_mm", bf16), fp32_flops=rates["fp32_mm"],
                     memory_bytes_per_s=rates["memory"], copy_bytes_per_s=min(rates["h2d"], rates["d2h"]),
                     efficiency=1.0, launch_s=1.0 / rates["launch"], op_seconds=tuple(sorted(ops.items())))
