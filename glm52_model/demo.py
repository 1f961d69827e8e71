"""``python -m sacpass demo``: the tiny GLM-5.2 model (FP8 and MTP on) trained a few steps, compiled with
plain min-cut (control) and with sacpass, side by side in one process.

Both runs compile every decoder layer as compile(checkpoint(layer)) with ``fullgraph=True`` through the same
sacpass backend class, so both produce reports and dumps; the control's policy is empty (PyTorch's own
min-cut decides everything), the sacpass run uses the model's registered must-save ops (the DSA top-k).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections import Counter

import torch

import sacpass
from sacpass.backend import INNERS
from glm52_model import GLM52Config, GLM52ForCausalLM
from glm52_model.ops.dsa_topk import topk_calls


def _layer_kinds(model: GLM52ForCausalLM) -> list[str]:
    cfg, kinds = model.cfg, []
    for i in range(cfg.num_layers):
        kind = "moe" if cfg.is_moe_layer(i) else "dense"
        kinds.append(f"{kind}/{'full-topk' if cfg.is_full_topk_layer(i) else 'shared-topk'}")
    kinds += ["mtp"] * cfg.mtp_layers
    return kinds


def run(name: str, model: GLM52ForCausalLM, backend: sacpass.Backend, batches, lr: float) -> dict:
    """Train ``len(batches)`` steps; count graph breaks and backward top-k executions."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model.compile_layers(backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, bw_topk, t0 = [], [], time.perf_counter()
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids)
        before = topk_calls().count
        loss.backward()
        bw_topk.append(topk_calls().count - before)
        opt.step()
        losses.append(loss.item())
    return {"name": name, "losses": losses, "bw_topk": bw_topk, "seconds": time.perf_counter() - t0,
            "graph_breaks": sum(counters["graph_break"].values()), "reports": list(backend.reports),
            "dump_dir": backend.dumper.dir if backend.dumper else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sacpass demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=128, help="tokens per step (one sequence)")
    # aot_eager: the same sacpass partition as Inductor, without Inductor's C++ code generation, which
    # takes several minutes for these layers on a 2-core CPU; --inner inductor compiles for real
    p.add_argument("--inner", choices=INNERS, default="aot_eager")
    p.add_argument("--dump-dir", default="sacpass_dumps", help="where both runs write their graph dumps")
    p.add_argument("--no-fp8", action="store_true")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    cfg = GLM52Config.tiny(fp8=not args.no_fp8, mtp_layers=1)
    base = GLM52ForCausalLM(cfg)
    batches = [torch.randint(0, cfg.vocab_size, (1, args.seq)) for _ in range(args.steps)]
    kinds = _layer_kinds(base)
    full = sum(k.endswith("full-topk") for k in kinds)
    print(f"GLM-5.2 tiny: {base.num_params():,} params, layers {kinds}, fp8={cfg.fp8}, "
          f"{args.steps} steps x {args.seq} tokens, inner={args.inner}, torch {torch.__version__}")

    control_be = sacpass.backend(inner=args.inner, use_registered=False,
                                 dump_dir=os.path.join(args.dump_dir, "control"))
    sacpass_be = sacpass.backend(inner=args.inner, dump_dir=os.path.join(args.dump_dir, "sacpass"))
    results = [run("control (min-cut, no policy)", copy.deepcopy(base), control_be, batches, 1e-2),
               run("sacpass", copy.deepcopy(base), sacpass_be, batches, 1e-2)]

    for r in results:
        print(f"\n== {r['name']}: {r['seconds']:.1f} s (compile included)")
        print(f"graph breaks: {r['graph_breaks']}")
        print(f"compiled graphs: {len(r['reports'])} for layer kinds {dict(Counter(kinds))} "
              f"(layers of the same structure share a graph)")
        print(f"top-k executions during backward per step: {r['bw_topk']} "
              f"(full top-k layers: {full})")
        print(f"saved for backward, all graphs: {sum(x.total_bytes for x in r['reports'])} bytes")
        print(f"losses: {[round(x, 6) for x in r['losses']]}")
    print("\n== saved-set report of the first sacpass graph holding a must-save tensor")
    rep = next((x for x in results[1]["reports"] if any(s.reason == "must-save" for s in x.saved)), None)
    print(rep.format() if rep else "(none)")
    diff = max(abs(a - b) for a, b in zip(results[0]["losses"], results[1]["losses"]))
    print(f"\nmax |loss(control) - loss(sacpass)| over {args.steps} steps: {diff:.3e}")
    print(f"dumps: {results[0]['dump_dir']}  {results[1]['dump_dir']}")
    print(f"compare them: python -m sacpass diff {results[0]['dump_dir']} {results[1]['dump_dir']}")
    ok = (results[0]["graph_breaks"] == 0 and results[1]["graph_breaks"] == 0
          and all(n == full for n in results[0]["bw_topk"]) and all(n == 0 for n in results[1]["bw_topk"]))
    print("demo: OK" if ok else "demo: UNEXPECTED RESULT (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
