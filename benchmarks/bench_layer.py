"""Layer benchmark: one GLM-5.2 MoE decoder layer (full top-k, FP8), forward+backward, five variants.

    python3 benchmarks/bench_layer.py --seq 4096,8192,16384,32768,65536 --out benchmarks/results/bench_layer_h200.json
    python3 benchmarks/bench_layer.py --device cpu --preset tiny --seq 128 --steps 2     # smoke test

Variants (one process, the same weights and the same inputs for every variant):

- ``no_ac``          no checkpoint, ``torch.compile(fullgraph=True)`` (upper bound on speed);
- ``full_recompute`` the control: the backward replays the whole forward, the DSA top-k included.
                     ``checkpoint(..., context_fn=<PyTorch SAC contexts, always PREFER_RECOMPUTE>)`` compiled with
                     plain Inductor: what torch >= 2.13 runs for a plain checkpoint. (Up to torch 2.12 a plain
                     checkpoint under compile leaves the ops inside custom autograd.Functions untagged, so the
                     FP8 linears' GEMMs and quantisations were saved, not recomputed: ``plain_ac`` below.)
- ``island``         the public workaround: the top-k call wrapped in ``torch._dynamo.disable`` (the
                     indexer's call site is swapped for this variant only) and kept by an eager
                     selective-checkpoint policy; compiled without ``fullgraph`` (it must graph-break);
- ``pytorch_sac``    ``checkpoint(..., context_fn=create_selective_checkpoint_contexts([dsa_topk_indices]))``
                     under ``torch.compile(fullgraph=True)``;
- ``sacpass``        the model's own ``checkpoint`` call, compiled with ``sacpass.backend()`` (Inductor).
- ``plain_ac``       (not run by default) the model's own plain ``checkpoint`` call under plain Inductor: equal
                     to the control on torch >= 2.13, a partly selective checkpoint on older ones (see above).

Every compiled variant marks the token dim dynamic (``torch._dynamo.maybe_mark_dynamic``), so one compile
serves every sequence length. Per variant and length: median step time over ``--steps`` steps after
``--warmup`` steps (CUDA events around each fwd+bwd), peak allocated / reserved memory, compile time (first
step minus a steady step), graph breaks, compiled graphs, top-k executions in forward and backward, loss.
The top-k op alone (and the whole indexer forward) is timed at each length, so the table shows
limit(S) = (control - top-k fwd) / control. Results are written after every measurement (JSON), then a
markdown table and a PNG plot of step time / control versus S.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import math
import os
import platform
import statistics
import struct
import sys
import time
import types
import zlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sacpass  # noqa: E402
from glm52_model import GLM52Config  # noqa: E402
from glm52_model.model import DecoderLayer, init_weights, packed_ranges  # noqa: E402
from glm52_model.ops.dsa_topk import topk_calls  # noqa: E402
from sacpass.passes.checkpoint_regions import always_recompute_context_fn  # noqa: E402

TOPK_OP = torch.ops.glm52.dsa_topk_indices.default
VARIANTS = ("no_ac", "full_recompute", "island", "pytorch_sac", "sacpass", "plain_ac")
RUN_ORDER = ("full_recompute", "sacpass", "pytorch_sac", "island", "no_ac")   # sacpass compiles before SAC
CONTROL = "full_recompute"


# ------------------------------------------------------------------------------------------ the layer
def build_layer(cfg: GLM52Config, device: torch.device, dtype: torch.dtype, compute_topk: bool = True,
                seed: int = 0) -> DecoderLayer:
    """One MoE decoder layer initialised with ``glm52_model.model.init_weights`` (as the model is)."""
    torch.manual_seed(seed)
    with torch.device(device):
        layer = DecoderLayer(cfg, 0, compute_topk=compute_topk, moe=True)
    init_weights(layer, cfg.init_std)
    return layer.to(dtype)


def _island_indexer_forward(self, x, q_latent, cos, sin, starts, ends):
    """``Indexer.forward`` with the top-k op call moved out of the compiled graph (the eager island).
    Mirrors glm52_model.model.Indexer.forward line for line except for the call."""
    T = x.shape[0]
    q = self._rope(self.wq_b(q_latent).view(T, self.n_heads, self.head_dim), cos, sin)
    k = self._rope(self.k_norm(self.wk(x)), cos, sin)
    w = self.weights_proj(x).float() * self.n_heads ** -0.5
    return _island_topk(q, k, w, starts, ends, self.topk, self.head_dim ** -0.5)


@torch._dynamo.disable
def _island_topk(q, k, w, starts, ends, topk, scale):
    return torch.ops.glm52.dsa_topk_indices(q, k, w, starts, ends, topk, scale)


def _save_topk_context():
    return create_selective_checkpoint_contexts([TOPK_OP])


class CheckpointLayer(torch.nn.Module):
    """checkpoint(layer, context_fn=...) placed by hand around a layer whose own checkpoint is off:
    PyTorch SAC (save the top-k op) or the control (recompute every op)."""

    def __init__(self, layer, context_fn):
        super().__init__()
        self.layer, self.context_fn = layer, context_fn

    def forward(self, *args):
        return checkpoint(self.layer, *args, use_reentrant=False, context_fn=self.context_fn)


class _IslandLayer:
    """The eager island: an eager selective checkpoint (saving the top-k) around the compiled layer."""

    def __init__(self, compiled_layer):
        self.compiled_layer = compiled_layer

    def __call__(self, x, positions, starts, ends):
        return checkpoint(self.compiled_layer, x, positions, starts, ends, use_reentrant=False,
                          context_fn=_save_topk_context)


class Variant:
    """A compiled (or eager) fwd function over one private copy of the layer."""

    def __init__(self, name: str, base: DecoderLayer, device_type: str, dynamic: bool, backend: str = "inductor"):
        self.name, self.dynamic = name, dynamic
        self.layer = layer = copy.deepcopy(base)
        self.backend, self.backend_name, self.fullgraph = None, backend, True
        if name == "eager":
            layer.recompute = True
            self.fn = layer
            return
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")
        if name == "sacpass":
            self.backend = sacpass.backend(inner="inductor" if backend == "inductor" else "aot_eager")
            self.backend_name = f"sacpass({self.backend.inner})"
        else:
            self.backend = backend
        if name in ("no_ac", "plain_ac", "sacpass"):
            layer.recompute = name != "no_ac"                                  # the model's own checkpoint call
            self.fn = torch.compile(layer, backend=self.backend, fullgraph=True)
        elif name in (CONTROL, "pytorch_sac"):
            layer.recompute = False                                             # the checkpoint is placed here
            ctx = always_recompute_context_fn if name == CONTROL else _save_topk_context
            self.fn = torch.compile(CheckpointLayer(layer, ctx), backend=self.backend, fullgraph=True)
        else:  # island
            # compile(checkpoint(layer)) with a graph break inside the checkpoint body runs the WHOLE body
            # eagerly (measured: 0 compiled graphs), so the island is built the way the workaround is used:
            # an eager selective checkpoint around the compiled layer, whose top-k call is swapped for a
            # torch._dynamo.disable'd one (graph breaks there); the eager SAC cache keeps its output.
            layer.recompute = False
            ind = layer.attn.indexer
            ind.forward = types.MethodType(_island_indexer_forward, ind)
            self.fullgraph = False
            self.fn = _IslandLayer(torch.compile(layer, backend=self.backend, fullgraph=False))

    def __call__(self, x, positions, starts, ends, topk_ids=None):
        if self.dynamic:
            for t in (x, positions, starts, ends, topk_ids):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        if topk_ids is None:
            return self.fn(x, positions, starts, ends)
        return self.fn(x, positions, starts, ends, topk_ids)


@contextlib.contextmanager
def cold_compile_caches():
    """A fresh Inductor + Triton cache dir and fresh compile workers: compile times of variants that
    produce the same graphs (SAC and sacpass) are comparable only when neither reuses the other's."""
    from torch._inductor.async_compile import shutdown_compile_workers
    from torch._inductor.utils import fresh_cache
    shutdown_compile_workers()
    with fresh_cache():
        yield
    shutdown_compile_workers()


