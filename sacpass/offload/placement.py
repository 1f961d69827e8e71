"""Where a model plan's values wait for their backward: pure functions, sizes in, placements out.

A step's values are keyed ``(region, index)``: the region's position in the step (the n-th checkpointed forward
since the last backward) and the value's index in its graph. Each has its device bytes and the pool bytes it
takes on the host (packed or not). The rule: from the last region back (its backward comes first, its reloads
would have nothing to hide behind), values stay on the device while the device budget lasts; the rest go to
the host, within the host budget. Regions past ``regions`` (more than the plan was made for) always go to the
host.

The first step has no sizes from a step before: it places each value as it comes (:func:`place_arriving`), the
regions still to come estimated as large as the largest before them, so its host pool grows no larger than the
later steps need. :func:`follow_peak` moves the device budget by the step's measured peak, and
:func:`cheaper_budget` takes it back where a larger budget did not measure faster than a smaller one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import OffloadError
from .sizes import pool_bytes

__all__ = ["Key", "Budgets", "place_step", "smallest_budgets", "later_device_bytes", "place_arriving", "follow_peak",
           "PeakMove", "backward_room", "fits_room", "room_fill", "cheaper_budget", "PAYS", "CONFIRM"]

Key = tuple[int, int]  # (region, index)
DEVICE, HOST = "device", "host"


@dataclass(frozen=True)
class Budgets:
    """What a step may keep: ``regions`` the plan was made for, device bytes (all regions together) and host
    pool bytes (all regions together). ``spelled``: how the plan names them, for errors."""

    regions: int
    device_bytes: int
    host_bytes: int
    spelled: str = ""

    def name(self) -> str:
        return self.spelled or (f"ModelPlan(layers={self.regions}, gpu_bytes={self.device_bytes}, "
                                f"host_bytes={self.host_bytes})")


def _host(host_sizes: Mapping[Key, int], sizes: Mapping[Key, int], key: Key) -> int:
    return host_sizes.get(key, pool_bytes(sizes[key]))


def place_step(sizes: Mapping[Key, int], budgets: Budgets, host_sizes: Mapping[Key, int] | None = None
               ) -> dict[Key, str]:
    """{key: "device" | "host"} for a step of values of ``sizes`` device bytes (``host_sizes``: their pool bytes
    on the host, by default a block each). Raises :class:`~sacpass.OffloadError` naming the smallest budgets
    that hold the step when the host part passes the host budget."""
    host_sizes = host_sizes or {}
    table, device = {}, 0
    for key in sorted(sizes, reverse=True):
        if key[0] < budgets.regions and device + sizes[key] <= budgets.device_bytes:
            table[key] = DEVICE
            device += sizes[key]
        else:
            table[key] = HOST
    host = sum(_host(host_sizes, sizes, k) for k, where in table.items() if where == HOST)
    if host <= budgets.host_bytes:
        return table
    total = sum(_host(host_sizes, sizes, k) for k in sizes)
    device_needed = smallest_budgets(sizes, budgets, host_sizes)[1]
    by_gpu = f"gpu_bytes={device_needed} with this host_bytes" if device_needed is not None else \
        f"no gpu_bytes with this host_bytes (values of regions past layers={budgets.regions} always go to the host)"
    raise OffloadError(
        f"sacpass: {budgets.name()} cannot place this step: its planned values take {sum(sizes.values())} bytes "
        f"({total} in the host pool), of which {host} would go to the host, past host_bytes. The smallest budgets "
        f"that hold the step are host_bytes={host} with this gpu_bytes, or {by_gpu}; or recompile with a smaller "
        f"plan (its per-region share, (host_bytes + gpu_bytes) / layers, picks what is kept at all).")


def smallest_budgets(sizes: Mapping[Key, int], budgets: Budgets, host_sizes: Mapping[Key, int] | None = None
                     ) -> tuple[int, int | None]:
    """(the host bytes the step needs with this device budget, the device bytes it needs with this host budget,
    None when no device budget helps: the regions past ``regions`` alone pass the host budget). The device part
    walks from the last region back in the device's own bytes (a packed value is larger there than in the pool)."""
    host_sizes = host_sizes or {}
    table = place_step(sizes, Budgets(budgets.regions, budgets.device_bytes, 1 << 62), host_sizes)
    host_needed = sum(_host(host_sizes, sizes, k) for k, where in table.items() if where == HOST)
    device, left = 0, sum(_host(host_sizes, sizes, k) for k in sizes)
    for key in sorted(sizes, reverse=True):
        if left <= budgets.host_bytes:
            break
        if key[0] < budgets.regions:
            device, left = device + sizes[key], left - _host(host_sizes, sizes, key)
    return host_needed, device if left <= budgets.host_bytes else None


def later_device_bytes(region: int, regions: int, region_bytes: Mapping[int, int], device_budget: int) -> int:
    """In the first step, the device bytes the regions after ``region`` will keep, estimated as place_step
    keeps them: each as large as the largest region before it this step (layers share graphs); with none before
    it, the whole device budget."""
    if region >= regions - 1:
        return 0
    seen = max((b for p, b in region_bytes.items() if p < region), default=0)
    return min(device_budget, (regions - 1 - region) * seen) if seen else device_budget


