"""The run-time state of one :class:`~sacpass.ModelPlan`: where each value of the step waits, from the step
before, and the step as it runs (what it recorded, placed and measured).

Equal plans share one state (keyed by the plan's key). Each step is placed from the sizes the step before
recorded (:func:`~sacpass.offload.placement.place_step`); the first, which has none, places values as they come
(:func:`~sacpass.offload.placement.place_arriving`). With a peak cap the device budget follows the measured peak
(:func:`~sacpass.offload.placement.follow_peak`), read as each backward ends; a budget rises only once the
budget in hand has been measured (a step placed at it), and where a larger budget did not measure faster than a
smaller one, in two steps, the plan goes back to the smaller and holds there
(:func:`~sacpass.offload.placement.cheaper_budget`): device memory is spent only where it buys time, and more
budget never makes the step slower.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import compression
from . import clocks
from .placement import (Budgets, Key, backward_room, cheaper_budget, fits_room, follow_peak, later_device_bytes,
                        place_arriving, place_step, room_fill)
from .sizes import packed_pool_bytes, pool_bytes
from .timeline import Timeline

__all__ = ["PlanState", "device_peak"]

UNMEASURED = 4  # steps whose timing events are still running, kept to read later (older ones are dropped)


def device_peak(device: tuple[str, int]) -> int | None:
    """The device's peak allocated memory (since the process began or the last reset_peak_memory_stats), where
    there is one (a GPU)."""
    return torch.cuda.max_memory_allocated(device[1]) if device[0] == "cuda" else None


@dataclass(eq=False)
class PlanState:
    """Where one model plan puts each value: {(region, index): "device" | "host"}, from the step before."""

    regions: int  # the regions the plan was made for (ModelPlan.layers)
    gpu_bytes: int  # the device budget it starts at, and never goes below
    host_bytes: int
    compress: str | None = None  # floating values go to the host packed in this format (ModelPlan(compress=))
    copy_bytes_per_s: float = 0.0  # the plan's cost model: a region's expected copy time, beside the measured
    peak_bytes: int | None = None  # ModelPlan(peak_bytes=): the device budget follows the measured peak
    spelled: str = ""  # how the plan reads, for errors
    lock: "threading.RLock" = field(default_factory=threading.RLock)  # the runtime's
    say: Callable[[str], None] = print  # the runtime's warnings, given once its op is done
    cut_prefetch: Callable[[tuple[str, int], int], int | None] = lambda device, excess: None  # the runtime's
    table: dict[Key, str] = field(default_factory=dict)
    recording: dict[Key, int] = field(default_factory=dict)  # this step: key -> device bytes
    host_sizes: dict[Key, int] = field(default_factory=dict)  # this step: key -> pool bytes on the host
    placed: dict[Key, tuple[str, int]] = field(default_factory=dict)  # this step: where, bytes
    last: dict[Key, tuple[str, int]] = field(default_factory=dict)  # the step before: where, bytes
    host_used: int = 0  # this step
    device_used: int = 0
    region_bytes: dict[int, int] = field(default_factory=dict)  # this step: region -> its values' bytes so far
    timeline: Timeline = field(default_factory=Timeline)  # this step's
    last_timeline: Timeline = field(default_factory=Timeline)  # the step before's
    device_budget: int = -1  # the device bytes the next step keeps: gpu_bytes, raised toward peak_bytes
    device: tuple[str, int] | None = None  # where the planned values live (whose peak is read)
    peak_read: int | None = None  # the device's peak as the last step's backward ended
    step_peak: int | None = None  # this step's: read at the end of each backward that unstashed its values
    task: int = -1  # the backward whose end is awaited (its final callback queued)
    warned: bool = False
    placed_at: int | None = None  # this step's device budget, where it was placed from the step before's table
    step_ms: dict[int, float] = field(default_factory=dict)  # device budget -> the fastest step measured at it
    step_samples: dict[int, int] = field(default_factory=dict)  # device budget -> the steps measured at it
    held: int | None = None  # the device budget never passed again: a larger one measured no faster
    doubt: int | None = None  # a budget measured no faster once: the next step runs at it again, to confirm or clear
    unmeasured: list = field(default_factory=list)  # (device budget, timeline) of steps whose timing is not read yet

    def __post_init__(self) -> None:
        if self.device_budget < 0:
            self.device_budget = self.gpu_bytes

    def budgets(self) -> Budgets:
        return Budgets(self.regions, self.device_budget, self.host_bytes, self.spelled)

    def new_step(self) -> None:
        """The step before is over: where a backward ran in it, its sizes and measured peak place the next one. A
        forward whose backward never ran (an exception part way, an evaluation under grad) is not a step to
        place from: the next step is placed as it would have been without it."""
        if self.recording and self.timeline.backward_began:
            self._next_budget()
            self.table = place_step(self.recording, self.budgets(), self.host_sizes)
            self.last = dict(self.placed)
            self.last_timeline = self.timeline
        self.placed_at = self.device_budget if self.table else None
        self.recording, self.host_sizes, self.placed, self.region_bytes = {}, {}, {}, {}
        self.host_used, self.device_used, self.timeline = 0, 0, Timeline()

    def note_forward(self, region: int, device: torch.device, forward_ms: float, backward_ms: float) -> None:
        """At a region's first stash (its forward's work all issued): mark when it is done, and keep what its
        graph's cost model expects of its forward and backward."""
        self.timeline.forward_done[region] = clocks.clock(device)
        self.timeline.expected[region] = (forward_ms, backward_ms)

    def note_backward(self, region: int, device: torch.device) -> None:
        """At each unstash, inside a backward: the first of region ``region`` marks when its backward began; the
        backward's end (an autograd final callback, queued once per backward) marks when it ended and, with
        peak_bytes, reads the device's peak then, so a reset_peak_memory_stats between steps leaves the step's
        own peak to read."""
        timeline = self.timeline
        if region not in timeline.backward_began:
            timeline.backward_began[region] = clocks.clock(device)
            if self.peak_bytes is not None and self.device is not None:
                seen = device_peak(self.device)
                if seen is not None:
                    timeline.peak_at_backward[region] = seen
        task = torch._C._current_graph_task_id()
        if task < 0 or task == self.task:
            return
        self.task = task

        def ended() -> None:
            mark = clocks.clock(device)
            peak = device_peak(self.device) if self.peak_bytes is not None and self.device is not None else None
            with self.lock:
                timeline.backward_ended = mark
                if peak is not None:
                    self.step_peak = max(self.step_peak or 0, peak)
        torch.autograd.Variable._execution_engine.queue_callback(ended)

    def _next_budget(self) -> None:
        """The device budget of the next step: the peak's move (with a cap), taken back to a smaller budget that
        measured as fast and held there; raised only once the budget in hand has been measured (a raise is judged
        against it)."""
        ran_at = self.device_budget
        self._follow_peak()
        if self.placed_at is not None:
            self.unmeasured.append((self.placed_at, self.timeline))
        self._measure()
        if self.device_budget > ran_at and ran_at not in self.step_ms:
            self.device_budget = ran_at
        if self.doubt is not None:
            self.device_budget = min(self.device_budget, self.doubt)
        if self.held is not None:
            self.device_budget = min(self.device_budget, self.held)

    def _measure(self) -> None:
        """Time the steps placed from a table whose device work is done (a GPU step's timing events are read
        once complete, never waited for: a loop that runs ahead of its GPU has them a step or two later), and
        hold at a smaller budget where the larger did not measure faster in ``CONFIRM`` steps; after one such step,
        doubt the budget (the next step runs at it again)."""
        waiting = []
        for budget, timeline in self.unmeasured:
            ms = timeline.regions_ms()
            if ms is None:
                waiting.append((budget, timeline))
                continue
            self.step_ms[budget] = min(ms, self.step_ms.get(budget, ms))
            self.step_samples[budget] = self.step_samples.get(budget, 0) + 1
            self.doubt = None
            if cheaper_budget(self.step_ms, budget) is None:  # faster than every smaller budget: it pays
                continue
            back = cheaper_budget(self.step_ms, budget, self.step_samples)
            if back is not None:
                self.held = back if self.held is None else min(self.held, back)
            else:
                self.doubt = budget
        self.unmeasured = waiting[-UNMEASURED:]

    def _follow_peak(self) -> None:
        peak, self.step_peak = self.step_peak, None
        if peak is None:
            return
        move = follow_peak(self.device_budget, self.gpu_bytes, self.peak_bytes, peak, self.peak_read,
                           everything=sum(self.recording.values()), room=self._room(peak))
        if move.at_floor_past_cap and self.device is not None:
            # the step ran keeping nothing past gpu_bytes: the reloads prefetched during a backward are what is left
            if self.cut_prefetch(self.device, peak - self.peak_bytes) is None and not self.warned:
                self.warned = True
                self.say(
                    f"sacpass: ModelPlan(peak_bytes={self.peak_bytes}): the step peaked at {peak} bytes on the device "
                    f"with the device budget at gpu_bytes={self.gpu_bytes}, the least it keeps, and the prefetch limit "
                    f"at one value ahead or set by hand (sacpass.offload.set_prefetch_limit). Lower gpu_bytes, or "
                    f"raise peak_bytes to what the step needs; the plan goes on at gpu_bytes. (The peak read is "
                    f"torch.cuda.max_memory_allocated(): if the compiling step set it, call "
                    f"torch.cuda.reset_peak_memory_stats() after that step.)")
        self.device_budget = move.device_budget
        self.peak_read = peak

    def _room(self, peak: int) -> int | None:
        """More device bytes the next step may keep than ``cap - peak``, by where in the step each region's values
        were gone (:func:`~sacpass.offload.placement.backward_room`, from the device's peak read as each backward
        began): the fill from the last region back (:func:`~sacpass.offload.placement.room_fill`), checked
        against the placement the larger budget gives (:func:`~sacpass.offload.placement.fits_room`); None where
        the marks cannot tell (none read, the peak past the cap) or no larger budget fits."""
        marks = list(self.timeline.peak_at_backward.items())
        if not marks or peak > self.peak_bytes:
            return None
        room = backward_room(self.peak_bytes, peak, marks)
        position = {region: j for j, (region, _) in enumerate(marks)}
        host, kept = [0] * len(marks), [0] * len(marks)
        for key, (where, _) in self.placed.items():
            if key[0] in position:
                (host if where == "host" else kept)[position[key[0]]] += self.recording[key]
        fill = room_fill(host, room)
        for extra in sorted({sum(fill), sum(fill[:-1])}, reverse=True):  # with the last region filled in part, or not
            if extra <= 0:
                break
            table = place_step(self.recording, Budgets(self.regions, self.device_budget + extra, 1 << 62))
            added, unmarked = [-n for n in kept], False
            for key, where in table.items():
                if where == "device":
                    if key[0] in position:
                        added[position[key[0]]] += self.recording[key]
                    else:
                        unmarked = True
            if not unmarked and fits_room(added, room):
                return extra
        return None

    def place(self, region: int, index: int, nbytes: int, packed: int | None = None) -> str:
        """Where value ``index`` of region ``region`` waits: the table's place (from the step before), or in the
        first step :func:`place_arriving`'s. ``packed``: the value's elements when it would go to the host
        packed (its host bytes are then those of the packed form)."""
        key = (region, index)
        size = pool_bytes(nbytes) if packed is None else packed_pool_bytes(packed)
        self.recording[key] = nbytes
        self.host_sizes[key] = size
        where = self.table.get(key) if self.table else None
        if where is None:
            later = later_device_bytes(region, self.regions, self.region_bytes, self.device_budget)
            self.region_bytes[region] = self.region_bytes.get(region, 0) + nbytes
            where = place_arriving(key, nbytes, size, self.budgets(), self.device_used, self.host_used, later)
        if where == "host":
            self.host_used += size
        else:
            self.device_used += nbytes
        self.placed[key] = (where, nbytes if where == "device" or packed is None else compression.packed_bytes(packed))
        return where