# ------------------------------------------------------------------------------------------- measuring
class Clock:
    """CUDA events on CUDA, perf_counter (after nothing to sync) on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed_ms(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b)
        return (b - a) * 1e3


def make_inputs(S: int, cfg: GLM52Config, device, dtype, seed: int = 1):
    g = torch.Generator(device="cpu").manual_seed(seed + S)
    x = torch.randn(S, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    cu = torch.tensor([0, S], device=device)
    positions, starts, ends, _ = packed_ranges(cu, S)
    return x, positions, starts, ends


def one_step(v: Variant, x0, positions, starts, ends, topk_ids=None):
    """fwd + bwd; returns (loss tensor, top-k runs in forward, in backward)."""
    v.layer.zero_grad(set_to_none=True)
    x = x0.detach().requires_grad_()
    c0 = topk_calls().count
    out, _ = v(x, positions, starts, ends, topk_ids)
    loss = out.float().square().mean()
    c1 = topk_calls().count
    loss.backward()
    c2 = topk_calls().count
    return loss.detach(), c1 - c0, c2 - c1


def dynamo_counts():
    from torch._dynamo.utils import counters, guard_failures
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": sorted(counters["graph_break"].keys())[:5],
            "unique_graphs": counters["stats"]["unique_graphs"],
            "guard_failures": [str(r)[:400] for reasons in guard_failures.values() for r in reasons]}


def measure(v: Variant, inputs, steps: int, warmup: int, clock: Clock, device, topk_ids=None) -> dict:
    """Warm up (the first call compiles), then time ``steps`` steps."""
    before = dynamo_counts()
    clock.sync()
    t0 = time.perf_counter()
    first_loss, fwd_k, bwd_k = one_step(v, *inputs, topk_ids=topk_ids)
    clock.sync()
    first_s = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        one_step(v, *inputs, topk_ids=topk_ids)
    clock.sync()
    if device.type == "cuda":                     # peaks of the timed steps only (not compile/autotune)
        v.layer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()
    times, fwd_counts, bwd_counts, losses = [], [], [], []
    for _ in range(steps):
        a = clock.start()
        loss, fk, bk = one_step(v, *inputs, topk_ids=topk_ids)
        b = clock.start()
        times.append((a, b))
        fwd_counts.append(fk)
        bwd_counts.append(bk)
        losses.append(loss)
    clock.sync()
    ms = [clock.elapsed_ms(a, b) for a, b in times]
    after = dynamo_counts()
    row = {
        "step_ms_median": statistics.median(ms), "step_ms_min": min(ms), "step_ms_max": max(ms),
        "steps": steps, "first_step_s": first_s,
        "topk_fwd_runs_per_step": max(fwd_counts + [fwd_k]), "topk_bwd_runs_per_step": max(bwd_counts + [bwd_k]),
        "loss": float(losses[-1]), "first_loss": float(first_loss),
        "new_graphs": after["unique_graphs"] - before["unique_graphs"],
        "new_graph_breaks": after["graph_breaks"] - before["graph_breaks"],
        "recompile_reasons": after["guard_failures"][len(before["guard_failures"]):],   # guards that failed
    }
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2 ** 30
        row["peak_allocated_above_weights_gib"] = (torch.cuda.max_memory_allocated() - base_alloc) / 2 ** 30
    return row


def time_topk(layer: DecoderLayer, inputs, clock: Clock, reps: int) -> dict:
    """The top-k op alone, and the whole indexer forward (projections + op), on this layer's real inputs."""
    x, positions, starts, ends = inputs
    attn, ind = layer.attn, layer.attn.indexer
    with torch.no_grad():
        h = layer.attn_norm(x)
        q_latent = attn.q_norm(attn.wq_a(h))
        from glm52_model.model import rope_cos_sin
        cos, sin = rope_cos_sin(positions, attn.rope, attn.rope_theta)
        T = h.shape[0]
        q = ind._rope(ind.wq_b(q_latent).view(T, ind.n_heads, ind.head_dim), cos, sin)
        k = ind._rope(ind.k_norm(ind.wk(h)), cos, sin)
        w = ind.weights_proj(h).float() * ind.n_heads ** -0.5

        def op():
            return torch.ops.glm52.dsa_topk_indices(q, k, w, starts, ends, ind.topk, ind.head_dim ** -0.5)

        def whole():
            return ind(h, q_latent, cos, sin, starts, ends)

        res = {}
        for name, fn in (("topk_fwd_ms", op), ("indexer_fwd_ms", whole)):
            fn()
            clock.sync()
            ts = []
            for _ in range(reps):
                a = clock.start()
                fn()
                b = clock.start()
                clock.sync()
                ts.append(clock.elapsed_ms(a, b))
            res[name] = statistics.median(ts)
        ids = op()
        res["saved_ids_bytes"] = ids.numel() * ids.element_size()
    return res


