"""The offload runtime: saved activations moved to host memory in the forward and brought back for the backward,
prefetched across the per-layer compiled graphs; and the placement of a :class:`~sacpass.ModelPlan`'s values.

Its parts, one job each:

- :mod:`.ops`: the four ops' declarations (``sacpass::offload``, ``reload``, ``stash``, ``unstash``), schemas and
  fakes: all that compile-time code imports;
- :mod:`.sizes`: the bytes a value takes in the pool (pure);
- :mod:`.pool`: the host pool, slabs sub-allocated in blocks, under this process's share of the host;
- :mod:`.transfers`: the copies each way, bundles, and the prefetch in the order the backward reads;
- :mod:`.feeder`: offload copies fed to their copy stream a few chunks at a time, from a thread;
- :mod:`.stash`: a model plan's values behind handles, and the regions of a step;
- :mod:`.placement`: where a step's values wait (pure functions: sizes in, placements out);
- :mod:`.plan_state`: one model plan's state across steps; :mod:`.timeline` one step as it ran; :mod:`.plans`
  the model plans this process's backends declared, by key;
- :mod:`.clocks`: side streams, timed copies, clock marks; :mod:`.counters`: the counters;
- :mod:`.runtime`: the process's :class:`~.runtime.Runtime` (lock, pool, devices, plans) the ops call;
- :mod:`.step_report` and :mod:`.api`: what users read and set (re-exported here).

On the CPU (a CPU tensor offloaded) the same code runs: pool, bundles, prefetch order, reload and free, with the
copies done synchronously (no feeder: its chunking, queue bound and errors are tested with a fake copy engine)
and an unpinned pool, so the lifecycle is tested without a GPU.
"""
from __future__ import annotations

from . import ops  # noqa: F401  (declares torch.ops.sacpass.*)
from .sizes import ALIGN, host_pool_bytes, packed_pool_bytes, packs, pool_bytes

__all__ = ["set_host_limit", "host_limit", "host_budget", "set_prefetch_limit", "prefetch_limit", "stats",
           "reset_stats", "OffloadStats", "release_host_memory", "synchronize", "placements", "format_placements",
           "device_budget",
           "pool_bytes", "host_pool_bytes", "packed_pool_bytes", "packs", "ALIGN"]

_API = {"set_host_limit", "host_limit", "host_budget", "set_prefetch_limit", "prefetch_limit", "stats",
        "reset_stats", "release_host_memory", "synchronize", "placements", "format_placements", "device_budget"}


def __getattr__(name: str):
    # the runtime loads at the first use of its API, not at `import sacpass` nor at compile time
    if name in _API:
        from . import api
        return getattr(api, name)
    if name == "OffloadStats":
        from .counters import OffloadStats
        return OffloadStats
    raise AttributeError(f"module 'sacpass.offload' has no attribute {name!r}")
