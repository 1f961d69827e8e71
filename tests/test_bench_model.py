"""bench_model's allocator replay (``--segments``): each segment the CUDA caching allocator added, with the state
it was added in, from the allocator's recorded trace. The trace here is written by hand in the format of
``torch.cuda.memory._snapshot()`` (no GPU needed)."""
import bench_model  # benchmarks/ (pytest.ini's pythonpath)

G = 1 << 30


def _frames(path):
    return [{"filename": "/usr/lib/python3/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": path, "line": 42, "name": "fn"}]


def test_segment_growth_replays_the_trace_from_the_snapshot_before():
    before = {"segments": [
        {"segment_type": "large", "address": 0, "total_size": 8 * G, "blocks": [
            {"state": "active_allocated", "address": 0, "size": 2 * G},
            {"state": "inactive", "address": 2 * G, "size": 2 * G},
            {"state": "active_allocated", "address": 4 * G, "size": 1 * G},
            {"state": "inactive", "address": 5 * G, "size": 3 * G}]},
        {"segment_type": "small", "address": 100 * G, "total_size": 2 << 20, "blocks": []}]}
    trace = [
        {"action": "alloc", "addr": 0, "size": 4096},  # before the snapshot: not replayed
        {"action": "snapshot", "addr": 0, "size": 0},
        {"action": "alloc", "addr": 2 * G, "size": 1 * G, "user_metadata": "layer 0 forward"},
        {"action": "free_requested", "addr": 4 * G, "size": 1 * G},  # awaits another stream's copy
        # needs 4 GiB: free are 1 GiB at 3 GiB and 3 GiB at 5 GiB, 1 GiB awaiting at 4 GiB: none is large enough
        {"action": "segment_alloc", "addr": 20 * G, "size": 4 * G, "user_metadata": "layer 3 backward"},
        {"action": "alloc", "addr": 20 * G, "size": 4 * G, "frames": _frames("/w/sacpass/offload.py")},
        {"action": "free_completed", "addr": 4 * G, "size": 1 * G},
        {"action": "segment_alloc", "addr": 30 * G, "size": 6 * G, "user_metadata": "layer 2 backward"},
        {"action": "alloc", "addr": 30 * G, "size": 6 * G, "frames": _frames("/tmp/x/lib.py")},
        {"action": "segment_free", "addr": 20 * G, "size": 4 * G},
        {"action": "segment_alloc", "addr": 40 * G, "size": 1 << 19},  # small pool: not listed
    ]
    growth = bench_model.segment_growth(before, {"device_traces": [trace]})
    assert [g["phase"] for g in growth] == ["layer 3 backward", "layer 2 backward"]
    first, second = growth
    assert (first["segment_gib"], first["request_gib"], first["reserved_gib"]) == (4, 4, 8)
    assert (first["allocated_gib"], first["awaiting_free_gib"], first["cached_free_gib"]) == (3, 1, 4)
    assert first["largest_free_gib"] == 3 and first["where"] == "offload.py:42:fn"
    # the awaited block came free, joining its neighbours (3 GiB at 4 GiB + 1 GiB before it): 5 GiB contiguous
    assert (second["reserved_gib"], second["allocated_gib"], second["awaiting_free_gib"]) == (12, 7, 0)
    assert second["largest_free_gib"] == 5 and second["where"] == "?"


def test_peak_gib_takes_gib_or_control_s_measured_peak():
    import argparse

    import pytest

    args = argparse.Namespace(peak_gib=None)
    assert bench_model.peak_bytes(args) is None
    args.peak_gib = "2.5"
    assert bench_model.peak_bytes(args) == int(2.5 * G)
    args.peak_gib = "control"
    with pytest.raises(SystemExit, match="measure control first"):
        bench_model.peak_bytes(args)
    args.control_peak_gib = 77.41
    assert bench_model.peak_bytes(args) == int(77.41 * G)


