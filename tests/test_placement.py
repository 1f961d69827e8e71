"""Where a model plan's values wait, as pure functions on synthetic step profiles (no model, no device).

A profile is {(region, index): bytes}. The rules pinned here: budgets are met or the error names the smallest
budgets that hold the step (and those do), the last regions are the ones kept on the device, regions past the
plan's count always go to the host, the first step (placed value by value as it comes) places a step of equal
regions as the steps after it do, and the device budget follows the measured peak.
"""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sacpass
from sacpass.offload.placement import (CONFIRM, PAYS, Budgets, backward_room, cheaper_budget, fits_room, follow_peak,
                                       later_device_bytes, place_arriving, place_step, room_fill, smallest_budgets)
from sacpass.offload.sizes import pool_bytes


def uniform(regions: int, values: list[int]) -> dict:
    """Every region with the same values (layers that share one graph)."""
    return {(r, i): n for r in range(regions) for i, n in enumerate(values)}


def on(table: dict, where: str) -> set:
    return {k for k, w in table.items() if w == where}


def test_a_device_budget_of_k_regions_keeps_the_last_k_regions():
    sizes = uniform(6, [4096, 1024, 512])
    region = 4096 + 1024 + 512
    for k in range(7):
        table = place_step(sizes, Budgets(6, k * region, 1 << 30))
        assert {r for r, _ in on(table, "device")} == set(range(6 - k, 6)), k


def test_what_is_left_of_the_device_budget_goes_to_the_next_region_back_value_by_value():
    sizes = uniform(3, [4096, 1024, 512])
    table = place_step(sizes, Budgets(3, 5632 + 1024 + 512, 1 << 30))  # region 2, then what fits of region 1
    assert on(table, "device") == {(2, 0), (2, 1), (2, 2), (1, 2), (1, 1)}


def test_regions_past_the_plans_count_always_go_to_the_host():
    sizes = uniform(5, [1000])
    table = place_step(sizes, Budgets(3, 1 << 30, 1 << 30))
    assert on(table, "host") == {(3, 0), (4, 0)} and on(table, "device") == {(0, 0), (1, 0), (2, 0)}


def test_a_step_the_host_cannot_hold_names_both_smallest_budgets():
    sizes = uniform(4, [4096])
    with pytest.raises(sacpass.OffloadError) as err:
        place_step(sizes, Budgets(4, 4096, 4096))
    text = str(err.value)
    assert "host_bytes=12288 with this gpu_bytes, or gpu_bytes=12288 with this host_bytes" in text, text
    assert smallest_budgets(sizes, Budgets(4, 4096, 4096)) == (12288, 12288)


@settings(max_examples=150, deadline=None)
@given(regions=st.integers(1, 6), extra=st.integers(0, 2),
       values=st.lists(st.integers(1, 20000), min_size=1, max_size=4),
       device=st.integers(0, 100000), host=st.integers(0, 100000))
def test_budgets_are_met_or_the_named_budgets_hold_the_step(regions, extra, values, device, host):
    """For any profile: a placement meets both budgets with the device part a suffix of the step (in the order
    the backward reads it); a step that fits neither is refused, and each pair of budgets the error names
    places it."""
    sizes = uniform(regions + extra, values)  # `extra` regions past the plan's count
    budgets = Budgets(regions, device, host)
    try:
        table = place_step(sizes, budgets)
    except sacpass.OffloadError as e:
        host_needed, device_needed = smallest_budgets(sizes, budgets)
        assert f"host_bytes={host_needed} with this gpu_bytes" in str(e)
        place_step(sizes, Budgets(regions, device, host_needed))
        if device_needed is None:
            assert "no gpu_bytes with this host_bytes" in str(e)
            past = sum(pool_bytes(n) for (r, _), n in sizes.items() if r >= regions)
            assert past > host
        else:
            assert re.search(rf"gpu_bytes={device_needed} with this host_bytes", str(e))
            place_step(sizes, Budgets(regions, device_needed, host))
        return
    kept = on(table, "device")
    assert sum(sizes[k] for k in kept) <= device
    assert sum(pool_bytes(sizes[k]) for k in on(table, "host")) <= host
    assert all(k[0] < regions for k in kept)
    # the backward reads from the last key back: what the device keeps is taken in that order, skipping only
    # values that did not fit what was left
    left = device
    for k in sorted(sizes, reverse=True):
        if k[0] < regions and sizes[k] <= left:
            assert k in kept
            left -= sizes[k]


