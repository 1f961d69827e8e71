"""docs/results.md from the files in benchmarks/results/: one section per measurement, its tables, plots, the
command that reproduces it, the commit, versions and machine.

    python3 benchmarks/results_page.py            # rewrite docs/results.md and its plots (docs/results/*.png)
    python3 benchmarks/results_page.py --check    # exit 1 when docs/results.md is not what the files give

Every results file is JSON with a ``meta`` object (``META_KEYS``), or another file (Nsight Compute text) with
a ``<name>.meta.json`` beside it holding that object. ``meta["kind"]`` picks the section's renderer. The
markdown depends on the JSON only; the plots need matplotlib and are written with fixed sizes, dpi and no
software or date in their metadata. ``--check`` compares the markdown (and that each plot it names exists),
so it needs no matplotlib and does not depend on the plotting library's version.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
PAGE = os.path.join(ROOT, "docs", "results.md")
REGEN = "python3 benchmarks/results_page.py"
META_KEYS = ("kind", "title", "about", "command", "commit", "torch", "tilelang", "cuda", "machine")
NAME_RULE = re.compile(r"(run|issue)[0-9]+", re.I)      # a results file is named by what it measures, never a run
KIND_ORDER = ("topk_op", "logits_sweep", "select_sweep", "topk_host", "ncu", "sparse_mla", "experts", "layer",
              "layer_profile", "model", "sac_vs_sacpass", "router_drift", "host_read", "host_pace")
ORDER = ("topk_op_h200.json", "logits_sweep_h200.json", "topk_host_64k_h200.json",
         "ncu_logits_32k_h200.txt", "ncu_select_32k_h200.txt", "sparse_mla_16k_h200.json",
         "sparse_mla_bwd_dkv_layouts_64heads_16k_h200.json", "experts_16k_h200.json", "layer_h200.json", "layer_64k_h200.json",
         "layer_16k_128k_h200.json", "profile_layer_64k_fp8experts_h200.json", "frontier_1layer_h200.json",
         "frontier_1layer_16k_h200.json", "budget_solvers_1layer_16k_h200.json", "frontier_16layers_64k_h200.json",
         "allocator_16layers_64k_h200.json", "prefetch_16layers_64k_h200.json", "plan_8layers_128k_h200.json",
         "allocator_8layers_128k_h200.json", "compress_16layers_64k_h200.json",
         "compress_8layers_128k_h200.json", "sac_vs_sacpass_h200.json", "router_drift_h200.json",
         "host_read_beside_copies_h100.json", "host_pace_beside_fed_copies_h100.json", "gaps_stack_8layers_64k_h100.json",
         "gaps_8layers_64k_h100.json")
# the page's order; a file not named here follows them, by kind (KIND_ORDER) and name
VARIANT_LABELS = {"default": "default"}


class ResultsError(Exception):
    pass


# ---------------------------------------------------------------------------------------------- loading

def load(results_dir: str = RESULTS) -> list[dict]:
    """Every measurement: {"name", "meta", "data" (the JSON, or None), "file" (the raw file for sidecars)}."""
    entries = []
    names = sorted(os.listdir(results_dir))
    for name in names:
        path = os.path.join(results_dir, name)
        if NAME_RULE.search(name):
            raise ResultsError(f"{name}: results files are named by what they measure, not by run or issue")
        if name.endswith(".meta.json"):
            raw = name[: -len(".meta.json")]
            if raw not in names:
                raise ResultsError(f"{name}: describes {raw}, which is not in {results_dir}")
            with open(path) as f:
                meta = json.load(f).get("meta")
            entries.append({"name": raw, "meta": meta, "data": None, "file": os.path.join(results_dir, raw)})
        elif name.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
            entries.append({"name": name, "meta": data.get("meta"), "data": data, "file": path})
        elif name + ".meta.json" not in names:
            raise ResultsError(f"{name}: not JSON and no {name}.meta.json beside it (command, commit, versions)")
    for e in entries:
        meta = e["meta"]
        if not isinstance(meta, dict):
            raise ResultsError(f"{e['name']}: no \"meta\" object")
        missing = [k for k in META_KEYS if not meta.get(k)]
        if missing:
            raise ResultsError(f"{e['name']}: meta lacks {', '.join(missing)}")
        if meta["kind"] not in RENDER:
            raise ResultsError(f"{e['name']}: unknown meta kind {meta['kind']!r} (one of {', '.join(KIND_ORDER)})")
    entries.sort(key=lambda e: (ORDER.index(e["name"]) if e["name"] in ORDER else len(ORDER),
                                KIND_ORDER.index(e["meta"]["kind"]), e["name"]))
    return entries


# ---------------------------------------------------------------------------------------------- formatting

def f(x, spec=".2f", none="-"):
    if x is None or x == "":
        return none
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def tokens_k(S) -> str:
    """A token count in thousands as the tables write it: 65536 -> "64K"."""
    return f"{int(S) // 1024}K"


def label(v: str) -> str:
    return VARIANT_LABELS.get(v, f"`{v}`")


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# ---------------------------------------------------------------------------------------------- renderers
# each: (entry, plots) -> markdown lines; ``plots`` collects (png name, draw function) to write

def r_topk_op(e, plots):
    out = ["The op, bf16 and FP8, ms:", ""]
    rows = []
    for t in e["data"]["topk"]:
        rows.append([tokens_k(t["S"]), f(t.get("tilelang_ms")), f(t.get("fp8_ms")), f(t.get("fp8_speedup"), ".3f"),
                     f"{f(t.get('fp8_id_overlap_mean'), '.3f')} / {f(t.get('fp8_id_overlap_min'), '.3f')}"])
    out += table(["S", "bf16 op", "FP8 op", "FP8 speedup", "FP8 vs bf16 ID overlap (mean / worst row)"], rows)
    kernels = [[tokens_k(t["S"])] + [f(_kernel_ms(t, k)) for k in ("indexer_logits_kernel", "topk_select_kernel")]
               for t in e["data"]["topk"] if t.get("fp8_kernels")]
    if kernels:
        out += ["The FP8 op's kernels (CUDA profiler), ms:", ""]
        out += table(["S", "logits kernel", "select kernel"], kernels)
    if not any(t.get("fp8_variants_ms") for t in e["data"]["topk"]):
        return out
    out += ["FP8 op variants, ms (medians of the rounds; back to back: calls queued without a synchronisation "
            "between them, as in a training step):", ""]
    rows = []
    for t in e["data"]["topk"]:
        for v, ms in t.get("fp8_variants_ms", {}).items():
            k = t.get("fp8_variants_kernels_ms", {}).get(v, {})
            rows.append([tokens_k(t["S"]), label(v), f(ms), f(t.get("fp8_variants_back_to_back_ms", {}).get(v)),
                         f"{f(k.get('indexer_logits_kernel'))} + {f(k.get('topk_select_kernel'))}",
                         f(t.get("fp8_variants_peak_gib", {}).get(v)),
                         f(t.get("fp8_variants_same_ids_rows", {}).get(v), ".5f")])
    out += table(["S", "variant", "synchronised", "back to back", "kernels: logits + select", "peak GiB",
                  "rows with the default's ID set"], rows)
    name = "topk_op_h200.png"
    plots.append((name, lambda path: plot_topk(e["data"], path)))
    return out + [f"![FP8 op per variant]({'results/' + name})", ""]


def _kernel_ms(t: dict, name: str):
    return next((k["ms"] for k in t["fp8_kernels"] if k["name"] == name), None)


def r_logits_sweep(e, plots):
    rows = []
    for s in e["data"]["logits_sweep"]:
        opts = ", ".join(f"{k}={s[k]}" for k in ("epilogue", "min_blocks", "block_N", "num_stages") if k in s)
        rows.append([tokens_k(s["S"]), f"`{s['config']}`", opts or "-", s.get("dtype"), f(s.get("ms")),
                     f(s.get("tflops"), ".0f"), f(s.get("max_rel_diff"), ".1e")])
    return table(["S", "config", "options", "dtype", "ms", "TFLOP/s", "max rel. diff"], rows)


def r_select_sweep(e, plots):
    rows = []
    for s in e["data"]["logits_sweep"]:
        rows.append([tokens_k(s["S"]), f"`{s['config']}`", f(s.get("direct_rank")), f(s.get("candidates"), "d"),
                     f(s.get("threads"), "d"), f(s.get("ms")), f(s.get("same_set_rows"), ".4f")])
    return table(["S", "config", "direct_rank", "candidates", "threads", "ms", "rows with the default's set"], rows)


def r_topk_host(e, plots):
    rows = []
    for h in e["data"]["host"]:
        rows.append([tokens_k(h["S"]), " / ".join(f(x) for x in h["returns_ms"]),
                     " / ".join(f(x) for x in h["done_ms"]), f(h.get("logits_launch_ms"), ".3f"),
                     f(h.get("select_launch_ms"), ".3f")])
    return table(["S", "host returns after, ms (per call)", "GPU done after, ms", "logits launch, host ms",
                  "select launch, host ms"], rows)


def _kv(row: dict, skip=()) -> list[list]:
    return [[f"`{k}`", f(v, ".4g") if isinstance(v, float) else f(v, "d") if isinstance(v, int) else f(v)]
            for k, v in row.items() if k not in skip and not isinstance(v, (list, dict))]


def r_sparse_mla(e, plots):
    out = []
    for row in e["data"]["sparse_mla"]:
        out += [f"S={tokens_k(row['S'])}, {row['heads']} heads, top-k {row['topk']} (ms, TFLOP/s, TB/s):", ""]
        out += table(["field", "value"], _kv(row, skip=("S", "heads", "topk")))
    return out


def r_experts(e, plots):
    out = []
    for row in e["data"]["experts"]:
        out += [f"{row['rows']} rows ({tokens_k(row['S'])} tokens x top-8) over {row['experts']} experts, "
                f"{row['hidden']} -> {row['width']}:", ""]
        bf, fp = row["bf16_fwd_ms"] + row["bf16_bwd_ms"], row["fp8_fwd_ms"] + row["fp8_bwd_ms"]
        out += table(["", "forward ms", "backward ms", "forward TFLOP/s", "backward TFLOP/s"],
                     [["bf16", f(row["bf16_fwd_ms"]), f(row["bf16_bwd_ms"]), f(row["bf16_fwd_tflops"], ".0f"),
                       f(row["bf16_bwd_tflops"], ".0f")],
                      ["FP8", f(row["fp8_fwd_ms"]), f(row["fp8_bwd_ms"]), f(row["fp8_fwd_tflops"], ".0f"),
                       f(row["fp8_bwd_tflops"], ".0f")],
                      ["bf16 / FP8", f(row["bf16_fwd_ms"] / row["fp8_fwd_ms"], ".2f") + "x",
                       f(row["bf16_bwd_ms"] / row["fp8_bwd_ms"], ".2f") + "x",
                       f"forward+backward {f(bf / fp, '.2f')}x", ""]])
        if "fp8_gemms_only_fwd_ms" in row:
            out += [f"The FP8 GEMMs alone: {f(row['fp8_gemms_only_fwd_ms'])} ms forward.", ""]
        if row.get("fp8_fwd_profile"):
            out += ["FP8 forward, kernels:", ""]
            out += table(["kernel", "ms", "calls"], [[f"`{k['name'][:60]}`", f(k["ms"]), k["calls"]]
                                                      for k in row["fp8_fwd_profile"]])
    return out


LAYER_COLS = ("step_ms_median", "peak_allocated_gib", "topk_bwd_runs_per_step", "loss")


def r_layer(e, plots):
    d = e["data"]
    prec = ", ".join(f"{k}={d[k]}" for k in ("fp8", "fp8_experts", "fp8_indexer") if k in d)
    out = [f"{d.get('preset')} preset ({prec}), {d.get('steps')} timed steps after {d.get('warmup')} warm-up; "
           "step = median fwd+bwd ms; ratio = variant / `full_recompute` (control).", ""]
    rows = []
    for S, entry in sorted(d["seq"].items(), key=lambda kv: int(kv[0])):
        vs = entry["variants"]
        ctrl = vs.get("full_recompute", {}).get("step_ms_median")
        tk = entry.get("topk", {}).get("topk_fwd_ms")
        for v, m in vs.items():
            if "step_ms_median" not in m:
                rows.append([tokens_k(S), f"`{v}`", m.get("status", "-"), "", "", "", ""])
                continue
            ratio = f(m["step_ms_median"] / ctrl, ".3f") if ctrl else "-"
            rows.append([tokens_k(S), f"`{v}`", f(m["step_ms_median"], ".1f"), ratio, f(m.get("peak_allocated_gib")),
                         m.get("topk_bwd_runs_per_step", "-"), f(m.get("loss"), ".5f")])
        if ctrl and tk is not None:
            rows.append([tokens_k(S), "limit (control - top-k fwd) / control", "", f((ctrl - tk) / ctrl, ".3f"), "",
                         "", ""])
    out += table(["S", "variant", "step ms", "/ control", "peak GiB", "bwd top-k runs", "loss"], rows)
    tks = [[tokens_k(S), f(en["topk"].get("topk_fwd_ms")), f(en["topk"].get("saved_ids_bytes", 0) / 2 ** 20, ".0f")]
           for S, en in sorted(d["seq"].items(), key=lambda kv: int(kv[0])) if en.get("topk")]
    if tks:
        out += ["One top-k forward, ms, and the IDs it saves, MiB:", ""] + table(["S", "top-k fwd", "IDs MiB"], tks)
    comp = [[f"`{v}`", tokens_k(c.get("at_S", 0)), "cold" if c.get("cold_caches") else "shared",
             f(c.get("compile_s"), ".1f"), c.get("graph_breaks"), c.get("unique_graphs"), f(c.get("fullgraph"))]
            for rows_ in (d.get("compile", {}), d.get("compile_merged_runs", {})) for v, c in rows_.items()]
    if comp:
        out += ["Compile (first step minus a steady step, s):", ""]
        out += table(["variant", "at S", "caches", "compile s", "graph breaks", "graphs", "fullgraph"], comp)
    mtp = [[tokens_k(S), f"`{v}`", f(m.get("step_ms_median"), ".1f"), f(m.get("peak_allocated_gib")),
            m.get("topk_bwd_runs_per_step", "-")]
           for S, en in sorted(d.get("mtp", {}).items(), key=lambda kv: int(kv[0])) for v, m in en.items()]
    if mtp:
        out += ["MTP layer (takes the main layer's top-k IDs):", ""]
        out += table(["S", "variant", "step ms", "peak GiB", "bwd top-k runs"], mtp)
    if e["meta"].get("plot") == "layer":
        name = e["name"].replace(".json", ".png")
        plots.append((name, lambda path: plot_layer(d, path)))
        out += [f"![step time / control against S](results/{name})", ""]
    if e["meta"].get("plot") == "frontier":
        out += ["Plot: see the 16-layer frontier below (both in one figure).", ""]
    return out


def r_layer_profile(e, plots):
    d = e["data"]
    out = [f"`{d['variant']}` at S={tokens_k(d['S'])}: {f(d['step_ms_profiled'], '.1f')} ms profiled, "
           f"{f(d['kernel_ms_total'], '.1f')} ms of kernels.", ""]
    tot = d["kernel_ms_total"]
    out += table(["group", "ms", "share"], [[g, f(ms, ".1f"), f(100 * ms / tot, ".0f") + "%"]
                                             for g, ms in sorted(d["groups_ms"].items(), key=lambda kv: -kv[1])])
    if d.get("top_kernels"):
        out += ["Top kernels:", ""]
        out += table(["kernel", "ms", "calls"], [[f"`{k['name'][:70]}`", f(k.get("ms"), ".1f"), k.get("calls", "-")]
                                                  for k in d["top_kernels"][:10]])
    return out


def r_model(e, plots):
    d = e["data"]
    a = d.get("args", {})
    out = [f"{a.get('layers')} layers, S={tokens_k(a.get('seq', 0))}, {a.get('steps')} timed steps after "
           f"{a.get('warmup')} warm-up; median step in s.", ""]
    vs = d["variants"]
    ctrl = vs.get("control", {}).get("step_ms_median")
    rows = []
    for v, m in vs.items():
        if "step_ms_median" not in m:  # a variant that did not run through: its status and error
            rows.append([f"`{v}`", {"oom": "out of memory"}.get(m.get("status"), m.get("status", "failed"))] + ["-"] * 7)
            continue
        off = m.get("offload", {})
        rows.append([f"`{v}`", f(m["step_ms_median"] / 1e3), f(m["step_ms_median"] / ctrl, ".3f") if ctrl else "-",
                     f(m.get("peak_allocated_gib")), f(m.get("peak_reserved_gib")),
                     f(off.get("gib_per_step_each_way"), ".1f"),
                     f(100 * off["prefetched_share"], ".1f") + "%" if off.get("gib_per_step_each_way") else "-",
                     m.get("bw_topk_runs_first_step", "-"), f(m.get("loss"), ".4f")])
    out += table(["variant", "step s", "/ control", "peak GiB", "peak reserved GiB", "host GiB per step (each way)",
                  "reloads prefetched", "bwd top-k runs", "loss"], rows)
    out += [line for v, m in vs.items() if "step_ms_median" not in m and m.get("error")
            for line in (f"`{v}`: {m['error']}", "")]
    profiled = {v: m["profile"] for v, m in vs.items() if m.get("profile")}
    if profiled:
        kinds = sorted({k for p in profiled.values() for k in p["kernel_ms_by_kind"]})
        out += ["One profiled step more (`--profile`), from its CUDA timeline, s: kernel time by kind, the time "
                "some kernel ran, the copies each way and how much of them no kernel ran beside.", ""]
        out += table(["variant"] + kinds + ["kernels busy", "copies HtoD / DtoH", "not hidden HtoD / DtoH"],
                     [[f"`{v}`"] + [f(p["kernel_ms_by_kind"].get(k, 0) / 1e3) for k in kinds]
                      + [f(p["kernel_busy_ms"] / 1e3), f"{f(p['copy_ms']['HtoD'] / 1e3)} / {f(p['copy_ms']['DtoH'] / 1e3)}",
                         f"{f(p['copy_not_hidden_ms']['HtoD'] / 1e3)} / {f(p['copy_not_hidden_ms']['DtoH'] / 1e3)}"]
                      for v, p in profiled.items()])
    why = {v: p["idle_over_1ms"] for v, p in profiled.items() if p.get("idle_over_1ms", {}).get("largest_why")}
    for v, idle in why.items():
        out += [f"`{v}`, the profiled step's largest GPU idle gaps ({idle['count']} over 1 ms, "
                f"{f(idle['ms'], '.0f')} ms in all): when each began (ms from the step's first kernel), the kernel that ended it and how long "
                "before it ran it was launched (little: the host was late; much: the stream waited on another), the "
                "innermost host ranges open on the launching thread through most of the gap, its CUDA calls "
                "over 0.1 ms (launches aside), and where its time in the gap went (by name: how many, own ms).", ""]
        out += table(["gap ms", "at ms", "next kernel", "launched ms before", "host ranges (innermost first)",
                      "host CUDA calls", "inside the gap"],
                     [[f(g, ".1f"), f(at, ".0f"), f(w["next_kernel"][:48]), f(w["launched_ms_before_start"], ".2f"),
                       f("; ".join(n[:56] for n, _ in w["host_ranges"][:3])),
                       f(", ".join(f"{n} {ms:.1f} ms" for n, ms in w["host_syncs"])),
                       f(", ".join(f"{n[:40]} x{c} {ms:.1f} ms" for n, c, ms in w.get("host_work", [])[:3]))]
                      for (g, at), w in zip(idle["largest_ms_at"], idle["largest_why"])])
    timed = {v: m["placements"] for v, m in vs.items()
             if m.get("placements") and "d2h_ms_measured" in m["placements"][0]}
    for v, regions in timed.items():
        timed_steps = "backward_ms_measured" in regions[0]
        out += [f"`{v}`, where its last timed step put each region's values: GiB on the device and the host, the "
                "copy time the plan's cost model expected each way beside the copies' own, measured on their "
                "streams (ms), and the reloads its backward waited for"
                + (("; and each region's forward and backward as the cost model expected them (its compiled "
                    "graphs' ops) and as they ran (ms, from timing events on the compute stream: a forward from "
                    "the region before's end, a backward from its first reload to the next region's). A region's "
                    "reloads are issued during the backward of the region after it, and hide when their H2D time "
                    "is well under that one's backward") if timed_steps else "") + ".", ""]

        def pair(r, way):
            return f"{f(r.get(f'{way}_ms_expected'), '.1f')} / {f(r.get(f'{way}_ms_measured'), '.1f')}"

        out += table(["region", "device GiB", "host GiB", "copy ms expected", "D2H ms measured", "H2D ms measured",
                      "reloads waited"]
                     + (["forward ms expected / measured", "backward ms expected / measured"] if timed_steps else []),
                     [[r["region"], f(r["device_bytes"] / 2 ** 30), f(r["host_bytes"] / 2 ** 30),
                       f(r["copy_ms_expected"], ".1f"), f(r["d2h_ms_measured"], ".1f"), f(r["h2d_ms_measured"], ".1f"),
                       r["reloads_waited"]] + ([pair(r, "forward"), pair(r, "backward")] if timed_steps else [])
                      for r in regions])
    phased = {v: m["memory_phases"] for v, m in vs.items() if m.get("memory_phases")}
    if phased:
        names = list(phased)
        phases = [p["phase"] for p in phased[names[0]] if "backward" in p["phase"]]
        reserved = all("reserved_peak_gib" in p for v in names for p in phased[v])
        out += ["Peak allocated GiB by phase of one more step (`--memory`), backward phases: the memory allocated as "
                "the phase began / its peak" + (" (the peak reserved)" if reserved else "") +
                "; **bold** where the variant's step peaks.", ""]
        rows = []
        for ph in phases:
            row = [ph]
            for v in names:
                got = {p["phase"]: p for p in phased[v]}.get(ph)
                top = max(p["peak_gib"] for p in phased[v])
                cell = f"{f(got['start_gib'])} / {f(got['peak_gib'])}" if got else "-"
                if got and reserved:
                    cell += f" ({f(got['reserved_peak_gib'])})"
                row.append(f"**{cell}**" if got and got["peak_gib"] == top else cell)
            rows.append(row)
        out += table(["phase"] + [f"`{v}`" for v in names], rows)
    grown = {v: [g for p in ph for g in p.get("segments_added", ())] for v, ph in phased.items()}
    for v, segments in grown.items():
        if not segments:
            continue
        out += [f"`{v}`, each segment of 1 MiB or more the caching allocator asked the driver for in that step "
                "(`--segments`), GiB: the request that needed it, the frame that asked, and the allocator's state "
                "just before: reserved, allocated, freed but awaiting another stream's work, free in its cache, "
                "and the largest free block there.", ""]
        out += table(["phase", "segment", "request", "asked by", "reserved", "allocated", "awaiting free",
                      "cached free", "largest free"],
                     [[g["phase"], f(g["segment_gib"]), f(g["request_gib"]), f"`{f(g['where'])}`", f(g["reserved_gib"]),
                       f(g["allocated_gib"]), f(g["awaiting_free_gib"]), f(g["cached_free_gib"]),
                       f(g["largest_free_gib"])] for g in segments])
    if e["meta"].get("plot") == "frontier":
        layer = [x for x in _ENTRIES if x["meta"].get("plot") == "frontier" and x["meta"]["kind"] == "layer"]
        name = "frontier_h200.png"
        sources = [x["data"] for x in layer] + [d]
        plots.append((name, lambda path: plot_frontier(sources, path)))
        out += [f"![step time against peak memory]({'results/' + name})", "",
                "Plot: " + ", ".join(f"`{x['name']}`" for x in layer + [e]) + " (`benchmarks/plot_frontier.py`).", ""]
    return out


def r_sac_vs_sacpass(e, plots):
    d = e["data"]
    rows = []
    for side in ("pytorch_sac", "sacpass"):
        s = d[side]
        rows.append([f"`{side}`", s["saved"], f(s["total_bytes"] / 2 ** 20, ".1f"), s["recomputed_ops"],
                     ", ".join(f"{k} {f(v / 2 ** 20, '.1f')}" for k, v in sorted(s["by_reason"].items()))])
    out = table(["", "saved tensors", "saved MiB", "recomputed ops", "MiB by reason"], rows)
    return out + [f"Recomputed by one and not the other: {len(d['recomputed_diff_sac_vs_sacpass'])} ops; saved by "
                  f"PyTorch SAC only: {len(d['only_sac_saves'])}, by sacpass only: {len(d['only_sacpass_saves'])}.", ""]


def r_router_drift(e, plots):
    d = e["data"]
    return table(["field", "value"], _kv(d, skip=("what",)) +
                 [["`config`", ", ".join(f"{k}={v}" for k, v in d.get("config", {}).items())]])


def _beside_copies(d: dict, field: str, columns: tuple[str, ...], header: list[str]) -> list[str]:
    """A probe's ``"<copy mode>/<column>"`` entries as a row per copy mode: each column's ``field`` and the
    copy's GB/s (none without a copy)."""
    modes = dict.fromkeys(k.split("/")[0] for k in d if "/" in k)
    rows = [[f"`{m}`"] + [f(d[f"{m}/{c}"][field]) for c in columns] +
            [f(d[f"{m}/{columns[0]}"]["copy_gb_s"]) if m != "none" else "-"] for m in modes]
    return table(header + ["copy GB/s"], rows)


