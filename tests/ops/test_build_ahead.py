"""TileLang kernels built ahead of their first call (glm52_model.ops.cuda.ahead), on a machine without a GPU.

Tracing the ops with fake CUDA inputs (what torch.compile does) starts the builds of the kernels their CUDA
launchers pick for those inputs, and no others; a build started ahead runs in a worker process, and the first
call here then loads it from TileLang's disk cache instead of compiling it; a build that fails in a worker
fails again at its first call here, with its own error; a listener that fails warns and tracing goes on.
"""
import shutil
from concurrent.futures import Future
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("tilelang", reason="TileLang not installed (pip install '.[cuda]')")

import glm52_model.ops  # noqa: E402,F401
from glm52_model.ops.cuda import ahead, dsa_topk_tl, fp8_quant_tl, sparse_mla_tl  # noqa: E402
from glm52_model.ops.cuda.dsa_topk_tl import LogitsConfig  # noqa: E402
from glm52_model.ops.cuda.topk_select_tl import SelectConfig  # noqa: E402
from tests.support import build_ahead as stand_ins  # noqa: E402

SM90 = {"kind": "cuda", "arch": "sm_90a"}
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


class _Recorder(ahead._Workers):
    """Workers that record what they are given and start no process (each build "done" at once)."""

    def __init__(self):
        super().__init__()
        self.submitted = []

    def submit(self, key, job):
        if key not in self.pending:
            self.submitted.append((job[1], job[2]))
            self.pending[key] = Future()
            self.pending[key].set_result(None)
        return self.pending[key]


@pytest.fixture(autouse=True)
def disk_cache_on():
    """TileLang's disk cache on (where builds ahead meet), as it was after: a CI build elsewhere turns it off."""
    import tilelang
    from tilelang import env
    was = env.is_cache_enabled()
    tilelang.enable_cache()
    yield
    if not was:
        tilelang.disable_cache()


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(ahead, "_WORKERS", rec)
    monkeypatch.delenv("GLM52_BUILD_AHEAD", raising=False)
    for family in (dsa_topk_tl, fp8_quant_tl, sparse_mla_tl):   # the device the fake tensors name: an H100/H200
        monkeypatch.setattr(family, "cuda_target", lambda device=None: SM90)
    for fn in (sparse_mla_tl.compile_sparse_mla_fwd_ws, sparse_mla_tl.compile_sparse_mla_bwd_ws,
               sparse_mla_tl.compile_sparse_mla_fwd, dsa_topk_tl.compile_indexer_logits,
               dsa_topk_tl.compile_topk_select, fp8_quant_tl._compiled):
        fn.cache_clear()
    return rec