@pytest.mark.parametrize("device_regions", [0, 1, 2, 3.5])
def test_the_first_step_places_a_step_of_equal_regions_as_the_steps_after_it(device_regions):
    """The first step has no table: each value is placed as it comes, the regions still to come estimated as
    large as the largest before them. For layers that share a graph that is the table the next step uses."""
    values = [3000, 1500, 700]
    regions = 5
    budgets = Budgets(regions, int(device_regions * sum(values)), 1 << 30)
    arriving, device_used, host_used, region_bytes = {}, 0, 0, {}
    for r in range(regions):
        for i, n in enumerate(values):
            later = later_device_bytes(r, regions, region_bytes, budgets.device_bytes)
            region_bytes[r] = region_bytes.get(r, 0) + n
            where = place_arriving((r, i), n, pool_bytes(n), budgets, device_used, host_used, later)
            arriving[(r, i)] = where
            device_used += n if where == "device" else 0
            host_used += pool_bytes(n) if where == "host" else 0
    table = place_step(uniform(regions, values), budgets)
    assert {r for r, _ in on(arriving, "device")} == {r for r, _ in on(table, "device")}


def test_a_value_neither_budget_holds_in_the_first_step_is_refused_naming_the_count():
    with pytest.raises(sacpass.OffloadError, match=r"more regions than layers=2 \(pass the real count\)"):
        place_arriving((2, 0), 4096, 4096, Budgets(2, 0, 4096), device_used=0, host_used=4096, later_device=0)


def test_the_device_budget_follows_the_measured_peak():
    cap = 100
    assert follow_peak(10, 0, cap, 60, None, everything=1000).device_budget == 50  # raised by the room left
    assert follow_peak(10, 0, cap, 60, None, everything=30).device_budget == 30  # no more than every value
    moved = follow_peak(50, 0, cap, 130, 100, everything=1000)
    assert moved.device_budget == 20 and not moved.at_floor_past_cap  # lowered by the excess
    assert follow_peak(50, 0, cap, 130, 130, everything=1000).device_budget == 50  # the same old peak
    assert follow_peak(50, 0, cap, 120, 130, everything=1000).device_budget == 30  # a lower one after a reset
    at_floor = follow_peak(5, 5, cap, 150, None, everything=1000)
    assert at_floor.device_budget == 5 and at_floor.at_floor_past_cap  # already at gpu_bytes: the plan warns


def test_each_stretch_of_the_step_has_the_room_under_the_running_peak_at_its_end():
    marks = [(3, 40), (2, 55), (1, 55), (0, 70)]  # (region, running peak as its backward began), backward order
    # before the first backward, then the backward of regions 3, 2, 1 and 0 (the last ends at the step's peak)
    assert backward_room(100, 90, marks) == [60, 45, 45, 30, 10]


def test_a_region_s_kept_bytes_count_in_every_stretch_up_to_its_own_backward():
    room = [60, 45, 45, 30, 10]
    assert fits_room([45, 0, 0, 0], room)  # the first backward's region: stretches 0 and 1
    assert not fits_room([46, 0, 0, 0], room)
    assert fits_room([20, 25, 0, 0], room) and not fits_room([20, 26, 0, 0], room)  # 2 is in stretch 1 too
    assert fits_room([0, 0, 10, 10], room) and not fits_room([0, 0, 0, 11], room)  # region 0: through the peak
    assert fits_room([50, -5, 0, 0], room)  # a region that keeps less makes room where its values were


def test_the_fill_goes_from_the_first_backward_s_region_on_within_every_stretch_s_room():
    room = [60, 45, 45, 30, 10]
    assert room_fill([30, 30, 30, 30], room) == [30, 15]  # 2 fills in part (stretch 1: 45 in all), then stops
    assert room_fill([10, 10, 10, 10], room) == [10, 10, 10, 10]  # 40 in stretches 0 and 1, 20 in 3, 10 in 4
    assert room_fill([10, 10, 10, 30], room) == [10, 10, 10, 10]  # region 0 alone lives through the peak's 10
    assert room_fill([0, 50], room) == [0, 45]
    # every fill fits
    for host in ([30, 30, 30, 30], [10, 10, 10, 10], [5, 50, 5, 5], [70, 0, 0, 0]):
        fill = room_fill(host, room)
        assert fits_room(fill + [0] * (4 - len(fill)), room), (host, fill)


