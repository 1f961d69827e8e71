"""Tile-wise FP8 grouped GEMM for the routed experts: ``glm52::fp8_grouped_mm`` and its backward
``glm52::fp8_grouped_mm_bwd``.

The contract of ``glm52::grouped_mm`` (rows of ``x`` sorted by expert, ``offs`` int32 [E] ends each expert's
group, rows past ``offs[-1]`` belong to no expert and get 0), with each expert's three GEMMs in the model's
tile-wise FP8 recipe (:mod:`glm52_model.ops.fp8`, DeepSeek-V3: e4m3, amax scales, fp32 accumulation):

* forward  ``y[g]  = x[g] @ w[e]``:     x in 1x128 tiles along K, ``w[e].T`` in 128x128 blocks;
* dgrad    ``dx[g] = dy[g] @ w[e].T``:  dy in 1x128 tiles along N, the same weight blocks transposed;
* wgrad    ``dw[e] = x[g].T @ dy[g]``:  x and dy in 1x128 tiles along tokens. Each expert's rows are
  padded to a multiple of 128 first, so that no tile straddles two experts.

    glm52::fp8_grouped_mm(Tensor x, Tensor w, Tensor offs) -> Tensor                 # y [R, N], x's dtype
    glm52::fp8_grouped_mm_bwd(Tensor dy, Tensor x, Tensor w, Tensor offs) -> (Tensor dx, Tensor dw)

Quantisation happens inside the ops: their inputs and the tensors autograd keeps are ``grouped_mm``'s (x, w,
offs), so swapping one op family for the other changes no saved set. The kernel quantises once and puts
every expert's rows into 128-row slots (:func:`glm52_model.ops.grouped_mm.group_slots`), then runs one
``glm52::fp8_blockwise_mm`` per expert with rows: on CUDA that is cuBLASLt's sm90 blockwise FP8 GEMM, on
the CPU the dequantise-then-matmul reference. The quantisers are the kernel's argument (:class:`Quantisers`):
PyTorch here, TileLang kernels on CUDA (``glm52_model.ops.cuda``). ``ref_fp8_grouped_mm`` is an independent fake-quant loop.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .fp8 import BLOCK, dequantize, quantize_1x128, quantize_1x128_t, quantize_128x128
from .grouped_mm import _check, group_slots, register_grouped_family, slot_rows

__all__ = ["TORCH_QUANTISERS", "Quantisers", "fp8_grouped_mm", "fp8_grouped_mm_bwd", "fp8_grouped_mm_bwd_kernel",
           "fp8_grouped_mm_kernel", "ref_fp8_grouped_mm"]


# ---------------------------------------------------------------------------------------------- kernel
class Quantisers(NamedTuple):
    """The three quantisations the kernel needs; each device brings its own (CUDA: TileLang kernels that fill
    the experts' slots in the same pass, ``glm52_model.ops.cuda.fp8_quant_tl``)."""

    rows: Callable[[Tensor, Tensor, Tensor, int], tuple[Tensor, Tensor]]   # (x, src, dest, total): 1x128 along K
    cols: Callable[[Tensor, Tensor, Tensor, int], tuple[Tensor, Tensor]]   # same slots, 1x128 along rows, as x.T
    blocks: Callable[[Tensor], tuple[Tensor, Tensor]]                      # [E, N, K] -> 128x128 blocks each


def _torch_rows(x: Tensor, src: Tensor, dest: Tensor, total: int) -> tuple[Tensor, Tensor]:
    return quantize_1x128(slot_rows(x, src, dest, total))


def _torch_cols(x: Tensor, src: Tensor, dest: Tensor, total: int) -> tuple[Tensor, Tensor]:
    return quantize_1x128_t(slot_rows(x, src, dest, total))


TORCH_QUANTISERS = Quantisers(rows=_torch_rows, cols=_torch_cols, blocks=quantize_128x128)


def _mm(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], out_dtype: torch.dtype) -> Tensor:
    return torch.ops.glm52.fp8_blockwise_mm(a[0].contiguous(), a[1].contiguous(), b[0].contiguous(),
                                            b[1].contiguous(), out_dtype)


def _blocks_t(quant: Quantisers, w: Tensor) -> tuple[Tensor, Tensor]:
    """128x128 blocks of every w[e].T: the blocks of w[e], transposed (a block's amax is the same set of
    values either way), so the bf16 weights are read once and only fp8 bytes are transposed."""
    wq, ws = quant.blocks(w)                                                     # [E, Kp, Np]
    return wq.transpose(1, 2).contiguous(), ws.transpose(1, 2).contiguous()


