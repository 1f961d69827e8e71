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
the CPU the dequantise-then-matmul reference. ``ref_fp8_grouped_mm`` is an independent fake-quant loop.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .fp8 import BLOCK, dequantize, quantize_1x128, quantize_1x128_t, quantize_128x128
from .grouped_mm import _check, group_slots

__all__ = ["fp8_grouped_mm", "fp8_grouped_mm_bwd", "ref_fp8_grouped_mm"]


# ---------------------------------------------------------------------------------------------- kernel
def _mm(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], out_dtype: torch.dtype) -> Tensor:
    return torch.ops.glm52.fp8_blockwise_mm(a[0].contiguous(), a[1].contiguous(), b[0].contiguous(),
                                            b[1].contiguous(), out_dtype)


def _slotted(q: Tensor, s: Tensor, dest: Tensor, src: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Rows ``src`` of quantised (q, s) moved to rows ``dest`` of a zeroed [total, ...] pair (fp8 rows
    travel as bytes: index_put has no float8 kernel on every device)."""
    qp = q.new_zeros((total, q.shape[1]), dtype=torch.uint8)
    qp[dest] = q.view(torch.uint8)[src]
    sp = s.new_ones((total, s.shape[1]))
    sp[dest] = s[src]
    return qp.view(q.dtype), sp


def _per_expert(poffs: Tensor, fn) -> None:
    """Call ``fn(e, p0, p1)`` for every expert with rows, [p0, p1) its padded slot (one host sync)."""
    p0 = 0
    for e, p1 in enumerate(poffs.tolist()):
        if p1 > p0:
            fn(e, p0, p1)
        p0 = p1


def _fp8_grouped_mm_kernel(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    _check(x, w, offs)
    R, N = x.shape[0], w.shape[2]
    y = x.new_zeros((R, N))
    if R == 0 or w.shape[0] == 0:
        return y
    src, dest, poffs = group_slots(offs, R, BLOCK)
    xq = _slotted(*quantize_1x128(x), dest, src, int(poffs[-1]))                 # [Rp, Kp] in 128-row slots
    wq, ws = quantize_128x128(w.transpose(1, 2))                                 # [E, Np, Kp] blocks of w[e].T
    yp = x.new_empty((int(poffs[-1]), wq.shape[1]))

    def expert(e, p0, p1):
        yp[p0:p1] = _mm((xq[0][p0:p1], xq[1][p0:p1]), (wq[e], ws[e]), x.dtype)
    _per_expert(poffs, expert)
    y[src] = yp[dest, :N]
    return y


def _fp8_grouped_mm_bwd_kernel(dy: Tensor, x: Tensor, w: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    _check(x, w, offs)
    R, K = x.shape
    dx, dw = torch.zeros_like(x), torch.zeros_like(w)
    if R == 0 or w.shape[0] == 0:
        return dx, dw
    src, dest, poffs = group_slots(offs, R, BLOCK)
    total = int(poffs[-1])
    # dgrad: dy tiles along N, the forward's weight blocks transposed (blocks of w[e] = blocks of w[e].T, .T)
    dyq = _slotted(*quantize_1x128(dy), dest, src, total)                        # [Rp, Np]
    wq, ws = quantize_128x128(w)                                                 # [E, Kp, Np] blocks of w[e]
    dxp = x.new_empty((total, wq.shape[1]))
    # wgrad: x and dy in 1x128 tiles along tokens; slots of 128 rows keep each tile inside one expert
    xp, dyp = x.new_zeros((total, K)), dy.new_zeros((total, dy.shape[1]))
    xp[dest], dyp[dest] = x[src], dy[src]
    xt, dyt = quantize_1x128_t(xp), quantize_1x128_t(dyp)                         # [K, Rp], [N, Rp]

    def expert(e, p0, p1):
        dxp[p0:p1] = _mm((dyq[0][p0:p1], dyq[1][p0:p1]), (wq[e], ws[e]), x.dtype)
        t0, t1 = p0 // BLOCK, p1 // BLOCK
        dw[e] = _mm((xt[0][:, p0:p1], xt[1][:, t0:t1]), (dyt[0][:, p0:p1], dyt[1][:, t0:t1]), w.dtype)
    _per_expert(poffs, expert)
    dx[src] = dxp[dest, :K]
    return dx, dw


# ---------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("glm52::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[g] = x[g] @ w[e] per expert's row group, both operands tile-wise FP8, fp32 accumulation."""
    return _fp8_grouped_mm_kernel(x, w, offs)


@fp8_grouped_mm.register_fake
def _(x, w, offs):
    _check(x, w, offs)
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("glm52::fp8_grouped_mm_bwd", mutates_args=())
def fp8_grouped_mm_bwd(dy: Tensor, x: Tensor, w: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """(dx[g] = dy[g] @ w[e].T, dw[e] = x[g].T @ dy[g]) in FP8; experts with no rows get dw = 0."""
    return _fp8_grouped_mm_bwd_kernel(dy, x, w, offs)


@fp8_grouped_mm_bwd.register_fake
def _(dy, x, w, offs):
    _check(x, w, offs)
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy):
    x, w, offs = ctx.saved_tensors
    dx, dw = torch.ops.glm52.fp8_grouped_mm_bwd(dy, x, w, offs)
    return dx, dw, None


fp8_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.glm52.fp8_grouped_mm)
def _flops(x_shape, w_shape, offs_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.glm52.fp8_grouped_mm_bwd)
def _bwd_flops(dy_shape, x_shape, w_shape, offs_shape, *args, **kwargs) -> int:
    return 4 * x_shape[0] * x_shape[1] * w_shape[2]


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
