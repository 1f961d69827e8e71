"""Kernel benchmark: TileLang DSA top-k vs the PyTorch reference kernel, sparse MLA fwd/bwd TFLOP/s, and
the routed experts' grouped GEMMs in FP8 against bf16.

    python3 benchmarks/bench_kernels.py --out results/bench_kernels.json

Top-k: GLM-5.2 indexer (32 heads x 128, top-k 2048), causal, bf16, at --topk-seq (4K, 16K); then the same
with FP8 logits (``quantize_indexer``: e4m3 q and k), its time with and without the quantisation, and how far
its ID sets overlap the bf16 kernel's (mean and worst row).
Sparse MLA: S = Sk = --mla-seq (16K), top-k 2048 IDs taken from the top-k kernel on random data,
heads --mla-heads; FLOPs count every slot (fwd 2*S*H*T*(576+512), bwd 2*S*H*T*(3*576+2*512)).
Times are medians of CUDA-event timings after warm-up. Profile: the sparse MLA backwards (serial and
pipelined) are also timed without their dkv scatter (an ablation built here from the production kernels: the
fp32 vector atomics into dKV stripped from their TIR), so the scatter's share of the backward is measured.
Sweeps: --topk-op-seq times the FP8 op beside its OP_SWEEP variants (launch and buffer options, the logits
kernel's register bound), --logits-sweep the logits kernel alone (LOGITS_SWEEP) and the select alone
(SELECT_SWEEP: its numeric tunables). A variant is a config (``dsa_topk_tl.TopkConfig``, ``LogitsConfig``,
``SelectConfig``, ``sparse_mla_tl.SparseMlaConfig``) passed to the launcher or the compile function it times;
the sweeps hold each as overrides of the op's defaults (:func:`with_overrides`).
Routed experts: --experts-seq tokens x top-8 rows over 8 experts of the bench layer (hidden 6144, expert
width 2048, balanced groups), the SwiGLU's three GEMMs forward and backward through ``glm52::grouped_mm``
(bf16) and ``glm52::fp8_grouped_mm`` (tile-wise FP8, quantisation included), plus the FP8 GEMMs alone on
operands quantised beforehand, and a torch.profiler table of the FP8 forward's and backward's kernels. Empty lists (``--topk-seq ""``) skip a section.
"""
import argparse
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time

import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.dsa_topk import _dsa_topk_kernel, id_overlap, quantize_indexer
from glm52_model.ops.sparse_mla import _sparse_mla_bwd_kernel, _sparse_mla_fwd_kernel


