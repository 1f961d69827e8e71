"""The process's offload runtime: one object that owns the host pool, the transfers in flight, the stashed
values and the model plans' states, behind one lock; one :class:`DeviceRuntime` per device.

The ops (:mod:`sacpass.offload.ops`) call in here. Warnings found under the lock (a reload past the prefetch
limit, a model plan's peak past its cap) are collected and given once the op's work is done, outside the lock:
a filter that makes them errors stops the caller with the runtime's state complete (the copy issued, the next
step placed), never halfway through.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import compression
from ..errors import OffloadError, SacpassWarning
from ..host import process_host_budget
from .clocks import SideStreams, device_key
from .plan_state import PlanState
from .plans import declared_plan
from .pool import HostMemory
from .stash import Stashes
from .counters import OffloadStats
from .transfers import CopiesOut, Transfers

__all__ = ["DeviceRuntime", "Runtime", "process_runtime", "AUTO", "DEFAULT_PREFETCH_BYTES"]

AUTO = "auto"
DEFAULT_PREFETCH_BYTES = 4 << 30  # the automatic prefetch limit before a device has offloaded anything


@dataclass(eq=False)
class DeviceRuntime:
    """One device's side of the runtime: its copy streams, the reload bytes in flight, the copies out not yet
    finished, the bundle each thread opened last, and the largest bundle and value seen (the automatic prefetch
    limit; the largest bundle also bounds the copies out)."""

    key: tuple[str, int]
    streams: SideStreams | None = None  # CUDA devices only
    in_flight: int = 0  # bytes of reloads issued and not yet read
    copies_out: CopiesOut = field(default_factory=CopiesOut)  # offloads whose copy to the host may still run
    open_bundles: dict = field(default_factory=dict)  # thread -> weak ref to the newest bundle
    largest_bundle: int = 0  # bytes one forward execution offloaded, the most yet
    largest_value: int = 0  # the largest single value offloaded
    peak_cut: int | None = None  # at most this many bytes ahead: a model plan's peak cap lowered the depth

    def auto_prefetch_limit(self) -> int:
        """One bundle ahead: while a layer's backward runs, every copy of the layer before it can be in flight,
        and one value more (so that no reload is larger than the limit); at most ``peak_cut``."""
        limit = self.largest_bundle + self.largest_value if self.largest_bundle else DEFAULT_PREFETCH_BYTES
        return limit if self.peak_cut is None else min(limit, self.peak_cut)

    def cut_prefetch(self, excess: int) -> int | None:
        """Prefetch ``excess`` bytes less from now on (a step peaked that much past a model plan's cap with its
        device budget at its floor: the reloads issued ahead are what is left to give back), down to one value
        ahead. Returns the new limit, or None where it is at that floor already."""
        now, floor = self.auto_prefetch_limit(), self.largest_value
        if now <= floor:
            return None
        self.peak_cut = max(floor, now - excess)
        return self.peak_cut


class Runtime:
    """The offload runtime of one process (see the module docstring)."""

    def __init__(self, budget=None):
        self.lock = threading.RLock()
        self.stats = OffloadStats()
        self.memory = HostMemory(budget if budget is not None else process_host_budget())
        self.devices: dict[tuple[str, int], DeviceRuntime] = {}
        self.prefetch_setting: int | None | str = AUTO
        self.plans: dict[str, PlanState] = {}
        self._warnings: list[str] = []
        self.transfers = Transfers(self.memory, self.stats, self.device, self.prefetch_limit, self._warnings.append,
                                   self.lock)
        self.stashes = Stashes(self.transfers, self.stats)
        self.transfers.settle_all = self.settle

    # -------------------------------------------------------------------------------------------- state
    def device(self, key: tuple[str, int]) -> DeviceRuntime:
        state = self.devices.get(key)
        if state is None:
            state = self.devices[key] = DeviceRuntime(key, SideStreams(key[1]) if key[0] == "cuda" else None)
        return state

    def prefetch_limit(self, key: tuple[str, int] | None = None) -> int | None:
        """The bytes of reloads that may be in flight on a device: the setting, or with ``"auto"`` one bundle
        ahead on that device."""
        if self.prefetch_setting != AUTO:
            return self.prefetch_setting
        if key is None:
            return max((d.auto_prefetch_limit() for d in self.devices.values()), default=DEFAULT_PREFETCH_BYTES)
        return self.device(key).auto_prefetch_limit()

    def _cut_prefetch(self, key: tuple[str, int], excess: int) -> int | None:
        """A model plan's step peaked ``excess`` bytes past its cap with nothing more to give back: under the
        automatic prefetch limit, prefetch that much less on the device (None: the limit is set by hand, or at one
        value ahead already)."""
        if self.prefetch_setting != AUTO:
            return None
        return self.device(key).cut_prefetch(excess)

    def settle(self) -> None:
        """Handles and host tensors that died since the last call: their values and blocks go."""
        self.stashes.settle()
        self.transfers.settle()

    def give_warnings(self) -> None:
        """Give the warnings found under the lock, outside it (at the end of an op)."""
        with self.lock:
            said = list(self._warnings)
            self._warnings.clear()
        for message in said:
            warnings.warn(message, SacpassWarning, stacklevel=4)

    def plan_state(self, key: str) -> PlanState:
        """The run-time state of the :class:`~sacpass.ModelPlan` of ``key`` (one per key: equal plans share it),
        made from the plan declared in this process (:func:`.plans.declared_plan`)."""
        with self.lock:
            state = self.plans.get(key)
            if state is None:
                plan = declared_plan(key)
                if plan is None:
                    raise OffloadError(
                        f"sacpass: a compiled graph stashes values for the model plan {key!r}, which no "
                        f"sacpass.ModelPlan in this process declares; build the backend with that plan before running "
                        f"graphs compiled (or cached) with it.")
                state = self.plans[plan.key] = PlanState(
                    regions=plan.layers, gpu_bytes=plan.gpu_bytes, host_bytes=plan.host_budget(),
                    compress=plan.compress, copy_bytes_per_s=plan.cost.copy_bytes_per_s,
                    peak_bytes=plan.peak_bytes, lock=self.lock, say=self._warnings.append,
                    cut_prefetch=self._cut_prefetch,
                    spelled=f"ModelPlan(layers={plan.layers}, gpu_bytes={plan.gpu_bytes}, "
                            f"host_bytes={plan.host_budget()})")
            return state

    # ---------------------------------------------------------------------------------------------- ops
    def offload(self, x: Tensor, index: int) -> Tensor:
        with self.lock:
            self.settle()
            host = self.transfers.to_host(x, index)
        self.transfers.wait_copies_out()
        return host

    def reload(self, host: Tensor, device: torch.device) -> Tensor:
        with self.lock:
            self.settle()
            entry = self.transfers.entry_for(host)
            if entry is not None:
                out, event = self.transfers.read(entry, device)
        if entry is None:
            return self.transfers.plain_copy(host, device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(event)
        self.give_warnings()
        return out

    def stash(self, x: Tensor, index: int, plan_key: str, pack: bool, forward_ms: float, backward_ms: float
              ) -> Tensor:
        with self.lock:
            self.settle()
            plan = self.plan_state(plan_key)
            handle = self.stashes.stash(x, index, plan, pack, forward_ms, backward_ms)
        self.transfers.wait_copies_out()
        self.give_warnings()  # after the handle: an error raised here drops it, and the stashed value with it
        return handle

    def unstash(self, handle: Tensor, size, stride, dtype: torch.dtype, device: torch.device) -> Tensor:
        with self.lock:
            self.settle()
            item, kept = self.stashes.take(handle, device)
        if kept is not None:
            self.give_warnings()  # the prefetch's warnings (a reload's own are given by reload)
            return kept
        if item.scales is None:
            return self.reload(item.value, device)
        out = torch.empty_strided(size, stride, dtype=dtype, device=device)
        return compression.unpack(self.reload(item.value, device), self.reload(item.scales, device), out)

    # ------------------------------------------------------------------------------------------ reading
    def snapshot(self) -> OffloadStats:
        with self.lock:
            self.settle()
            st = self.stats
            st.bundles_alive = len(self.transfers.live)
            st.host_bytes_held = self.memory.held
            st.peak_host_bytes_held = max(st.peak_host_bytes_held, self.memory.peak_held)
            return OffloadStats(**{k: v for k, v in vars(st).items()})

    def reset_stats(self) -> None:
        with self.lock:
            self.settle()
            kept = {k: getattr(self.stats, k) for k in OffloadStats.STATE}
            fresh = OffloadStats(**kept)
            for k, v in vars(fresh).items():
                setattr(self.stats, k, v)
            self.stats.host_bytes_held = self.memory.held
            self.memory.peak_held = self.memory.held
            self.stats.peak_host_bytes = self.stats.host_bytes_alive
            self.stats.peak_host_bytes_held = self.stats.host_bytes_held

    def synchronize(self) -> None:
        """Every offload copy queued (the feeder threads done with their sources) and finished, then the values
        and blocks that died meanwhile settled."""
        with self.lock:
            streams = [state.streams for state in self.devices.values() if state.streams is not None]
        for s in streams:  # outside the lock: the feeders never take it
            s.flush()
            torch.cuda.synchronize(s.index)
        with self.lock:
            self.settle()

    def release_host_memory(self) -> int:
        with self.lock:
            self.settle()
            freed = self.memory.trim()
        empty = getattr(torch._C, "_host_emptyCache", None)
        if freed and empty is not None and torch.cuda.is_available():
            empty()
        return freed


_PROCESS: Runtime | None = None
_PROCESS_LOCK = threading.Lock()


def process_runtime() -> Runtime:
    """This process's runtime, made at its first use."""
    global _PROCESS
    if _PROCESS is None:
        with _PROCESS_LOCK:
            if _PROCESS is None:
                _PROCESS = Runtime()
    return _PROCESS