@given(st.lists(st.integers(0, 100), min_size=2, max_size=9), st.data())
def test_the_fill_never_takes_a_stretch_past_the_cap(peaks, data):
    """Any step: each stretch's own peak (before the first backward, then each region's backward), the marks read
    as running peaks, what each region sent to the host; the fill keeps every stretch, with the values it keeps
    there, under the cap, fills region by region, and keeps no more than a region sent."""
    n = len(peaks) - 1  # regions
    host = data.draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    cap = max(peaks) + data.draw(st.integers(0, 80))
    running = [max(peaks[:s + 1]) for s in range(n + 1)]
    room = backward_room(cap, running[-1], [(n - 1 - j, running[j]) for j in range(n)])
    fill = room_fill(host, room)
    full = fill + [0] * (n - len(fill))
    for s, own in enumerate(peaks):  # stretch s holds what positions s - 1 on keep
        assert own + sum(full[max(s - 1, 0):]) <= cap, (peaks, host, cap, fill)
    assert all(0 <= f <= h for f, h in zip(full, host)) and all(f == h for f, h in zip(fill[:-1], host))


def test_the_device_budget_grows_by_the_larger_of_the_peak_s_room_and_the_stretches():
    cap = 100
    assert follow_peak(0, 0, cap, 100, None, everything=1000, room=25).device_budget == 25
    assert follow_peak(0, 0, cap, 90, None, everything=1000, room=5).device_budget == 10  # the peak's room is more
    assert follow_peak(0, 0, cap, 90, None, everything=20, room=35).device_budget == 20
    # past the cap: lowered as before, whatever the stretches' room
    assert follow_peak(50, 0, cap, 130, None, everything=1000, room=25).device_budget == 20


def test_a_budget_that_did_not_measure_faster_than_a_smaller_one_goes_back_to_the_smallest_as_fast():
    assert cheaper_budget({0: 100.0}, 0) is None  # nothing smaller to compare with
    assert cheaper_budget({0: 100.0, 8: 95.0}, 8) is None  # faster by more than PAYS: it pays, kept
    assert cheaper_budget({0: 100.0, 8: 100.0 * (1 - PAYS) - 0.01}, 8) is None  # just past PAYS: kept
    assert cheaper_budget({0: 100.0, 8: 100.0 * (1 - PAYS) + 0.01}, 8) == 0  # faster, but by less: memory not spent
    assert cheaper_budget({0: 100.0, 8: 100.0}, 8) == 0  # as fast: given back
    assert cheaper_budget({0: 100.0, 8: 103.0}, 8) == 0  # slower: given back
    assert cheaper_budget({0: 100.0, 4: 95.0, 8: 103.0}, 8) == 4  # the fastest of the smaller
    assert cheaper_budget({0: 100.0, 4: 95.0, 8: 95.5}, 8) == 4  # 4 paid, 8 did not pay over it
    assert cheaper_budget({0: 95.0, 4: 95.0, 8: 103.0}, 8) == 0  # on a tie, the smallest
    assert cheaper_budget({0: 95.5, 4: 95.0, 8: 103.0}, 8) == 0  # within PAYS of the fastest: the smallest
    assert cheaper_budget({0: 100.0, 8: 103.0}, 0) is None  # only smaller budgets are gone back to
    # judged only once CONFIRM steps were measured at it: one slow step does not cap the plan for good
    assert cheaper_budget({0: 100.0, 8: 103.0}, 8, {0: 3, 8: CONFIRM - 1}) is None
    assert cheaper_budget({0: 100.0, 8: 103.0}, 8, {0: 1, 8: CONFIRM}) == 0


@given(st.dictionaries(st.integers(0, 1 << 40), st.floats(1.0, 1e4), min_size=1, max_size=8), st.data())
def test_going_back_picks_the_smallest_budget_as_fast_and_only_where_the_larger_did_not_pay(times, data):
    budget = data.draw(st.sampled_from(sorted(times)))
    back = cheaper_budget(times, budget)
    below = {b: ms for b, ms in times.items() if b < budget}
    if not below:
        assert back is None
        return
    fastest = min(below.values())
    assert (back is None) == (times[budget] < fastest * (1 - PAYS))
    if back is not None:
        assert back < budget and times[back] <= fastest * (1 + PAYS)
        assert all(ms > fastest * (1 + PAYS) for b, ms in below.items() if b < back)
