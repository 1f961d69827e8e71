"""Offload on the GPU: pinned host memory, side streams, prefetch across per-layer graphs, Inductor.

A stack of toy DSA layers, each compiled on its own (one compiled graph per layer, as the model's layers are),
with ``offload=["aten::addmm"]`` (the MLP's first GEMM output). Checks: numerics equal the same compile with
the value kept on the GPU; the forward's saved copy lives in pinned host memory; the device memory between
forward and backward drops by the offloaded bytes; in the backward, every layer but the last one has its
reloads started ahead (prefetched during the backward of the layer after it).
"""
import pytest
import torch

import sacpass
import sacpass.offload as offload_runtime
from sacpass.offload.runtime import process_runtime
from sacpass.testing import OpCounter
from tests.support.toy import CompiledStack, ToyLayer

N_LAYERS = 3


def Stack(backend, seed=0):
    """The GPU stack: toy layers at a width where the copies are worth timing, one compiled graph each."""
    return CompiledStack(backend, N_LAYERS, seed, dim=256, idx_dim=64, topk=16)


def _run(options):
    torch._dynamo.reset()
    be = sacpass.backend(inner="inductor", **options)
    model = Stack(be).cuda()
    x = torch.randn(2048, 256, device="cuda", requires_grad=True)
    out = model(x)  # compile
    out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    offload_runtime.reset_stats()
    before = torch.cuda.memory_allocated()
    out = model(x)
    offload_runtime.synchronize()  # every offload copy queued and done (the feeder lets go of its sources)
    torch.empty(1, device="cuda")  # lets the allocator retire blocks whose side-stream copies have finished
    between = torch.cuda.memory_allocated() - before   # what the forward leaves for the backward (+ out)
    with OpCounter("sacpass::offload", "sacpass::reload") as calls:
        out.float().square().mean().backward()
    torch.cuda.synchronize()
    grads = [p.grad.float().clone() for p in model.parameters() if p.grad is not None] + [x.grad.float().clone()]
    return be, between, offload_runtime.stats(), calls, grads


def test_offload_on_cuda_moves_bytes_to_pinned_host_and_prefetches():
    saved_be, saved_between, _, _, saved_grads = _run({"save": ["aten::addmm"]})
    off_be, off_between, st, calls, off_grads = _run({"offload": ["aten::addmm"]})
    for a, b in zip(off_grads, saved_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    rep = off_be.reports[0]
    assert rep.host_bytes > 0 and "aten::addmm.default" not in rep.recomputed
    per_layer = rep.host_bytes
    assert st.offloaded_bytes == N_LAYERS * per_layer == st.reloaded_bytes
    assert saved_between - off_between >= 0.9 * N_LAYERS * per_layer, (saved_between, off_between, per_layer)
    # the last layer's backward comes first: its reloads start there; every earlier layer's were prefetched
    assert st.prefetched_bytes == (N_LAYERS - 1) * per_layer, st
    assert calls.count("backward", "sacpass::reload") == N_LAYERS * sum(s.reason == "offload" for s in rep.saved)


def test_the_prefetch_limit_lowers_the_backward_peak_and_keeps_the_gradients():
    """Several values a layer offloaded: with no limit, the last layer's first reload issues its other copies
    and the whole layer before's, all resident at once; one copy ahead at a time holds fewer bytes on the
    device at the backward's peak, the copies still prefetched (in the order the backward read them last
    step), and the gradients are the same."""
    x = torch.randn(2048, 256, device="cuda")
    limit, results = offload_runtime.prefetch_limit(), {}
    try:
        for name, cap in (("unbounded", None), ("one ahead", 1)):
            offload_runtime.set_prefetch_limit(cap)
            torch._dynamo.reset()
            model, _ = _stack({"offload": ["aten::mm", "aten::addmm"]})
            _step(model, x)  # compiles, and learns the reading order
            model.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_(True)
            out = model(xx).float().square().mean()
            offload_runtime.synchronize()
            offload_runtime.reset_stats()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out.backward()
            torch.cuda.synchronize()
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None] + [xx.grad.clone()]
            results[name] = (torch.cuda.max_memory_allocated() - base, offload_runtime.stats(), grads)
    finally:
        offload_runtime.set_prefetch_limit(limit)
    (peak_all, st_all, g_all), (peak_one, st_one, g_one) = results["unbounded"], results["one ahead"]
    assert st_one.waited_reloads == st_all.waited_reloads == 1, (st_one.format(), st_all.format())
    layer = st_one.reloaded_bytes // N_LAYERS
    assert peak_one < peak_all, (peak_one, peak_all, layer)
    for a, b in zip(g_one, g_all):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # atomics in the gather's backward


