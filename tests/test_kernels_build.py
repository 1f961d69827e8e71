"""Every TileLang kernel lowers and builds for the H200 (sm_90a) on a machine without a GPU.

Needs TileLang (the `cuda` extra) and nvcc; skipped with a message otherwise. Nothing is launched.
One build per entry of each family's ``ci_builds`` (the kernels the ops dispatch to, and each kernel variant a
benchmark can switch to), TileLang's disk cache off so that nvcc really runs: 10-15 s each (about 2 minutes
in all on a 2-core machine, serially; a process pool is used where there are >= 3 cores).
"""
import concurrent.futures as cf
import multiprocessing as mp
import os
import shutil

import pytest

pytest.importorskip("tilelang", reason="TileLang not installed (pip install '.[cuda]')")
if shutil.which("nvcc") is None:
    pytest.skip("nvcc not on PATH: cannot build CUDA kernels here", allow_module_level=True)

import glm52_model.ops  # noqa: E402,F401  (defines the ops before the cuda package registers on them)
from glm52_model.ops.cuda import build_kernel_source_or_error, ci_kernel_names  # noqa: E402,E501

ARCH = "sm_90a"
NAMES = ci_kernel_names(ARCH)


@pytest.fixture(scope="module")
def built():
    """name -> CUDA source, or the exception its build raised. With >= 3 cores the builds run in a
    process pool (each worker pays ~5 s of imports); on fewer they run here, one after another."""
    workers = min(len(NAMES), os.cpu_count() or 1)
    if workers < 3:
        return {n: build_kernel_source_or_error(n, ARCH) for n in NAMES}
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return dict(zip(NAMES, pool.map(build_kernel_source_or_error, NAMES)))


@pytest.mark.parametrize("name", NAMES)
def test_kernel_builds_for_sm90a(built, name):
    src = built[name]
    if isinstance(src, Exception):
        raise AssertionError(f"{name} failed to build for {ARCH}: {src}") from src
    assert "__global__" in src, f"{name}: no CUDA kernel in the generated source"
    if "logits" in name or "sparse_mla" in name:
        assert "wgmma" in src or "mma" in src, f"{name}: no tensor-core instruction in the source"


def test_op_logits_kernel_calls_its_epilogue(built):
    """Each logits build calls the register epilogue the op dispatches it to (``logits_epilogue``): "mma_pairs" for
    FP8 at the indexer's 32 heads (4 queries a block), "mma" for FP8 at 64 heads, "lanes" for bf16."""
    builds = {"indexer_logits_fp8[h32,d128]": "dsa_logits::mma_pairs<32, true, true>(",
              "indexer_logits_fp8[h64,d128]": "dsa_logits::mma<2, 64, true, true>(",
              "indexer_logits[h32,d128]": "dsa_logits::lanes<4, 32, false, true>("}
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    assert tl.logits_epilogue(32, 4, True) == "mma_pairs" and tl.logits_epilogue(64, 2, True) == "mma"
    assert tl.logits_epilogue(32, 4, False) == "lanes"
    for name, call in builds.items():
        src = built[name]
        if isinstance(src, Exception):
            pytest.skip("a build failed (reported by test_kernel_builds_for_sm90a)")
        assert call in src, f"{name}: no call {call}"          # a call: the definitions are unqualified
        others = {"mma_pairs", "mma", "lanes"} - {call.split("::")[1].split("<")[0]}
        assert not any(f"dsa_logits::{o}<" in src for o in others), f"{name} calls another epilogue"
