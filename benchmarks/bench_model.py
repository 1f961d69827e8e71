"""The memory-speed frontier on a stack of GLM-5.2-width layers: several variants, one process.

    python3 benchmarks/bench_model.py --layers 16 --seq 65536 --variants control,sacpass,plan \
        --host-gib 4 --out benchmarks/results/frontier_16layers_64k_h200.json

The model is ``GLM52ForCausalLM(GLM52Config.bench(num_layers=N, mtp_layers=0))`` in bf16 with FP8 linears and FP8
routed experts (the bench preset's FP8 recipe; ``--experts bf16`` for bf16 routed experts) and the TileLang kernels:
full top-k layers 0, 1, 2, 6, 10, 14 and shared-top-k layers between them. Every decoder layer is
compile(checkpoint(layer)) (``glm52_model.compile.apply_compile``). Per variant: a fresh model from the same seed,
one compiling step (``first_step_s``, and PyTorch's compile stack's share of it by function,
``first_step_compile_s``; the rest is the step's run and its kernels' first builds; which TileLang kernels it
needed were built ahead in workers while it compiled, ``first_step_kernels``), ``--warmup`` more (a model
plan: up to ``--settle`` more while its device budget still moves, ``settle_steps``; what they compiled,
``warmup_compile_s``), then the median of ``--steps`` timed fwd+bwd steps (CUDA events), the peak
allocated memory of the timed steps, the caching allocator's retries and driver allocations in each
(``allocator_per_step``), the host bytes offloaded and how much of the reload was prefetched, the
backward top-k runs, the loss, and per compiled graph the planner's decisions (each value's bytes, action and
estimated recompute and copy time) and the ops its backward recomputes.

Variants: ``control`` (full recompute: sacpass with no policy at all, i.e. PyTorch's min-cut over checkpoints
that recompute every op, the top-k included), ``sacpass`` (the default backend), ``offload_ids`` (the top-k
IDs offloaded), ``plan`` (``sacpass.Plan(host_bytes=--host-gib per layer)``), ``budget`` (``memory_budget``), and
``pytorch_budget``: PyTorch's own solver alone (no checkpoint, Inductor under
``torch._functorch.config.activation_memory_budget=--budget``; its dynamic-programming knapsack, or with
``pytorch_budget_ilp`` its integer linear program (scipy's ``milp``) and ``pytorch_budget_greedy`` its greedy one),
and ``model_plan``
(``sacpass.ModelPlan(layers=--layers, gpu_bytes=--gpu-gib, host_bytes=--step-host-gib, peak_bytes=--peak-gib)``:
one plan for all layers, placed per layer at run time; ``--peak-gib control`` caps the peak at control's, measured
first in the same command); ``model_plan_auto`` is ``sacpass.ModelPlan()`` with no arguments but ``--peak-gib``
(its first step runs the policy alone while it counts the layers; the plan compiles in the first warm-up step);
``model_plan_fp8`` is the same as ``model_plan`` with ``compress="fp8"`` and ``model_plan_auto_fp8`` as
``model_plan_auto`` (lossy: the values sent to the host go FP8-packed, but for those ``--exact`` names, by default
those the backward is sensitive to; compare its loss with control's); ``model_plan_int8`` and
``model_plan_auto_int8`` likewise with ``compress="int8"``.
``name:x`` sweeps a variant's parameter: ``model_plan:16`` keeps up to 16
GiB on the device, ``pytorch_budget:0.05`` runs PyTorch's solver at 0.05; ``name@g`` runs it under an offload
prefetch limit of g GiB (``sacpass.offload.set_prefetch_limit``; ``@inf``: none). ``--profile`` adds one
profiled step per variant: kernel time by kind and the copy time no kernel ran beside, from the CUDA timeline;
``--memory`` one step's peak allocated and reserved memory by phase (each layer's forward and backward, the
head); with ``--segments``, each segment the allocator added then, the request that needed it and the
largest free block at the time. ``--append`` adds the variants to ``--out``'s, for a sweep that spans several commands on one machine
(each row keeps its command; ratios are against the file's control).
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import gc
import heapq
import json
import os
import statistics
import sys
import time

import torch
from torch._functorch import config as functorch_config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sacpass  # noqa: E402
import sacpass.offload as offload_runtime  # noqa: E402
from glm52_model import GLM52Config, GLM52ForCausalLM  # noqa: E402
from glm52_model.compile import apply_ac, apply_compile  # noqa: E402
from glm52_model.ops.cuda import ahead as kernels_ahead  # noqa: E402
from sacpass.testing import OpCounter  # noqa: E402
from layerbench.variants import add_experts_option, experts_overrides  # noqa: E402


GIB = 2 ** 30


def model_plan(args, gpu_gib: float, compress: str | None = None) -> sacpass.ModelPlan:
    return sacpass.ModelPlan(layers=args.layers, gpu_bytes=int(gpu_gib * GIB), host_bytes=int(args.step_host_gib * GIB),
                             compress=compress, peak_bytes=peak_bytes(args),
                             exact=exact_values(args) if compress else None)


def exact_values(args) -> tuple | None:
    """--exact: ``sensitive`` (None: the values the backward is sensitive to, the default), ``none`` (every
    floating value packed) or op selectors."""
    return None if args.exact == "sensitive" else () if args.exact == "none" else tuple(args.exact.split(","))


def gib_or_control(v: str):
    return v if v == "control" else float(v)


def peak_bytes(args) -> int | None:
    """--peak-gib: None, GiB, or ``control``: the peak allocated memory of the control measured before (in this
    command, or in the --append file)."""
    if args.peak_gib is None:
        return None
    if args.peak_gib == "control":
        if getattr(args, "control_peak_gib", None) is None:
            raise SystemExit("--peak-gib control: measure control first, on the GPU (list it before the model plan "
                             "in --variants, or --append to a file that has it)")
        return int(args.control_peak_gib * GIB)
    return int(float(args.peak_gib) * GIB)


def backends(args) -> dict:
    """{variant: (param) -> backend}; a variant ``name:x`` passes x (model_plan: GPU GiB; budget and
    pytorch_budget: the memory budget)."""
    inner = "inductor" if args.device == "cuda" else "aot_eager"
    host = int(args.host_gib * GIB)
    return {
        "control": lambda _: sacpass.backend(inner=inner, use_registered=False, save_discrete=False),
        "sacpass": lambda _: sacpass.backend(inner=inner),
        "offload_ids": lambda _: sacpass.backend(inner=inner, offload=["glm52::dsa_topk_indices"]),
        "plan": lambda _: sacpass.backend(inner=inner, plan=sacpass.Plan(host_bytes=host)),
        "model_plan": lambda x: sacpass.backend(inner=inner, plan=model_plan(args, args.gpu_gib if x is None else x)),
        "model_plan_fp8": lambda x: sacpass.backend(
            inner=inner, plan=model_plan(args, args.gpu_gib if x is None else x, compress="fp8")),
        "model_plan_auto": lambda _: sacpass.backend(inner=inner, plan=sacpass.ModelPlan(peak_bytes=peak_bytes(args))),
        "model_plan_auto_fp8": lambda _: sacpass.backend(inner=inner, plan=sacpass.ModelPlan(
            peak_bytes=peak_bytes(args), compress="fp8", exact=exact_values(args))),
        "model_plan_int8": lambda x: sacpass.backend(
            inner=inner, plan=model_plan(args, args.gpu_gib if x is None else x, compress="int8")),
        "model_plan_auto_int8": lambda _: sacpass.backend(inner=inner, plan=sacpass.ModelPlan(
            peak_bytes=peak_bytes(args), compress="int8", exact=exact_values(args))),
        "budget": lambda x: sacpass.backend(inner=inner, memory_budget=args.budget if x is None else x),
        "pytorch_budget": lambda _: inner,
        "pytorch_budget_ilp": lambda _: inner,
        "pytorch_budget_greedy": lambda _: inner,
    }


# the pytorch_budget variants: the knapsack solver of PyTorch's each runs
# (torch._functorch.config.activation_memory_budget_solver)
PYTORCH_SOLVERS = {"pytorch_budget": "dp", "pytorch_budget_ilp": "ilp", "pytorch_budget_greedy": "greedy"}


def split_variant(spec: str) -> tuple[str, float | None, int | None | str]:
    """``name[:x][@prefetch]``: the variant, its parameter, and the offload prefetch limit in GiB (``@inf``: no
    limit; absent: the runtime's default, returned as "default")."""
    spec, _, prefetch = spec.partition("@")
    name, _, param = spec.partition(":")
    limit = "default" if not prefetch else None if prefetch == "inf" else int(float(prefetch) * GIB)
    return name, float(param) if param else None, limit


def build(args, device, dtype) -> GLM52ForCausalLM:
    torch.manual_seed(0)
    cfg = GLM52Config.preset(args.preset, num_layers=args.layers, mtp_layers=0, fp8=not args.no_fp8,
                             first_k_dense=0, **experts_overrides(args))
    with torch.device(device):
        model = GLM52ForCausalLM(cfg)
    return model.to(dtype)


def step(model, ids) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids)
    loss.backward()
    return loss.detach()


