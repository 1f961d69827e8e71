"""The memory-speed frontier as a picture: step time against peak memory, one point per variant.

    python3 benchmarks/plot_frontier.py benchmarks/results/frontier_1layer_h200.json \
        benchmarks/results/frontier_16layers_64k_h200.json --out docs/results/frontier_h200.png

Reads ``bench_layer.py`` results (one panel per sequence length) and ``bench_model.py`` results (one panel);
needs matplotlib. ``benchmarks/results_page.py`` draws the results page's frontier plot with the same functions.

    python3 benchmarks/plot_frontier.py --against-control benchmarks/results/*layers_*_h200.json \
        --out docs/results/model_against_control_h200.png

``--against-control``: every ``bench_model.py`` row beside the full recompute (``control``) of its own file, so
that files measured at different times share one picture: step time and peak memory (allocated, and reserved)
as shares of that control's, one pair of panels per model shape; packed offload (lossy) drawn apart from
the exact variants, rows measured under another allocator configuration left out.
"""
from __future__ import annotations

import argparse
import json
import os
import textwrap


def _layer_panels(result: dict) -> list[tuple[str, dict]]:
    panels = []
    for S, entry in sorted(result.get("seq", {}).items(), key=lambda kv: int(kv[0])):
        points = {name: (v["peak_allocated_gib"], v["step_ms_median"])
                  for name, v in entry.get("variants", {}).items() if "step_ms_median" in v and "peak_allocated_gib" in v}
        if points:
            panels.append((f"one layer, S={int(S) // 1024}K (ms)", points))
    return panels


def _model_panel(result: dict) -> list[tuple[str, dict]]:
    points = {name: (v["peak_allocated_gib"], v["step_ms_median"] / 1e3)
              for name, v in result.get("variants", {}).items() if "peak_allocated_gib" in v}
    args = result.get("args", {})
    return [(f"{args.get('layers')} layers, S={args.get('seq', 0) // 1024}K (s)", points)] if points else []


def solver_note(points: dict, peak=lambda x: f"{x:.1f} GiB") -> list[str]:
    """Where PyTorch's budget solver stops, against control's peak and the lowest sacpass plan, as lines of text
    (``peak`` formats a peak); none when the points have no solver row. ``points``: {variant: (peak, step)}."""
    solver = [p for v, p in points.items() if v.startswith("pytorch_budget")]
    plans = [p for v, p in points.items() if v.startswith(("model_plan", "plan"))]
    if not solver:
        return []
    low = min(solver)[0]
    lines = [f"PyTorch's solver: lowest peak {peak(low)}"
             + (" (never down to control's)" if "control" in points and low > points["control"][0] else "")]
    if plans:
        lines.append(f"sacpass plans: lowest peak {peak(min(plans)[0])}")
    return lines


def _corner_note(ax, lines: list[str]) -> None:
    """Lines of text, wrapped narrow, in a panel's lower right corner (where faster-and-bigger rows seldom are)."""
    text = "\n".join(textwrap.fill(line, 44, subsequent_indent="  ") for line in lines)
    ax.text(0.98, 0.02, text, transform=ax.transAxes, fontsize=6.5, va="bottom", ha="right")


def panels(results: list[dict]) -> list[tuple[str, dict]]:
    """One panel per layer-benchmark length and one per model benchmark, in the order given."""
    out = []
    for result in results:
        out += _model_panel(result) if "variants" in result else _layer_panels(result)
    return out


def draw(panel_list: list[tuple[str, dict]], path: str, title: str = "memory-speed frontier, H200") -> str:
    """Write the panels to ``path`` as a PNG, byte for byte the same for the same input and matplotlib
    (fixed size and dpi, no software or date in the PNG's metadata)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panel_list), figsize=(5 * len(panel_list), 4), squeeze=False)
    for ax, (name, points) in zip(axes[0], panel_list):
        for variant, (peak, t) in sorted(points.items()):
            ax.scatter(peak, t, s=30)
            ax.annotate(variant, (peak, t), fontsize=7, xytext=(3, 3), textcoords="offset points")
        note = solver_note(points)
        if "control" in points:
            ax.axvline(points["control"][0], color="grey", lw=0.8, ls="--")
            note = ["dashed: control's peak"] + note if note else note
        if note:
            _corner_note(ax, note)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("peak allocated (GiB)")
        ax.set_ylabel("step time")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title} (lower left is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------- against control
# bench_model variants whose offloaded values come back close to, not equal to, the forward's: their packing
PACKED = {"model_plan_fp8": "FP8", "model_plan_auto_fp8": "FP8", "model_plan_int8": "INT8",
          "model_plan_auto_int8": "INT8"}


def packing(variant: str) -> str | None:
    """The packing format (``"FP8"``, ``"INT8"``) of a lossy variant's offloaded values, None for an exact one."""
    return PACKED.get(variant.split("@")[0].split(":")[0])


def is_lossy(variant: str) -> bool:
    return packing(variant) is not None


def _allocator(command: str) -> str:
    """The caching allocator's configuration a command ran under ('default' or what it set)."""
    for word in command.split():
        if word.startswith("PYTORCH_CUDA_ALLOC_CONF="):
            return word.split("=", 1)[1]
    return "default"


