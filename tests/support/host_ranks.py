"""One rank of the many-ranks-one-host test (tests/test_host_budget.py), started by torchrun on the CPU (gloo),
with the repository root on PYTHONPATH.

The host's memory comes from a fake cgroup (``--cgroup DIR``: its memory.max is the container's limit). Each rank
trains two steps of a toy stack under ``sacpass.ModelPlan(layers=.., cost=..)`` (its host budget the default:
its share of the node), then offloads ``--extra-mib`` more (the last rank ``--last-extra-mib``), keeping them
alive; the ranks all-gather what their pools hold and rank 0 writes what every rank saw to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cgroup", required=True)
    p.add_argument("--extra-mib", type=int, required=True)
    p.add_argument("--last-extra-mib", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import sacpass.host as host
    budget = host.host_budget(cgroup_root=args.cgroup, proc_cgroup=os.path.join(args.cgroup, "self-cgroup"))
    host.process_host_budget = lambda: budget  # what this rank reads as its host (the fake container)

    import sacpass
    import sacpass.offload as rt
    from sacpass.testing import no_compile_caches
    from tests.support.toy import CompiledStack

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = sacpass.ModelPlan(layers=3, cost=sacpass.CostModel(), min_offload_bytes=0)
    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=plan), 3, rank)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(torch.randn(24, 32, requires_grad=True)).square().sum().backward()
    resolved = model.layers[0].forward  # noqa: F841  (the compiled layers keep the backend alive)
    extra = args.last_extra_mib if rank == world - 1 else args.extra_mib
    kept, error = [], None
    try:
        for _ in range(extra):
            kept.append(torch.ops.sacpass.offload(torch.zeros(1 << 18), len(kept), []))  # 1 MiB each
    except sacpass.OffloadError as e:
        error = str(e)
    st = rt.stats()
    mine = {"rank": rank, "local_rank": budget.local_rank, "local_ranks": budget.local_ranks,
            "limit": rt.host_limit(), "plan_host_bytes": plan.host_budget(), "node_bytes": budget.node_bytes,
            "held": st.host_bytes_held, "peak_held": st.peak_host_bytes_held, "offloaded": len(kept),
            "error": error}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(everyone, f, indent=1)
    # every rank past its last collective before any tears gloo down, and the offloads freed before the
    # interpreter exits (a rank leaving while a peer still talks, or tensors freed at interpreter teardown,
    # can abort a process with "terminate called without an active exception")
    dist.barrier()
    del kept
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
