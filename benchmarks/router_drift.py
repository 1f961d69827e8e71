"""Does the GLM-5.2 router's recompute pick other experts than its forward? (on the H200)

    python3 benchmarks/router_drift.py --seq 4096 --steps 300 --out benchmarks/results/router_drift_h200.json

One bench MoE layer with GLM-5.2's router (hidden 6144, 256 experts, top-8; ``--expert-width`` keeps the
experts' own GEMMs small: the router's math is untouched) compiled with Inductor under full recompute of the
router (sacpass with ``save_discrete=False``: the backward replays ``MoE.route``, as a plain compiled
checkpoint does). A probe
op after the router's top-k records the expert IDs each time it runs: once in the forward, once in the
recompute. Each step draws a new input; the result is the number of steps, and of tokens, whose recomputed
experts differ from the forward's. With sacpass's default the recompute never happens (the IDs are saved),
so there is nothing to differ.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sacpass  # noqa: E402
from glm52_model import GLM52Config  # noqa: E402
from glm52_model.compile import apply_compile  # noqa: E402
from layerbench.variants import build_layer, make_inputs  # noqa: E402

_SEEN: list[tuple[bool, torch.Tensor]] = []


@torch.library.custom_op("bench::probe_ids", mutates_args=())
def probe_ids(ids: torch.Tensor) -> torch.Tensor:
    """Identity on the router's expert IDs that remembers them, and whether it ran in a backward."""
    _SEEN.append((torch._C._current_autograd_node() is not None, ids.detach().clone()))
    return ids.clone()


@probe_ids.register_fake
def _(ids):
    return torch.empty_like(ids)


def probed_route(self, x):
    expert, weight = type(self).route(self, x)
    return torch.ops.bench.probe_ids(expert), weight


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="bench", choices=("bench", "tiny"))
    p.add_argument("--experts", type=int, default=256, help="routed experts (GLM-5.2: 256, top-8)")
    p.add_argument("--expert-width", type=int, default=128, help="moe_intermediate_size (the router ignores it)")
    p.add_argument("--out", default="benchmarks/results/router_drift.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = GLM52Config.preset(args.preset, recompute=True, num_layers=1, first_k_dense=0, mtp_layers=0,
                             num_experts=args.experts, moe_intermediate_size=args.expert_width)
    if cfg.num_experts_per_tok >= cfg.num_experts:
        sys.exit(f"router_drift: top-{cfg.num_experts_per_tok} of {cfg.num_experts} experts picks every expert: "
                 f"nothing could differ; use --experts > {cfg.num_experts_per_tok}")
    layer = build_layer(cfg, device, dtype)
    layer.mlp.route = types.MethodType(probed_route, layer.mlp)
    be = sacpass.backend(inner="inductor" if device.type == "cuda" else "aot_eager", save_discrete=False)
    apply_compile(layer, backend=be)
    steps, tokens, t0 = [], 0, time.perf_counter()
    for i in range(args.steps):
        x, positions, starts, ends = make_inputs(args.seq, cfg, device, dtype, seed=i)
        _SEEN.clear()
        out, _ = layer(x.requires_grad_(), positions, starts, ends)
        out.float().square().mean().backward()
        layer.zero_grad(set_to_none=True)
        fwd = [t for bw, t in _SEEN if not bw]
        bwd = [t for bw, t in _SEEN if bw]
        assert len(fwd) == 1 and len(bwd) == 1, f"expected one forward and one recompute, got {len(fwd)}/{len(bwd)}"
        a, b = fwd[0].sort(-1).values, bwd[0].sort(-1).values          # the same experts, in any order
        diff = int((a != b).any(-1).sum())
        tokens += args.seq
        steps.append(diff)
    result = {
        "what": "GLM-5.2 router recompute vs forward: tokens whose expert set differs", "S": args.seq,
        "steps": args.steps, "tokens": tokens, "steps_with_a_difference": sum(d > 0 for d in steps),
        "tokens_with_a_difference": sum(steps), "max_tokens_differing_in_a_step": max(steps),
        "backend": "sacpass(save_discrete=False), Inductor", "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "seconds": time.perf_counter() - t0,
        "config": {"experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok, "hidden": cfg.hidden_size},
    }
    print(json.dumps(result), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
