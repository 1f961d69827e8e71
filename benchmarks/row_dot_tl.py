"""A TileLang alternative to the sparse MLA backward's delta = rowsum(out * dout) in fp32, kept only for
``bench_kernels.py`` (``--mla-heads``), which times it beside the PyTorch form the op runs
(:func:`glm52_model.ops.cuda.sparse_mla_tl.row_dot`: a chunk of rows at a time, three fp32 passes) and records
their largest difference. This kernel reads each bf16 tensor once and needs no temporaries.
"""
import functools

import torch

import tilelang
import tilelang.language as T


def build_row_dot(dim: int, *, block_R: int = 32, block_D: int = 0, threads: int = 128):
    """Delta[r] = sum_d O[r, d] * dO[r, d] in fp32 for bf16 [rows, dim] O and dO (rows = queries x heads), each read
    once; a block of `block_R` rows walks the columns `block_D` (default 128, or 64 where 128 does not divide `dim`)
    at a time."""
    block_D = block_D or (128 if dim % 128 == 0 else 64)
    assert dim % block_D == 0
    rows = T.dynamic("rows")
    dtype, accum = T.bfloat16, T.float32

    @T.prim_func
    def row_dot(
        O: T.Tensor([rows, dim], dtype),
        dO: T.Tensor([rows, dim], dtype),
        Delta: T.Tensor([rows], accum),
    ):
        with T.Kernel(T.ceildiv(rows, block_R), threads=threads) as bx:
            o = T.alloc_fragment([block_R, block_D], dtype)
            do = T.alloc_fragment([block_R, block_D], dtype)
            acc = T.alloc_fragment([block_R, block_D], accum)
            d = T.alloc_fragment([block_R], accum)
            T.clear(acc)
            for k in T.serial(dim // block_D):
                T.copy(O[bx * block_R:(bx + 1) * block_R, k * block_D:(k + 1) * block_D], o)
                T.copy(dO[bx * block_R:(bx + 1) * block_R, k * block_D:(k + 1) * block_D], do)
                for i, j in T.Parallel(block_R, block_D):
                    acc[i, j] += T.Cast(accum, o[i, j]) * T.Cast(accum, do[i, j])
            T.reduce_sum(acc, d, dim=1)
            T.copy(d, Delta[bx * block_R:(bx + 1) * block_R])

    return row_dot


@functools.lru_cache(maxsize=None)
def compile_row_dot(dim: int, target_arch: str = "sm_90a"):
    from glm52_model.ops.cuda.sparse_mla_tl import FWD_PASS_CONFIGS

    return tilelang.compile(build_row_dot(dim), target={"kind": "cuda", "arch": target_arch},
                            pass_configs=FWD_PASS_CONFIGS)


def _rows16(x: torch.Tensor, d_v: int) -> torch.Tensor:
    """``x`` as contiguous bf16 [rows, d_v] whose data is 16-byte aligned (the kernel's vector loads)."""
    x = x.to(torch.bfloat16).contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    return x.view(-1, d_v)


def row_dot_tl(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """sum(out * dout, -1) in fp32, [S, H], for [S, H, d_v] out and dout, by :func:`build_row_dot`."""
    from glm52_model.ops.cuda._common import cuda_target

    d_v = out.shape[-1]
    delta = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    if delta.numel():
        compile_row_dot(d_v, cuda_target(out.device)["arch"])(_rows16(out, d_v), _rows16(dout, d_v), delta.view(-1))
    return delta