def profile_step(model, ids, sync, stack: bool = False) -> dict:
    """One step under the profiler, from its CUDA timeline: kernel time by kind, copy time each way, the copy time
    no kernel ran beside (not hidden), and the GPU's idle time between kernels: the gaps over 1 ms, the largest
    with when they began (ms from the step's first kernel)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof, \
            GcClock(annotate=True) as gcs:
        model.zero_grad(set_to_none=True)
        with torch.profiler.record_function(PHASES[0]):
            loss = model(ids, labels=ids)
        with torch.profiler.record_function(PHASES[1]):
            loss.backward()
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return {**timeline_summary(events), "gc": gcs.summary()}


LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # a kernel's launch: cudaLaunchKernel, or cuLaunchKernel(Ex)
TOP_KERNELS = 24  # the profile names the kernels that took longest in all
PHASES = ("bench.forward", "bench.backward")  # the profiled step's two CPU ranges (torch.profiler annotations)


def timeline_summary(events: list[dict]) -> dict:
    """:func:`profile_step`'s figures from a Chrome trace's events (times in microseconds). Each kernel's phase is
    the :data:`PHASES` range its launch (the runtime call with its correlation id) fell in, on the CPU's clock."""
    kernels, copies = [], {"HtoD": [], "DtoH": []}
    by_kind: dict = {}
    by_name: dict = {}
    by_phase: dict = {}
    ranges = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
              if e.get("ph") == "X" and e.get("name") in PHASES and "dur" in e]
    # correlation id -> (when the launch was made, the thread that made it)
    launched = {e["args"]["correlation"]: (float(e["ts"]), e.get("tid")) for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}

    def phase(e):
        at = launched.get(e.get("args", {}).get("correlation"), (None,))[0]
        return next((n for n, a, b in ranges if at is not None and a <= at <= b), "outside")

    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if e.get("cat") == "kernel":
            kernels.append(span)
            name = e["name"]
            count, us = by_name.get(name[:96], (0, 0.0))
            by_name[name[:96]] = (count + 1, us + float(e["dur"]))
            ph = phase(e)
            by_phase[ph] = by_phase.get(ph, 0.0) + float(e["dur"])
            kind = ("offload fp8 pack" if "pack_kernel" in name else
                    "sparse_mla" if "sparse" in name.lower() or "mla" in name.lower() else
                    "topk/indexer" if "topk" in name.lower() or "logits" in name.lower() or "select" in name.lower() else
                    "gemm" if any(t in name.lower() for t in ("gemm", "sm90", "cutlass", "matmul", "mm_")) else
                    "triton" if name.startswith("triton") else "other")
            by_kind[kind] = by_kind.get(kind, 0.0) + float(e["dur"])
        elif e.get("cat") == "gpu_memcpy":
            for way in copies:
                if way in e["name"]:
                    copies[way].append(span)

    def merged(spans):
        out = []
        for a, b in sorted(spans):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    busy = merged(kernels)

    def unhidden(spans):
        total = 0.0
        for a, b in merged(spans):
            covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy if y > a and x < b)
            total += (b - a) - covered
        return total

    gaps = sorted(((b[0] - a[1], a[1]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] > 1e3), reverse=True)
    starts = sorted(((float(e["ts"]), e) for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"),
                    key=lambda t: t[0])
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return {"kernel_ms_by_kind": {k: v / 1e3 for k, v in sorted(by_kind.items())},
            # kernel time by the phase that launched it: the forward, the backward (its recompute included)
            "kernel_ms_by_phase": {k.removeprefix("bench."): v / 1e3 for k, v in sorted(by_phase.items())},
            "top_kernels": [{"name": n, "count": c, "ms": us / 1e3} for n, (c, us) in top],
            "kernel_busy_ms": sum(b - a for a, b in busy) / 1e3,
            # the GPU idle between its first kernel and its last: waits (a reload, a host sync) and launch gaps
            "kernel_span_ms": (busy[-1][1] - busy[0][0]) / 1e3 if busy else 0.0,
            "idle_over_1ms": {"count": len(gaps), "ms": sum(g for g, _ in gaps) / 1e3,
                              "largest_ms_at": [(g / 1e3, (at - busy[0][0]) / 1e3) for g, at in gaps[:8]],
                              "largest_why": [gap_cause(events, starts, launched, at, at + g) for g, at in gaps[:8]]},
            "copy_ms": {w: sum(b - a for a, b in merged(c)) / 1e3 for w, c in copies.items()},
            "copy_not_hidden_ms": {w: unhidden(c) / 1e3 for w, c in copies.items()}}


GAP_CAUSES = 6  # the host ranges named per idle gap (innermost first: with --profile-stack, Python functions)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def gap_cause(events: list[dict], starts: list, launched: dict, a: float, b: float) -> dict:
    """What the GPU waited for between ``a`` and ``b`` (µs): the kernel that ended the gap was launched either late
    (``launched_ms_before_start`` small: the host was busy, and the CPU ranges open on the launching thread during
    the gap say with what, innermost first), or early (the stream waited on another: a copy, an event). With the
    CUDA calls over 0.1 ms the launching thread made during the gap, launches aside (synchronisations, copies
    that wait, allocations), and where the launching thread's time in the gap went: each range's *own* time there
    (its time less that of the ranges nested in it), by name, so that with ``--profile-stack`` the Python function
    that held the host stands first."""
    i = bisect.bisect_left(starts, b, key=lambda t: t[0])
    nxt = starts[i][1] if i < len(starts) else None
    corr = (nxt or {}).get("args", {}).get("correlation")
    at, tid = launched.get(corr, (None, None))
    open_ranges, syncs, mine = [], [], []
    others: dict[str, list] = {}  # name -> [count, overlap], the other threads' (the offload feeder's, autograd's)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or e.get("cat") in DEVICE_CATEGORIES:
            continue
        s, d = float(e["ts"]), float(e["dur"])
        overlap = min(b, s + d) - max(a, s)
        if overlap <= 0:
            continue
        if e.get("tid") != tid:
            tally = others.setdefault(e["name"][:80], [0, 0.0])
            tally[0], tally[1] = tally[0] + 1, tally[1] + overlap
            continue
        mine.append((s, d, e["name"][:80]))
        if overlap >= 0.5 * (b - a):
            open_ranges.append((d, e["name"][:80], overlap))
        if e.get("cat") in LAUNCH_CATEGORIES and "Launch" not in e["name"] and d > 100:
            syncs.append((e["name"], round(d / 1e3, 3)))
    open_ranges.sort()
    return {"next_kernel": (nxt or {}).get("name", "?")[:80],
            "launched_ms_before_start": None if at is None else round((b - at) / 1e3, 3),
            "host_ranges": [(n, round(o / 1e3, 3)) for _, n, o in open_ranges[:GAP_CAUSES]],
            "host_syncs": syncs[:GAP_CAUSES],
            # (name, how many, ms): the launching thread's own time in the gap, and the other threads' ranges there
            "host_work": _busiest(_own_time(mine, a, b), 2 * GAP_CAUSES),
            "other_threads": _busiest(others, GAP_CAUSES)}


def _own_time(ranges: list[tuple], a: float, b: float) -> dict[str, list]:
    """{name: [count, own µs]} of one thread's ranges ``(start, duration, name)`` inside the window ``a``-``b``:
    each instant goes to the innermost range open then (the latest begun, the shortest of those), so the times
    add up to at most the window even where a trace's ranges do not nest cleanly. One sweep over the ranges'
    clipped ends, the open ones in a heap (a gap holds thousands of Python calls with --profile-stack)."""
    out: dict[str, list] = {}
    for _, _, name in ranges:
        out.setdefault(name, [0, 0.0])[0] += 1
    by_start = sorted((max(a, s), s, d, name) for s, d, name in ranges)
    cuts = sorted({t for s, d, _ in ranges for t in (max(a, s), min(b, s + d))})
    open_now: list = []  # (-start, duration, end, name): the innermost first
    i = 0
    for lo, hi in zip(cuts, cuts[1:]):
        while i < len(by_start) and by_start[i][0] <= lo:
            _, s, d, name = by_start[i]
            heapq.heappush(open_now, (-s, d, min(b, s + d), name))
            i += 1
        while open_now and open_now[0][2] <= lo:
            heapq.heappop(open_now)
        if open_now:
            out[open_now[0][3]][1] += hi - lo
    return out


def _busiest(tally: dict[str, list], n: int) -> list:
    rows = sorted(((us, name, count) for name, (count, us) in tally.items()), reverse=True)
    return [(name, count, round(us / 1e3, 3)) for us, name, count in rows[:n]]


class GcClock:
    """Python's cyclic garbage collector over some steps: its passes by generation and the time they took (a pass
    holds the launching thread, and the GPU idles once its queue runs dry). Use as a context manager; inside
    :func:`profile_step` each pass is also a ``gc.gen<n>`` range on the profiler's timeline."""

    def __init__(self, annotate: bool = False):
        self.passes, self.ms, self._t, self._range, self.annotate = [0, 0, 0], 0.0, 0.0, None, annotate

    def _callback(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
            if self.annotate:
                self._range = torch.profiler.record_function(f"gc.gen{info['generation']}")
                self._range.__enter__()
        else:
            if self._range is not None:
                self._range.__exit__(None, None, None)
                self._range = None
            self.passes[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._t) * 1e3

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def summary(self, steps: int = 1) -> dict:
        return {"passes_by_generation": self.passes, "ms_per_step": self.ms / steps}


def memory_phases(model, ids, segments: bool = False) -> list[dict]:
    """One step's peak allocated and reserved memory by phase, in the order the phases ran: each layer's
    forward, the head (norm, logits, loss), each layer's backward (from its output's gradient to the next
    layer's), with the memory allocated as each began. The allocator's counters move as the host issues the
    work, so the phases are cut on the host (module hooks, gradient hooks) without a synchronization.
    ``segments``: also record the allocator's history (slow: a Python stack per allocation) and list, per
    phase, each segment it added (:func:`segment_growth`)."""
    rows, state = [], {"phase": "embedding forward", "start": torch.cuda.memory_allocated()}
    tag = getattr(torch.cuda.memory, "_set_memory_metadata", None) if segments else None
    tag = tag or (lambda name: None)

    def enter(name):
        rows.append({"phase": state["phase"], "start_gib": state["start"] / GIB,
                     "peak_gib": torch.cuda.max_memory_allocated() / GIB,
                     "reserved_peak_gib": torch.cuda.max_memory_reserved() / GIB})
        torch.cuda.reset_peak_memory_stats()
        state.update(phase=name, start=torch.cuda.memory_allocated())
        tag(name)

    def output_hook(i):
        def hook(module, inputs, out):
            out[0].register_hook(lambda grad: enter(f"layer {i} backward"))
        return hook

    hooks = [model.norm.register_forward_pre_hook(lambda *_: enter("head forward"))]
    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda *_, i=i: enter(f"layer {i} forward")))
        hooks.append(layer.register_forward_hook(output_hook(i)))
    try:
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()  # the reserved memory grows from nothing, as in the timed steps: by phase
        torch.cuda.reset_peak_memory_stats()
        state["start"] = torch.cuda.memory_allocated()
        if segments:
            torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=1_000_000)
            before = torch.cuda.memory._snapshot()
            tag("embedding forward")
        loss = model(ids, labels=ids)
        enter("head backward")
        loss.backward()
        enter("end")
        if segments:
            growth = segment_growth(before, torch.cuda.memory._snapshot())
            for row in rows:
                row["segments_added"] = [g for g in growth if g["phase"] == row["phase"]]
    finally:
        if segments:
            tag("")
            torch.cuda.memory._record_memory_history(enabled=None)
        for h in hooks:
            h.remove()
    return rows