def r_host_read(e, plots):
    return _beside_copies(e["data"], "read_ms", ("tolist", "kernel_into_pinned"),
                          ["copy beside the read", "`tolist()` ms", "kernel into pinned ms"])


def r_host_pace(e, plots):
    return _beside_copies(e["data"], "work_ms", ("launches", "python"),
                          ["copy beside the work", "launch loop ms", "pure Python ms"])


NCU_METRICS = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "Issue Slots Busy",
               "Executed Ipc Elapsed", "Registers Per Thread", "Achieved Occupancy")


def parse_ncu(text: str) -> list[dict]:
    """Each profiled launch in an Nsight Compute text report: its kernel and the first value of each metric."""
    launches = []
    for line in text.splitlines():
        m = re.match(r"^  (\w+) \((\d+), \d+, \d+\)x\((\d+), \d+, \d+\)", line)
        if m:
            launches.append({"kernel": m.group(1), "grid": m.group(2), "block": m.group(3)})
            continue
        m = re.match(r"^    (\S.*?\S)\s{2,}(\S+)\s+([\d.,]+)\s*$", line)
        if m and launches and m.group(1) in NCU_METRICS and m.group(1) not in launches[-1]:
            launches[-1][m.group(1)] = f"{m.group(3)} {m.group(2)}"
    return launches


