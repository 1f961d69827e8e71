"""Timing: clocks, one fwd+bwd step, a variant at one length, and the top-k op alone.

Top-k runs are counted with ``sacpass.testing.OpCounter`` on the untimed steps only (the first, compiling
step and the warm-up steps): a dispatch mode adds Python work to every dispatched op, so the timed steps run
without it. The counts are the same on every step.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from glm52_model.model import DecoderLayer, rope_cos_sin
from sacpass.testing import OpCounter

from .variants import TOPK_OP, Variant


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


def step(v: Variant, x0, positions, starts, ends, topk_ids=None) -> torch.Tensor:
    """One fwd + bwd; returns the loss."""
    v.layer.zero_grad(set_to_none=True)
    x = x0.detach().requires_grad_()
    out, _ = v(x, positions, starts, ends, topk_ids)
    loss = out.float().square().mean()
    loss.backward()
    return loss.detach()


def counted_step(v: Variant, *inputs, topk_ids=None) -> tuple[torch.Tensor, int, int]:
    """:func:`step`, counting the top-k runs: (loss, runs in forward, runs in backward)."""
    with OpCounter(TOPK_OP) as topk:
        loss = step(v, *inputs, topk_ids=topk_ids)
    return loss, topk.forward, topk.backward


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
    first_loss, fwd_k, bwd_k = counted_step(v, *inputs, topk_ids=topk_ids)
    clock.sync()
    first_s = time.perf_counter() - t0
    fwd_counts, bwd_counts = [fwd_k], [bwd_k]
    for _ in range(max(0, warmup - 1)):
        _, fk, bk = counted_step(v, *inputs, topk_ids=topk_ids)
        fwd_counts.append(fk)
        bwd_counts.append(bk)
    clock.sync()
    if device.type == "cuda":                     # peaks of the timed steps only (not compile/autotune)
        v.layer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()
    import sacpass.offload as offload_runtime
    offload_runtime.reset_stats()
    times, losses = [], []
    for _ in range(steps):
        a = clock.start()
        losses.append(step(v, *inputs, topk_ids=topk_ids))
        times.append((a, clock.start()))
    clock.sync()
    ms = [clock.elapsed_ms(a, b) for a, b in times]
    after = dynamo_counts()
    row = {
        "step_ms_median": statistics.median(ms), "step_ms_min": min(ms), "step_ms_max": max(ms),
        "steps": steps, "first_step_s": first_s,
        "topk_fwd_runs_per_step": max(fwd_counts), "topk_bwd_runs_per_step": max(bwd_counts),
        "loss": float(losses[-1]), "first_loss": float(first_loss),
        "new_graphs": after["unique_graphs"] - before["unique_graphs"],
        "new_graph_breaks": after["graph_breaks"] - before["graph_breaks"],
        "recompile_reasons": after["guard_failures"][len(before["guard_failures"]):],   # guards that failed
    }
    st = offload_runtime.stats()
    if st.offloaded_bytes:
        row["offload"] = {"gib_per_step_each_way": st.offloaded_bytes / steps / 2 ** 30,
                          "prefetched_share": st.prefetched_bytes / max(1, st.reloaded_bytes),
                          "reloads_not_prefetched_per_step": st.waited_reloads / steps,
                          "peak_host_gib": st.peak_host_bytes / 2 ** 30}
    reports = getattr(v.backend, "reports", None)
    if reports:
        row["saved_activation_gib"] = sum(r.activation_bytes for r in reports) / 2 ** 30
        row["saved_host_gib"] = sum(r.host_bytes for r in reports) / 2 ** 30
        row["discrete_bytes"] = sum(s.bytes for r in reports for s in r.saved if s.reason == "discrete")
        row["planned"] = {a: sum(1 for r in reports for d in r.decisions if d.action == a)
                          for a in ("save", "offload", "recompute")}
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
