"""The result of a run as JSON (new, or merged into an earlier run's), the markdown table, the targets.

The JSON layout is that of ``benchmarks/results/layer_h200.json``: ``env``, settings, ``config``,
``seq[S]`` (``topk`` and ``variants[name]`` rows), ``compile[name]``, ``mtp[S][name]``, ``notes``,
``targets``, ``plot``; a merged run appends to ``runs`` and ``notes`` and writes its compile rows to
``compile_merged_runs``.
"""
from __future__ import annotations

import json
import os
import platform
import sys

import torch

from .variants import CONTROL, VARIANTS

CONFIG_KEYS = ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "index_n_heads", "index_head_dim",
               "index_topk", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
MERGE_KEYS = ("preset", "fp8", "fp8_experts", "fp8_indexer", "steps", "backend",
              "dynamic_tokens")                                          # must agree to merge two runs


def new_result(args, cfg, device: torch.device, dtype: torch.dtype) -> dict:
    return {"env": env_info(device), "preset": args.preset, "fp8": cfg.fp8, "fp8_experts": cfg.fp8_experts,
            "fp8_indexer": cfg.fp8_indexer, "dtype": str(dtype),
            "steps": args.steps, "warmup": args.warmup, "backend": args.backend, "dynamic_tokens": not args.static,
            "config": {k: getattr(cfg, k) for k in CONFIG_KEYS}, "seq": {}, "compile": {}, "mtp": {}, "notes": []}


def merge_into(path: str, result: dict, args) -> dict:
    """A second run that fills lengths/variants the first one had no time for: its measurements land in the
    first run's result (same settings required); the first run's compile rows are kept and this run's go
    to ``compile_merged_runs``. Returns the result to fill."""
    with open(path) as f:
        prev = json.load(f)
    for k in MERGE_KEYS:
        if prev.get(k) != result.get(k):
            sys.exit(f"bench_layer: --merge {path}: {k}={prev.get(k)!r} differs from this run's {result.get(k)!r}")
    prev.setdefault("runs", [dict(prev["env"])]).append(dict(result["env"]))
    prev["notes"].append(f"merged run: {result['env']['command']} (lengths {args.seq}, variants {args.variants})")
    prev.setdefault("compile_merged_runs", {})
    return prev


def compile_rows(result: dict, merged: bool) -> dict:
    """Where this run's compile rows go: ``compile``, or ``compile_merged_runs`` in a merged run."""
    return result["compile_merged_runs"] if merged else result["compile"]


def save(result: dict, out: str, wall_s: float) -> None:
    """Write the JSON and, beside it, the markdown table."""
    result["wall_s"] = wall_s
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(markdown(result))