def r_ncu(e, plots):
    with open(e["file"]) as fh:
        launches = parse_ncu(fh.read())
    configs = e["meta"].get("launches", [])
    rows = [[i + 1, configs[i] if i < len(configs) else "-", f"`{L['kernel']}`", f"{L['grid']} x {L['block']}"] +
            [f(L.get(k)) for k in NCU_METRICS] for i, L in enumerate(launches)]
    return (table(["launch", "config", "kernel", "grid x block"] + list(NCU_METRICS), rows) +
            [f"The full report: [`benchmarks/results/{e['name']}`](../benchmarks/results/{e['name']}).", ""])


RENDER = {"topk_op": r_topk_op, "logits_sweep": r_logits_sweep, "select_sweep": r_select_sweep,
          "topk_host": r_topk_host, "ncu": r_ncu, "sparse_mla": r_sparse_mla, "experts": r_experts,
          "layer": r_layer, "layer_profile": r_layer_profile, "model": r_model,
          "sac_vs_sacpass": r_sac_vs_sacpass, "router_drift": r_router_drift, "host_read": r_host_read,
          "host_pace": r_host_pace}
_ENTRIES: list[dict] = []


# ---------------------------------------------------------------------------------------------- plots

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    fig.clf()
    _plt().close(fig)


def plot_layer(d: dict, path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    seqs = sorted(d["seq"].items(), key=lambda kv: int(kv[0]))
    names = sorted({v for _, en in seqs for v in en["variants"]})
    for v in names:
        pts = [(int(S), en["variants"][v]["step_ms_median"] / en["variants"]["full_recompute"]["step_ms_median"])
               for S, en in seqs if "step_ms_median" in en["variants"].get(v, {})
               and "step_ms_median" in en["variants"].get("full_recompute", {})]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=v)
    lim = [(int(S), 1 - en["topk"]["topk_fwd_ms"] / en["variants"]["full_recompute"]["step_ms_median"])
           for S, en in seqs if en.get("topk") and "step_ms_median" in en["variants"].get("full_recompute", {})]
    if lim:
        ax.plot([p[0] for p in lim], [p[1] for p in lim], "k--", label="limit")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel("step time / full recompute")
    ax.set_title(f"bench layer fwd+bwd, {d['meta']['machine']}, torch {d['meta']['torch']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_topk(d: dict, path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, len(d["topk"]), figsize=(3.2 * len(d["topk"]), 3.6), squeeze=False)
    for ax, t in zip(axes[0], d["topk"]):
        vs = list(t.get("fp8_variants_ms", {}))
        logits = [t["fp8_variants_kernels_ms"][v]["indexer_logits_kernel"] for v in vs]
        select = [t["fp8_variants_kernels_ms"][v]["topk_select_kernel"] for v in vs]
        call = [t["fp8_variants_ms"][v] for v in vs]
        xs = range(len(vs))
        ax.bar(xs, logits, label="logits kernel")
        ax.bar(xs, select, bottom=logits, label="select kernel")
        ax.scatter(xs, call, color="k", zorder=3, label="synchronised call")
        ax.set_xticks(list(xs), list(vs), fontsize=8)
        ax.set_title(f"FP8 op, S={tokens_k(t['S'])}", fontsize=9)
        ax.set_ylabel("ms")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower center")
    _save(fig, path)


def _pf():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import plot_frontier
    return plot_frontier


def plot_frontier(sources: list[dict], path: str) -> None:
    pf = _pf()
    pf.draw(pf.panels(sources), path)


def model_against_control(entries: list[dict], plots: list) -> list[str]:
    """The page's summary of the whole-model measurements: every bench_model row as a share of its own file's
    control (step, peak allocated, peak reserved), a table per model shape and one plot."""
    pf = _pf()
    sources = [(e["name"], e["data"]) for e in entries if e["meta"]["kind"] == "model" and e["data"]]
    groups = pf.against_control(sources)
    if not groups:
        return []
    name = "model_against_control_h200.png"
    plots.append((name, lambda path: pf.draw_against_control(groups, path)))
    out = ["## The whole model against full recompute", "",
           "Every whole-model row (`benchmarks/bench_model.py`) beside the full recompute (`control`) measured in "
           "its own file: its step time, peak allocated and peak reserved GiB as shares of that control's, fastest "
           "first. Rows measured at different times compare through their controls. `exact`: the backward reads "
           "the forward's values bit for bit; `FP8-packed` / `INT8-packed`: ModelPlan(compress=\"fp8\" / "
           "\"int8\") sends the floating values to the host as float8 e4m3 / int8 with per-128 scales (lossy). The "
           "plot leaves out the rows run under another allocator configuration.", ""]
    for (layers, seq), rows in groups.items():
        out += [f"{layers} layers, S={tokens_k(seq)}:", ""]
        out += table(["variant", "file", "step / control", "allocated / control", "reserved / control", "values",
                      "allocator", "loss - control's"],
                     [[f"`{r['variant']}`", f"`{r['file']}`",
                       f(r["step"], ".3f") if r["status"] == "ok" else {"oom": "out of memory"}.get(r["status"], r["status"]),
                       f(r["allocated"], ".3f"), f(r["reserved"], ".3f"),
                       f"{r['packing']}-packed" if r["lossy"] else "exact",
                       f(r["allocator"]), f(r["loss_diff"], "+.4f")] for r in rows])
        for memory in ("allocated", "reserved"):
            note = pf.solver_note_against_control(rows, memory)
            if note:
                out += [f"Peak {memory}, default allocator: " + "; ".join(note) + ".", ""]
    out += [f"![every whole-model row against its control](results/{name})", "",
            "Plot: `python3 benchmarks/plot_frontier.py --against-control "
            + " ".join(f"benchmarks/results/{n}" for n in sorted({r["file"] for rows in groups.values() for r in rows}))
            + f" --out docs/results/{name}`.", ""]
    return out


# ---------------------------------------------------------------------------------------------- the page

def short(sha: str) -> str:
    return sha[:10]


def render(entries: list[dict]) -> tuple[str, list]:
    _ENTRIES[:] = entries
    plots: list = []
    lines = ["# Results", "",
             f"Generated by `{REGEN}` from the files in `benchmarks/results/`: do not edit by hand; "
             f"`{REGEN} --check` (run by `tests/test_results_page.py`) fails when this page and the files differ. "
             "Each section names its file, the command that reproduces it (from the repository root), the commit "
             "that recorded it and where it ran; a command's options are those of the scripts at that commit. A "
             "measurement taken again replaces its file (git keeps the old one).", ""]
    lines += ["| measurement | file | machine | date |", "|---|---|---|---|"]
    for e in entries:
        anchor = re.sub(r"[^a-z0-9 -]", "", e["meta"]["title"].lower()).replace(" ", "-")
        lines.append(f"| [{e['meta']['title']}](#{anchor}) | `{e['name']}` | {e['meta']['machine']} | "
                     f"{e['meta'].get('date', '-')} |")
    lines.append("")
    lines += model_against_control(entries, plots)
    for e in entries:
        m = e["meta"]
        lines += [f"## {m['title']}", "", m["about"], ""]
        lines += RENDER[m["kind"]](e, plots)
        if m.get("kept"):
            lines += [f"Kept from the command's output: {m['kept']}.", ""]
        cmds = m["command"] if isinstance(m["command"], list) else [m["command"]]
        lines += ["Reproduce" + (" (in this order; the later commands merge into the file):" if len(cmds) > 1 else ":"),
                  "", "```", *cmds, "```", ""]
        if m.get("command_note"):
            lines += [f"Note: {m['command_note']}.", ""]
        lines += [f"File `benchmarks/results/{e['name']}`; commit `{short(m['commit'])}` ({m.get('date', '-')}); "
                  f"{m['machine']}, torch {m['torch']}, TileLang {m['tilelang']}, CUDA {m['cuda']}"
                  + (f", Python {m['python']}" if m.get("python") else "") + ".", ""]
    return "\n".join(lines).rstrip("\n") + "\n", plots


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/results.md is out of date")
    p.add_argument("--results", default=RESULTS, help=argparse.SUPPRESS)
    p.add_argument("--page", default=PAGE, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        text, plots = render(load(args.results))
    except (ResultsError, KeyError, ValueError) as exc:
        print(f"results_page: {exc}", file=sys.stderr)
        return 2
    plot_dir = os.path.join(os.path.dirname(args.page), "results")
    if args.check:
        try:
            with open(args.page) as fh:
                current = fh.read()
        except FileNotFoundError:
            current = None
        missing = [n for n, _ in plots if not os.path.exists(os.path.join(plot_dir, n))]
        if current != text or missing:
            what = "is missing plots " + ", ".join(missing) if current == text else "differs from benchmarks/results/"
            print(f"results_page: {os.path.relpath(args.page, ROOT)} {what}: run `{REGEN}` and commit the result",
                  file=sys.stderr)
            return 1
        return 0
    os.makedirs(plot_dir, exist_ok=True)
    for name, draw in plots:
        draw(os.path.join(plot_dir, name))
    for stale in sorted(os.listdir(plot_dir)):
        if stale.endswith(".png") and stale not in {n for n, _ in plots}:
            os.remove(os.path.join(plot_dir, stale))
    with open(args.page, "w") as fh:
        fh.write(text)
    print(os.path.relpath(args.page, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
