"""TileLang CUDA kernels registered on the glm52 custom ops (`register_kernel(..., "cuda")`).

Importing this package registers, when TileLang imports:

- ``glm52::dsa_topk_indices``: masked indexer logits (bf16 or e4m3, :mod:`.dsa_topk_tl`) + the exact top-k
  select (:mod:`.topk_select_tl`);
- ``glm52::sparse_mla`` / ``glm52::sparse_mla_bwd``: sparse MLA forward (warp-specialised at 64 heads) /
  backward (:mod:`.sparse_mla_tl`);
- ``glm52::fp8_grouped_mm`` / ``glm52::fp8_grouped_mm_bwd``: the same cuBLASLt GEMMs as without TileLang, with
  the FP8 quantisation (and the experts' 128-row slots) in single-pass kernels (:mod:`.fp8_quant_tl`);
- ``glm52::fp8_quantize`` (the dense FP8 linears): the same kernels (bit-exact with the PyTorch quantisers).

Each kernel builder takes its tunables as a small frozen config whose defaults are what the ops run; the
launchers take a config too (a benchmark passes others), and the registered kernels always run the defaults.

Without TileLang these ops run their PyTorch reference kernels on CUDA too, each warning once
(:func:`._common.reference_fallback`). With TileLang, inputs the kernels do not take (dtypes other than
bfloat16, other latent widths) also run the reference kernel, with a one-time warning.
The ops must already be defined: ``glm52_model.ops`` imports the reference families first.
Kernels are JIT-compiled per shape family (seconds each) and cached by TileLang; under torch.compile they are built
ahead of their first call, in worker processes, from the inputs the ops' fakes see while traced (:mod:`.ahead`).
"""
import torch

from .. import dsa_topk, sparse_mla
from ._common import reference_fallback

try:
    import tilelang  # noqa: F401
except ImportError:
    TILELANG_AVAILABLE = False
else:
    TILELANG_AVAILABLE = True

# the ops that have a TileLang kernel, and their PyTorch kernels
REFERENCE_KERNELS = {
    "glm52::dsa_topk_indices": dsa_topk._dsa_topk_kernel,
    "glm52::sparse_mla": sparse_mla._sparse_mla_fwd_kernel,
    "glm52::sparse_mla_bwd": sparse_mla._sparse_mla_bwd_kernel,
}

if TILELANG_AVAILABLE:
    from . import dsa_topk_tl, fp8_quant_tl, sparse_mla_tl

    dsa_topk_tl.register()
    sparse_mla_tl.register()
    fp8_quant_tl.register()
else:
    for _op, _reference in REFERENCE_KERNELS.items():
        torch.library.register_kernel(_op, "cuda")(reference_fallback(_op, _reference))

__all__ = ["TILELANG_AVAILABLE", "REFERENCE_KERNELS", "build_kernel_source", "build_kernel_source_or_error",
           "ci_kernel_names"]


def ci_kernel_names(target_arch: str = "sm_90a") -> list:
    """Names of the kernels CI builds (one per kernel builder) for `target_arch`."""
    return sorted(_ci_builds(target_arch))


def _ci_builds(target_arch: str) -> dict:
    return {**dsa_topk_tl.ci_builds(target_arch), **sparse_mla_tl.ci_builds(target_arch),
            **fp8_quant_tl.ci_builds(target_arch)}


def build_kernel_source(name: str, target_arch: str = "sm_90a", use_cache: bool = False) -> str:
    """Lower and build kernel `name` (see `ci_kernel_names`) without launching it; returns its CUDA
    source. Top-level so that a process pool can run several builds at once."""
    import tilelang

    if not use_cache:
        tilelang.disable_cache()
    builds = _ci_builds(target_arch)
    if name not in builds:
        raise KeyError(f"unknown kernel {name!r}; known: {sorted(builds)}")
    return builds[name]().get_kernel_source()


def build_kernel_source_or_error(name: str, target_arch: str = "sm_90a"):
    """`build_kernel_source`, returning the exception instead of raising it (for process pools)."""
    try:
        return build_kernel_source(name, target_arch)
    except Exception as e:  # handed back to the caller, which reports it per kernel
        return e