def env_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    try:
        import tilelang
        info["tilelang"] = tilelang.__version__
    except ImportError:
        info["tilelang"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        from glm52_model.ops import cuda as _c
        info["tilelang_kernels_registered"] = bool(_c.TILELANG_AVAILABLE) and device.type == "cuda"
    except ImportError:
        info["tilelang_kernels_registered"] = False
    return info


def ratio_rows(result: dict) -> list[dict]:
    """Per length: every variant's step time / control, and limit(S)."""
    rows = []
    for S, entry in sorted(result["seq"].items(), key=lambda kv: int(kv[0])):
        ctrl = entry["variants"].get(CONTROL, {}).get("step_ms_median")
        tk = entry.get("topk", {}).get("topk_fwd_ms")
        r = {"S": int(S), "control_ms": ctrl, "topk_fwd_ms": tk}
        r["limit"] = (ctrl - tk) / ctrl if ctrl and tk is not None else None
        for v, m in entry["variants"].items():
            if ctrl and "step_ms_median" in m:
                r[v] = m["step_ms_median"] / ctrl
        rows.append(r)
    return rows


def targets(result: dict) -> list[dict]:
    """The layer benchmark's targets (sacpass's step time against the control's limit, the island and SAC; peak
    memory; backward top-k runs; compile time), evaluated on this run (met: True / False / None when not
    measured)."""
    out = []

    def add(name, met, detail):
        out.append({"target": name, "met": met, "detail": detail})

    seqs = sorted(result["seq"].items(), key=lambda kv: int(kv[0]))

    def ms(entry, v):
        return entry["variants"].get(v, {}).get("step_ms_median")
    for S, e in seqs:
        c, sp, tk = ms(e, CONTROL), ms(e, "sacpass"), e.get("topk", {}).get("topk_fwd_ms")
        if c and sp and tk is not None:
            lim = (c - tk) / c
            goal = lim + 0.01 if int(S) != 65536 else min(lim + 0.01, 0.95)
            add(f"sacpass/control <= limit+0.01{' and <= 0.95' if int(S) == 65536 else ''} at S={S}",
                sp / c <= goal, f"{sp / c:.4f} vs limit {lim:.4f}")
        isl, sac = ms(e, "island"), ms(e, "pytorch_sac")
        if sp and isl:
            add(f"sacpass faster than island at S={S}" + (" (<= 0.95 at 16K)" if int(S) == 16384 else ""),
                sp / isl < (0.95 if int(S) == 16384 else 1.0), f"sacpass/island {sp / isl:.4f}")
        if sp and sac:
            add(f"sacpass/SAC within 1% at S={S}", abs(sp / sac - 1) <= 0.01, f"{sp / sac:.4f}")
        pc = e["variants"].get(CONTROL, {}).get("peak_allocated_gib")
        ps = e["variants"].get("sacpass", {}).get("peak_allocated_gib")
        ids = e.get("topk", {}).get("saved_ids_bytes")
        if pc is not None and ps is not None and ids is not None:
            d = (ps - pc) * 2 ** 30
            add(f"peak alloc sacpass - control <= IDs + 64 MiB at S={S}", d <= ids + 64 * 2 ** 20,
                f"{d / 2 ** 20:.1f} MiB vs IDs {ids / 2 ** 20:.1f} MiB + 64")
        for v, want in (("sacpass", 0), ("pytorch_sac", 0), (CONTROL, 1)):
            m = e["variants"].get(v, {})
            if "topk_bwd_runs_per_step" in m:
                add(f"backward top-k runs of {v} == {want} at S={S}", m["topk_bwd_runs_per_step"] == want,
                    str(m["topk_bwd_runs_per_step"]))
    # prefer the run in which every variant compiled with cold caches (a merged run may have them)
    runs = [r for r in (result.get("compile", {}), result.get("compile_merged_runs", {}))
            if "compile_s" in r.get("sacpass", {}) and "compile_s" in r.get("pytorch_sac", {})]
    runs.sort(key=lambda r: not (r["sacpass"].get("cold_caches") and r["pytorch_sac"].get("cold_caches")))
    if runs:
        cs, cp = runs[0]["sacpass"], runs[0]["pytorch_sac"]
        add("compile time sacpass <= PyTorch SAC", cs["compile_s"] <= cp["compile_s"],
            f"{cs['compile_s']:.1f} s vs {cp['compile_s']:.1f} s "
            f"({'each variant with fresh compile caches and workers' if cs.get('cold_caches') else 'shared caches: sacpass compiled first'})")
    return out


def _fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def markdown(result: dict) -> str:
    info = result["env"]
    # fp8_experts / fp8_indexer: the base layer's (variants may switch them); older results lack them
    precision = "".join(f", {k}={result[k]}" for k in ("fp8_experts", "fp8_indexer") if k in result)
    lines = [f"# Layer benchmark ({result['preset']} preset, fp8={result['fp8']}{precision}, "
             f"{info.get('gpu', info['device'])})",
             "",
             f"torch {info['torch']}, TileLang {info['tilelang']}, Python {info['python']}; "
             f"`{info['command']}`", "",
             f"{result['steps']} timed steps after {result['warmup']} warm-up steps; median step (fwd+bwd) in ms; "
             "ratio = variant / full_recompute (control); limit = (control - top-k fwd) / control.", "",
             "| S | top-k fwd | " + " | ".join(VARIANTS) + " | limit | sacpass/ctrl | sacpass/island | sacpass/SAC |",
             "|---|---|" + "---|" * len(VARIANTS) + "---|---|---|---|"]
    for S, entry in sorted(result["seq"].items(), key=lambda kv: int(kv[0])):
        vs = entry["variants"]
        ms = {v: vs.get(v, {}).get("step_ms_median") for v in VARIANTS}
        tk = entry.get("topk", {}).get("topk_fwd_ms")
        ctrl = ms[CONTROL]
        cells = [_fmt(ms[v]) if ms[v] is not None else vs.get(v, {}).get("status", "-") for v in VARIANTS]
        lim = (ctrl - tk) / ctrl if ctrl and tk is not None else None

        def rat(a, b):
            return _fmt(ms[a] / ms[b], ".3f") if ms[a] and ms[b] else "-"
        lines.append(f"| {S} | {_fmt(tk, '.2f')} | " + " | ".join(cells) +
                     f" | {_fmt(lim, '.3f')} | {rat('sacpass', CONTROL)} | {rat('sacpass', 'island')} | "
                     f"{rat('sacpass', 'pytorch_sac')} |")
    lines += ["", "Peak allocated / reserved (GiB), top-k runs in backward per step, loss:", "",
              "| S | variant | peak alloc | peak reserved | bwd top-k | fwd top-k | loss | new graphs |",
              "|---|---|---|---|---|---|---|---|"]
    for S, entry in sorted(result["seq"].items(), key=lambda kv: int(kv[0])):
        for v in VARIANTS:
            m = entry["variants"].get(v)
            if not m:
                continue
            if "step_ms_median" not in m:
                lines.append(f"| {S} | {v} | {m.get('status', '-')} | | | | | |")
                continue
            lines.append(f"| {S} | {v} | {_fmt(m.get('peak_allocated_gib'), '.2f')} | "
                         f"{_fmt(m.get('peak_reserved_gib'), '.2f')} | {m['topk_bwd_runs_per_step']} | "
                         f"{m['topk_fwd_runs_per_step']} | {m['loss']:.6g} | {m['new_graphs']} |")
    lines += ["", "Compile (first step minus a steady step, s), graph breaks, compiled graphs:", "",
              "| variant | compile s | graph breaks | graphs | fullgraph |", "|---|---|---|---|---|"]
    for label, rows in (("", result.get("compile", {})), ("merged run: ", result.get("compile_merged_runs", {}))):
        for v, c in rows.items():
            lines.append(f"| {label}{v} (S={c.get('at_S')}, {'cold' if c.get('cold_caches') else 'shared'} caches) | "
                         f"{_fmt(c.get('compile_s'), '.1f')} | {c.get('graph_breaks')} | "
                         f"{c.get('unique_graphs')} | {c.get('fullgraph')} |")
    if result.get("mtp"):
        lines += ["", "MTP layer (shared top-k: no top-k inside the layer):", "",
                  "| S | variant | step ms | peak alloc GiB | bwd top-k |", "|---|---|---|---|---|"]
        for S, entry in sorted(result["mtp"].items(), key=lambda kv: int(kv[0])):
            for v, m in entry.items():
                lines.append(f"| {S} | {v} | {_fmt(m.get('step_ms_median'))} | "
                             f"{_fmt(m.get('peak_allocated_gib'), '.2f')} | {m.get('topk_bwd_runs_per_step', '-')} |")
    tg = targets(result)
    if tg:
        lines += ["", "Targets:", "", "| target | met | value |", "|---|---|---|"]
        lines += [f"| {t['target']} | {'yes' if t['met'] else 'NO'} | {t['detail']} |" for t in tg]
    if result.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"
