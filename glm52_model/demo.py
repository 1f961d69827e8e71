"""``python -m glm52_model.demo``: the tiny GLM-5.2 model (FP8 and MTP on) trained a few steps, compiled with
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

import torch

import sacpass
from sacpass.options import INNERS
from sacpass.testing import OpCounter
from glm52_model import GLM52Config, GLM52ForCausalLM
from glm52_model.compile import apply_compile
from glm52_model.model import MoE, decoder_layers

TOPK_OP = "glm52::dsa_topk_indices"


def _layer_kinds(model: GLM52ForCausalLM) -> dict[str, list[str]]:
    """Layer kind ("moe/shared-topk", ...) -> the decoder layers of that kind ("layer 2", "mtp 0"), in the
    order they run; layers of one kind have the same structure, so they share one compiled graph."""
    kinds: dict[str, list[str]] = {}
    n_main = model.cfg.num_layers
    for layer in decoder_layers(model):
        kind = f"{'moe' if isinstance(layer.mlp, MoE) else 'dense'}/{'full' if layer.compute_topk else 'shared'}-topk"
        i = layer.layer_id
        kinds.setdefault(kind, []).append(f"layer {i}" if i < n_main else f"mtp {i - n_main}")
    return kinds


def _control_extra() -> dict:
    """Options that keep the control a control: PyTorch's min-cut alone, which replays the top-k (and the
    routers' top-k) in the backward: sacpass's default of saving discrete decisions is off."""
    return {"save_discrete": False}


def run(name: str, model: GLM52ForCausalLM, backend: sacpass.Backend, batches, lr: float) -> dict:
    """Train ``len(batches)`` steps; count graph breaks and backward top-k executions."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    apply_compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, bw_topk, t0 = [], [], time.perf_counter()
    with OpCounter(TOPK_OP) as topk:
        for ids in batches:
            topk.reset()
            opt.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids)
            loss.backward()
            bw_topk.append(topk.backward)
            opt.step()
            losses.append(loss.item())
    return {"name": name, "losses": losses, "bw_topk": bw_topk, "seconds": time.perf_counter() - t0,
            "graph_breaks": sum(counters["graph_break"].values()), "reports": list(backend.reports),
            "dump_dir": backend.dumper.dir if backend.dumper else None}


def print_graphs(reports: list, kinds: dict[str, list[str]]) -> None:
    """Which layers run which compiled graph: one per layer kind, compiled when its first layer runs."""
    if len(reports) != len(kinds):
        print(f"compiled graphs: {len(reports)} (expected one per layer kind: {len(kinds)} kinds {kinds})")
        return
    print(f"compiled graphs: {len(reports)}, one per layer kind (layers of the same kind share it):")
    for r, (kind, layers) in zip(reports, kinds.items()):
        print(f"  {r.graph}: {kind}: {', '.join(layers)}")


def print_saved(reports: list) -> None:
    """Saved for backward, all graphs: activations apart from graph inputs (parameters, layer inputs),
    which the backward would hold anyway."""
    inputs = [s for r in reports for s in r.saved if s.reason == "graph input"]
    n_act = sum(len(r.saved) for r in reports) - len(inputs)
    print(f"saved for backward, all graphs: activations {sum(r.activation_bytes for r in reports)} bytes "
          f"in {n_act} tensors; graph inputs (parameters, layer inputs) {sum(r.input_bytes for r in reports)} "
          f"bytes in {len(inputs)} tensors")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm52_model.demo", description=__doc__.split("\n\n")[0])
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
    full = sum(len(layers) for kind, layers in kinds.items() if kind.endswith("full-topk"))
    print(f"GLM-5.2 tiny: {base.num_params():,} params, layer kinds {kinds}, fp8={cfg.fp8}, "
          f"{args.steps} steps x {args.seq} tokens, inner={args.inner}, torch {torch.__version__}")

    control_be = sacpass.backend(inner=args.inner, use_registered=False,
                                 dump_dir=os.path.join(args.dump_dir, "control"), **_control_extra())
    sacpass_be = sacpass.backend(inner=args.inner, dump_dir=os.path.join(args.dump_dir, "sacpass"))
    results = [run("control (min-cut, no policy)", copy.deepcopy(base), control_be, batches, 1e-2),
               run("sacpass", copy.deepcopy(base), sacpass_be, batches, 1e-2)]

    for r in results:
        print(f"\n== {r['name']}: {r['seconds']:.1f} s (compile included)")
        print(f"graph breaks: {r['graph_breaks']}")
        print_graphs(r["reports"], kinds)
        print(f"top-k executions during backward per step: {r['bw_topk']} "
              f"(full top-k layers: {full})")
        print_saved(r["reports"])
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
