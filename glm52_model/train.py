"""Distributed training launcher for the GLM-5.2 model: SP / EP / FSDP2, decoder layers compiled whole.

    torchrun --nproc-per-node N -m glm52_model.train --sp S --ep E [--fsdp] --steps K \
        --backend sacpass|inductor|aot_eager [--inner inductor|aot_eager] [--verify]

NCCL on GPUs (one per local rank), gloo on CPU. Rank 0 prints loss, step time and peak memory per step
(GPU: max allocated; CPU: the process's peak RSS). Process groups carry ``--timeout``: a rank that dies
makes torchrun stop the others, and a rank that hangs makes the others' collectives time out, so a run
fails with the culprit's error instead of hanging. ``--verify`` also trains an eager single-rank replica
on the same global batch on every rank and checks loss and gradients against it (``--json-dir`` writes
per-rank results: losses, errors, graph breaks, graph counts, backward top-k calls, sacpass reports).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import resource
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from sacpass.testing import OpCounter

from .compile import apply_ac, apply_compile
from .config import PRESETS, GLM52Config
from .model import GLM52ForCausalLM, MoE
from .parallel import (DISPATCHERS, ParallelCausalLM, ParallelDims, ParallelGroups, apply_ep, apply_fsdp,
                       apply_sp, expert_slice, shard_batch, sync_grads, _is_expert_param)

BACKENDS = ("sacpass", "inductor", "aot_eager", "eager")
TOPK_OP = "glm52::dsa_topk_indices"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m glm52_model.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel degree")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    p.add_argument("--fsdp", action="store_true", help="fully_shard every decoder layer and the root")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", choices=BACKENDS, default="sacpass")
    p.add_argument("--inner", choices=("inductor", "aot_eager"), default="inductor",
                   help="sacpass's inner compiler")
    p.add_argument("--ep-dispatch", choices=DISPATCHERS, default="padded")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="padded dispatch: rows per destination = ceil(f * T * k / ep); default dropless")
    p.add_argument("--preset", default="tiny", choices=PRESETS, help="GLM52Config preset")
    p.add_argument("--layers", type=int, default=None, help="override num_layers")
    p.add_argument("--first-dense", type=int, default=None, help="override first_k_dense")
    p.add_argument("--mtp", type=int, default=None, help="override mtp_layers (0 or 1)")
    p.add_argument("--batch", type=int, default=2, help="global batch: sequences")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="parameter dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    p.add_argument("--verify", action="store_true", help="compare with an eager single-rank replica")
    p.add_argument("--json-dir", default=None, help="write rank<r>.json with the run's results there")
    p.add_argument("--fault", default=None, metavar="RANK:raise|hang",
                   help="testing: make RANK raise or hang at the start of step 1")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- setup
def _setup(args) -> tuple[torch.device, int, int]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    timeout = datetime.timedelta(seconds=args.timeout)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device, dist.get_rank(), dist.get_world_size()


def _config(args):
    over = {k: v for k, v in (("num_layers", args.layers), ("first_k_dense", args.first_dense),
                              ("mtp_layers", args.mtp)) if v is not None}
    if "num_layers" in over and "first_k_dense" not in over:
        over["first_k_dense"] = min(GLM52Config.preset(args.preset).first_k_dense, over["num_layers"])
    return GLM52Config.preset(args.preset, **over)


def _backend(args):
    if args.backend == "sacpass":
        import sacpass
        return sacpass.backend(inner=args.inner)
    return args.backend


def _batch(cfg, args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (identical on every rank): labels = next token, -100 at sequence ends."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    labels = torch.cat([ids[:, 1:], ids.new_full((args.batch, 1), -100)], dim=1)
    return ids, labels


def _peak_mem_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _fault(args, rank: int, step: int) -> None:
    if args.fault is None or step != 1:
        return
    who, _, kind = args.fault.partition(":")
    if kind not in ("raise", "hang") or not who.isdigit():
        raise ValueError(f"--fault {args.fault!r}: expected RANK:raise or RANK:hang")
    if int(who) != rank:
        return
    if kind == "hang":  # the other ranks' collectives time out long before this returns
        time.sleep(10 * args.timeout)
    raise RuntimeError(f"injected fault on rank {rank} (--fault {args.fault})")


# ------------------------------------------------------------------------------------------ checking
def _local_grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _compare_grads(model: GLM52ForCausalLM, ref: GLM52ForCausalLM, ep: int, ep_rank: int) -> dict:
    """Max abs error and max error relative to each tensor's max |ref| over all parameters."""
    refs = dict(ref.named_parameters())
    worst_abs = worst_rel = 0.0
    worst_name, missing = "", []
    for name, p in model.named_parameters():
        g, r = _local_grad(p), refs[name].grad
        if (g is None) != (r is None):
            missing.append(name)
            continue
        if g is None:
            continue
        if ep > 1 and _is_expert_param(name):
            r = r[expert_slice(r.shape[0], ep, ep_rank)]
        err = float((g.float() - r.float()).abs().max())
        rel = err / max(float(r.abs().max()), 1e-12)
        if rel > worst_rel:
            worst_rel, worst_name = rel, name
        worst_abs = max(worst_abs, err)
    return {"grad_max_abs_err": worst_abs, "grad_max_rel_err": worst_rel, "grad_worst": worst_name,
            "grad_missing": missing}