def place_arriving(key: Key, nbytes: int, host_size: int, budgets: Budgets, device_used: int, host_used: int,
                   later_device: int) -> str:
    """Where value ``key`` of a step with no table waits: the device if the device budget, less what the later
    regions are expected to keep there (``later_device``), holds it; else the host while the host budget lasts;
    else the device while its budget lasts. Raises OffloadError when neither holds it."""
    region = key[0]
    if region < budgets.regions and nbytes <= budgets.device_bytes - device_used - later_device:
        return DEVICE
    if host_used + host_size <= budgets.host_bytes:
        return HOST
    if region < budgets.regions and device_used + nbytes <= budgets.device_bytes:
        return DEVICE
    raise OffloadError(
        f"sacpass: {budgets.name()}: by region {region} this step's planned values take "
        f"{host_used + device_used + nbytes} bytes, past host_bytes + gpu_bytes. Each region was compiled to keep "
        f"at most (host_bytes + gpu_bytes) / layers, so the step runs more regions than layers={budgets.regions} "
        f"(pass the real count) or larger ones than at compile time; or raise the budgets.")


@dataclass(frozen=True)
class PeakMove:
    """How one step's measured peak moves the device budget: the budget for the next step, and whether the step
    passed the cap with the budget already at its floor (the plan warns once)."""

    device_budget: int
    at_floor_past_cap: bool


def follow_peak(device_budget: int, floor: int, cap: int, peak: int, peak_before: int | None,
                everything: int, room: int | None = None) -> PeakMove:
    """The device budget after a step that peaked at ``peak`` (the highest since the last reset) under a cap of
    ``cap``: raised by the room left under the cap (``room`` where :func:`backward_room` found more, else
    ``cap - peak``; to at most ``everything``, every value of the step); lowered by the excess when the peak rose
    past the cap (never below ``floor``, the plan's gpu_bytes). A peak equal to the one read before
    (``peak_before``) past the cap is the same old peak (PyTorch's, the highest since the last reset): nothing
    moves; a lower one past the cap is a step's own after a reset, and moves it again."""
    if peak <= cap:
        grow = max(cap - peak, room or 0)
        return PeakMove(max(device_budget, min(device_budget + grow, everything)), False)
    if peak_before is None or peak != peak_before:
        lowered = max(floor, device_budget - (peak - cap))
        return PeakMove(lowered, lowered == device_budget)
    return PeakMove(device_budget, False)


def backward_room(cap: int, peak: int, marks: Sequence[tuple[int, int]]) -> list[int]:
    """The room under ``cap`` in each stretch of a step, from ``marks``: (region, the device's running peak as its
    backward began), in the order the backwards ran, and the step's ``peak``. Stretch 0 is everything before the
    first backward (the forwards, the loss); stretch ``s`` is the backward of the region at position ``s - 1``.
    A stretch peaks at most at the running peak at its end (the next mark; the step's peak for the last), so its
    room is at least ``cap`` less that. A value a region keeps on the device instead of copying is there from its
    forward through its own backward: in stretches 0 to its position + 1 (:func:`fits_room`)."""
    ends = [seen for _, seen in marks] + [peak]
    return [cap - end for end in ends]


def fits_room(added: Sequence[int], room: Sequence[int]) -> bool:
    """Whether a step that keeps ``added[j]`` more bytes on the device for the region at backward position ``j``
    (its values there from its forward through its own backward) stays within ``room`` (:func:`backward_room`) in
    every stretch: stretch ``s`` holds the added bytes of positions ``s - 1`` on."""
    return all(sum(added[max(s - 1, 0):]) <= free for s, free in enumerate(room))


def room_fill(host: Sequence[int], room: Sequence[int]) -> list[int]:
    """The bytes each region, by backward position, may keep more on the device within ``room``, filled as the
    placement fills (from the first backward's region on, the next only once one is full): ``host[j]`` is what
    the region at position ``j`` sent to the host."""
    fill: list[int] = []
    for j, sent in enumerate(host):
        limit = min(free - sum(fill[max(s - 1, 0):]) for s, free in enumerate(room[:j + 2]))
        fill.append(max(0, min(sent, limit)))
        if fill[-1] < sent:
            break
    return fill


PAYS = 0.01  # a larger device budget is kept only where its step measured this much faster than at every smaller one
CONFIRM = 2  # steps measured at a budget before it is judged (a verdict that holds for good)


def cheaper_budget(step_ms: Mapping[int, float], budget: int, samples: Mapping[int, int] | None = None
                   ) -> int | None:
    """After a step placed at device budget ``budget``: the smaller budget to go back to and hold at, where
    ``budget`` did not measure faster than the fastest smaller one by ``PAYS`` (the smallest budget measured within
    ``PAYS`` of that fastest); else None, the larger budget pays. ``step_ms``: the fastest step measured at each
    budget, ``budget``'s included; ``samples``: how many steps were measured at each, where ``budget`` is judged
    only once ``CONFIRM`` steps were measured at it (one slow step, a pool growing or another process on the host,
    does not cap the plan for good); without it, the verdict of the times alone. Device memory is spent only where
    it buys time: a value kept instead of copied saves nothing when its copy hid behind compute anyway, and it
    still raises the step's peak and the allocator's reserve; where the measurement says keeping cost time (the
    allocator, bandwidth the copies shared), all the more so."""
    here = step_ms.get(budget)
    below = {b: ms for b, ms in step_ms.items() if b < budget}
    if here is None or not below or (samples is not None and samples.get(budget, 0) < CONFIRM):
        return None
    fastest = min(below.values())
    if here < fastest * (1 - PAYS):
        return None
    return min(b for b, ms in below.items() if ms <= fastest * (1 + PAYS))
