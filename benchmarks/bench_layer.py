"""Layer benchmark: one GLM-5.2 MoE decoder layer (full top-k, FP8), forward+backward, several variants.

    python3 benchmarks/bench_layer.py --seq 4096,8192,16384,32768,65536 --out benchmarks/results/layer_h200.json
    python3 benchmarks/bench_layer.py --device cpu --preset tiny --seq 128 --steps 2     # smoke test

Variants (one process, the same weights and the same inputs for every variant) are named builders in
``layerbench/variants.py`` (``--list-variants`` prints them): ``no_ac`` (no checkpoint, the upper bound on
speed), ``full_recompute`` (the control: the backward replays the whole forward, the DSA top-k included),
``island`` (the public workaround: the top-k in ``torch._dynamo.disable``, kept by an eager selective
checkpoint), ``pytorch_sac`` (PyTorch SAC saving the top-k, compiled whole), ``sacpass`` (the model's own
checkpoint compiled with ``sacpass.backend()``), and ``plain_ac`` (not run by default: the model's plain
checkpoint under plain torch.compile).

Every compiled variant marks the token dim dynamic, so one compile serves every sequence length. Per variant
and length: median step time over ``--steps`` steps after ``--warmup`` steps (CUDA events around each
fwd+bwd), peak allocated / reserved memory, compile time (first step minus a steady step), graph breaks,
compiled graphs, top-k executions in forward and backward, loss. The top-k op alone (and the whole indexer
forward) is timed at each length, so the table shows limit(S) = (control - top-k fwd) / control. Results
are written after every measurement (JSON), then a markdown table and a PNG plot of step time / control
versus S (``layerbench/``: variants, measure, results, plot).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm52_model import GLM52Config  # noqa: E402
from layerbench.measure import Clock, cold_compile_caches, counted_step, dynamo_counts, measure, time_topk  # noqa: E402
from layerbench.plot import plot  # noqa: E402
from layerbench.results import compile_rows, markdown, merge_into, new_result, save, targets  # noqa: E402
from layerbench.variants import (CONTROL, RUN_ORDER, VARIANTS, Variant, add_experts_option,  # noqa: E402
                                 build_layer, experts_overrides, make_inputs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--preset", default="bench", choices=("bench", "tiny"))
    p.add_argument("--seq", default="4096,8192,16384,32768,65536", help="comma-separated lengths, small first")
    p.add_argument("--variants", default=",".join(RUN_ORDER), help="run order (caches warm for later ones)")
    p.add_argument("--list-variants", action="store_true", help="print the registered variants and exit")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps, the first compiles")
    p.add_argument("--topk-reps", type=int, default=10)
    p.add_argument("--no-fp8", action="store_true")
    add_experts_option(p)
    p.add_argument("--fp8-indexer", action="store_true", help="the indexer's logits from e4m3 q and k")
    p.add_argument("--backend", default=None, choices=("inductor", "aot_eager"),
                   help="inner compiler of every variant (default: inductor on CUDA, aot_eager on CPU, where "
                        "Inductor's C++ compile of this layer takes minutes per variant)")
    p.add_argument("--static", action="store_true", help="do not mark the token dim dynamic")
    p.add_argument("--warm-caches", action="store_true",
                   help="share Inductor/Triton caches and compile workers between variants (default: every "
                        "variant compiles cold, so identical graphs do not hit a cache a previous variant filled)")
    p.add_argument("--mtp-seq", type=int, default=0, help="also time the MTP layer at this length (0: skip)")
    p.add_argument("--mtp-variants", default=f"{CONTROL},sacpass")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget: a length or variant predicted to overrun it is skipped")
    p.add_argument("--out", default="benchmarks/results/bench_layer.json")
    p.add_argument("--merge", default=None, help="a previous run's JSON to add this run's measurements to")
    args = p.parse_args(argv)
    if args.list_variants:
        for name, spec in VARIANTS.items():
            print(f"{name:16} {' '.join(spec.doc.split())}")
        sys.exit(0)
    args.names = [v for v in args.variants.split(",") if v and v != "none"]
    for v in args.names:
        if v not in VARIANTS:
            sys.exit(f"bench_layer: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if args.backend is None:
        args.backend = "inductor" if args.device == "cuda" else "aot_eager"
    return args


def layer_config(args) -> GLM52Config:
    """One MoE layer computing top-k: the bench preset, or the tiny widths for a CPU smoke test."""
    experts = experts_overrides(args)
    if args.preset == "tiny":
        return GLM52Config.tiny(fp8=not args.no_fp8, fp8_indexer=args.fp8_indexer, recompute=True,
                                num_layers=1, first_k_dense=0, mtp_layers=0, **experts)
    return GLM52Config.bench(fp8=not args.no_fp8, fp8_indexer=args.fp8_indexer, recompute=True, **experts)


class Run:
    """One invocation: settings, the base layer, the result being filled and the wall-clock budget."""

    def __init__(self, args):
        self.args, self.t_start = args, time.perf_counter()
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            sys.exit("bench_layer: --device cuda but no CUDA device (use --device cpu --preset tiny)")
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.cfg = layer_config(args)
        self.seqs = [int(s) for s in args.seq.split(",") if s]
        self.clock = Clock(self.device)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        self.result = new_result(args, self.cfg, self.device, self.dtype)
        self.merged = bool(args.merge)
        if self.merged:
            self.result = merge_into(args.merge, self.result, args)
        self.base = build_layer(self.cfg, self.device, self.dtype)

    def inputs(self, S: int):
        return make_inputs(S, self.cfg, self.device, self.dtype)

    def save(self) -> None:
        save(self.result, self.args.out, time.perf_counter() - self.t_start)

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t_start)

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def eager_first_length(run: Run) -> None:
    """Eager warm-up at the first length: JIT-compiles the TileLang kernels outside any variant's compile time."""
    S = run.seqs[0]
    eager = Variant("eager", run.base, dynamic=False)
    t0 = time.perf_counter()
    loss, fk, bk = counted_step(eager, *run.inputs(S))
    run.clock.sync()
    key = "eager_first_length_merged_run" if run.merged else "eager_first_length"
    run.result[key] = {"S": S, "loss": float(loss), "first_step_s": time.perf_counter() - t0,
                       "topk_fwd_runs": fk, "topk_bwd_runs": bk}
    print(f"eager S={S}: loss {float(loss):.6g}, fwd/bwd top-k runs {fk}/{bk}, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


def topk_alone(run: Run) -> None:
    """The top-k op alone at every length first (one table column; also warms the kernels per length)."""
    for S in run.seqs:
        entry = run.result["seq"].setdefault(str(S), {"variants": {}})
        try:
            entry["topk"] = time_topk(run.base, run.inputs(S), run.clock, run.args.topk_reps)
        except torch.cuda.OutOfMemoryError as e:
            entry["topk"] = {"status": "oom", "error": str(e)[:200]}
        print(f"S={S} top-k: {entry['topk']}", flush=True)
    run.save()


def measure_or_oom(run: Run, v: Variant, inputs, topk_ids=None) -> dict:
    try:
        return measure(v, inputs, run.args.steps, run.args.warmup, run.clock, run.device, topk_ids=topk_ids)
    except torch.cuda.OutOfMemoryError as e:
        v.layer.zero_grad(set_to_none=True)
        return {"status": "oom", "error": str(e)[:300]}


def record_compile(run: Run, name: str, v: Variant, m: dict, S: int) -> None:
    """The variant's compile row, from its first measured length."""
    rows = compile_rows(run.result, run.merged)
    if name in rows:
        return
    c = dynamo_counts()
    rows[name] = {"compile_s": m.get("first_step_s", 0) - m.get("step_ms_median", 0) / 1e3,
                  "at_S": S, "graph_breaks": c["graph_breaks"], "graph_break_reasons": c["graph_break_reasons"],
                  "unique_graphs": c["unique_graphs"], "fullgraph": v.fullgraph, "backend": str(v.backend_name)}
    reports = getattr(v.backend, "reports", None)
    if reports:
        rows[name]["saved_must_save"] = [
            {"op": t.op, "shape": list(t.shape), "dtype": t.dtype, "bytes_at_hint": t.bytes}
            for r in reports for t in r.saved if t.reason == "must-save"]
        rows[name]["saved_total_bytes_at_hint"] = sum(r.total_bytes for r in reports)
        rows[name]["violations"] = [x for r in reports for x in r.violations]


def run_variant(run: Run, name: str, share: float) -> None:
    """A fresh dynamo (no shared code-object caches between variants), one compile at the first length
    (token dim dynamic), then every length that fits its share of the budget."""
    from torch._dynamo.utils import counters

    args = run.args
    with contextlib.ExitStack() as caches:
        if not args.warm_caches:
            caches.enter_context(cold_compile_caches())
        t_variant = time.perf_counter()
        torch._dynamo.reset()
        counters.clear()
        v = Variant(name, run.base, dynamic=not args.static, backend=args.backend)
        prev = None                                                  # (S, step ms) of the last length
        for S in run.seqs:
            entry = run.result["seq"][str(S)]
            if prev is not None:
                need = prev[1] * (S / prev[0]) ** 1.5 * (args.steps + args.warmup) / 1e3 * 1.1 + 3
                spent = time.perf_counter() - t_variant
                if need > share - spent:
                    msg = f"{name} S={S} skipped: predicted {need:.0f} s > {share - spent:.0f} s of its budget"
                    print(msg, flush=True)
                    run.result["notes"].append(msg)
                    entry["variants"][name] = {"status": "skipped (time)"}
                    run.save()
                    continue
            m = measure_or_oom(run, v, run.inputs(S))
            run.free()
            entry["variants"][name] = m
            if "step_ms_median" in m:
                prev = (S, m["step_ms_median"])
            record_compile(run, name, v, m, S)
            print(f"S={S} {name}: " + json.dumps({k: (round(x, 4) if isinstance(x, float) else x)
                                                  for k, x in m.items() if k != "error"}), flush=True)
            run.save()
        rows = compile_rows(run.result, run.merged)
        rows.setdefault(name, {})["graphs_after_all_lengths"] = dynamo_counts()["unique_graphs"]
        rows[name]["cold_caches"] = not args.warm_caches
        del v
    run.free()


def run_mtp(run: Run) -> None:
    """The MTP layer: a shared-top-k MoE layer that takes the main layer's IDs (no top-k inside it)."""
    from torch._dynamo.utils import counters

    args, S = run.args, run.args.mtp_seq
    names = [v for v in args.mtp_variants.split(",") if v]
    if set(names) - {"no_ac", CONTROL, "sacpass"}:
        sys.exit(f"bench_layer: --mtp-variants takes no_ac, {CONTROL}, sacpass")
    ctrl = run.result["seq"].get(str(S), {}).get("variants", {}).get(CONTROL, {}).get("step_ms_median")
    need = (2 * (ctrl or 0) * (args.steps + args.warmup) / 1e3 + 90) * len(names)
    if need > run.left():
        run.result["notes"].append(f"MTP layer at S={S} skipped: predicted {need:.0f} s > {run.left():.0f} s left")
        return
    run.free()
    mtp_base = build_layer(run.cfg, run.device, run.dtype, compute_topk=False, seed=2)
    inputs = run.inputs(S)
    with torch.no_grad():
        ids = run.base(*inputs)[1]                                   # the main layer's top-k IDs
    entry = run.result["mtp"].setdefault(str(S), {})
    for name in names:
        counters.clear()
        torch._dynamo.reset()
        v = Variant(name, mtp_base, dynamic=not args.static, backend=args.backend)
        m = measure_or_oom(run, v, inputs, topk_ids=ids)
        if "first_step_s" in m:
            m["compile_s"] = m["first_step_s"] - m["step_ms_median"] / 1e3
        entry[name] = m
        print(f"MTP S={S} {name}: {m}", flush=True)
        del v
        run.save()


def main(argv=None) -> dict:
    run = Run(parse_args(argv))
    print(f"bench_layer: {run.result['env']}", flush=True)
    print(f"layer params: {sum(p.numel() for p in run.base.parameters()) / 1e6:.1f} M, "
          f"cfg {run.result['config']}", flush=True)
    eager_first_length(run)
    topk_alone(run)
    for i, name in enumerate(run.args.names):
        run_variant(run, name, share=run.left() / (len(run.args.names) - i) - 5)   # an equal share of what is left
    if run.args.mtp_seq:
        run_mtp(run)
    run.result["targets"] = targets(run.result)
    run.save()
    run.result["plot"] = plot(run.result, os.path.splitext(run.args.out)[0] + ".png")
    run.save()
    print(markdown(run.result), flush=True)
    return run.result


if __name__ == "__main__":
    main()
