"""The offload runtime's public functions (re-exported by :mod:`sacpass.offload`)."""
from __future__ import annotations

import torch

from ..errors import OffloadError
from .clocks import device_key
from .plans import declared_plan, resolved_plan
from .step_report import budget_of, format_rows, placement_rows
from .runtime import AUTO, process_runtime
from .counters import OffloadStats

__all__ = ["set_host_limit", "host_limit", "host_budget", "set_prefetch_limit", "prefetch_limit", "stats",
           "reset_stats", "release_host_memory", "synchronize", "placements", "format_placements",
           "device_budget"]


def set_host_limit(nbytes: int) -> None:
    """Cap the host bytes sacpass's pool may hold (its slabs, all devices and graphs together; default: this
    process's share of the host, :func:`host_budget`). Unused slabs over a lowered limit are given back at once;
    a later offload that needs more raises OffloadError."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"sacpass.offload.set_host_limit({nbytes!r}): pass a number of bytes, an int >= 0.")
    rt = process_runtime()
    with rt.lock:
        rt.memory.set_limit(nbytes)


def host_limit() -> int:
    """The bytes sacpass's host pool may hold in this process: what :func:`set_host_limit` set, else this
    process's share of the host (:func:`host_budget`). Reading it makes no runtime."""
    from . import runtime
    if runtime._PROCESS is not None:
        return runtime._PROCESS.memory.limit
    return host_budget().rank_bytes


def host_budget():
    """This process's share of the host's memory (:class:`sacpass.host.HostBudget`): node memory, local ranks,
    the node budget and this rank's, as the default limit was derived."""
    from ..host import process_host_budget
    return process_host_budget()


def set_prefetch_limit(nbytes: int | None | str) -> None:
    """Cap the bytes of reloads issued ahead and not yet read by the backward, per device. ``"auto"`` (the
    default): one bundle ahead, the largest layer's offloaded bytes and one value more, so that while a layer's
    backward runs the layer before it can be copied back whole. ``None``: no cap, every copy of a layer and of the
    layer before it issued at the layer's first reload. One copy is always in flight, however large (a reload
    larger than the cap warns once: it is copied alone, when nothing else is in flight). A lower cap holds fewer
    reloaded values on the device at once; too low a cap issues the next layer's copies late in this layer's
    backward, where the compute may no longer hide them. Under ``"auto"`` a model plan whose step peaks past its
    ``peak_bytes`` with its device budget at ``gpu_bytes`` lowers the limit by the excess, down to one value ahead
    (``device_budget(plan)["prefetch_cut"]``); setting the limit again clears that."""
    if nbytes is not None and nbytes != AUTO and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                                                  or nbytes < 0):
        raise ValueError(f"sacpass.offload.set_prefetch_limit({nbytes!r}): pass a number of bytes, an int >= 0, "
                         f"'auto' (one layer ahead, the default), or None for no cap.")
    rt = process_runtime()
    with rt.lock:
        rt.prefetch_setting = nbytes
        for device in rt.devices.values():
            device.peak_cut = None


def prefetch_limit(device=None) -> int | None | str:
    """The prefetch setting (an int, None or ``"auto"``); with ``device``, the bytes it comes to there now."""
    rt = process_runtime()
    if device is None:
        return rt.prefetch_setting
    return rt.prefetch_limit(device_key(torch.device(device)))


def stats() -> OffloadStats:
    return process_runtime().snapshot()


def reset_stats() -> None:
    process_runtime().reset_stats()


def synchronize() -> None:
    """Wait until every offload copy has been queued and has finished. Offload copies are fed to their copy stream
    by a thread, a few chunks at a time, which holds each source until its last chunk is queued: after
    ``torch.cuda.synchronize()`` alone an offloaded value's device memory, or its host copy's bytes, may still be
    in use for a moment. Call this before reading memory counters or a host copy directly."""
    process_runtime().synchronize()


def release_host_memory() -> int:
    """Give back the pool's slabs that hold no live offload (and, on CUDA, PyTorch's cached pinned blocks).
    Returns the bytes given back."""
    return process_runtime().release_host_memory()


def _key(plan) -> str:
    """The runtime's key of ``plan``, as given or as its backend resolved it."""
    resolved = resolved_plan(plan)
    if resolved is None:
        raise OffloadError(f"sacpass: {plan!r} has not been compiled yet (a ModelPlan with no layers= or cost= is "
                           f"resolved at its backend's first training compile); run a training step first.")
    return resolved.key


def _states(plan) -> list:
    rt = process_runtime()
    with rt.lock:
        if plan is not None and _key(plan) in rt.plans:
            return [rt.plans[_key(plan)]]
        return list(rt.plans.values())


def placements(plan=None) -> list[dict]:
    """Where the last complete step put each planned value: one row per region, in step order, with the bytes
    kept on the device and sent to the host, the expected copy time of those host bytes each way (the plan's
    cost model) beside the measured one (``d2h_ms_measured``, ``h2d_ms_measured``: the copies' own time, from
    CUDA timing events on their streams, or the host clock for a CPU tensor's; None while one is still
    running), how many of the region's reloads had no prefetch to hide behind (its backward waited for them),
    and the region's forward and backward as its graph's cost model expected them (``*_ms_expected``: the
    compiled forward's and backward's ops, recomputation included) beside what they took
    (``*_ms_measured``: timing events on the compute stream, or the host clock; a forward from the region
    before's end to its own, so the first region's is None; a backward from its first unstash to the next
    region's; None where not measured). A region's reloads are issued while the region after it runs its
    backward: they hide when their H2D time is well under that region's backward (the plan's, or every
    registered plan's)."""
    rt = process_runtime()
    with rt.lock:
        return placement_rows(_states(plan))


def device_budget(plan) -> dict:
    """A model plan's device budget: ``gpu_bytes`` (where it started), ``device_budget`` (what the next step
    keeps on the device), ``peak_bytes`` (the cap, or None), ``peak_read`` (the device's peak allocated
    memory as the last step's backward ended, or None before one has, or where there is none to read),
    ``peak_at_backward`` ({region: the device's peak as its backward began}, in the order the backwards ran, for
    the last step read; empty where none was),
    ``step_ms`` ({device budget: the fastest step measured at it, in its regions' forwards and backwards}) and
    ``held_at`` (the budget the plan holds at because a larger one measured no faster, or None) and
    ``prefetch_cut`` (the automatic prefetch limit a step past the cap with the budget at ``gpu_bytes`` lowered
    the device to, or None)."""
    if declared_plan(_key(plan)) is None:
        raise OffloadError(f"sacpass: {plan!r} is not registered: build a backend with it (sacpass.backend(plan="
                           f"...)) before asking for its device budget.")
    rt = process_runtime()
    with rt.lock:
        state = rt.plan_state(_key(plan))
        return budget_of(state, _prefetch_cut(rt, state))


def _prefetch_cut(rt, state) -> int | None:
    """The prefetch limit the peak cap lowered ``state``'s device to (the device runtime holds it), or None."""
    device = rt.devices.get(state.device) if state is not None and state.device is not None else None
    return None if device is None else device.peak_cut


def format_placements(plan=None) -> str:
    rt = process_runtime()
    with rt.lock:
        state = rt.plans.get(_key(plan)) if plan is not None else None
        return format_rows(placement_rows(_states(plan)), state, _prefetch_cut(rt, state))