def _where(frames) -> str:
    """The innermost frame of the project or of a compiled graph's code that asked for the memory."""
    for f in frames or ():
        name = f.get("filename", "")
        if any(k in name for k in ("sacpass/", "glm52_model/", "torchinductor", "benchmarks/")):
            return f"{os.path.basename(name)}:{f.get('line')}:{f.get('name')}"
    return "?"


def segment_growth(before: dict, after: dict) -> list[dict]:
    """Each time the allocator asked the driver for a new segment during the recorded step: the segment and the
    request that caused it, with the allocator's state just before (reserved, allocated, freed but awaiting
    another stream's work, free in its cache, and the largest free block of the large pool), and the frame
    that asked. Replayed from the allocator's trace, starting from the segments and blocks of ``before``."""
    segs, live, pending = {}, {}, {}
    for seg in before.get("segments", ()):
        if seg.get("segment_type") != "large":
            continue
        segs[seg["address"]] = seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                live[b["address"]] = b["size"]
            elif b["state"] == "active_awaiting_free":
                pending[b["address"]] = b["size"]
    trace = next((t for t in after.get("device_traces", ()) if t), [])
    start = next((i + 1 for i, e in enumerate(trace) if e["action"] == "snapshot"), 0)
    out = []

    def largest_free() -> int:
        used = sorted(list(live.items()) + list(pending.items()))
        best = 0
        for base, size in segs.items():
            cursor, end = base, base + size
            for a, n in used:
                if a < base or a >= end:
                    continue
                best = max(best, a - cursor)
                cursor = max(cursor, a + n)
            best = max(best, end - cursor)
        return best

    for i in range(start, len(trace)):
        e = trace[i]
        act, addr, size = e["action"], e.get("addr"), e.get("size", 0)
        if act == "segment_alloc" and size >= 1 << 20:
            request = next((x for x in trace[i + 1:i + 4] if x["action"] == "alloc" and x.get("addr") == addr), e)
            reserved, allocated, waiting = sum(segs.values()), sum(live.values()), sum(pending.values())
            out.append({"phase": e.get("user_metadata") or "?", "segment_gib": size / GIB,
                        "request_gib": request.get("size", 0) / GIB, "reserved_gib": reserved / GIB,
                        "allocated_gib": allocated / GIB, "awaiting_free_gib": waiting / GIB,
                        "cached_free_gib": (reserved - allocated - waiting) / GIB, "largest_free_gib": largest_free() / GIB,
                        "where": _where(request.get("frames"))})
            segs[addr] = size
        elif act == "segment_free":
            segs.pop(addr, None)
        elif act == "alloc" and size >= 1 << 20:
            live[addr] = size
        elif act == "free_requested":
            if live.pop(addr, None) is not None:
                pending[addr] = size
        elif act == "free_completed":
            live.pop(addr, None)
            pending.pop(addr, None)
    return out


