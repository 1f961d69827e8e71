"""Grouped GEMM for MoE experts: ``glm52::grouped_mm`` and its backward ``glm52::grouped_mm_bwd``.

Rows of ``x`` are sorted by expert; ``offs`` (int32 [E], cumulative row counts) ends each expert's
group, so the number of rows per expert is data, not shape: one compiled graph serves every routing.

    x [R, K], w [E, K, N], offs [E] int32  ->  y [R, N],  y[g] = x[g] @ w[e] for group g of expert e

A custom op because ``aten._grouped_mm``'s meta function only accepts bf16 while the CPU tests run in
fp32; its kernels call ``torch._grouped_mm`` (CPU: any float dtype; CUDA: bf16, offs int32).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["grouped_mm", "grouped_mm_bwd", "ref_grouped_mm"]


def _check(x: Tensor, w: Tensor, offs: Tensor) -> None:
    torch._check(x.dim() == 2 and w.dim() == 3 and x.shape[1] == w.shape[1],
                 lambda: f"grouped_mm: x [R, K] and w [E, K, N] needed, got {tuple(x.shape)}, {tuple(w.shape)}")
    torch._check(offs.dim() == 1 and offs.shape[0] == w.shape[0] and offs.dtype == torch.int32,
                 lambda: f"grouped_mm: offs must be int32 [E={w.shape[0]}], got {offs.dtype} {tuple(offs.shape)}")


@torch.library.custom_op("glm52::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[g] = x[g] @ w[e] for each expert's contiguous row group."""
    _check(x, w, offs)
    return torch._grouped_mm(x.contiguous(), w.contiguous(), offs=offs)


@grouped_mm.register_fake
def _(x, w, offs):
    _check(x, w, offs)
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("glm52::grouped_mm_bwd", mutates_args=())
def grouped_mm_bwd(dy: Tensor, x: Tensor, w: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """(dx = dy[g] @ w[e].T, dw[e] = x[g].T @ dy[g]); experts with no rows get dw = 0."""
    dy = dy.contiguous()
    dx = torch._grouped_mm(dy, w.transpose(1, 2).contiguous(), offs=offs)
    # x.T is [K, R]: its row stride must be a multiple of 16 bytes, so pad R with zero rows (rows past
    # offs[-1] belong to no expert and add nothing)
    align = max(1, 16 // x.element_size())
    pad = (-x.shape[0]) % align
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        dy = torch.nn.functional.pad(dy, (0, 0, 0, pad))
    dw = torch._grouped_mm(x.t().contiguous(), dy, offs=offs)
    return dx, dw


@grouped_mm_bwd.register_fake
def _(dy, x, w, offs):
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy):
    x, w, offs = ctx.saved_tensors
    dx, dw = torch.ops.glm52.grouped_mm_bwd(dy, x, w, offs)
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def ref_grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Loop over experts with plain matmuls (differentiable)."""
    outs, start = [], 0
    for e, end in enumerate(offs.tolist()):
        outs.append(x[start:end] @ w[e])
        start = end
    outs.append(x.new_zeros((x.shape[0] - start, w.shape[2])))                     # rows past offs[-1]
    return torch.cat(outs)
