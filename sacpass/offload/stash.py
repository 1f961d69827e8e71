"""Stash and unstash: a model plan's values, kept on the device or sent to the host pool, per region.

``stash`` decides per call where a value waits for its backward (its plan's :class:`PlanState`, by the region's
position in the step and the value's index in its graph, so layers that share one compiled graph place their
values differently) and returns a *handle*: a one-element int64 host tensor whose life is the value's. When
autograd frees the saved handle, the kept value or host copy goes with it. ``unstash`` gives the backward the
value behind a handle: the kept tensor, or the host copy reloaded (through :mod:`.transfers`, prefetched).

Regions are counted per device and thread by a :class:`StepCursor`: a stash of index 0 opens the next region;
one that finds the region before it has begun its backward (or its values gone) opens a new step.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import compression
from ..errors import OffloadError
from .clocks import device_key
from .plan_state import PlanState
from .sizes import host_layout, packs
from .counters import OffloadStats
from .transfers import Bundle, Transfers

__all__ = ["Region", "StepCursor", "Stashed", "Stashes"]


def _deref(ref: "weakref.ref | None"):
    return ref() if ref is not None else None


@dataclass(eq=False)
class Region:
    """One region's run in a step: whether its backward has begun on its values (a bundle's, or ones kept on the
    device), whether its first value for the host has opened its bundle, and the bundle before it."""

    backward_started: bool = False
    bundled: bool = False
    before: "weakref.ref[Bundle] | None" = None  # the newest bundle when the region began: its backward is next


@dataclass(eq=False)
class StepCursor:
    """Where one device and thread are in a step: the region running its forward, by its order in the step."""

    position: int = -1
    region: "weakref.ref[Region] | None" = None  # that region's record (it dies with the region's values)


@dataclass(eq=False)
class Stashed:
    value: Tensor | None  # the device tensor kept, or the host tensor of the pool (offload's)
    region: Region
    on_host: bool
    plan: PlanState  # the plan that placed it
    position: int  # its region's, in the step
    source: "weakref.ref[Tensor]"  # the value stashed, while something else keeps it (a graph input's caller)
    version: int  # its version then: an in-place write before the backward is refused, as autograd does
    consumed: bool = False
    scales: Tensor | None = None  # packed on the host: value holds its one-byte elements, this their tile scales

    def check_unchanged(self) -> None:
        x = self.source()
        if x is not None and x._version != self.version:
            raise OffloadError(
                f"sacpass: a value a model plan keeps for the backward ({tuple(x.shape)} {x.dtype}) was modified in "
                f"place after the forward (version {self.version} -> {x._version}); its backward would read other "
                f"values. Do not write into a layer's input or output before the backward (clone it first), as "
                f"autograd requires for every saved tensor.")


class Stashes:
    """The values behind live handles and the step cursors. Called under the runtime's lock."""

    def __init__(self, transfers: Transfers, stats: OffloadStats):
        self.transfers, self.stats = transfers, stats
        self.items: dict[int, Stashed] = {}  # handle key -> what it stands for
        self.dead: collections.deque = collections.deque()  # keys of handles that died, settled under the lock
        self.cursors: dict[tuple[tuple[str, int], int], StepCursor] = {}  # (device, thread) -> its step
        self._ids = itertools.count(1)

    def _handle(self, key: int) -> Tensor:
        buf = (ctypes.c_int64 * 1)(key)
        weakref.finalize(buf, self.dead.append, key).atexit = False
        return torch.frombuffer(buf, dtype=torch.int64)

    def settle(self) -> None:
        while self.dead:
            self.items.pop(self.dead.popleft(), None)  # the kept value, or the host tensor (then its block), goes

    def _region(self, device: torch.device, index: int, plan: PlanState) -> tuple[int, Region]:
        """The position in the step of the forward this call belongs to (index 0 starts a region; a region whose
        values' backward has begun ends the step) and that region's record."""
        cursor = self.cursors.setdefault((device_key(device), threading.get_ident()), StepCursor())
        last = _deref(cursor.region)
        if index == 0 or last is None or last.backward_started:
            # a new step when the region before has begun its backward, or its values are gone (a forward whose
            # backward never ran, an exception in the middle of a step)
            new_step = last is None or last.backward_started
            cursor.position = 0 if new_step else cursor.position + 1
            last = Region(before=self.transfers.newest_bundle(device))
            cursor.region = weakref.ref(last)
            if new_step:
                plan.new_step()
        return cursor.position, last

    def stash(self, x: Tensor, index: int, plan: PlanState, pack: bool, forward_ms: float, backward_ms: float
              ) -> Tensor:
        plan.device = device_key(x.device)
        position, region = self._region(x.device, index, plan)
        if index == 0:
            plan.note_forward(position, x.device, forward_ms, backward_ms)
        nbytes = host_layout(x)[2]
        packed = x.numel() if pack and packs(x.dtype, plan.compress) else None
        where = plan.place(position, index, nbytes, packed)
        key = next(self._ids)
        if where == "device":
            self.stats.kept_bytes += nbytes
            self.items[key] = Stashed(x, region, on_host=False, plan=plan, position=position, source=weakref.ref(x),
                                      version=x._version)
        else:
            first, region.bundled = not region.bundled, True
            sent, scales = (x, None) if packed is None else compression.pack(x, plan.compress)  # on the compute stream
            timing = plan.timeline.copy_times(position)
            host = self.transfers.to_host(sent, 0 if first else 1, timing)  # the region's first opens its bundle
            if scales is not None:
                scales = self.transfers.to_host(scales, 1, timing)
                self.stats.packed_bytes += nbytes
            self.items[key] = Stashed(host, region, on_host=True, plan=plan, position=position, source=weakref.ref(x),
                                      version=x._version, scales=scales)
        return self._handle(key)

    def take(self, handle: Tensor, device: torch.device) -> tuple[Stashed, Tensor | None]:
        """The stashed value behind ``handle`` at the start of its backward: (its record, the kept tensor for a
        value kept on the device, else None: the caller reloads the host copy outside the lock)."""
        item = self.items.get(int(handle[0]))
        if item is None:
            raise OffloadError("sacpass: a backward asked for a stashed value whose handle sacpass does not know "
                               "(its forward ran in another process, or the handle was copied); run the "
                               "forward and the backward of a compiled graph in one process.")
        if not item.on_host:  # a value kept on the device: prefetch the region before (its backward is next)
            self.transfers.prefetch(device, None, _deref(item.region.before))
        item.region.backward_started = True
        item.plan.note_backward(item.position, device)
        item.check_unchanged()
        if item.on_host:
            entry = self.transfers.entry_for(item.value)
            if entry is not None and entry.reload is None:  # no prefetch issued its copy: the backward waits for it
                waited = item.plan.timeline.waited
                waited[item.position] = waited.get(item.position, 0) + 1
            return item, None
        if item.consumed:
            raise OffloadError("sacpass: a second backward through a graph whose planned value the model plan "
                               "kept on the device: the first backward owned it. Use a sacpass.Plan (per graph) "
                               "for graphs that are differentiated twice (retain_graph=True).")
        item.consumed = True
        out, item.value = item.value, None
        # handed to the backward, which may write into it once it is dead there: only if nothing else (a view
        # kept by the forward's caller, another saved view) shares its memory
        if torch._C._storage_Use_Count(out.untyped_storage()._cdata) > 2:
            out = out.clone()
        return item, out