def test_the_profile_counts_kernels_copies_not_hidden_and_the_gpu_s_idle_gaps():
    """A hand-written CUDA timeline (µs): kernels at 0-1000 (a GEMM), 1500-4000 (sparse MLA) and 7000-8000 (a
    Triton kernel), an H2D copy at 3500-6000 of which 2000 µs ran beside no kernel, a D2H copy under a kernel. The
    GPU idled 3000 µs (at 4000) and 500 µs (under the 1 ms floor) between its kernels."""
    def ev(cat, name, ts, dur, launch=None, tid=1):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
        if launch is not None:  # the kernel's launch on the CPU (a runtime call sharing its correlation id)
            e["args"] = {"correlation": launch}
        return e

    forward, backward = bench_model.PHASES
    s = bench_model.timeline_summary([
        ev("user_annotation", forward, -100, 50), ev("user_annotation", backward, -40, 8100),
        ev("cuda_runtime", "cudaLaunchKernel", -90, 1, launch=1), ev("cuda_driver", "cuLaunchKernelEx", -30, 1, launch=2),
        ev("cuda_runtime", "cudaLaunchKernel", 6990, 1, launch=3),
        # the host between the second kernel's end and the third's launch: a Python GC pass inside a region's forward,
        # with a synchronising call in it; a range on another thread (the feeder's) is not the launching thread's
        ev("cpu_op", "region.forward", 3000, 4500), ev("user_annotation", "gc.gen2", 3900, 3000),
        ev("cuda_runtime", "cudaEventSynchronize", 4100, 800), ev("cpu_op", "feeder", 3000, 5000, tid=2),
        ev("cuda_runtime", "cudaHostAlloc", 5000, 300), ev("cuda_runtime", "cudaLaunchKernel", 5400, 200),
        ev("cuda_runtime", "cudaMemcpyAsync", 5700, 50),
        ev("kernel", "sm90_xmma_gemm_bf16", 0, 1000, launch=1), ev("kernel", "sparse_mla_fwd", 1500, 2500, launch=2),
        ev("kernel", "triton_poi_fused_0", 7000, 1000, launch=3), ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 3500, 2500),
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 100, 500), {"ph": "i", "name": "marker", "ts": 5}])
    assert s["kernel_ms_by_phase"] == {"forward": 1.0, "backward": 3.5}
    assert [(k["name"], k["count"], k["ms"]) for k in s["top_kernels"]] == [
        ("sparse_mla_fwd", 1, 2.5), ("sm90_xmma_gemm_bf16", 1, 1.0), ("triton_poi_fused_0", 1, 1.0)]
    assert s["kernel_ms_by_kind"] == {"gemm": 1.0, "sparse_mla": 2.5, "triton": 1.0}
    assert s["kernel_busy_ms"] == 4.5 and s["kernel_span_ms"] == 8.0
    assert s["idle_over_1ms"] == {"count": 1, "ms": 3.0, "largest_ms_at": [(3.0, 4.0)], "largest_why": [
        {"next_kernel": "triton_poi_fused_0", "launched_ms_before_start": 0.01,
         "host_ranges": [("gc.gen2", 2.9), ("region.forward", 3.0), ("bench.backward", 3.0)],
         "host_syncs": [("cudaEventSynchronize", 0.8), ("cudaHostAlloc", 0.3)],
         # own time: the GC pass less the calls inside it, the region's forward less the GC pass and a launch
         "host_work": [("gc.gen2", 1, 1.55), ("cudaEventSynchronize", 1, 0.8), ("cudaHostAlloc", 1, 0.3),
                       ("cudaLaunchKernel", 2, 0.201), ("region.forward", 1, 0.099), ("cudaMemcpyAsync", 1, 0.05),
                       ("bench.backward", 1, 0.0)],
         "other_threads": [("feeder", 1, 3.0)]}]}
    assert s["copy_ms"] == {"HtoD": 2.5, "DtoH": 0.5} and s["copy_not_hidden_ms"] == {"HtoD": 2.0, "DtoH": 0.0}