def cuda_time_ms(fn, warmup=2, reps=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def interleaved_ms(fns, warmup=2, reps=10, rounds=None, calls=1):
    """Each of ``fns`` (name -> callable) timed once a round, in turn, for ``reps`` rounds: a drift of the clocks
    over the run reaches every one alike. The median ms per call and name; ``rounds`` (a dict) gets every round's
    times. ``calls`` > 1: each round times that many calls queued back to back (no synchronisation between them,
    as the op runs inside a training step, where the host is ahead of the GPU)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                fn()
            b.record()
            torch.cuda.synchronize()
            times[name].append(a.elapsed_time(b) / calls)
    if rounds is not None:
        rounds.update(times)
    return {name: statistics.median(t) for name, t in times.items()}


def kernel_profile(fn, top=12):
    """The CUDA kernels one call of ``fn`` runs, by device time: [{name, ms, calls}] (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(ev.name[:90], {"name": ev.name[:90], "ms": 0.0, "calls": 0})
            r["ms"] += ev.device_time_total / 1e3
            r["calls"] += 1
    return sorted(rows.values(), key=lambda r: -r["ms"])[:top]


def launch_timeline(fn, top=4):
    """Where one call of ``fn`` leaves the GPU idle (torch.profiler, CPU and CUDA): ms from the call's start on the
    host to its first kernel, the span from its first kernel's start to its last one's end, the kernels' busy time
    in it, and the ``top`` largest gaps between consecutive kernels (ms, and the kernel before each)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("timed_call"):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    call = next(ev for ev in events if ev.name == "timed_call" and ev.device_type == torch.autograd.DeviceType.CPU)
    kernels = sorted((ev.time_range.start, ev.time_range.end, ev.name[:40]) for ev in events
                     if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name != "timed_call"
                     and ev.time_range.end > ev.time_range.start)
    busy, gaps, reach = 0.0, [], kernels[0][0]
    for (s0, e0, name), prev in zip(kernels, [None] + kernels[:-1]):
        busy += max(0.0, e0 - max(s0, reach))
        if prev is not None and s0 > reach:
            gaps.append((round((s0 - reach) / 1e3, 3), prev[2]))
        reach = max(reach, e0)
    return {"to_first_kernel_ms": round((kernels[0][0] - call.time_range.start) / 1e3, 3),
            "span_ms": round((reach - kernels[0][0]) / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "kernels": len(kernels), "gaps_ms": round(sum(g for g, _ in gaps), 3),
            "largest_gaps": sorted(gaps, reverse=True)[:top]}


def with_overrides(config, over: dict):
    """``config`` (a frozen dataclass) with the fields ``over`` names replaced; a nested config takes a dict of its
    own overrides. An unknown field raises TypeError."""
    return dataclasses.replace(config, **{k: with_overrides(getattr(config, k), v) if isinstance(v, dict) else v
                                          for k, v in over.items()})


def topk_inputs(S, H=32, D=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(S, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(S, H, device="cuda", generator=g) * H ** -0.5
    starts = torch.zeros(S, dtype=torch.int32, device="cuda")
    ends = torch.arange(1, S + 1, dtype=torch.int32, device="cuda")
    return q, k, w, starts, ends


def config_row(config) -> dict:
    """The row fields that record a top-k op config (``TopkConfig``)."""
    return {"logits_tunables": dataclasses.asdict(config.logits), "select_tunables": dataclasses.asdict(config.select),
            "launch_tunables": {"buffers": config.buffers, "select_priority": config.select_priority},
            "logits_budget_bytes": config.logits_budget_bytes}


def bench_topk(S, topk, reps, base, reference=True, parts=True, variants=()):
    """The op as the model calls it (chunked logits, then the select), bf16 and FP8 inputs, with ``base`` (a
    ``TopkConfig``, the op's unless --logits-tunables / --select-tunables); with ``parts`` also its kernels alone
    and (``reference``) the PyTorch kernel; ``variants``: OP_SWEEP names timed round-robin beside ``base``."""
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    q, k, w, starts, ends = topk_inputs(S)
    scale = 128 ** -0.5
    q8, k8, w8, ks = quantize_indexer(q, k, w)
    row = {"S": S, "heads": 32, "dim": 128, "topk": topk, **config_row(base)}
    op = functools.partial(tl.dsa_topk_indices_tl, config=base)
    row["tilelang_ms"] = cuda_time_ms(lambda: op(q, k, w, starts, ends, topk, scale), reps=reps)
    # FP8 logits (e4m3 q and k, one scale per head row and per key): same op, same select kernel
    row["fp8_ms"] = cuda_time_ms(lambda: op(q8, k8, w8, starts, ends, topk, scale, ks), reps=reps)
    row["fp8_speedup"] = row["tilelang_ms"] / row["fp8_ms"]
    ids = op(q, k, w, starts, ends, topk, scale)
    ids8 = op(q8, k8, w8, starts, ends, topk, scale, ks)
    overlap = id_overlap(ids8, ids)
    row["fp8_id_overlap_mean"] = float(overlap.mean())
    row["fp8_id_overlap_min"] = float(overlap.min())
    # where the FP8 op's time goes: its kernels (logits, select, the padding copies) in one call
    row["fp8_kernels"] = kernel_profile(lambda: op(q8, k8, w8, starts, ends, topk, scale, ks), top=6)
    # the FP8 op's variants (OP_SWEEP), round-robin (interleaved_ms), with the op's default among them
    if variants:
        def variant(name):
            config = with_overrides(base, OP_SWEEP.get(name, {}))
            return lambda: tl.dsa_topk_indices_tl(q8, k8, w8, starts, ends, topk, scale, ks, config=config)
        calls = {name: variant(name) for name in ["default"] + [n for n in variants if n != "default"]}
        row["fp8_variants_rounds_ms"] = {}
        row["fp8_variants_ms"] = interleaved_ms(calls, reps=reps, rounds=row["fp8_variants_rounds_ms"])
        row["fp8_variants_peak_gib"], row["fp8_variants_same_ids_rows"] = {}, {}
        # each variant's kernels in one call (torch.profiler): against its time above, what the GPU spends idle
        row["fp8_variants_kernels_ms"] = {name: {r["name"][:24]: round(r["ms"], 3) for r in kernel_profile(call, top=2)}
                                          for name, call in calls.items()}
        row["fp8_variants_timeline"] = {name: launch_timeline(call) for name, call in calls.items()}
        row["fp8_variants_back_to_back_ms"] = interleaved_ms(calls, warmup=1, reps=max(3, reps // 2), calls=4)
        for name, call in calls.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            same = call()
            row["fp8_variants_peak_gib"][name] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            row["fp8_variants_same_ids_rows"][name] = float(
                (torch.sort(same, 1).values == torch.sort(ids8, 1).values).all(1).float().mean())
    if not parts:
        return row, ids
    # split: logits kernel alone (one chunk covers S here), then the select on its logits
    H, D = 32, 128
    lk = tl.logits_kernel(H, D, torch.bfloat16, tl.cuda_target()["arch"], base.logits)
    sk = tl.select_kernel(topk, tl.cuda_target()["arch"], base.select)
    logits = torch.empty(S, S, dtype=torch.float32, device="cuda")
    wq = (w * scale).contiguous()
    ones = torch.ones(S, dtype=torch.float32, device="cuda")
    row["logits_kernel_ms"] = cuda_time_ms(lambda: lk(q.view(S * H, D), k, ones, wq, starts, ends, logits),
                                           reps=reps)
    out = torch.empty(S, topk, dtype=torch.int32, device="cuda")
    row["select_kernel_ms"] = cuda_time_ms(lambda: sk(logits, starts, ends, out), reps=reps)
    if reference:
        row["torch_topk_on_logits_ms"] = cuda_time_ms(lambda: torch.topk(logits, topk, dim=1), reps=reps)
        row["reference_ms"] = cuda_time_ms(lambda: _dsa_topk_kernel(q, k, w, starts, ends, topk, scale),
                                           warmup=1, reps=max(3, reps // 3))
        row["speedup_vs_reference"] = row["reference_ms"] / row["tilelang_ms"]
        ref = _dsa_topk_kernel(q, k, w, starts, ends, topk, scale)
        same = (torch.sort(ids, 1).values == torch.sort(ref, 1).values).all(1)
        row["rows_with_identical_id_set"] = float(same.float().mean())
    row["fp8_with_quantisation_ms"] = cuda_time_ms(lambda: _fp8_call(op, q, k, w, starts, ends, topk, scale),
                                                   reps=reps)
    lk8 = tl.logits_kernel(H, D, torch.float8_e4m3fn, tl.cuda_target()["arch"], base.logits)
    row["fp8_logits_kernel_ms"] = cuda_time_ms(lambda: lk8(q8.view(S * H, D), k8, ks, w8 * scale, starts, ends,
                                                           logits), reps=reps)
    del logits
    return row, ids


# The logits kernel's register bound timed side by side (--logits-sweep): name -> LogitsConfig overrides
LOGITS_SWEEP = {
    "default": {},                                    # the run's LogitsConfig as it is
    "min3": {"min_blocks": 3},                        # registers for 3 CTAs per SM
    "min5": {"min_blocks": 5},                        # <= 96 registers (the op's min_blocks=4: <= 128)
    "regs_free": {"min_blocks": 1},                   # registers unbounded
}


# The FP8 op's variants timed round-robin beside its default (--op-configs): name -> TopkConfig overrides
OP_SWEEP = {
    "overlap": {"buffers": 2},                               # the select beside the next chunk's logits, 2 buffers
    "overlap_high": {"buffers": 2, "select_priority": -1},   # ... its CTAs dispatched first
    "overlap_1g": {"buffers": 2, "logits_budget_bytes": 1 << 30},   # ... two 1 GiB buffers
    "serial_4g": {"logits_budget_bytes": 4 << 30},           # one full-width 4 GiB buffer: half the launches
    "l3": {"logits": {"min_blocks": 3}},                     # the logits kernel's registers for 3 CTAs per SM
}


def sweep_logits(S, reps, base, names=None, select_names=None):
    """The logits kernel alone, bf16 and FP8, for each LOGITS_SWEEP entry (overrides of ``base.logits``): ms,
    TFLOP/s (causal: S^2/2 pairs x 32 heads x 128 x 2), and the largest difference from the default's logits
    relative to the row scale (0: the register bound changes no arithmetic); then the select alone on the default
    bf16 logits for each SELECT_SWEEP entry (overrides of ``base.select``), with the rows whose id set is
    ``base.select``'s."""
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    from glm52_model.ops.cuda import topk_select_tl
    H, D = 32, 128
    q, k, w, starts, ends = topk_inputs(S)
    scale = 128 ** -0.5
    q8, k8, w8, ks = quantize_indexer(q, k, w)
    ones = torch.ones(S, dtype=torch.float32, device="cuda")
    inputs = {"bf16": (q.view(S * H, D), k, ones, (w * scale).contiguous()),
              "fp8": (q8.view(S * H, D), k8, ks.float(), (w8.float() * scale).contiguous())}
    flop = S * S / 2 * H * D * 2
    arch = tl.cuda_target()["arch"]
    want = {dt: torch.empty(S, S, dtype=torch.float32, device="cuda") for dt in inputs}
    got = torch.empty(S, S, dtype=torch.float32, device="cuda")
    rows = []
    for name, over in LOGITS_SWEEP.items():
        if names and name not in names:
            continue
        for dt, (qq, kk, kss, ww) in inputs.items():
            row = {"S": S, "config": name, "dtype": dt, **over}
            try:
                t0 = time.time()
                lk = tl.compile_indexer_logits(H, D, arch, qq.dtype, with_overrides(base.logits, over))
                row["compile_s"] = round(time.time() - t0, 1)
                out = want[dt] if name == "default" else got
                lk(qq, kk, kss, ww, starts, ends, out)
                row["ms"] = cuda_time_ms(lambda: lk(qq, kk, kss, ww, starts, ends, out), reps=reps)
                row["tflops"] = flop / row["ms"] / 1e9
                # only [starts, ends) is defined: tiles past a block's last key are never written
                keys = torch.arange(S, device="cuda")
                valid = (keys >= starts[:, None]) & (keys < ends[:, None])
                assert bool(torch.isfinite(out)[valid].all()), "a valid key's logit is not finite"
                rs = want[dt].masked_fill(~valid, 0).abs().amax(1, keepdim=True).clamp_min(1e-6)
                row["max_rel_diff"] = float(((out - want[dt]).abs() / rs).masked_fill(~valid, 0).max())
            except Exception as e:                                               # a tile choice that fails
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[-1][:200] if str(e) else ''}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    # the select's tunables, on the default bf16 logits
    topk = 2048
    ref_ids = torch.empty(S, topk, dtype=torch.int32, device="cuda")
    ids = torch.empty_like(ref_ids)
    tl.select_kernel(topk, arch, base.select)(want["bf16"], starts, ends, ref_ids)
    ref_sorted = torch.sort(ref_ids, 1).values
    for name, over in SELECT_SWEEP.items():
        if select_names is not None and name not in select_names:
            continue
        tun = with_overrides(base.select, over)
        row = {"S": S, "config": f"select_{name}", **dataclasses.asdict(tun)}
        try:
            sk = topk_select_tl.compile_topk_select(topk, arch, tun)
            row["ms"] = cuda_time_ms(lambda: sk(want["bf16"], starts, ends, ids), reps=reps)
            row["same_set_rows"] = float((torch.sort(ids, 1).values == ref_sorted).all(1).float().mean())
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[-1][:200] if str(e) else ''}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    del want, got
    return rows


# The select's numeric tunables timed side by side (--logits-sweep): name -> SelectConfig overrides
SELECT_SWEEP = {
    "default": {},
    "sort16": {"sort_elems": 16},                               # 16 pairs a thread: 128 sorting threads
    "sort4": {"sort_elems": 4},                                 # 4 a thread: all 512 sort
    "vec1": {"vec": 1},                                         # one score a load
    "ungrouped": {"sample_group": 1},                           # every 8th vector alone
    "c4096": {"candidates": 4096},
    "u1": {"unroll": 1},                                        # 1 vector a thread in flight per trip
    "u4": {"unroll": 4},
    "u4_min2": {"unroll": 4, "min_blocks": 2},                  # ... with registers for 2 CTAs per SM
    "s16": {"sample": 16},
    "t256": {"threads": 256},
    "regs_free": {"min_blocks": 1},
}


def _build_one(job):
    """Compile (not run) one top-k kernel into TileLang's disk cache; a worker of :func:`precompile`."""
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    from glm52_model.ops.cuda import topk_select_tl
    kind, args, config = job
    t0 = time.time()
    try:
        if kind == "logits":
            tl.compile_indexer_logits(*args, config)
        else:
            topk_select_tl.compile_topk_select(*args, config)
        return kind, dataclasses.asdict(config), round(time.time() - t0, 1), ""
    except Exception as e:                                          # reported by the timing run that needs it
        return kind, dataclasses.asdict(config), round(time.time() - t0, 1), f"{type(e).__name__}"


def precompile(workers, topk, base, logits_names=None, arch="sm_90a", select_names=None, op_names=()):
    """Build every top-k kernel a run may time (``base``'s, the sweeps', the FP8 op's ``op_names`` variants
    (OP_SWEEP)) in ``workers`` processes at once: a fresh machine compiles each in ~20 s, one at a time in the
    timing process. Later compiles of the same kernels load from TileLang's disk cache."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    ops = [with_overrides(base, OP_SWEEP[name]) for name in op_names if name in OP_SWEEP]
    jobs = [("logits", (32, 128, arch, dt), with_overrides(base.logits, over)) for name, over in LOGITS_SWEEP.items()
            if not logits_names or name in logits_names for dt in (torch.bfloat16, torch.float8_e4m3fn)]
    jobs += [("logits", (32, 128, arch, torch.float8_e4m3fn), op.logits) for op in ops]
    selects = [with_overrides(base.select, over) for name, over in SELECT_SWEEP.items()
               if select_names is None or name in select_names]
    selects += [op.select for op in ops] + [base.select]
    jobs += [("select", (topk, arch), config) for config in selects]
    t0 = time.time()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        done = list(ex.map(_build_one, jobs))
    failed = [d for d in done if d[3]]
    print(json.dumps({"precompiled": len(done), "failed": [[d[0], d[1], d[3]] for d in failed],
                      "wall_s": round(time.time() - t0, 1)}), flush=True)


def fp8_inputs(S):
    """:func:`topk_inputs` as the FP8 op takes them: (q8, k8, w8, k_scale, starts, ends, the weights with the op's
    1/sqrt(128) folded in, as its logits kernel reads them)."""
    q, k, w, starts, ends = topk_inputs(S)
    q8, k8, w8, ks = quantize_indexer(q, k, w)
    return q8, k8, w8, ks, starts, ends, (w8.float() * 128 ** -0.5).contiguous()


def host_time(S, topk, base, calls=4):
    """The FP8 op's host side at S (``base``: a TopkConfig): per call, ms until it returns (every launch queued)
    and until the GPU is done, each call from an idle GPU; and the ms of a TileLang launch of each kernel on 64 rows
    (the GPU idle)."""
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    q8, k8, w8, ks, starts, ends, wq = fp8_inputs(S)
    op = lambda: tl.dsa_topk_indices_tl(q8, k8, w8, starts, ends, topk, 128 ** -0.5, ks, config=base)  # noqa: E731
    op()
    row = {"S": S, "returns_ms": [], "done_ms": []}
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        op()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        row["returns_ms"].append(round(1e3 * (t1 - t0), 3))
        row["done_ms"].append(round(1e3 * (time.perf_counter() - t0), 3))
    arch = tl.cuda_target()["arch"]
    lk, sk = tl.logits_kernel(32, 128, q8.dtype, arch, base.logits), tl.select_kernel(topk, arch, base.select)
    buf = torch.empty(64, S, dtype=torch.float32, device="cuda")
    out = torch.empty(64, topk, dtype=torch.int32, device="cuda")
    launches = {"logits": lambda: lk(q8[:64].reshape(64 * 32, 128), k8, ks, wq[:64], starts[:64], ends[:64], buf),
                "select": lambda: sk(buf, starts[:64], ends[:64], out)}
    for name, fn in launches.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        row[f"{name}_launch_ms"] = round(1e3 * (time.perf_counter() - t0) / 20, 4)
    return row


def logits_once(S, names, base):
    """One launch of the FP8 logits kernel at S for each LOGITS_SWEEP name (overrides of ``base.logits``; for a
    profiler: ncu --kernel-name indexer_logits_kernel python3 benchmarks/bench_kernels.py --logits-once S:name,...)."""
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    q8, k8, _, ks, starts, ends, wq = fp8_inputs(S)
    out = torch.empty(S, S, dtype=torch.float32, device="cuda")
    for name in names:
        lk = tl.compile_indexer_logits(32, 128, tl.cuda_target()["arch"], torch.float8_e4m3fn,
                                       with_overrides(base.logits, LOGITS_SWEEP[name]))
        lk(q8.view(S * 32, 128), k8, ks, wq, starts, ends, out)
        torch.cuda.synchronize()


def _fp8_call(op, q, k, w, starts, ends, topk, scale):
    q8, k8, w8, ks = quantize_indexer(q, k, w)
    return op(q8, k8, w8, starts, ends, topk, scale, ks)


_DKV_ATOMICS = ("tl.atomic_addx4_elem_op", "tl.atomic_addx2_elem_op")   # the serial / pipelined scatter


def without_dkv_scatter(prim_func):
    """A sparse MLA backward kernel minus its dkv scatter (the ``atomic_addx4`` / ``atomic_addx2`` stores into
    dKV, which then stays zero): what the rest of the backward costs. Profiling only: dkv is wrong."""
    from tvm import tirx
    from tvm.tirx import stmt_functor

    def drop_atomics(stmt):
        call = stmt.value
        if isinstance(call, tirx.Call) and getattr(call.op, "name", "") in _DKV_ATOMICS:
            return tirx.Evaluate(0)
        return None

    return prim_func.with_body(stmt_functor.ir_transform(prim_func.body, None, drop_atomics, ["tirx.Evaluate"]))


def _without_dkv_scatter_kernel(build, pass_configs, heads, topk, sm_scale, target_arch, dim_qk, dim_v, config):
    import tilelang

    kernel = tilelang.compile(without_dkv_scatter(build(heads, topk, sm_scale, dim_qk=dim_qk, dim_v=dim_v,
                                                        config=config)),
                              target={"kind": "cuda", "arch": target_arch}, pass_configs=pass_configs)
    assert "AtomicAdd" not in kernel.get_kernel_source(), "the dkv scatter is still in the ablation kernel"
    return kernel


@functools.lru_cache(maxsize=None)
def compile_bwd_without_dkv_scatter(heads, topk, sm_scale, target_arch, dim_qk, dim_v, config):
    """Stands in for ``sparse_mla_tl.compile_sparse_mla_bwd`` (same signature; ``sparse_mla_bwd_tl``'s
    ``compile_kernel``) while the ablation is timed."""
    from glm52_model.ops.cuda import sparse_mla_tl as tl
    return _without_dkv_scatter_kernel(tl.build_sparse_mla_bwd, tl.BWD_PASS_CONFIGS, heads, topk, sm_scale,
                                       target_arch, dim_qk, dim_v, config)


@functools.lru_cache(maxsize=None)
def compile_bwd_ws_without_dkv_scatter(heads, topk, sm_scale, target_arch, dim_qk, dim_v, config):
    """Stands in for ``sparse_mla_tl.compile_sparse_mla_bwd_ws`` (same signature) while the ablation is timed."""
    from glm52_model.ops.cuda import sparse_mla_tl as tl
    return _without_dkv_scatter_kernel(tl.build_sparse_mla_bwd_ws, tl.FWD_PASS_CONFIGS, heads, topk, sm_scale,
                                       target_arch, dim_qk, dim_v, config)


def bench_mla(S, H, idx, reps, with_reference):
    """Sparse MLA at H heads with the ops' kernels (``SparseMlaConfig()``), then beside them: the backward's delta
    by the TileLang row-dot kernel (``row_dot_tl``), the serial backward and (64 heads) the warp-specialised
    forward and backward each way, the backwards without their dkv scatter, and the pipelined backward's other
    piece width."""
    from glm52_model.ops.cuda import sparse_mla_tl as tl
    from row_dot_tl import row_dot_tl
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(S, H, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=g).bfloat16()
    scale = 576 ** -0.5
    topk = idx.shape[1]
    fwd_flop, bwd_flop = tl.sparse_mla_flops(S, H, topk)
    ops = tl.SparseMlaConfig()
    row = {"S": S, "heads": H, "topk": topk, "valid_slot_fraction": float((idx >= 0).float().mean())}
    out, lse = tl.sparse_mla_tl(q, kv, idx, scale, 512)
    dout = torch.randn_like(out)

    def bwd(config=ops, compile_kernel=None):
        return lambda: tl.sparse_mla_bwd_tl(q, kv, out, dout, idx, lse, scale, 512, config, compile_kernel)
    row["fwd_ms"] = cuda_time_ms(lambda: tl.sparse_mla_tl(q, kv, idx, scale, 512), reps=reps)
    row["bwd_ms"] = cuda_time_ms(bwd(), reps=reps)
    ws_bwd = tl.bwd_kernel_choice(tl.padded_heads(H), 512, ops)[0] is tl.compile_sparse_mla_bwd_ws
    row["bwd_kernel"] = "pipelined" if ws_bwd else "serial"
    row["delta_kernel"] = "pytorch"
    # the backward's delta = rowsum(out * dout): the op's PyTorch form beside the TileLang kernel
    deltas = {"pytorch": lambda: tl.row_dot(out, dout, ops.delta_chunk_bytes),
              "tilelang": lambda: row_dot_tl(out, dout)}
    for kernel, fn in deltas.items():
        row[f"delta_{kernel}_ms"] = cuda_time_ms(fn, reps=reps)
    row["delta_tilelang_max_abs_diff"] = float((deltas["tilelang"]() - deltas["pytorch"]()).abs().max())
    row["fwd_tflops"] = fwd_flop / row["fwd_ms"] / 1e9
    row["bwd_tflops"] = bwd_flop / row["bwd_ms"] / 1e9
    if with_reference:
        row["reference_fwd_ms"] = cuda_time_ms(lambda: _sparse_mla_fwd_kernel(q, kv, idx, scale, 512),
                                               warmup=1, reps=2)
        row["reference_bwd_ms"] = cuda_time_ms(
            lambda: _sparse_mla_bwd_kernel(q, kv, out, dout, idx, lse, scale, 512), warmup=1, reps=2)
    # profile of the serial backward: what the kernels move (every query gathers topk latent rows, 576
    # bf16, in fwd and bwd; the bwd also scatters topk x 576 fp32 dkv partial sums with vector atomics),
    # and the serial backward without those atomics (an ablation built from its TIR)
    gathered = S * topk * 576 * 2
    row["fwd_gather_tb_per_s"] = gathered / row["fwd_ms"] / 1e9
    serial = dataclasses.replace(ops, pipelined_bwd=False)
    row["bwd_serial_ms"] = cuda_time_ms(bwd(serial), reps=reps)
    row["bwd_serial_no_dkv_scatter_ms"] = cuda_time_ms(bwd(serial, compile_bwd_without_dkv_scatter), reps=reps)
    row["bwd_serial_tflops"] = bwd_flop / row["bwd_serial_ms"] / 1e9
    row["bwd_serial_dkv_scatter_share"] = 1 - row["bwd_serial_no_dkv_scatter_ms"] / row["bwd_serial_ms"]
    spent = row["bwd_serial_ms"] - row["bwd_serial_no_dkv_scatter_ms"]
    row["bwd_serial_dkv_atomic_tb_per_s"] = S * topk * 576 * 4 / spent / 1e9 if spent > 0 else None
    if tl.padded_heads(H) == 64:
        row.update(_bench_mla_pipelined(tl, q, kv, idx, out, lse, bwd, serial, fwd_flop, bwd_flop, reps))
    return row


def _bench_mla_pipelined(tl, q, kv, idx, out, lse, bwd, serial, fwd_flop, bwd_flop, reps):
    """At 64 heads: the warp-specialised forward (its output against the serial forward's) and backward (against
    the serial backward; a failure is recorded in the row instead of aborting the benchmark), the latter without
    its dkv atomics (dkv is then wrong), and with the other piece width of Q / dO / KV (64 columns: fewer register
    spills, more GEMM waits; 128: the reverse)."""
    scale = 576 ** -0.5
    pipelined = dataclasses.replace(serial, pipelined_fwd=True, pipelined_bwd=True)
    fwd_serial = dataclasses.replace(serial, pipelined_fwd=False)
    row = {}
    out_p, _ = tl.sparse_mla_tl(q, kv, idx, scale, 512, pipelined)
    out_s, _ = tl.sparse_mla_tl(q, kv, idx, scale, 512, fwd_serial)
    row["fwd_pipelined_ms"] = cuda_time_ms(lambda: tl.sparse_mla_tl(q, kv, idx, scale, 512, pipelined), reps=reps)
    row["fwd_pipelined_tflops"] = fwd_flop / row["fwd_pipelined_ms"] / 1e9
    row["fwd_pipelined_max_abs_diff"] = float((out_p.float() - out_s.float()).abs().max())
    try:
        dq_s, dkv_s = bwd(serial)()
        dq_p, dkv_p = bwd(pipelined)()
        row["bwd_pipelined_ms"] = cuda_time_ms(bwd(pipelined), reps=reps)
        row["bwd_pipelined_tflops"] = bwd_flop / row["bwd_pipelined_ms"] / 1e9
        row["bwd_pipelined_chunk"] = pipelined.bwd_ws.chunk
        row["bwd_pipelined_dq_max_abs_diff"] = float((dq_p.float() - dq_s.float()).abs().max())
        row["bwd_pipelined_dkv_max_abs_diff"] = float((dkv_p.float() - dkv_s.float()).abs().max())
        row["bwd_pipelined_dq_max_abs_serial"] = float(dq_s.float().abs().max())
        row["bwd_pipelined_dkv_max_abs_serial"] = float(dkv_s.float().abs().max())
        del dq_p, dkv_p
        row["bwd_pipelined_no_dkv_scatter_ms"] = cuda_time_ms(bwd(pipelined, compile_bwd_ws_without_dkv_scatter),
                                                              reps=reps)
        other = 128 if pipelined.bwd_ws.chunk == 64 else 64
        other_chunk = with_overrides(pipelined, {"bwd_ws": {"chunk": other}})
        row[f"bwd_pipelined_chunk{other}_ms"] = cuda_time_ms(bwd(other_chunk), reps=reps)
    except Exception as e:  # noqa: BLE001
        row["bwd_pipelined_error"] = f"{type(e).__name__}: {e}"[:500]
    return row


def bench_experts(S, reps, E=8, top_k=8, hidden=6144, width=2048):
    """fwd and bwd of the experts' three grouped GEMMs, bf16 vs FP8, ms and TFLOP/s."""
    from glm52_model.ops.fp8 import quantize_1x128, quantize_128x128

    R = S * top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(R, hidden, device="cuda", generator=g).bfloat16()
    h = torch.randn(R, width, device="cuda", generator=g).bfloat16()
    w_in = (torch.randn(E, hidden, width, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    w_out = (torch.randn(E, width, hidden, device="cuda", generator=g) * width ** -0.5).bfloat16()
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (R // E)
    dy_in = torch.randn(R, width, device="cuda", generator=g).bfloat16()
    dy_out = torch.randn(R, hidden, device="cuda", generator=g).bfloat16()
    flop = 2 * R * hidden * width * 3                                          # gate, up, down

    def fwd(op):
        return lambda: (op(x, w_in, offs), op(x, w_in, offs), op(h, w_out, offs))

    def bwd(op):
        return lambda: (op(dy_in, x, w_in, offs), op(dy_in, x, w_in, offs), op(dy_out, h, w_out, offs))

    G = torch.ops.glm52
    row = {"S": S, "rows": R, "experts": E, "hidden": hidden, "width": width}
    for name, f, b in (("bf16", G.grouped_mm, G.grouped_mm_bwd), ("fp8", G.fp8_grouped_mm, G.fp8_grouped_mm_bwd)):
        row[f"{name}_fwd_ms"] = cuda_time_ms(fwd(f), reps=reps)
        row[f"{name}_bwd_ms"] = cuda_time_ms(bwd(b), reps=reps)
        row[f"{name}_fwd_tflops"] = flop / row[f"{name}_fwd_ms"] / 1e9
        row[f"{name}_bwd_tflops"] = 2 * flop / row[f"{name}_bwd_ms"] / 1e9
    # the FP8 GEMMs alone: operands quantised beforehand, one blockwise GEMM per expert (forward form)
    xq, wq = quantize_1x128(x), quantize_128x128(w_in.transpose(1, 2))
    hq, woq = quantize_1x128(h), quantize_128x128(w_out.transpose(1, 2))
    n = R // E

    def gemms():
        for e in range(E):
            sl = slice(e * n, (e + 1) * n)
            for a, b in ((xq, wq), (xq, wq), (hq, woq)):
                G.fp8_blockwise_mm(a[0][sl], a[1][sl], b[0][e], b[1][e], torch.bfloat16)
    row["fp8_gemms_only_fwd_ms"] = cuda_time_ms(gemms, reps=reps)
    # uneven groups (no expert's rows a multiple of 128): the forward's tail GEMMs at the op's GEMM_ROWS (16) and 128,
    # through the kernel the op's CUDA kernel calls, with its TileLang quantisers
    from glm52_model.ops import fp8_grouped_mm as fgm
    from glm52_model.ops.cuda.fp8_quant_tl import tilelang_quantisers
    uneven = offs - torch.arange(E, 0, -1, device="cuda", dtype=torch.int32) * 37
    row["fp8_fwd_uneven_ms"] = cuda_time_ms(lambda: G.fp8_grouped_mm(x, w_in, uneven), reps=reps)
    quant = tilelang_quantisers()
    row["fp8_fwd_uneven_gemm_rows_128_ms"] = cuda_time_ms(
        lambda: fgm.fp8_grouped_mm_kernel(x, w_in, uneven, quant, gemm_rows=128), reps=reps)
    row["fp8_fwd_profile"] = kernel_profile(fwd(G.fp8_grouped_mm))
    row["fp8_bwd_profile"] = kernel_profile(bwd(G.fp8_grouped_mm_bwd))
    row["fwd_speedup"] = row["bf16_fwd_ms"] / row["fp8_fwd_ms"]
    row["bwd_speedup"] = row["bf16_bwd_ms"] / row["fp8_bwd_ms"]
    row["gemms_only_fwd_speedup"] = row["bf16_fwd_ms"] / row["fp8_gemms_only_fwd_ms"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topk-seq", default="4096,16384")
    p.add_argument("--mla-seq", type=int, default=16384)
    p.add_argument("--mla-heads", default="16,64,128")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--experts-seq", default="16384", help="tokens for the routed-expert GEMMs")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--reference-max-seq", type=int, default=65536,
                   help="longer top-k rows skip the PyTorch reference kernel and torch.topk (seconds per call)")
    p.add_argument("--mla-reference", action="store_true", help="also time the PyTorch sparse MLA kernels")
    p.add_argument("--topk-op-seq", default="", help="lengths at which to time only the top-k op (bf16, FP8; rows in 'topk')")
    p.add_argument("--op-configs", default="",
                   help="OP_SWEEP names the --topk-op-seq rows time beside the FP8 op's default ('all' for every one)")
    p.add_argument("--logits-sweep", default="", help="sequence lengths for the logits kernel's tile sweep")
    p.add_argument("--logits-configs", default="", help="LOGITS_SWEEP names to run (default: all)")
    p.add_argument("--select-configs", default=None,
                   help="SELECT_SWEEP names the logits sweep also times (default: all; '' for none)")
    p.add_argument("--logits-tunables", default="",
                   help="JSON overrides of the op's LogitsConfig for this whole run (recorded in the rows)")
    p.add_argument("--select-tunables", default="",
                   help="JSON overrides of the op's SelectConfig for this whole run (recorded in the rows)")
    p.add_argument("--host-seq", default="", help="lengths at which to time the FP8 op's host side (host_time)")
    p.add_argument("--logits-once", default="",
                   help="S:name,name: one FP8 logits launch per LOGITS_SWEEP name at S (for ncu), then exit")
    p.add_argument("--precompile", type=int, default=0,
                   help="first build the top-k kernels the sweeps and the op use in this many processes")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    op_names = list(OP_SWEEP) if args.op_configs == "all" else [n for n in args.op_configs.split(",") if n]
    unknown = sorted(set(op_names) - set(OP_SWEEP) - {"default"})
    if unknown:
        sys.exit(f"bench_kernels: --op-configs {','.join(unknown)}: not in OP_SWEEP; "
                 f"choose from {', '.join(OP_SWEEP)} or 'all'")
    from glm52_model.ops.cuda.dsa_topk_tl import LogitsConfig, TopkConfig
    from glm52_model.ops.cuda.topk_select_tl import SelectConfig
    try:
        base = with_overrides(TopkConfig(), {"logits": json.loads(args.logits_tunables or "{}"),
                                             "select": json.loads(args.select_tunables or "{}")})
    except TypeError as e:
        fields = {c.__name__: [f.name for f in dataclasses.fields(c)] for c in (LogitsConfig, SelectConfig)}
        sys.exit(f"bench_kernels: --logits-tunables / --select-tunables: {e}; the configs' fields: {fields}")
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA device")
    import tilelang
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tilelang": tilelang.__version__, "python": platform.python_version(),
              "command": " ".join(sys.argv), "topk": [], "sparse_mla": [], "experts": [], "logits_sweep": []}
    t0 = time.time()
    if args.precompile:
        from glm52_model.ops.cuda.dsa_topk_tl import cuda_target
        precompile(args.precompile, args.topk, base, [n for n in args.logits_configs.split(",") if n],
                   cuda_target()["arch"],
                   select_names=None if args.select_configs is None else args.select_configs.split(","),
                   op_names=op_names if args.topk_op_seq else ())
    if args.logits_once:
        S, names = args.logits_once.split(":")
        unknown = sorted(set(names.split(",")) - set(LOGITS_SWEEP))
        if unknown:
            sys.exit(f"bench_kernels: --logits-once {','.join(unknown)}: not in LOGITS_SWEEP; choose from "
                     f"{', '.join(LOGITS_SWEEP)}")
        logits_once(int(S), names.split(","), base)
        return result
    ids16 = None
    ints = lambda csv: [int(v) for v in csv.split(",") if v]
    result["host"] = [host_time(S, args.topk, base) for S in ints(args.host_seq)]
    for row in result["host"]:
        print(json.dumps(row), flush=True)
    for S in ints(args.topk_op_seq):
        row, _ = bench_topk(S, args.topk, args.reps, base, parts=False, variants=op_names)
        print(json.dumps(row), flush=True)
        result["topk"].append(row)
    for S in ints(args.logits_sweep):
        selects = None if args.select_configs is None else [n for n in args.select_configs.split(",") if n]
        result["logits_sweep"] += sweep_logits(S, args.reps, base, [n for n in args.logits_configs.split(",") if n],
                                               selects)
    for S in ints(args.experts_seq):
        row = bench_experts(S, args.reps)
        print(json.dumps(row), flush=True)
        result["experts"].append(row)
    for S in ints(args.topk_seq):
        row, ids = bench_topk(S, args.topk, args.reps, base, reference=S <= args.reference_max_seq)
        print(json.dumps(row), flush=True)
        result["topk"].append(row)
        if S == args.mla_seq:
            ids16 = ids
    if ids16 is None and ints(args.mla_heads):
        _, ids16 = bench_topk(args.mla_seq, args.topk, 1, base, parts=False)
    for H in ints(args.mla_heads):
        row = bench_mla(args.mla_seq, H, ids16, args.reps, args.mla_reference and H == 16)
        print(json.dumps(row), flush=True)
        result["sparse_mla"].append(row)
    result["wall_s"] = time.time() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
