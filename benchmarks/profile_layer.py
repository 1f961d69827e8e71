"""Where a layer step's GPU time goes: one variant of the bench layer, one step under torch.profiler, its CUDA
kernels summed into named groups (the bound the closing note of a speed target gives).

    python3 benchmarks/profile_layer.py --seq 65536 --variant sacpass_fp8_experts --out results/profile.json

The step is the one ``bench_layer.py`` times (same layer, inputs, variant, dynamic token dim); it runs twice
first (compile, warm-up). Groups match kernel names (first match wins, in the order of ``GROUPS``); the rest
are "other". The JSON keeps the top kernels too.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm52_model import GLM52Config  # noqa: E402
from layerbench.measure import step  # noqa: E402
from layerbench.variants import VARIANTS, Variant, build_layer, make_inputs  # noqa: E402

GROUPS = (  # (group, kernel-name pattern)
    ("sparse MLA forward", r"sparse_mla_fwd"),
    ("sparse MLA backward", r"sparse_mla_bwd"),
    ("indexer logits", r"indexer_logits"),
    ("top-k select", r"topk_select"),
    ("FP8 quantisers (TileLang)", r"quant_(rows|cols|blocks)"),
    ("FP8 GEMMs (cuBLASLt)", r"nvjet.*qq|sm90_xmma_gemm.*e4m3|_scaled_mm"),
    ("bf16 GEMMs (cuBLAS)", r"nvjet|gemm|cutlass|sm90_xmma"),
    ("Triton (Inductor fusions)", r"^triton_"),
    ("copies / fills", r"Memcpy|Memset|copy_kernel|FillFunctor"),
)


def grouped(prof) -> tuple[dict, list]:
    groups, kernels = {g: 0.0 for g, _ in GROUPS} | {"other": 0.0}, {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = ev.device_time_total / 1e3
        name = next((g for g, pat in GROUPS if re.search(pat, ev.name)), "other")
        groups[name] += ms
        kernels[ev.name[:100]] = kernels.get(ev.name[:100], 0.0) + ms
    top = sorted(({"name": k, "ms": v} for k, v in kernels.items()), key=lambda r: -r["ms"])[:25]
    return groups, top


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--variant", default="sacpass", choices=sorted(VARIANTS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_layer: needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    cfg = GLM52Config.bench(fp8=True, recompute=True)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    v = Variant(args.variant, build_layer(cfg, dev, dtype), dynamic=True)
    inputs = make_inputs(args.seq, cfg, dev, dtype)
    for _ in range(2):
        step(v, *inputs)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        a.record()
        step(v, *inputs)
        b.record()
        torch.cuda.synchronize()
    groups, top = grouped(prof)
    step_ms = a.elapsed_time(b)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "S": args.seq, "variant": args.variant, "step_ms_profiled": step_ms,
              "kernel_ms_total": sum(groups.values()), "groups_ms": groups, "top_kernels": top}
    print(f"S={args.seq} {args.variant}: step {step_ms:.1f} ms (profiled), kernels {result['kernel_ms_total']:.1f} ms")
    for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:28} {ms:9.1f} ms  {100 * ms / step_ms:5.1f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
