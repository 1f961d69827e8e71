"""The memory-speed frontier as a picture: step time against peak memory, one point per variant.

    python3 benchmarks/plot_frontier.py benchmarks/results/frontier_1layer_h200.json \
        benchmarks/results/frontier_16layers_64k_h200.json --out docs/results/frontier_h200.png

Reads ``bench_layer.py`` results (one panel per sequence length) and ``bench_model.py`` results (one panel);
needs matplotlib. ``benchmarks/results_page.py`` draws the results page's frontier plot with the same functions.
"""
from __future__ import annotations

import argparse
import json


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


def solver_note(points: dict) -> str:
    """Where PyTorch's budget solver stops, against control's peak and the lowest sacpass plan: '' when the panel
    has no solver point."""
    solver = {v: p for v, p in points.items() if v.startswith("pytorch_budget")}
    plans = {v: p for v, p in points.items() if v.startswith(("model_plan", "plan"))}
    if not solver:
        return ""
    low = min(solver.values())
    text = ("dashed: control's peak\n" if "control" in points else "") + \
        f"PyTorch's solver: lowest peak {low[0]:.1f} GiB"
    if "control" in points and low[0] > points["control"][0]:
        text += "\n(never down to control's)"
    if plans:
        text += f"\nsacpass plans: lowest peak {min(plans.values())[0]:.1f} GiB"
    return text


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
        if note:
            ax.text(0.98, 0.98, note, transform=ax.transAxes, fontsize=6.5, va="top", ha="right")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("peak allocated (GiB)")
        ax.set_ylabel("step time")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title} (lower left is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default="frontier.png")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        with open(path) as f:
            results.append(json.load(f))
    draw(panels(results), args.out)
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
