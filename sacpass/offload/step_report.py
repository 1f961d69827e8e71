"""What a model plan's last step did, per region: where its values waited, its copies and its compute, expected
and measured. Reads the runtime's plan states; changes nothing."""
from __future__ import annotations

from .clocks import copy_ms
from . import placement
from .plan_state import PlanState

__all__ = ["placement_rows", "format_rows", "budget_of"]


def _new_row(region: int) -> dict:
    return {"region": region, "device_bytes": 0, "host_bytes": 0, "values": 0, "copy_ms_expected": 0.0,
            "d2h_ms_measured": 0.0, "h2d_ms_measured": 0.0, "reloads_waited": 0,
            "forward_ms_expected": None, "forward_ms_measured": None,
            "backward_ms_expected": None, "backward_ms_measured": None}


def placement_rows(states: list[PlanState]) -> list[dict]:
    """One row per region of the last complete step of ``states`` (see :func:`sacpass.offload.placements`)."""
    rows: dict[int, dict] = {}
    for state in states:
        complete = bool(state.last)
        for (pos, _), (where, nbytes) in sorted((state.last or state.placed).items()):
            row = rows.setdefault(pos, _new_row(pos))
            row[f"{where}_bytes"] += nbytes
            row["values"] += 1
            if where == "host" and state.copy_bytes_per_s:
                row["copy_ms_expected"] += 1e3 * nbytes / state.copy_bytes_per_s
        timeline = state.last_timeline if complete else state.timeline
        for pos, n in timeline.waited.items():
            if pos in rows:
                rows[pos]["reloads_waited"] += n
        for pos, times in timeline.copies.items():
            for way in ("d2h", "h2d"):
                ms = copy_ms(times[way])
                if pos in rows:
                    got = rows[pos][f"{way}_ms_measured"]
                    rows[pos][f"{way}_ms_measured"] = None if ms is None or got is None else got + ms
        for pos, (fwd, bwd) in timeline.expected.items():
            if pos in rows:
                rows[pos]["forward_ms_expected"], rows[pos]["backward_ms_expected"] = fwd, bwd
        for way, measured in (("forward", timeline.forward_ms()), ("backward", timeline.backward_ms())):
            for pos, ms in measured.items():
                if pos in rows and ms is not None:
                    rows[pos][f"{way}_ms_measured"] = ms
    return [rows[p] for p in sorted(rows)]


def budget_of(state: PlanState, prefetch_cut: int | None = None) -> dict:
    """``state``'s device budget and what moved it; ``prefetch_cut``: the device's prefetch limit as the peak cap
    lowered it (the runtime's, which setting the limit clears), or None."""
    return {"gpu_bytes": state.gpu_bytes, "device_budget": state.device_budget, "peak_bytes": state.peak_bytes,
            "peak_read": state.peak_read, "peak_at_backward": dict(state.last_timeline.peak_at_backward),
            "held_at": state.held, "step_ms": dict(sorted(state.step_ms.items())),
            "step_samples": dict(sorted(state.step_samples.items())), "doubt": state.doubt,
            "prefetch_cut": prefetch_cut}


def format_rows(rows: list[dict], state: PlanState | None = None, prefetch_cut: int | None = None) -> str:
    gib = 2 ** 30
    lines = ["region  values  device GiB  host GiB  copy ms (expected, each way)  measured D2H / H2D  "
             "reloads waited (measured)  forward ms expected / measured  backward ms expected / measured"]
    shown = lambda ms: "-" if ms is None else f"{ms:.2f}"  # noqa: E731
    for r in rows:
        measured = f"{shown(r['d2h_ms_measured'])} / {shown(r['h2d_ms_measured'])}"
        lines.append(f"{r['region']:>6}  {r['values']:>6}  {r['device_bytes'] / gib:>10.3f}  {r['host_bytes'] / gib:>8.3f}"
                     f"  {r['copy_ms_expected']:>28.2f}  {measured:>18}  {r['reloads_waited']:>25}"
                     f"  {shown(r['forward_ms_expected']) + ' / ' + shown(r['forward_ms_measured']):>31}"
                     f"  {shown(r['backward_ms_expected']) + ' / ' + shown(r['backward_ms_measured']):>32}")
    if state is not None and state.peak_bytes is not None:
        b = budget_of(state, prefetch_cut)
        read = "none read yet" if b["peak_read"] is None else f"{b['peak_read'] / gib:.3f} GiB read"
        if b["peak_at_backward"]:
            marks = ", ".join(f"{region} {seen / gib:.3f}" for region, seen in b["peak_at_backward"].items())
            lines.append(f"the device's peak as each region's backward began (GiB): {marks}; a region's values kept "
                         f"instead of copied count only where they are alive")
        lines.append(f"device budget {b['device_budget'] / gib:.3f} GiB for the next step (from gpu_bytes "
                     f"{b['gpu_bytes'] / gib:.3f}; peak {read}, cap {b['peak_bytes'] / gib:.3f})")
        if b["held_at"] is not None:
            measured = ", ".join(f"{budget / gib:.3f} GiB {ms:.1f} ms ({b['step_samples'].get(budget, 0)} steps)"
                                 for budget, ms in b["step_ms"].items())
            lines.append(f"held at {b['held_at'] / gib:.3f} GiB: a larger device budget measured no faster (by "
                         f"{placement.PAYS:.0%}; the fastest step in its regions at each budget: {measured})")
        elif b["doubt"] is not None:
            lines.append(f"{b['doubt'] / gib:.3f} GiB measured no faster than a smaller budget once: the next step "
                         f"runs at it again before it is judged")
        if b["prefetch_cut"] is not None:
            lines.append(f"prefetch limit lowered to {b['prefetch_cut'] / gib:.3f} GiB: a step peaked past the cap "
                         f"with the device budget at gpu_bytes")
    return "\n".join(lines)
