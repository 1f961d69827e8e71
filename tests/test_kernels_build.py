"""Every TileLang kernel lowers and builds for the H200 (sm_90a) on a machine without a GPU.

Needs TileLang (the `cuda` extra) and nvcc; skipped with a message otherwise. Nothing is launched.
One build per entry of each family's ``ci_builds`` (the op's own tile choices, and each kernel variant a
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
    """The FP8 logits build at the indexer's 32 heads calls the op's register epilogue (LOGITS_TUNABLES), and the
    64-head build the one "mma_pairs" falls back to (it takes 4 queries of 32 heads a block)."""
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    h32, h64 = built["indexer_logits_fp8[h32,d128]"], built["indexer_logits_fp8[h64,d128]"]
    if isinstance(h32, Exception) or isinstance(h64, Exception):
        pytest.skip("a build failed (reported by test_kernel_builds_for_sm90a)")
    assert f"dsa_logits::{tl.LOGITS_TUNABLES['epilogue']}<" in h32       # a call: the definitions are unqualified
    assert "dsa_logits::mma<2, 64, true, true>(" in h64 and "dsa_logits::mma_pairs<" not in h64