def _experts_with_rows(offs: Tensor, poffs: Tensor):
    """(e, slot [p0, p1), rows [r0, r1)) of every expert with rows (one host sync)."""
    p0 = r0 = 0
    for e, (p1, r1) in enumerate(zip(*torch.stack([poffs, offs]).tolist())):
        if r1 > r0:
            yield e, p0, p1, r0, r1
        p0, r0 = p1, r1


def fp8_grouped_mm_kernel(x: Tensor, w: Tensor, offs: Tensor, quant: Quantisers = TORCH_QUANTISERS) -> Tensor:
    """y[g] = x[g] @ w[e]: x quantised into 128-row expert slots, one blockwise FP8 GEMM per expert."""
    _check(x, w, offs)
    R, N = x.shape[0], w.shape[2]
    y = x.new_zeros((R, N))
    if R == 0 or w.shape[0] == 0:
        return y
    src, dest, poffs = group_slots(offs, R, BLOCK)
    xq, xs = quant.rows(x, src, dest, int(poffs[-1]))                            # [Rp, Kp] in 128-row slots
    wq, ws = _blocks_t(quant, w)                                                 # [E, Np, Kp] blocks of w[e].T
    for e, p0, p1, r0, r1 in _experts_with_rows(offs, poffs):
        y[r0:r1] = _mm((xq[p0:p1], xs[p0:p1]), (wq[e], ws[e]), x.dtype)[:r1 - r0, :N]
    return y


def fp8_grouped_mm_bwd_kernel(dy: Tensor, x: Tensor, w: Tensor, offs: Tensor,
                              quant: Quantisers = TORCH_QUANTISERS) -> tuple[Tensor, Tensor]:
    """dgrad with dy in 1x128 tiles along N and the weight blocks of w[e]; wgrad with x and dy in 1x128 tiles
    along tokens, each expert's rows in 128-row slots so that no tile straddles two experts."""
    _check(x, w, offs)
    R, K = x.shape
    dx, dw = torch.zeros_like(x), torch.zeros_like(w)
    if R == 0 or w.shape[0] == 0:
        return dx, dw
    src, dest, poffs = group_slots(offs, R, BLOCK)
    total = int(poffs[-1])
    dyq, dys = quant.rows(dy, src, dest, total)                                  # [Rp, Np]
    wq, ws = quant.blocks(w)                                                     # [E, Kp, Np] blocks of w[e]
    xt, xts = quant.cols(x, src, dest, total)                                    # [K, Rp], [K, Rp/128]
    dyt, dyts = quant.cols(dy, src, dest, total)                                 # [N, Rp]
    for e, p0, p1, r0, r1 in _experts_with_rows(offs, poffs):
        dx[r0:r1] = _mm((dyq[p0:p1], dys[p0:p1]), (wq[e], ws[e]), x.dtype)[:r1 - r0, :K]
        t0, t1 = p0 // BLOCK, p1 // BLOCK
        dw[e] = _mm((xt[:, p0:p1], xts[:, t0:t1]), (dyt[:, p0:p1], dyts[:, t0:t1]), w.dtype)
    return dx, dw


# ---------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("glm52::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[g] = x[g] @ w[e] per expert's row group, both operands tile-wise FP8, fp32 accumulation."""
    return fp8_grouped_mm_kernel(x, w, offs)


@torch.library.custom_op("glm52::fp8_grouped_mm_bwd", mutates_args=())
def fp8_grouped_mm_bwd(dy: Tensor, x: Tensor, w: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """(dx[g] = dy[g] @ w[e].T, dw[e] = x[g].T @ dy[g]) in FP8; experts with no rows get dw = 0."""
    return fp8_grouped_mm_bwd_kernel(dy, x, w, offs)


register_grouped_family("fp8_grouped_mm")                    # fakes, autograd, FLOPs: grouped_mm's


# ---------------------------------------------------------------------------------------------- reference
def ref_fp8_grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Fake-quant loop over experts in fp32 (the forward only): quantise x[g] in 1x128 tiles and w[e].T in
    128x128 blocks, dequantise, matmul; rows past offs[-1] are 0."""
    K, N = x.shape[1], w.shape[2]
    y, start = x.new_zeros((x.shape[0], N), dtype=torch.float32), 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            xd = dequantize(*quantize_1x128(x[start:end]))[:, :K]
            wd = dequantize(*quantize_128x128(w[e].t()))[:N, :K]
            y[start:end] = xd @ wd.T
        start = end
    return y.to(x.dtype)