def test_a_gaps_own_time_adds_up_to_the_gap_where_a_trace_s_ranges_do_not_nest():
    """Ranges (µs) in a 0-100 window: an outer one, a call that ends after its caller (the tracer's clock), two
    ranges of one name that overlap as stairs, and one outside the window. Each instant goes to the innermost
    range: the own times add up to the window."""
    ranges = [(-50, 300, "outer"), (10, 40, "caller"), (20, 40, "call"), (60, 30, "stair"), (70, 40, "stair"),
              (200, 10, "later")]
    own = bench_model._own_time(ranges, 0, 100)
    assert own == {"outer": [1, 10.0], "caller": [1, 10.0], "call": [1, 40.0], "stair": [2, 40.0], "later": [1, 0.0]}
    assert sum(us for _, us in own.values()) == 100


def test_the_allocator_counters_are_read_on_a_gpu_and_empty_on_the_cpu(monkeypatch):
    import torch

    assert bench_model.allocator_counts(torch.device("cpu")) == {}
    stats = {"num_alloc_retries": 3, "num_device_alloc": 40, "num_device_free": 7}  # no num_ooms: an older torch
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    assert bench_model.allocator_counts(torch.device("cuda", 0)) == {
        "alloc_retries": 3, "cuda_mallocs": 40, "cuda_frees": 7, "ooms": 0}


def test_the_compile_seconds_of_a_step_count_the_compiles_it_ran_and_none_after():
    """What the first step's row says of PyTorch's compile stack: a compile adds Dynamo's and AOTAutograd's
    timed functions, largest first; a call served by the compiled graph adds none."""
    import torch

    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager")
    x = torch.randn(8, requires_grad=True)
    before = bench_model.compile_seconds()
    fn(x).backward()
    added = bench_model.seconds_since(before)
    assert added.get("_compile.compile_inner", 0) > 0 and added.get("create_aot_dispatcher_function", 0) > 0
    assert list(added.values()) == sorted(added.values(), reverse=True)
    again = bench_model.compile_seconds()
    fn(x).backward()
    assert not any(k in bench_model.seconds_since(again) for k in ("_compile.compile_inner",
                                                                  "create_aot_dispatcher_function"))


def test_warm_up_goes_on_while_a_model_plan_s_budget_moves_is_in_doubt_or_unmeasured(monkeypatch):
    """settle(): steps while the device budget moves, while a budget measured slower once waits for its second
    step, and while the budget in hand has no measured step yet (a GPU step's timing is read a step later); it
    stops at the first step that leaves a measured budget beyond doubt where it was."""
    import sacpass

    plan = sacpass.ModelPlan(layers=2, gpu_bytes=0, host_bytes=1 << 20)
    # (device budget, doubt, steps measured at it, held at) after n steps: 0 measured, raised to 8; 8 not yet read,
    # then slower once (doubt), then held back at 0 for good
    states = [(0, None, 1, None), (8, None, 0, None), (8, None, 0, None), (8, 8, 1, None), (0, None, 1, 0),
              (0, None, 1, 0), (0, None, 1, 0)]
    n = [0]
    monkeypatch.setattr(bench_model, "step", lambda model, ids: n.__setitem__(0, n[0] + 1))
    monkeypatch.setattr(bench_model.offload_runtime, "device_budget", lambda p: {
        "device_budget": states[n[0]][0], "doubt": states[n[0]][1], "held_at": states[n[0]][3],
        "step_samples": {states[n[0]][0]: states[n[0]][2]}})
    assert bench_model.settle(None, None, plan, most=6) == 5 and n[0] == 5
    n[0] = 1  # the budget just raised to 8 and never read: the warm-up runs out rather than settle on it
    states[2:] = [states[1]] * 5
    assert bench_model.settle(None, None, plan, most=3) == 3
    assert bench_model.settle(None, None, object(), most=5) == 0  # not a model plan: nothing to settle


def test_the_gc_clock_counts_python_s_collector_passes_and_marks_them_on_the_profiler_s_timeline():
    import gc

    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            bench_model.GcClock(annotate=True) as clock:
        gc.collect()
        gc.collect(0)
    assert clock.passes[2] == 1 and clock.passes[0] >= 1 and clock.ms > 0
    assert clock.summary(steps=2)["ms_per_step"] == clock.ms / 2
    names = {e.name for e in prof.events()}
    assert {"gc.gen2", "gc.gen0"} <= names
    gc.collect()
    assert clock.passes[2] == 1  # the clock counts only while entered