def test_a_read_reload_is_reused_at_once_and_an_unread_one_after_its_copy():
    """The memory of a copy the backward read goes back to the compute stream's pool at once, while a later
    copy still runs on the copy stream (the compute waited for its own copy before any use); that of a copy
    freed unread is handed out only after its copy has finished."""
    torch.cuda.empty_cache()
    small = torch.randn(16 << 20, device="cuda")              # 64 MiB
    big = torch.randn(1 << 30, device="cuda")                 # 4 GiB: about 80 ms of copy
    h_small = torch.ops.sacpass.offload(small, 0, [])
    h_big = torch.ops.sacpass.offload(big, 1, [])
    offload_runtime.synchronize()
    h2d = process_runtime().device(("cuda", torch.cuda.current_device())).streams.get("h2d")
    got = torch.ops.sacpass.reload(h_small, torch.device("cuda"))  # issues small's copy, then prefetches big's
    entry = process_runtime().transfers.entries[h_big.data_ptr()]
    assert entry.reload is not None and not h2d.query()      # big's copy queued behind small's, running
    ptr, value = got.data_ptr(), got.clone()
    del got
    assert torch.empty(16 << 20, device="cuda").data_ptr() == ptr and not h2d.query()
    big_ptr = entry.reload.data_ptr()
    del h_big, entry
    offload_runtime.stats()                                   # settles the dead host tensor: its copy dropped unread
    assert not h2d.query()                                    # ... while the copy still writes into it
    assert torch.empty(1 << 30, device="cuda").data_ptr() != big_ptr
    torch.cuda.synchronize()
    torch.testing.assert_close(value, small)


def test_offloaded_tensor_is_pinned_host_memory():
    torch._dynamo.reset()
    be = sacpass.backend(inner="inductor", offload=["aten::addmm"])
    layer = torch.compile(ToyLayer(dim=256, idx_dim=64, topk=16).cuda(), backend=be, fullgraph=True)
    packed = []

    def pack(t):
        packed.append((t.device.type, t.is_pinned() if t.device.type == "cpu" else None))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(torch.randn(512, 256, device="cuda", requires_grad=True))
    out.sum().backward()
    assert ("cpu", True) in packed, packed