# ---------------------------------------------------------------------------------------------- output
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
    """The issue's targets, evaluated on this run (met: True / False / None when not measured)."""
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
    lines = [f"# Layer benchmark ({result['preset']} preset, fp8={result['fp8']}, {info.get('gpu', info['device'])})",
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
        lines += ["", "Targets (issue 4):", "", "| target | met | value |", "|---|---|---|"]
        lines += [f"| {t['target']} | {'yes' if t['met'] else 'NO'} | {t['detail']} |" for t in tg]
    if result.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> str:
    """PNG of step time / control vs S (matplotlib when present, else a minimal built-in raster)."""
    rows = [r for r in ratio_rows(result) if r.get("control_ms")]
    series = {v: [(r["S"], r[v]) for r in rows if r.get(v) is not None] for v in VARIANTS}
    series["limit"] = [(r["S"], r["limit"]) for r in rows if r.get("limit") is not None]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raster_plot(series, path)
        return "builtin"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"limit": dict(color="k", ls="--"), "no_ac": dict(color="tab:gray"),
              CONTROL: dict(color="tab:blue"), "island": dict(color="tab:red"),
              "pytorch_sac": dict(color="tab:orange", marker="s"), "sacpass": dict(color="tab:green", marker="o"),
              "plain_ac": dict(color="tab:purple", ls=":")}
    for name, pts in series.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **{"marker": ".", **styles.get(name, {})})
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel("step time / full recompute")
    info = result["env"]
    ax.set_title(f"GLM-5.2 MoE layer fwd+bwd, {info.get('gpu', info['device'])}, torch {info['torch']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"


def _raster_plot(series: dict, path: str, w: int = 480, h: int = 320) -> None:
    """Lines on a white canvas, written as an 8-bit RGB PNG with zlib (no axes text)."""
    img = [[(255, 255, 255)] * w for _ in range(h)]
    pts = [p for s in series.values() for p in s]
    if pts:
        xs = [math.log2(p[0]) for p in pts]
        ys = [p[1] for p in pts]
        x0, x1 = min(xs), max(xs) + 1e-9
        y0, y1 = min(ys + [0.8]), max(ys + [1.05])
        colors = [(128, 128, 128), (31, 119, 180), (214, 39, 40), (255, 127, 14), (44, 160, 44), (0, 0, 0)]

        def px(S, y):
            return (int(20 + (math.log2(S) - x0) / (x1 - x0 + 1e-9) * (w - 40)),
                    int(h - 20 - (y - y0) / (y1 - y0) * (h - 40)))
        for yy in (1.0,):
            _, py = px(2 ** x0, yy)
            for x in range(w):
                img[py][x] = (200, 200, 200)
        for (name, s), col in zip(series.items(), colors):
            s = sorted(s)
            for (a, b) in zip(s, s[1:] + s[-1:]):
                (ax_, ay), (bx, by) = px(*a), px(*b)
                n = max(abs(bx - ax_), abs(by - ay), 1)
                for i in range(n + 1):
                    x, y = ax_ + (bx - ax_) * i // n, ay + (by - ay) * i // n
                    for dx in (-1, 0, 1):
                        for dy in (-1, 0, 1):
                            if 0 <= x + dx < w and 0 <= y + dy < h:
                                img[y + dy][x + dx] = col
    raw = b"".join(b"\x00" + bytes(c for p in row for c in p) for row in img)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--preset", default="bench", choices=("bench", "tiny"))
    p.add_argument("--seq", default="4096,8192,16384,32768,65536", help="comma-separated lengths, small first")
    p.add_argument("--variants", default=",".join(RUN_ORDER), help="run order (caches warm for later ones)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps, the first compiles")
    p.add_argument("--topk-reps", type=int, default=10)
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--backend", default=None, choices=("inductor", "aot_eager"),
                   help="inner compiler of every variant (default: inductor on CUDA, aot_eager on CPU, where "
                        "Inductor's C++ compile of this layer takes minutes per variant)")
    p.add_argument("--static", action="store_true", help="do not mark the token dim dynamic")
    p.add_argument("--warm-caches", action="store_true",
                   help="share Inductor/Triton caches and compile workers between variants (default: every "
                        "variant compiles cold, so identical graphs do not hit a cache a previous variant filled)")
    p.add_argument("--mtp-seq", type=int, default=0, help="also time the MTP layer at this length (0: skip)")
    p.add_argument("--mtp-variants", default=f"{CONTROL},sacpass")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget: a length or variant predicted to overrun it is skipped")
    p.add_argument("--out", default="benchmarks/results/bench_layer.json")
    p.add_argument("--merge", default=None, help="a previous run's JSON to add this run's measurements to")
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_layer: --device cuda but no CUDA device (use --device cpu --preset tiny)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fp8 = not args.no_fp8
    cfg = (GLM52Config.bench if args.preset == "bench" else GLM52Config.tiny)(fp8=fp8, recompute=True)
    if args.preset == "tiny":
        cfg = GLM52Config.tiny(fp8=fp8, recompute=True, num_layers=1, first_k_dense=0, mtp_layers=0)
    seqs = [int(s) for s in args.seq.split(",") if s]
    names = [v for v in args.variants.split(",") if v and v != "none"]
    for v in names:
        if v not in VARIANTS:
            sys.exit(f"bench_layer: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if args.backend is None:
        args.backend = "inductor" if device.type == "cuda" else "aot_eager"
    result_backend = args.backend
    clock = Clock(device)
    out_base = os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result = {"env": env_info(device), "preset": args.preset, "fp8": fp8, "dtype": str(dtype),
              "steps": args.steps, "warmup": args.warmup, "backend": result_backend, "dynamic_tokens": not args.static,
              "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank",
                                                      "index_n_heads", "index_head_dim", "index_topk",
                                                      "num_experts", "num_experts_per_tok", "moe_intermediate_size")},
              "seq": {}, "compile": {}, "mtp": {}, "notes": []}

    if args.merge:
        # a second run that fills lengths/variants the first one had no time for: measurements land in the
        # first run's result (same preset and settings required); the first run's compile rows are kept
        with open(args.merge) as f:
            prev = json.load(f)
        for k in ("preset", "fp8", "steps", "backend", "dynamic_tokens"):
            if prev.get(k) != result.get(k):
                sys.exit(f"bench_layer: --merge {args.merge}: {k}={prev.get(k)!r} differs from this run's {result.get(k)!r}")
        prev.setdefault("runs", [dict(prev["env"])]).append(dict(result["env"]))
        prev["notes"].append(f"merged run: {result['env']['command']} (lengths {args.seq}, variants {args.variants})")
        prev["compile_merged_runs"] = prev.get("compile_merged_runs", {})
        result, merged_compile = prev, prev["compile_merged_runs"]
    else:
        merged_compile = None

    def save():
        result["wall_s"] = time.perf_counter() - t_start
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(out_base + ".md", "w") as f:
            f.write(markdown(result))

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    print(f"bench_layer: {result['env']}", flush=True)
    base = build_layer(cfg, device, dtype)
    print(f"layer params: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M, cfg {result['config']}", flush=True)

    # eager warm-up at the first length: JIT-compiles the TileLang kernels outside any variant's compile time
    eager = Variant("eager", base, device.type, dynamic=False)
    inputs0 = make_inputs(seqs[0], cfg, device, dtype)
    t0 = time.perf_counter()
    l_e, fk, bk = one_step(eager, *inputs0)
    clock.sync()
    result["eager_first_length" if merged_compile is None else "eager_first_length_merged_run"] = {"S": seqs[0], "loss": float(l_e), "first_step_s": time.perf_counter() - t0,
                                    "topk_fwd_runs": fk, "topk_bwd_runs": bk}
    del eager
    print(f"eager S={seqs[0]}: loss {float(l_e):.6g}, fwd/bwd top-k runs {fk}/{bk}, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    # top-k op alone at every length first (one table column; also warms the kernels per length)
    for S in seqs:
        entry = result["seq"].setdefault(str(S), {"variants": {}})
        try:
            entry["topk"] = time_topk(base, make_inputs(S, cfg, device, dtype), clock, args.topk_reps)
        except torch.cuda.OutOfMemoryError as e:
            entry["topk"] = {"status": "oom", "error": str(e)[:200]}
        print(f"S={S} top-k: {entry['topk']}", flush=True)
    save()

    from torch._dynamo.utils import counters
    for i, name in enumerate(names):
        # each variant: a fresh dynamo (no shared code-object caches between variants), one compile at the
        # first length (token dim dynamic), then every length; an equal share of the remaining budget
        share = left() / (len(names) - i) - 5
        caches = contextlib.ExitStack()
        if not args.warm_caches:
            caches.enter_context(cold_compile_caches())
        t_variant = time.perf_counter()
        torch._dynamo.reset()
        counters.clear()
        v = Variant(name, base, device.type, dynamic=not args.static, backend=args.backend)
        prev = None                                                  # (S, step ms) of the last length
        for S in seqs:
            entry = result["seq"][str(S)]
            if prev is not None:
                need = prev[1] * (S / prev[0]) ** 1.5 * (args.steps + args.warmup) / 1e3 * 1.1 + 3
                spent = time.perf_counter() - t_variant
                if need > share - spent:
                    msg = f"{name} S={S} skipped: predicted {need:.0f} s > {share - spent:.0f} s of its budget"
                    print(msg, flush=True)
                    result["notes"].append(msg)
                    entry["variants"][name] = {"status": "skipped (time)"}
                    save()
                    continue
            inputs = make_inputs(S, cfg, device, dtype)
            try:
                m = measure(v, inputs, args.steps, args.warmup, clock, device)
            except torch.cuda.OutOfMemoryError as e:
                m = {"status": "oom", "error": str(e)[:300]}
                v.layer.zero_grad(set_to_none=True)
            del inputs
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            entry["variants"][name] = m
            if "step_ms_median" in m:
                prev = (S, m["step_ms_median"])
            compile_rows = result["compile"] if merged_compile is None else merged_compile
            if name not in compile_rows:
                c = dynamo_counts()
                compile_rows[name] = {
                    "compile_s": m.get("first_step_s", 0) - m.get("step_ms_median", 0) / 1e3,
                    "at_S": S, "graph_breaks": c["graph_breaks"], "graph_break_reasons": c["graph_break_reasons"],
                    "unique_graphs": c["unique_graphs"], "fullgraph": v.fullgraph, "backend": str(v.backend_name)}
                if name == "sacpass" and v.backend.reports:
                    reps = v.backend.reports
                    compile_rows[name]["saved_must_save"] = [
                        {"op": t.op, "shape": list(t.shape), "dtype": t.dtype, "bytes_at_hint": t.bytes}
                        for r in reps for t in r.saved if t.reason == "must-save"]
                    compile_rows[name]["saved_total_bytes_at_hint"] = sum(r.total_bytes for r in reps)
                    compile_rows[name]["violations"] = [x for r in reps for x in r.violations]
            print(f"S={S} {name}: " + json.dumps({k: (round(x, 4) if isinstance(x, float) else x)
                                                  for k, x in m.items() if k != "error"}), flush=True)
            save()
        compile_rows = result["compile"] if merged_compile is None else merged_compile
        compile_rows.setdefault(name, {})["graphs_after_all_lengths"] = dynamo_counts()["unique_graphs"]
        compile_rows[name]["cold_caches"] = not args.warm_caches
        del v
        caches.close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # MTP layer: a shared-top-k MoE layer that takes the main layer's IDs (no top-k inside it)
    if args.mtp_seq:
        mtp_names = [v for v in args.mtp_variants.split(",") if v]
        if set(mtp_names) - {"no_ac", CONTROL, "sacpass"}:
            sys.exit(f"bench_layer: --mtp-variants takes no_ac, {CONTROL}, sacpass")
        S = args.mtp_seq
        ctrl = result["seq"].get(str(S), {}).get("variants", {}).get(CONTROL, {}).get("step_ms_median")
        need = (2 * (ctrl or 0) * (args.steps + args.warmup) / 1e3 + 90) * len(mtp_names)
        if need > left():
            result["notes"].append(f"MTP layer at S={S} skipped: predicted {need:.0f} s > {left():.0f} s left")
        else:
            gc.collect()
            mtp_base = build_layer(cfg, device, dtype, compute_topk=False, seed=2)
            inputs = make_inputs(S, cfg, device, dtype)
            with torch.no_grad():
                ids = base(*inputs)[1]                            # the main layer's top-k IDs
            entry = result["mtp"].setdefault(str(S), {})
            for name in mtp_names:
                counters.clear()
                torch._dynamo.reset()
                v = Variant(name, mtp_base, device.type, dynamic=not args.static, backend=args.backend)
                try:
                    m = measure(v, inputs, args.steps, args.warmup, clock, device, topk_ids=ids)
                    m["compile_s"] = m["first_step_s"] - m["step_ms_median"] / 1e3
                except torch.cuda.OutOfMemoryError as e:
                    m = {"status": "oom", "error": str(e)[:300]}
                entry[name] = m
                print(f"MTP S={S} {name}: {m}", flush=True)
                del v
                save()

    result["targets"] = targets(result)
    save()
    result["plot"] = plot(result, out_base + ".png")
    save()
    print(markdown(result), flush=True)
    return result


if __name__ == "__main__":
    main()
