"""Do PyTorch SAC and sacpass reach the same partition of the bench layer? Compare their saved sets.

Compiles the bench layer twice through sacpass's partitioner so both get a report: (1) PyTorch SAC placed
by hand (checkpoint(layer, context_fn=save the top-k)) with sacpass adding no tags (``use_registered=False``),
(2) the model's own checkpoint with sacpass. Prints saved bytes by reason and the ops each backward
recomputes that the other does not. On the H200 (torch 2.11, 4K) both save the same 20 tensors and
recompute the same 161 ops (``benchmarks/results/sac_vs_sacpass_h200.json``, bf16 routed experts: the bench
preset's default then; it now runs them in FP8, ``--experts bf16`` for that comparison); before sacpass routed
plain checkpoints through torch 2.13's tagging, sacpass's side saved the FP8 linears' outputs.

    python3 benchmarks/compare_sac_partition.py --seq 4096 [--device cuda] [--inner inductor]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sacpass  # noqa: E402
from glm52_model import GLM52Config  # noqa: E402
from glm52_model.compile import apply_ac  # noqa: E402
from layerbench.variants import (CheckpointLayer, add_experts_option, build_layer,  # noqa: E402
                                 experts_overrides, make_inputs, save_topk_context)


def partition_of(fn_layer, be, inputs):
    torch._dynamo.reset()
    compiled = torch.compile(fn_layer, backend=be, fullgraph=True)
    x, positions, starts, ends = inputs
    out = compiled(x.detach().requires_grad_(), positions, starts, ends)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    (report,) = be.reports
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="bench")
    p.add_argument("--inner", default="inductor")
    add_experts_option(p)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = GLM52Config.preset(args.preset, fp8=True, recompute=True, **experts_overrides(args))
    base = build_layer(cfg, device, dtype)
    inputs = make_inputs(args.seq, cfg, device, dtype)

    sac_layer = apply_ac(copy.deepcopy(base), False)
    sac = partition_of(CheckpointLayer(sac_layer, save_topk_context),
                       sacpass.backend(inner=args.inner, use_registered=False), inputs)
    sp = partition_of(copy.deepcopy(base), sacpass.backend(inner=args.inner), inputs)
    result = {}
    for name, rep in (("pytorch_sac", sac), ("sacpass", sp)):
        result[name] = {"total_bytes": rep.total_bytes, "by_reason": rep.bytes_by_reason(),
                        "recomputed_ops": sum(rep.recomputed.values()), "saved": len(rep.saved)}
        print(f"{name}: {len(rep.saved)} saved, {rep.total_bytes} bytes {rep.bytes_by_reason()}, "
              f"{sum(rep.recomputed.values())} recomputed ops")
    ops = sorted(set(sac.recomputed) | set(sp.recomputed))
    diff = {op: (sac.recomputed.get(op, 0), sp.recomputed.get(op, 0)) for op in ops
            if sac.recomputed.get(op, 0) != sp.recomputed.get(op, 0)}
    result["recomputed_diff_sac_vs_sacpass"] = diff
    print("recomputed in backward, SAC vs sacpass (only differences):")
    for op, (a, b) in diff.items():
        print(f"  {op}: {a} vs {b}")
    sac_saved = sorted((s.op, s.dtype, s.shape) for s in sac.saved)
    sp_saved = sorted((s.op, s.dtype, s.shape) for s in sp.saved)
    result["only_sac_saves"] = [list(map(str, t)) for t in sorted(set(sac_saved) - set(sp_saved))]
    result["only_sacpass_saves"] = [list(map(str, t)) for t in sorted(set(sp_saved) - set(sac_saved))]
    print("only SAC saves:", result["only_sac_saves"])
    print("only sacpass saves:", result["only_sacpass_saves"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