ALLOCATOR_COUNTS = {"alloc_retries": "num_alloc_retries", "cuda_mallocs": "num_device_alloc",
                    "cuda_frees": "num_device_free", "ooms": "num_ooms"}


def allocator_counts(device) -> dict[str, int]:
    """The CUDA caching allocator's counters (torch.cuda.memory_stats): allocations it retried after freeing its
    cache (each a device synchronisation), segments it asked the driver for and gave back. A step near the card's
    memory shows there; the timed steps' deltas go in the row. Empty on the CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTS.items()}


def settle(model, ids, plan, most: int) -> int:
    """More warm-up steps, at most ``most``, while a model plan's device budget still moves (one following the
    measured peak rises step by step from 0), is in doubt (measured slower once), or has not been measured yet (a
    GPU step's timing is read a step or two later, and a budget rises only once the one in hand is measured): the
    timed steps then run the budget the plan settled at. Returns the steps run."""
    if not isinstance(plan, sacpass.ModelPlan):
        return 0
    def budget():
        try:
            b = offload_runtime.device_budget(plan)
        except sacpass.SacpassError:  # a plan not yet compiled (its counted step only)
            return None
        measured = b["held_at"] is not None or b["step_samples"].get(b["device_budget"], 0) > 0
        return b["device_budget"], b["doubt"], measured

    for n in range(most):
        before = budget()
        step(model, ids)
        if before is not None and budget() == before and before[1] is None and before[2]:
            return n + 1
    return most


def compile_seconds() -> dict[str, float]:
    """{function: seconds} that PyTorch's compile stack timed so far in this process (Dynamo, AOTAutograd,
    Inductor, its autotuning and code generation: ``torch._dynamo.utils.compilation_time_metrics``), summed."""
    from torch._dynamo.utils import compilation_time_metrics
    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}


def seconds_since(before: dict[str, float]) -> dict[str, float]:
    """What :func:`compile_seconds` added since ``before``, largest first, to the millisecond."""
    now = compile_seconds()
    added = {k: round(v - before.get(k, 0.0), 3) for k, v in now.items()}
    return dict(sorted(((k, v) for k, v in added.items() if v > 0), key=lambda kv: -kv[1]))


def measure(args, spec, make_backend, device, dtype) -> dict:
    name, param, _ = split_variant(spec)
    torch._dynamo.reset()
    model = build(args, device, dtype)
    be = make_backend(param)
    budget = contextlib.nullcontext()
    if name in PYTORCH_SOLVERS:  # PyTorch's solver alone: no checkpoint, its budget
        apply_ac(model, False)
        budget = functorch_config.patch(activation_memory_budget=args.budget if param is None else param,
                                        activation_memory_budget_solver=PYTORCH_SOLVERS[name])
    apply_compile(model, backend=be)
    reports = getattr(be, "reports", ())
    ids = torch.randint(0, model.cfg.vocab_size, (1, args.seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0, compiled_before = time.perf_counter(), compile_seconds()
    kernels_before, built_before = kernels_ahead.first_calls(), len(kernels_ahead.built())
    with OpCounter("glm52::dsa_topk_indices", "aten::topk") as calls, budget:
        first = step(model, ids)
    sync()
    first_s = time.perf_counter() - t0
    kernels = {k: v - kernels_before[k] for k, v in kernels_ahead.first_calls().items()}
    builds = [seconds for _, seconds in kernels_ahead.built()[built_before:]]
    first_compile, compiled_before = seconds_since(compiled_before), compile_seconds()
    if device.type == "cuda":  # the compiling step's peak is not the steps' (a ModelPlan(peak_bytes=) reads it)
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step(model, ids)
    settled = settle(model, ids, getattr(getattr(be, "config", None), "plan", None), args.settle)
    sync()
    warmup_compile = seconds_since(compiled_before)
    if device.type == "cuda":
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    offload_runtime.reset_stats()
    times, loss, allocator = [], first, []
    with GcClock() as gcs:
        for _ in range(args.steps):
            before = allocator_counts(device)
            a = time.perf_counter()
            loss = step(model, ids)
            sync()
            times.append((time.perf_counter() - a) * 1e3)
            after = allocator_counts(device)
            allocator.append({k: after[k] - before[k] for k in after})
    st = offload_runtime.stats()
    plan = getattr(getattr(be, "config", None), "plan", None)
    row = {"step_ms_median": statistics.median(times), "step_ms": times, "first_step_s": first_s,
           # where the compiling steps' time went: PyTorch's compile stack by function (the rest of the first
           # step is its run: the kernels' first builds, TileLang's among them, and the step itself); a model
           # plan that counts its regions compiles again in the second step (the warm-up)
           "first_step_compile_s": first_compile, "warmup_compile_s": warmup_compile,
           # the TileLang kernels the first step needed, by where each came from (glm52_model.ops.cuda.ahead), and
           # the seconds of the builds the workers ran meanwhile (beside the compile, several at once)
           "first_step_kernels": {**kernels, "worker_build_s_total": round(sum(builds), 1),
                                  "worker_build_s_longest": round(max(builds, default=0.0), 1)},
           "settle_steps": settled, "allocator_per_step": allocator,
           "gc": gcs.summary(args.steps),
           "loss": float(loss), "first_loss": float(first), "bw_topk_runs_first_step": calls.backward,
           "fp8_experts": model.cfg.fp8_experts,
           "graphs": len(reports), "saved_activation_gib_per_graph": [r.activation_bytes / 2 ** 30 for r in reports],
           "saved_host_gib_per_graph": [r.host_bytes / 2 ** 30 for r in reports],
           "planned": {a: sum(1 for r in reports for d in r.decisions if d.action == a)
                       for a in ("save", "offload", "recompute")},
           "offload": {"gib_per_step_each_way": st.offloaded_bytes / args.steps / 2 ** 30,
                       "prefetched_share": st.prefetched_bytes / max(1, st.reloaded_bytes),
                       "reloads_not_prefetched_per_step": st.waited_reloads / args.steps,
                       "device_copied_gib_per_step": st.device_copied_bytes / args.steps / 2 ** 30,
                       "copy_out_waits_per_step": st.copy_out_waits / args.steps,
                       "copy_out_wait_ms_per_step": st.copy_out_wait_ms / args.steps,
                       "largest_reload_gib": st.largest_reload_bytes / 2 ** 30,
                       "peak_host_gib": st.peak_host_bytes / 2 ** 30,
                       "peak_pool_held_gib": st.peak_host_bytes_held / 2 ** 30,
                       "dropped_prefetch_gib": st.dropped_prefetch_bytes / 2 ** 30,
                       "bundles_alive_after": st.bundles_alive,
                       "kept_on_device_gib_per_step": st.kept_bytes / args.steps / 2 ** 30,
                       "packed_gib_per_step": st.packed_bytes / args.steps / 2 ** 30},
           "decisions": [dict(graph=r.graph, **dataclasses.asdict(d)) for r in reports for d in r.decisions],
           "recomputed_per_graph": [dict(r.recomputed) for r in reports],
           # per graph: {budget: (values the planner recomputes for want of it, their estimated ms)}
           "recompute_bounds_per_graph": [r.recompute_bounds() for r in reports]}
    if isinstance(plan, sacpass.ModelPlan):
        cost = plan.cost
        row["plan"] = {"layers": plan.layers, "gpu_bytes": plan.gpu_bytes, "host_bytes": plan.host_budget(),
                       "peak_bytes": plan.peak_bytes, "cost": {k: v for k, v in dataclasses.asdict(cost).items()
                                                               if k != "op_seconds"},
                       "measured_ops": len(cost.op_seconds)}
        row["placements"] = offload_runtime.placements(plan)
        row["device_budget"] = offload_runtime.device_budget(plan)
        print(f"{spec}: where the last timed step put each region's values\n{offload_runtime.format_placements(plan)}",
              flush=True)
    if device.type == "cuda":
        host = torch.cuda.host_memory_stats()  # what PyTorch's pinned allocator holds (sacpass's pool lives there)
        row["offload"]["pytorch_pinned_gib"] = host.get("allocated_bytes.current", 0) / 2 ** 30
        row["offload"]["pytorch_pinned_peak_gib"] = host.get("allocated_bytes.peak", 0) / 2 ** 30
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2 ** 30
        if args.profile:
            row["profile"] = profile_step(model, ids, sync, stack=args.profile_stack)
        if args.memory:
            row["memory_phases"] = memory_phases(model, ids, segments=args.segments)
    limit = offload_runtime.prefetch_limit(device)
    row["prefetch_limit_gib"] = None if limit is None else limit / GIB
    del model, be
    gc.collect()
    offload_runtime.release_host_memory()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="bench")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--variants", default="control,sacpass,plan")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--settle", type=int, default=6,
                   help="a model plan: up to this many more warm-up steps while its device budget still moves")
    p.add_argument("--host-gib", type=float, default=4.0, help="planner host budget per layer (GiB)")
    p.add_argument("--budget", type=float, default=0.1, help="memory_budget of the budget and pytorch_budget variants")
    p.add_argument("--gpu-gib", type=float, default=8.0, help="model_plan: device GiB the step may keep")
    p.add_argument("--step-host-gib", type=float, default=96.0, help="model_plan: host GiB the step may offload")
    p.add_argument("--exact", default="sensitive",
                   help="the packing variants (model_plan_fp8, model_plan_auto_int8, ...): the values sent to the "
                        "host unpacked: 'sensitive' (the "
                        "default: those the backward is sensitive to), 'none' (every floating value packed), or "
                        "comma-separated op selectors (ModelPlan(exact=), e.g. glm52::sparse_mla)")
    p.add_argument("--peak-gib", default=None, type=gib_or_control,
                   help="model_plan: the device peak the step may reach (ModelPlan(peak_bytes=)), in GiB or 'control' "
                        "(control's peak allocated, measured before it); the plan keeps more on the device, step by "
                        "step, while the measured peak stays within it")
    p.add_argument("--profile", action="store_true", help="profile one more step per variant (CUDA timeline)")
    p.add_argument("--profile-stack", action="store_true",
                   help="with --profile: record Python calls too, so each large idle gap names the Python functions "
                        "the launching thread was in (slows the host: the gaps grow, their causes show)")
    p.add_argument("--memory", action="store_true",
                   help="one more step per variant: peak allocated and reserved memory by phase (each layer's forward and "
                        "backward)")
    p.add_argument("--segments", action="store_true",
                   help="with --memory: list each segment the allocator added in the step, by phase, with the request "
                        "that needed it and the largest free block then (records the allocator's history: slow)")
    p.add_argument("--no-fp8", action="store_true")
    add_experts_option(p)
    p.add_argument("--out", default="benchmarks/results/bench_model.json")
    p.add_argument("--append", action="store_true",
                   help="add these variants to --out's (a sweep over several commands on one machine); ratios are "
                        "taken against the control in the file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    table = backends(args)
    command = "python3 " + " ".join(sys.argv)
    result = {"command": command, "torch": torch.__version__, "args": vars(args),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "variants": {}}
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
        before = result["command"] if isinstance(result["command"], list) else [result["command"]]
        result["command"] = before + [command]
        if result.get("torch") != torch.__version__:
            raise SystemExit(f"--append: {args.out} was measured with torch {result.get('torch')}, this is "
                             f"{torch.__version__}; measure into a new file")
    args.control_peak_gib = result["variants"].get("control", {}).get("peak_allocated_gib")
    for name in args.variants.split(","):
        variant, _, prefetch = split_variant(name)
        default_prefetch = offload_runtime.prefetch_limit()
        try:
            if prefetch != "default":
                offload_runtime.set_prefetch_limit(prefetch)
            result["variants"][name] = measure(args, name, table[variant], device, dtype)
            result["variants"][name]["command"] = command
        except torch.cuda.OutOfMemoryError as e:
            result["variants"][name] = {"status": "oom", "error": str(e)[:300]}
            gc.collect()
            torch.cuda.empty_cache()
        finally:
            offload_runtime.set_prefetch_limit(default_prefetch)
        if name == "control":
            args.control_peak_gib = result["variants"][name].get("peak_allocated_gib")
        shown = {k: v for k, v in result["variants"][name].items()
                 if k not in ("step_ms", "decisions", "recomputed_per_graph")}
        print(name, json.dumps(shown), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    ctrl = result["variants"].get("control", {}).get("step_ms_median")
    for name, row in result["variants"].items():
        if ctrl and "step_ms_median" in row:
            row["vs_control"] = row["step_ms_median"] / ctrl
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