def against_control(results: list[tuple[str, dict]]) -> dict[tuple[int, int], list[dict]]:
    """Every bench_model.py row of ``(file name, result)`` pairs beside the control of its own file, grouped by
    model shape (layers, sequence length), each group sorted by step: {"file", "variant", "step", "allocated",
    "reserved" (shares of control's; None where the row did not run), "status", "lossy", "allocator",
    "loss_diff" (the row's loss less control's)}. Files without a control that ran are left out."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for name, result in results:
        rows, args = result.get("variants", {}), result.get("args", {})
        control = rows.get("control", {})
        if "step_ms_median" not in control or not control.get("peak_allocated_gib"):
            continue
        default_command = result.get("meta", {}).get("command", "")
        default_command = default_command[0] if isinstance(default_command, list) else default_command
        for variant, row in rows.items():
            if variant == "control":
                continue
            ran = "step_ms_median" in row

            def share(key: str, row=row, ran=ran):
                return row[key] / control[key] if ran and row.get(key) and control.get(key) else None
            loss = row.get("loss")
            groups.setdefault((args.get("layers"), args.get("seq")), []).append({
                "file": name, "variant": variant, "step": share("step_ms_median"),
                "allocated": share("peak_allocated_gib"), "reserved": share("peak_reserved_gib"),
                "status": "ok" if ran else row.get("status", "failed"), "lossy": is_lossy(variant),
                "packing": packing(variant),
                "allocator": _allocator(row.get("command") or default_command),
                "loss_diff": loss - control["loss"] if ran and loss is not None and control.get("loss") is not None
                else None})
    for rows in groups.values():
        rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0.0, r["file"], r["variant"]))
    return dict(sorted(groups.items(), key=lambda kv: (-(kv[0][0] or 0), kv[0][1] or 0)))


def solver_note_against_control(rows: list[dict], memory: str) -> list[str]:
    """:func:`solver_note` for one shape's rows of :func:`against_control` (those of the default allocator), with
    peaks (``memory``: "allocated" or "reserved") as shares of control's."""
    points = {"control": (1.0, 1.0)}
    for r in rows:
        if r["allocator"] == "default" and r["step"] is not None and r[memory] is not None:
            points[f"{r['variant']} {r['file']}"] = (r[memory], r["step"])
    return solver_note(points, peak=lambda x: f"{x:.3f} of control's")


def draw_against_control(groups: dict[tuple[int, int], list[dict]], path: str,
                         title: str = "whole model against full recompute, H200") -> str:
    """Two panels per model shape (peak allocated, peak reserved): each row as (its peak / control's, its step /
    control's), exact variants as dots and packed (lossy) ones as triangles; the default allocator's rows
    only. Lower left of the dashed lines: faster than full recompute at less memory. Rows that did not run are
    named in the panel, and where PyTorch's solver stops beside the lowest plan (:func:`solver_note`). Same
    bytes for the same input and matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(groups)
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 4.2 * len(shapes)), squeeze=False)
    for row_axes, shape in zip(axes, shapes):
        rows = [r for r in groups[shape] if r["allocator"] == "default"]
        layers, seq = shape
        for ax, memory in zip(row_axes, ("allocated", "reserved")):
            for r in rows:
                if r["step"] is None or r[memory] is None:
                    continue
                ax.scatter(r[memory], r["step"], s=32, marker="^" if r["lossy"] else "o",
                           color="tab:red" if r["lossy"] else "tab:blue")
                ax.annotate(r["variant"], (r[memory], r["step"]), fontsize=6.5, xytext=(3, 3), textcoords="offset points")
            ax.scatter([1.0], [1.0], s=40, marker="s", color="k")
            ax.annotate("control", (1.0, 1.0), fontsize=6.5, xytext=(3, -9), textcoords="offset points")
            ax.axvline(1.0, color="grey", lw=0.8, ls="--")
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            note = solver_note_against_control(rows, memory)
            if note:
                _corner_note(ax, note)
            failed = sorted({f"{r['variant']} ({r['status']})" for r in rows if r["step"] is None})
            if failed:
                ax.text(0.02, 0.98, "did not run: " + ", ".join(failed), transform=ax.transAxes, fontsize=6.5,
                        va="top", ha="left")
            ax.set_title(f"{layers} layers, S={(seq or 0) // 1024}K: peak {memory}", fontsize=9)
            ax.set_xlabel(f"peak {memory} / full recompute's")
            ax.set_ylabel("step time / full recompute's")
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], ls="", marker="o", color="tab:blue", label="exact"),
               plt.Line2D([], [], ls="", marker="^", color="tab:red", label="packed offload (lossy)"),
               plt.Line2D([], [], ls="", marker="s", color="k", label="full recompute (each file's own)")]
    fig.suptitle(f"{title} (lower left is better)", fontsize=10)
    fig.legend(handles=handles, fontsize=7, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 0.975), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default="frontier.png")
    p.add_argument("--against-control", action="store_true",
                   help="bench_model.py rows as shares of their own file's control, one pair of panels per shape")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        with open(path) as f:
            results.append((os.path.basename(path), json.load(f)))
    if args.against_control:
        draw_against_control(against_control(results), args.out)
    else:
        draw(panels([r for _, r in results]), args.out)
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