def test_planner_on_cuda_matches_full_recompute():
    x = torch.randn(1024, 256, device="cuda")
    results = {}
    for name, options in (("control", {"use_registered": False, "save_discrete": False}),
                          ("plan", {"plan": sacpass.Plan(host_bytes=64 << 20, min_offload_bytes=0)})):
        torch._dynamo.reset()
        be = sacpass.backend(inner="inductor", **options)
        model = Stack(be).cuda()  # the same seed: the same weights
        xx = x.clone().requires_grad_()
        model(xx).float().square().mean().backward()
        results[name] = ([p.grad.float() for p in model.parameters() if p.grad is not None], be)
    for a, b in zip(results["plan"][0], results["control"][0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    plan_be = results["plan"][1]
    assert any(d.action == "offload" for r in plan_be.reports for d in r.decisions)
    assert sum(r.host_bytes for r in plan_be.reports) > 0


def test_model_plan_on_cuda_keeps_the_last_layer_and_matches_full_recompute():
    """One plan for the stack: the last layer's values stay on the device, the others go through pinned
    memory; three steps (the first measures), each with full recompute's gradients."""
    x = torch.randn(1024, 256, device="cuda")
    torch._dynamo.reset()
    ref = _step(_stack({"use_registered": False, "save_discrete": False})[0], x)
    torch._dynamo.reset()
    plan = sacpass.ModelPlan(layers=N_LAYERS, gpu_bytes=8 << 20, host_bytes=64 << 20, min_offload_bytes=0)
    model, _ = _stack({"plan": plan})
    for _ in range(3):
        offload_runtime.reset_stats()
        grads = _step(model, x)
        for a, b in zip(grads, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    st = offload_runtime.stats()
    rows = offload_runtime.placements(plan)
    assert rows[-1]["host_bytes"] == 0 < rows[-1]["device_bytes"] and rows[0]["host_bytes"] > 0, rows
    assert st.kept_bytes > 0 and st.offloaded_bytes == st.reloaded_bytes + st.device_copied_bytes > 0, st.format()
    assert st.bundles_alive == 0 and st.host_bytes_alive == 0, st.format()


# ------------------------------------------------------------------------------------------ lifecycle
def _stack(options, seed=0):
    be = sacpass.backend(inner="inductor", **options)
    return Stack(be, seed).cuda(), be


def _step(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None] + [x.grad.clone()]


def _counters(st):
    return st.offloaded_bytes, st.reloaded_bytes, st.prefetched_bytes, st.waited_reloads, st.dropped_prefetch_bytes


def test_forwards_without_backward_leave_nothing_on_cuda():
    torch._dynamo.reset()
    model, be = _stack({"offload": ["aten::addmm"]})
    x = torch.randn(2048, 256, device="cuda")
    _step(model, x)
    offload_runtime.reset_stats()
    expected = _step(model, x)
    clean = _counters(offload_runtime.stats())
    for _ in range(20):  # an eval loop under grad: no backward
        out = model(x.clone().requires_grad_(True))
        del out
    offload_runtime.synchronize()
    st = offload_runtime.stats()
    assert st.bundles_alive == 0 and st.host_bytes_alive == 0, st.format()
    offload_runtime.reset_stats()
    grads = _step(model, x)
    assert _counters(offload_runtime.stats()) == clean
    for a, b in zip(grads, expected):  # the toy's index backward accumulates atomically: not bit for bit on CUDA
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    st = offload_runtime.stats()
    assert st.bundles_alive == 0 and st.host_bytes_alive == 0, st.format()


def test_an_unconsumed_prefetch_is_freed_when_its_backward_ends():
    torch._dynamo.reset()
    model, be = _stack({"offload": ["aten::addmm"]})
    x = torch.randn(2048, 256, device="cuda")
    _step(model, x)
    kept = model(x.clone().requires_grad_(True))  # its backward comes later: the next step prefetches it
    model.zero_grad(set_to_none=True)
    offload_runtime.synchronize()
    before = torch.cuda.memory_allocated()
    offload_runtime.reset_stats()
    _step(model, x)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")
    st = offload_runtime.stats()
    assert st.dropped_prefetch_bytes == be.reports[0].host_bytes, st.format()
    assert torch.cuda.memory_allocated() == before  # the dropped copy's device memory went back
    kept.float().square().mean().backward()  # and the kept forward's own backward still reloads it
    del kept
    assert offload_runtime.stats().bundles_alive == 0


def test_two_models_interleaved_on_one_gpu():
    torch._dynamo.reset()
    (m1, be1), (m2, _) = _stack({"offload": ["aten::addmm"]}, 0), _stack({"offload": ["aten::addmm"]}, 1)
    x1, x2 = torch.randn(2048, 256, device="cuda"), torch.randn(2048, 256, device="cuda")
    ref1, ref2 = _step(m1, x1), _step(m2, x2)
    for m in (m1, m2):
        m.zero_grad(set_to_none=True)
    offload_runtime.reset_stats()
    a, b = x1.clone().requires_grad_(True), x2.clone().requires_grad_(True)
    o1, o2 = m1(a), m2(b)  # F1 F2 B1 B2
    o1.float().square().mean().backward()
    o2.float().square().mean().backward()
    torch.cuda.synchronize()
    st = offload_runtime.stats()
    assert st.prefetched_bytes == 2 * (N_LAYERS - 1) * be1.reports[0].host_bytes, st.format()
    assert st.dropped_prefetch_bytes == 0
    got1 = [p.grad for p in m1.parameters() if p.grad is not None] + [a.grad]
    got2 = [p.grad for p in m2.parameters() if p.grad is not None] + [b.grad]
    for g, r in zip(got1 + got2, ref1 + ref2):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_the_pool_is_what_pytorchs_pinned_allocator_holds():
    torch._dynamo.reset()
    offload_runtime.release_host_memory()
    base = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    model, be = _stack({"offload": ["aten::addmm"]})
    x = torch.randn(2048, 256, device="cuda")
    _step(model, x)
    st = offload_runtime.stats()
    held = torch.cuda.host_memory_stats()["allocated_bytes.current"] - base
    assert st.peak_host_bytes_held > 0 and abs(held - st.host_bytes_held) <= 0.05 * st.host_bytes_held, (held, st.format())
    assert st.peak_host_bytes >= N_LAYERS * be.reports[0].host_pool_bytes


def test_a_fed_offload_arrives_whole_and_a_host_read_beside_it_is_exact():
    """An offload large enough to be fed in many chunks (a dense, permuted 320 MiB value) reaches pinned host
    memory whole; a reload ordered after it (its event) brings back the same bits; meanwhile the MoE's row-ends
    read (glm52_model's ``host_ints``, written by a kernel into pinned memory) and a plain ``tolist`` read the
    right values while the copy runs."""
    from glm52_model.ops.grouped_mm import host_ints
    from sacpass.offload.clocks import SideStreams
    from sacpass.offload.feeder import CHUNK

    x = torch.randn(8192, 10240, device="cuda").t()  # dense, not contiguous: copied in its own layout
    assert x.numel() * 4 > 4 * CHUNK
    host = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, pin_memory=True)
    streams = SideStreams(torch.cuda.current_device())
    timing = {"d2h": [], "h2d": []}
    fed = streams.feed("d2h", host, x, timing=timing)
    offs = torch.arange(1, 257, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
    assert host_ints(offs) == offs.tolist() == offs.cpu().tolist()
    back = torch.empty_like(x)
    done = streams.copy("h2d", back, host, after=fed.event())
    torch.cuda.current_stream().wait_event(done)
    assert torch.equal(back, x)
    fed.synchronize()
    assert fed.query() and timing["d2h"] == [fed] and fed.elapsed_ms() > 0


def test_a_reload_asked_for_while_the_copy_out_still_runs_copies_the_device_value():
    """A value whose copy to the host waits behind another (the copy engine still busy, as at a forward's end
    when its copies run longer than its compute) comes back as a copy of the device value, made on the device
    long before both copies through the host would have finished; its copy out goes on and lands whole. The read
    prefetches the other value too (from the device or the host, as its copy stands then). Once the copies have
    finished, a second backward's read copies back from the host; every read gives the offloaded bits."""
    first = torch.randn(1 << 28, device="cuda")  # 1 GiB: its copy keeps the engine busy for ~20 ms
    x = torch.randn(4096, 8192, device="cuda")  # 128 MiB, queued behind it
    n_first, n_x = first.numel() * 4, x.numel() * 4
    h_first = torch.ops.sacpass.offload(first, 0, [])
    h_x = torch.ops.sacpass.offload(x, 1, [])
    offload_runtime.reset_stats()
    back = torch.ops.sacpass.reload(h_x, x.device)
    st = offload_runtime.stats()
    assert st.device_copied_bytes >= n_x and st.device_copied_bytes + st.reloaded_bytes == n_x + n_first, st.format()
    assert st.waited_reloads == 0, st.format()
    assert back.data_ptr() != x.data_ptr() and torch.equal(back, x)
    assert torch.equal(torch.ops.sacpass.reload(h_first, first.device), first)  # the prefetched copy
    offload_runtime.synchronize()
    assert torch.equal(h_x, x.cpu()) and torch.equal(h_first, first.cpu())  # the copies out finished, whole
    offload_runtime.reset_stats()
    again = torch.ops.sacpass.reload(h_x, x.device)
    torch.cuda.synchronize()
    st = offload_runtime.stats()
    assert torch.equal(again, x) and st.reloaded_bytes == n_x and st.device_copied_bytes == 0, st.format()


def test_the_copies_out_trail_the_forward_by_one_bundle_at_most(monkeypatch):
    """Offloads issued far faster than the copy engine runs them (four bundles of three 256 MiB values, nothing
    computed between) wait on the host for the oldest copies: the bytes whose copy out has not finished never
    pass one bundle's, the memory of the values already copied is handed out again (the reserve grows by a
    bundle and a value or so, not by all twelve values), and every host copy holds its value's bits."""
    state = process_runtime().device(("cuda", torch.cuda.current_device()))
    offload_runtime.synchronize()
    monkeypatch.setattr(state, "largest_bundle", 0)  # this test's bundles set the limit, not earlier tests'
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    reserved, value = torch.cuda.memory_reserved(), 1 << 28
    offload_runtime.reset_stats()
    hosts, seeds = [], []
    for b in range(4):
        for i in range(3):
            g = torch.Generator(device="cuda").manual_seed(10 * b + i)
            x = torch.randn(value // 4, device="cuda", generator=g)
            hosts.append(torch.ops.sacpass.offload(x, i, []))
            seeds.append(10 * b + i)
            assert state.copies_out.nbytes <= state.largest_bundle
            del x
    assert state.largest_bundle == 3 * value
    st = offload_runtime.stats()
    assert st.copy_out_waits >= 3 and st.copy_out_wait_ms > 0 and "the forward waited for" in st.format(), st.format()
    grown = torch.cuda.max_memory_reserved() - reserved
    assert grown <= 3 * value + 2 * value, (grown / 2 ** 30, st.format())  # without the wait: 12 values
    offload_runtime.synchronize()
    for h, seed in zip(hosts, seeds):
        g = torch.Generator(device="cuda").manual_seed(seed)
        assert torch.equal(h, torch.randn(value // 4, device="cuda", generator=g).cpu())
