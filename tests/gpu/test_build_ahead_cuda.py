"""Kernels built ahead, on the GPU: compiling a 1-layer GLM-5.2 bench model (FP8 linears and experts, the top-k
and sparse MLA) starts, while torch.compile traces it, the builds of every TileLang kernel its first step runs, so
that step compiles none of them at its first call; and the step computes what it computes with the builds at
their first calls (GLM52_BUILD_AHEAD=0): the same loss, bit for bit (the gradients are not compared: sparse MLA's
backward adds with atomics, so they differ from run to run by themselves).

Each run is a fresh process with its own empty TileLang disk cache, so that nothing of another test's (or an earlier
run's) kernels is found. Printed: each process's first step, and the builds' seconds in their workers."""
import pytest
import torch

from tests.support.gpu_model import run_fresh

STEP = r"""
import json, time, torch
from glm52_model.ops.cuda import ahead
from tests.support.gpu_model import compiled_bench_model
model, ids = compiled_bench_model(layers=1, seq=4096)
t0 = time.perf_counter()
loss = model(ids, labels=ids)
loss.backward()
torch.cuda.synchronize()
print("RESULT" + json.dumps({"first_step_s": time.perf_counter() - t0, "loss": loss.item(),
                             "first_calls": ahead.first_calls(), "built": ahead.built()}))
"""


def _run(tmp_path, name, **env):
    cache = tmp_path / name
    cache.mkdir()
    return run_fresh(STEP, TILELANG_CACHE_DIR=str(cache), **env)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_compiled_step_compiles_no_kernel_at_its_first_call(tmp_path):
    pytest.importorskip("tilelang")
    on = _run(tmp_path, "ahead")
    off = _run(tmp_path, "at_first_call", GLM52_BUILD_AHEAD="0")
    print(f"first step: {on['first_step_s']:.1f} s built ahead, {off['first_step_s']:.1f} s at first calls")
    for kernel, seconds in on["built"]:
        print(f"  {seconds:6.1f} s  {kernel[:150]}")
    # the top-k, sparse MLA forward and backward, and FP8 quantisers of several widths: all of them ahead
    assert on["first_calls"]["compiled here"] == 0, on["first_calls"]
    assert on["first_calls"]["built ahead"] == len(on["built"]) >= 8, on["first_calls"]
    assert off["first_calls"] == {"built ahead": 0, "compiled here": on["first_calls"]["built ahead"]}
    assert on["loss"] == off["loss"]