def _cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def test_tracing_the_ops_starts_the_builds_their_cuda_launchers_pick(recorder):
    S, scale, ops = 256, 576 ** -0.5, sparse_mla_tl.SparseMlaConfig()
    with FakeTensorMode():
        q, kv, idx = _cuda(S, 64, 576), _cuda(S, 576), _cuda(S, 2000, dtype=torch.int32)
        out, lse = torch.ops.glm52.sparse_mla(q, kv, idx, scale, 512)
        torch.ops.glm52.sparse_mla_bwd(q, kv, out, out, idx, lse, scale, 512)
        iq, ik = _cuda(S, 32, 128, dtype=E4M3), _cuda(S, 128, dtype=E4M3)
        starts = _cuda(S, dtype=torch.int32)
        torch.ops.glm52.dsa_topk_indices(iq, ik, _cuda(S, 32, dtype=torch.float32), starts, starts, 2048, 0.1,
                                         _cuda(S, dtype=torch.float32))
        x, w = _cuda(S, 6144), _cuda(2048, 6144)
        torch.ops.glm52.fp8_quantize(x, "1x128")
        torch.ops.glm52.fp8_quantize(w, "128x128")
        torch.ops.glm52.fp8_quantize_pair(_cuda(S, 2048))
        we, offs = _cuda(8, 6144, 1024), _cuda(8, dtype=torch.int32)
        h1, h2 = torch.ops.glm52.fp8_grouped_mm_pair(x, we, we, offs)
        torch.ops.glm52.fp8_grouped_mm_pair_bwd(h1, h2, x, we, we, offs)
    # the slots padded as the launchers pad them: 2000 -> two blocks of the pipelined kernels
    fwd_slots, bwd_slots = (-(-2000 // (2 * c.block_I)) * 2 * c.block_I for c in (ops.fwd_ws, ops.bwd_ws))
    assert sorted(recorder.submitted, key=repr) == sorted([
        ("compile_sparse_mla_fwd_ws", (64, fwd_slots, scale, "sm_90a", 576, 512, ops.fwd_ws)),
        ("compile_sparse_mla_bwd_ws", (64, bwd_slots, scale, "sm_90a", 576, 512, ops.bwd_ws)),
        ("compile_indexer_logits", (32, 128, "sm_90a", E4M3, LogitsConfig())),
        ("compile_topk_select", (2048, "sm_90a", SelectConfig())),
        ("_compiled", ("rows", (6144,), BF16, "sm_90a", False)),          # x, its 1x128 tiles (and the experts')
        ("_compiled", ("blocks", (2048, 6144), BF16, "sm_90a", False)),   # w, its 128x128 blocks
        ("_compiled", ("rows", (2048,), BF16, "sm_90a", False)),          # the pair: 1x128 tiles ...
        ("_compiled", ("cols", (2048,), BF16, "sm_90a", False)),          # ... and along tokens
        ("_compiled", ("blocks", (6144, 1024), BF16, "sm_90a", True)),    # the experts' forward: w[e].T's blocks
        ("_compiled", ("cols", (6144,), BF16, "sm_90a", False)),          # their backward: x along tokens,
        ("_compiled", ("rows", (1024,), BF16, "sm_90a", False)),          # dy both ways,
        ("_compiled", ("cols", (1024,), BF16, "sm_90a", False)),
        ("_compiled", ("blocks", (6144, 1024), BF16, "sm_90a", False)),   # w[e]'s blocks
    ], key=repr)


def test_the_experts_single_and_combining_gemms_start_their_quantisers(recorder):
    with FakeTensorMode():
        x, w, offs = _cuda(256, 512), _cuda(4, 512, 384), _cuda(4, dtype=torch.int32)
        y = torch.ops.glm52.fp8_grouped_mm(x, w, offs)
        torch.ops.glm52.fp8_grouped_mm_bwd(y, x, w, offs)
        order, weight = _cuda(256, dtype=torch.int64), _cuda(128, 2, dtype=torch.float32)
        xc, wc = _cuda(256, 896), _cuda(4, 896, 640)
        out = torch.ops.glm52.fp8_grouped_mm_combine(xc, wc, offs, order, weight)
        torch.ops.glm52.fp8_grouped_mm_combine_bwd(out, xc, wc, offs, order, weight)
    assert sorted(recorder.submitted, key=repr) == sorted([("_compiled", a) for a in [
        ("rows", (512,), BF16, "sm_90a", False), ("blocks", (512, 384), BF16, "sm_90a", True),     # forward
        ("cols", (512,), BF16, "sm_90a", False), ("rows", (384,), BF16, "sm_90a", False),          # backward
        ("blocks", (512, 384), BF16, "sm_90a", False), ("cols", (384,), BF16, "sm_90a", False),
        ("rows", (896,), BF16, "sm_90a", False), ("blocks", (896, 640), BF16, "sm_90a", True),     # combine
        ("rows", (640,), BF16, "sm_90a", False), ("blocks", (896, 640), BF16, "sm_90a", False),
        ("cols", (896,), BF16, "sm_90a", False), ("cols", (640,), BF16, "sm_90a", False)]], key=repr)


def test_inputs_the_kernels_do_not_take_start_no_build(recorder):
    with FakeTensorMode():
        q32, kv32 = _cuda(16, 64, 576, dtype=torch.float32), _cuda(16, 576, dtype=torch.float32)
        torch.ops.glm52.sparse_mla(q32, kv32, _cuda(16, 64, dtype=torch.int32), 0.1, 512)   # fp32: the reference
        q5, k5 = _cuda(16, 5, 128), _cuda(16, 128)                                           # 5 indexer heads
        starts = _cuda(16, dtype=torch.int32)
        torch.ops.glm52.dsa_topk_indices(q5, k5, _cuda(16, 5, dtype=torch.float32), starts, starts, 8, 0.1)
        torch.ops.glm52.fp8_quantize(_cuda(16, 256, dtype=torch.float64), "1x128")          # no kernel for fp64
        torch.ops.glm52.fp8_quantize(torch.empty(16, 256, dtype=BF16), "1x128")             # a CPU tensor
    assert recorder.submitted == []


def test_a_build_is_started_once_and_not_where_this_process_has_it(recorder):
    with FakeTensorMode():
        for _ in range(3):
            torch.ops.glm52.fp8_quantize(_cuda(64, 768), "1x128_t")
    assert recorder.submitted == [("_compiled", ("cols", (768,), BF16, "sm_90a", False))]
    stand_ins.square.cache_clear()
    assert stand_ins.square(3) == 9
    assert stand_ins.square.ahead(3) is None and stand_ins.square.ahead(n=3, offset=0) is None  # cached here
    assert stand_ins.square.ahead(4) is not None and stand_ins.square.ahead(n=4) is not None
    assert recorder.submitted[1:] == [("square", (4, 0))]                     # one build, by its bound arguments


def test_without_the_disk_cache_or_with_GLM52_BUILD_AHEAD_0_nothing_is_built_ahead(recorder, monkeypatch):
    stand_ins.square.cache_clear()
    monkeypatch.setenv("GLM52_BUILD_AHEAD", "0")
    assert stand_ins.square.ahead(5) is None
    monkeypatch.delenv("GLM52_BUILD_AHEAD")
    import tilelang
    tilelang.disable_cache()
    try:
        assert stand_ins.square.ahead(5) is None
    finally:
        tilelang.enable_cache()
    assert recorder.submitted == [] and stand_ins.square(5) == 25


def test_a_listener_that_fails_warns_once_and_tracing_goes_on(recorder, monkeypatch):
    def fails(kind, x):
        raise RuntimeError("no width")
    monkeypatch.setattr(fp8_quant_tl, "quant_kernel", fails)
    with FakeTensorMode(), pytest.warns(UserWarning, match="kernel builds ahead failed in _quantize_ahead") as seen:
        for _ in range(2):
            q, s = torch.ops.glm52.fp8_quantize(_cuda(64, 512), "1x128")
    assert len([w for w in seen if "builds ahead" in str(w.message)]) == 1
    assert q.shape == (64, 512) and s.shape == (64, 4) and recorder.submitted == []


def test_a_worker_builds_what_the_first_call_here_then_takes_and_a_failed_build_fails_here(monkeypatch):
    monkeypatch.delenv("GLM52_BUILD_AHEAD", raising=False)
    monkeypatch.setattr(ahead, "_WORKERS", ahead._Workers())
    stand_ins.square.cache_clear()
    stand_ins.broken.cache_clear()
    ok, bad = stand_ins.square.ahead(7, offset=1), stand_ins.broken.ahead(2)
    assert ok.result(timeout=120) is None                                   # built in the worker
    assert bad.result(timeout=120) == "ValueError: no kernel for n=2"       # its error, handed back
    assert [name for name, _ in ahead.built()] == ["square(7, 1)"]
    assert stand_ins.square(7, 1) == 50
    with pytest.raises(ValueError, match="no kernel for n=2"):
        stand_ins.broken(2)                                                 # compiled here, and raises here
    assert ahead.first_calls() == {"built ahead": 1, "compiled here": 1}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot build CUDA kernels here")
def test_a_kernel_built_ahead_is_loaded_from_the_disk_cache_at_its_first_call(monkeypatch):
    """A real TileLang build (an FP8 quantiser for sm_90a) in a worker; the first call here finds it in TileLang's
    disk cache (TileLang's own lookup returns the kernel) instead of compiling it."""
    from tilelang.cache.kernel_cache import KernelCache

    monkeypatch.delenv("GLM52_BUILD_AHEAD", raising=False)
    monkeypatch.setattr(ahead, "_WORKERS", ahead._Workers())
    fp8_quant_tl._compiled.cache_clear()
    args = ("rows", (640,), BF16, "sm_90a", False)
    assert fp8_quant_tl._compiled.ahead(*args).result(timeout=300) is None
    loads = []
    load = KernelCache._load_kernel_from_disk

    def counted(self, *a, **k):
        loads.append(load(self, *a, **k))
        return loads[-1]
    with mock.patch.object(KernelCache, "_load_kernel_from_disk", counted):
        kernel = fp8_quant_tl._compiled(*args)
    assert len(loads) == 1 and loads[0] is kernel, loads
    assert ahead.first_calls()["built ahead"] == 1


def test_a_build_ahead_that_does_not_finish_in_time_is_built_at_the_first_call(recorder, monkeypatch):
    stand_ins.square.cache_clear()
    monkeypatch.setattr(ahead, "WAIT_S", 0.01)
    late = Future()                                                         # a worker that never answers
    recorder.pending[("tests.support.build_ahead.square", (6, 0))] = late
    before = ahead.first_calls()
    with pytest.warns(UserWarning, match="took over 0 s in its worker; it is built here instead"):
        assert stand_ins.square(6) == 36
    after = ahead.first_calls()
    assert after["compiled here"] == before["compiled here"] + 1 and after["built ahead"] == before["built ahead"]
