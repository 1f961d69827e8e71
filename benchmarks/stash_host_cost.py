"""The launching thread's time in a model plan's ``sacpass::stash`` calls, on a GPU: the host cost of a region's
values at the end of its forward, which the GPU waits for once the host has caught up with it (a host read in
the forward, an MoE's row counts, lets it catch up).

Runs the plan's runtime as compiled graphs do, without a model: per region, ``--work-ms`` of GPU work queued, a
host read (as an MoE's row counts), then the region's values stashed through the op (``torch.ops.sacpass.stash``)
with ``--after`` other outputs ordering them; then the backward's unstashes in reverse. The values' sizes
default to those of one GLM-5.2 layer at 64K tokens. Prints one JSON object: per step the host ms of each
region's stash calls (median and largest), per call by where the value went, and the runtime's functions that
took the host's time in one step (``cProfile``, by own time)."""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

import sacpass
from sacpass.offload.runtime import process_runtime
from sacpass.plan import declare

MIB = 1 << 20
GLM52_64K_MIB = (4112, 2048, 1056, 768, 768, 396, 396, 396, 396, 132, 132, 2) + (1,) * 10  # one region's values


def region_values(sizes_mib, device) -> list[torch.Tensor]:
    return [torch.empty(int(s * MIB) // 2, dtype=torch.bfloat16, device=device).fill_(1.0) for s in sizes_mib]


def busy(ms: float, device) -> None:
    """About ``ms`` of GPU work queued (square bf16 matmuls)."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(max(1, int(ms / 0.2))):  # ~0.2 ms each on an H100
        a = (a @ a).clamp_(-1, 1)


def run_step(plan_key: str, args, device, timings: dict, profile: cProfile.Profile | None) -> None:
    stash, unstash = torch.ops.sacpass.stash.default, torch.ops.sacpass.unstash.default
    after = [torch.empty(1, device=device) for _ in range(args.after)]
    handles = []
    for region in range(args.regions):
        busy(args.work_ms, device)
        torch.ones(8, device=device).tolist()  # the forward's host read: the host catches up with the GPU
        values = region_values(GLM52_64K_MIB, device)
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        mine = []
        for i, x in enumerate(values):
            a = time.perf_counter()
            h = stash(x, i, plan_key, after, True, 0.0, 0.0)
            timings["per_call_ms"].append((time.perf_counter() - a) * 1e3)
            mine.append((h, tuple(x.shape), tuple(x.stride()), x.dtype))
        if profile is not None:
            profile.disable()
        timings["region_ms"].append((time.perf_counter() - t0) * 1e3)
        del values
        handles.append(mine)
    for mine in reversed(handles):  # the backward: each region's values, last region first
        busy(args.work_ms, device)
        for h, shape, stride, dtype in reversed(mine):
            unstash(h, list(shape), list(stride), dtype, device).sum()
    del handles
    torch.cuda.synchronize()


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regions", type=int, default=6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--work-ms", type=float, default=150.0, help="GPU work queued before each region's stashes")
    p.add_argument("--after", type=int, default=60, help="the other forward outputs each stash is ordered after")
    p.add_argument("--gpu-gib", type=float, default=0.0, help="the plan's device budget (0: every value to the host)")
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device("cuda")
    plan = declare(sacpass.ModelPlan(layers=args.regions, gpu_bytes=int(args.gpu_gib * 2 ** 30),
                                     host_bytes=int(96 * 2 ** 30), cost=sacpass.CostModel()))
    result = {"command": "python3 benchmarks/stash_host_cost.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": []}
    for step in range(args.steps):
        timings = {"per_call_ms": [], "region_ms": []}
        profile = cProfile.Profile() if step == args.steps - 1 else None
        run_step(plan.key, args, device, timings, profile)
        calls = timings["per_call_ms"]
        result["steps"].append({"region_ms_median": statistics.median(timings["region_ms"]),
                                "region_ms_max": max(timings["region_ms"]),
                                "call_ms_median": statistics.median(calls), "call_ms_max": max(calls),
                                "calls": len(calls)})
        if profile is not None:
            stats = pstats.Stats(profile)
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # by own time
            result["by_own_time"] = [{"function": f"{f[0].split('site-packages/')[-1]}:{f[1]}({f[2]})",
                                      "calls": v[1], "own_ms": round(v[2] * 1e3, 3), "cum_ms": round(v[3] * 1e3, 3)}
                                     for f, v in rows]
    st = process_runtime().snapshot()
    result["offloaded_gib_per_step"] = st.offloaded_bytes / args.steps / 2 ** 30
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
