"""Every TileLang kernel lowers and builds for the H200 (sm_90a) on a machine without a GPU.

Needs TileLang (the `cuda` extra) and nvcc; skipped with a message otherwise. Nothing is launched.
One build per entry of each kernel file's ``ci_builds`` (the kernels the ops dispatch to, with their default
configs), TileLang's disk cache off so that nvcc really runs: 10-15 s each on a 2-core
machine. The full suite builds them all (at least one per kernel file); the quick run (``-m "not slow"``) builds
one (:data:`QUICK`). Only the kernels the selected tests read are built (serially, or in a process pool where
there are >= 3 cores).
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
from glm52_model.ops.cuda import build_kernel_source_or_error, ci_kernel_names, dsa_topk_tl  # noqa: E402

ARCH = "sm_90a"
NAMES = ci_kernel_names(ARCH)
# The quick run's one build (-m "not slow"): the FP8 indexer logits kernel the op runs at 32 heads.
QUICK = {"indexer_logits_fp8[h32,d128]"}
# logits build -> the register epilogue the op dispatches it to (``logits_epilogue``): "mma_pairs" for FP8 at the
# indexer's 32 heads (4 queries a block), "mma" for FP8 at 64 heads, "lanes" for bf16
EPILOGUE_CALLS = {"indexer_logits_fp8[h32,d128]": "dsa_logits::mma_pairs<32, true, true>(",
                  "indexer_logits_fp8[h64,d128]": "dsa_logits::mma<2, 64, true, true>(",
                  "indexer_logits[h32,d128]": "dsa_logits::lanes<4, 32, false, true>("}


def _params(names):
    assert QUICK <= set(NAMES), f"{sorted(QUICK - set(NAMES))} is no CI build"
    return [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in names]


@pytest.fixture(scope="module")
def built(request):
    """name -> CUDA source, or the exception its build raised, for every kernel a selected test of this module
    reads (each built once). With >= 3 cores the builds run in a process pool (each worker pays ~5 s of
    imports); on fewer they run here, one after another."""
    wanted = sorted({item.callspec.params["name"] for item in request.session.items
                     if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params})
    workers = min(len(wanted), os.cpu_count() or 1)
    if workers < 3:
        return {n: build_kernel_source_or_error(n, ARCH) for n in wanted}
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return dict(zip(wanted, pool.map(build_kernel_source_or_error, wanted)))


@pytest.mark.parametrize("name", _params(NAMES))
def test_kernel_builds_for_sm90a(built, name):
    src = built[name]
    if isinstance(src, Exception):
        raise AssertionError(f"{name} failed to build for {ARCH}: {src}") from src
    assert "__global__" in src, f"{name}: no CUDA kernel in the generated source"
    if "logits" in name or "sparse_mla" in name:
        assert "wgmma" in src or "mma" in src, f"{name}: no tensor-core instruction in the source"


@pytest.mark.parametrize("name", _params(EPILOGUE_CALLS))
def test_op_logits_kernel_calls_its_epilogue(built, name):
    """Each logits build calls the register epilogue the op dispatches it to, and no other."""
    assert dsa_topk_tl.logits_epilogue(32, 4, True) == "mma_pairs"
    assert dsa_topk_tl.logits_epilogue(64, 2, True) == "mma"
    assert dsa_topk_tl.logits_epilogue(32, 4, False) == "lanes"
    src, call = built[name], EPILOGUE_CALLS[name]
    if isinstance(src, Exception):
        pytest.skip("the build failed (reported by test_kernel_builds_for_sm90a)")
    assert call in src, f"{name}: no call {call}"          # a call: the definitions are unqualified
    others = {"mma_pairs", "mma", "lanes"} - {call.split("::")[1].split("<")[0]}
    assert not any(f"dsa_logits::{o}<" in src for o in others), f"{name} calls another epilogue"