def _record_routing(ref: GLM52ForCausalLM) -> list[list[int]]:
    """Hook the replica's MoE layers: each forward appends that layer's tokens-per-expert counts, so a
    run can show that routing changed between steps (the compiled graphs must not)."""
    log: list[list[int]] = []

    def hook(mod, inputs, _out):
        with torch.no_grad():
            expert, _ = mod.route(inputs[0])
            log.append(torch.bincount(expert.flatten(), minlength=mod.n_experts).tolist())

    for m in ref.modules():
        if isinstance(m, MoE):
            m.register_forward_hook(hook)
    return log


# --------------------------------------------------------------------------------------------- train
def train(args) -> dict:
    from torch._dynamo.utils import counters

    device, rank, world = _setup(args)
    dims = ParallelDims(world=world, sp=args.sp, ep=args.ep, fsdp=args.fsdp)
    groups = ParallelGroups.build(dims)
    cfg = _config(args)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)

    torch.manual_seed(args.seed)
    model = GLM52ForCausalLM(cfg).to(device=device, dtype=dtype)
    for m in model.modules():  # keep the routing-bias buffers fp32 like the reference
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.data = m.e_score_correction_bias.float()
    ref = copy.deepcopy(model) if args.verify else None
    if groups.sp is not None:
        apply_sp(model, groups.sp)
    if groups.ep is not None:
        apply_ep(model, groups.ep, dims.ep, groups.ep_rank, args.ep_dispatch, args.capacity_factor)
    apply_ac(model)
    backend = _backend(args)
    if args.backend != "eager":
        apply_compile(model, backend, fullgraph=True)
    wrapper = ParallelCausalLM(model)
    if dims.fsdp:
        apply_fsdp(wrapper)
    opt = torch.optim.SGD(wrapper.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr) if ref is not None else None
    routing = _record_routing(ref) if ref is not None else []

    counters.clear()
    scalar_ctx = torch._dynamo.config.patch(capture_scalar_outputs=args.ep_dispatch == "dynamic")
    steps = []
    if rank == 0:
        print(f"glm52 train: world={world} sp={dims.sp} ep={dims.ep} dp={dims.dp} fsdp={dims.fsdp} "
              f"backend={args.backend}{'/' + args.inner if args.backend == 'sacpass' else ''} device={device} "
              f"dtype={dtype} tokens/step={args.batch * args.seq} layers={cfg.num_layers}+{cfg.mtp_layers} mtp",
              flush=True)
    with scalar_ctx:
        for step in range(1, args.steps + 1):
            _fault(args, rank, step)
            ids, labels = _batch(cfg, args, step)
            shard = shard_batch(ids, labels, dims, rank)
            shard = type(shard)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                   for k, v in shard.__dict__.items()})
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with OpCounter(TOPK_OP) as topk:
                loss = wrapper(shard)
                loss.backward()
            bw_topk = topk.backward
            if not dims.fsdp:
                sync_grads(wrapper, groups)
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            rec = {"step": step, "loss": float(total), "bw_topk": bw_topk,
                   "unique_graphs": counters["stats"]["unique_graphs"],
                   "graph_breaks": sum(counters["graph_break"].values())}
            if ref is not None:
                ref_opt.zero_grad(set_to_none=True)
                ref_loss = ref(ids.to(device), labels=labels.to(device))
                ref_loss.backward()
                rec["ref_loss"] = float(ref_loss.detach())
                rec["routing"] = list(routing)
                routing.clear()
                rec.update(_compare_grads(model, ref, dims.ep, groups.ep_rank))
                ref_opt.step()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rec["seconds"] = time.perf_counter() - t0
            rec["peak_mem_mib"] = _peak_mem_mib(device)
            steps.append(rec)
            if rank == 0:
                extra = (f"  ref {rec['ref_loss']:.6f}  grad rel err {rec['grad_max_rel_err']:.2e}"
                         if ref is not None else "")
                print(f"step {step}  loss {rec['loss']:.6f}  time {rec['seconds']:.3f}s  "
                      f"peak mem {rec['peak_mem_mib']:.1f} MiB  bw top-k {bw_topk}{extra}", flush=True)
    reports = list(getattr(backend, "reports", []))
    result = {"rank": rank, "world": world, "dims": {"sp": dims.sp, "ep": dims.ep, "fsdp": dims.fsdp},
              "steps": steps, "graph_breaks": dict(Counter({str(k): v for k, v in counters["graph_break"].items()})),
              "reports": [r.to_dict() for r in reports]}
    for r in reports:  # every rank has its own backend and reports
        must = [s.op for s in r.saved if s.reason.startswith("must-save")]
        print(f"rank {rank} sacpass {r.graph}: {len(r.saved)} saved tensors, {r.total_bytes} bytes, "
              f"must-save: {', '.join(must) or 'none'}", flush=True)
    if args.json_dir:
        os.makedirs(args.json_dir, exist_ok=True)
        with open(os.path.join(args.json_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return result


@record
def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
