"""Step time / control versus S, one line per variant plus limit(S), as a PNG (matplotlib)."""
from __future__ import annotations

from .results import ratio_rows
from .variants import CONTROL, VARIANTS

LIMIT_STYLE = {"color": "k", "ls": "--"}


def plot(result: dict, path: str) -> str:
    """Write the plot to ``path``; returns what the result records under ``plot``. Without matplotlib the
    plot is skipped with a printed note."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"bench_layer: matplotlib is not installed: no plot written to {path} (pip install matplotlib)",
              flush=True)
        return "skipped: matplotlib not installed"
    rows = [r for r in ratio_rows(result) if r.get("control_ms")]
    series = {v: [(r["S"], r[v]) for r in rows if r.get(v) is not None] for v in VARIANTS}
    series["limit"] = [(r["S"], r["limit"]) for r in rows if r.get("limit") is not None]
    styles = {name: spec.style for name, spec in VARIANTS.items()} | {"limit": LIMIT_STYLE}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in series.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **{"marker": ".", **styles[name]})
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel(f"step time / {CONTROL.replace('_', ' ')}")
    info = result["env"]
    ax.set_title(f"GLM-5.2 MoE layer fwd+bwd, {info.get('gpu', info['device'])}, torch {info['torch']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"
