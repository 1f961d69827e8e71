"""Tile-wise FP8 grouped GEMM for the routed experts: ``glm52::fp8_grouped_mm`` and its backward
``glm52::fp8_grouped_mm_bwd``, and the FP8 forms of ``grouped_mm_pair`` and ``grouped_mm_combine``
(``glm52::fp8_grouped_mm_pair``, ``glm52::fp8_grouped_mm_combine``, each with its ``_bwd``).

The contract of ``glm52::grouped_mm`` (rows of ``x`` sorted by expert, ``offs`` int32 [E] ends each expert's
group, rows past ``offs[-1]`` belong to no expert and get 0), with each expert's three GEMMs in the model's
tile-wise FP8 recipe (:mod:`glm52_model.ops.fp8`, DeepSeek-V3: e4m3, amax scales, fp32 accumulation):

* forward  ``y[g]  = x[g] @ w[e]``:     x in 1x128 tiles along K, ``w[e].T`` in 128x128 blocks;
* dgrad    ``dx[g] = dy[g] @ w[e].T``:  dy in 1x128 tiles along N, the same weight blocks transposed;
* wgrad    ``dw[e] = x[g].T @ dy[g]``:  x and dy in 1x128 tiles along tokens. Each expert's rows are
  padded to a multiple of 128 first, so that no tile straddles two experts.

    glm52::fp8_grouped_mm(Tensor x, Tensor w, Tensor offs, Tensor? rows=None) -> Tensor   # y [R, N], x's dtype
    glm52::fp8_grouped_mm_bwd(Tensor dy, Tensor x, Tensor w, Tensor offs, Tensor? rows=None) -> (Tensor dx, Tensor dw)

With ``rows`` (``grouped_mm``'s gathered form: y's row i reads x's row rows[i]) the quantisers read x's rows
where they are, so the [R, K] gathered copy of x never exists, in the forward or the backward; the dgrad's
expert GEMMs add into a [T, K] fp32 sum, one ``index_add`` per expert, instead of writing an [R, K] dx that a
sum over each token's rows reads back (at 64K tokens x top-8 x 6144: 1.5 GiB, then 0.75, where the rows took
6 GiB).

Quantisation happens inside the ops: their inputs and the tensors autograd keeps are ``grouped_mm``'s (x, w,
offs), so swapping one op family for the other changes no saved set. Each op reads ``offs`` to the host once
(:func:`~glm52_model.ops.grouped_mm.host_ints`: written by a kernel into pinned memory on a GPU, so the read
never queues behind offload copies) and reuses that list. The forward's rows are independent (1x128 tiles along
K are per row), so it quantises x in its own row order and runs each expert's GEMM on the expert's rows, written
straight into y (:func:`_expert_gemms`); the backward quantises once into 128-row expert slots
(:func:`glm52_model.ops.grouped_mm.group_slots`), which the wgrad's tiles along tokens need, and runs its
GEMMs per expert slot. The GEMMs are cuBLASLt's sm90 blockwise FP8 GEMM on CUDA (``torch._scaled_mm``, as in
``glm52::fp8_blockwise_mm``), the dequantise-then-matmul reference on the CPU. The quantisers are the kernel's
argument (:class:`Quantisers`): PyTorch here, TileLang kernels on CUDA (``glm52_model.ops.cuda``).
``ref_fp8_grouped_mm`` is an independent fake-quant loop.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .fp8 import (BLOCK, FP8_DTYPE, blockwise_scaled_mm, dequantize, quantize_1x128, quantize_1x128_t,
                  quantize_128x128)
from .grouped_mm import (_check, _check_combine, _check_pair, combine_rows, expert_groups, group_slots, host_ints,
                         out_rows, register_combine_family, register_grouped_family, register_pair_family,
                         set_assignments, slot_rows, sum_into_rows, token_sum)

__all__ = ["GEMM_ROWS", "TORCH_QUANTISERS", "Quantisers", "expert_cols", "fp8_grouped_mm", "fp8_grouped_mm_bwd",
           "fp8_grouped_mm_bwd_kernel", "fp8_grouped_mm_combine", "fp8_grouped_mm_combine_bwd",
           "fp8_grouped_mm_combine_bwd_kernel", "fp8_grouped_mm_combine_kernel", "fp8_grouped_mm_kernel",
           "fp8_grouped_mm_pair", "fp8_grouped_mm_pair_bwd", "fp8_grouped_mm_pair_bwd_kernel",
           "fp8_grouped_mm_pair_kernel", "ref_fp8_grouped_mm"]


# ---------------------------------------------------------------------------------------------- kernel
class Quantisers(NamedTuple):
    """The four quantisations the kernel needs; each device brings its own (CUDA: TileLang kernels that fill
    the experts' slots in the same pass, ``glm52_model.ops.cuda.fp8_quant_tl``)."""

    rows: Callable[[Tensor, Tensor, Tensor, int], tuple[Tensor, Tensor]]   # (x, src, dest, total): 1x128 along K
    cols: Callable[[Tensor, Tensor, Tensor, Tensor, list], tuple[Tensor, Tensor]]  # (x, src, dest, poffs, host
                                                                           # poffs): see expert_cols
    blocks: Callable[[Tensor], tuple[Tensor, Tensor]]                      # [E, N, K] -> 128x128 blocks of each w[e]
    blocks_t: Callable[[Tensor], tuple[Tensor, Tensor]]                    # [E, N, K] -> the blocks of each w[e].T


def expert_cols(q: Tensor, s: Tensor, cols: int, p0: int, p1: int) -> tuple[Tensor, Tensor]:
    """Expert slot [p0, p1) of a ``Quantisers.cols`` result: the slot's rows of x in 1x128 tiles along the rows,
    as x[slot].T, ``([C, p1 - p0], [C, (p1 - p0) / 128])``, contiguous. ``cols`` lays the experts out one after
    the other (elements [C * p0, C * p1) of the flat data), so each wgrad GEMM reads its operand in place."""
    return (q[cols * p0:cols * p1].view(cols, p1 - p0),
            s[cols * p0 // BLOCK:cols * p1 // BLOCK].view(cols, (p1 - p0) // BLOCK))


def _torch_rows(x: Tensor, src: Tensor, dest: Tensor, total: int) -> tuple[Tensor, Tensor]:
    return quantize_1x128(slot_rows(x, src, dest, total))


def _torch_cols(x: Tensor, src: Tensor, dest: Tensor, poffs: Tensor, slot_ends: list[int]) -> tuple[Tensor, Tensor]:
    xp = slot_rows(x, src, dest, slot_ends[-1])
    tiles = [quantize_1x128_t(xp[p0:p1]) for p0, p1 in zip([0] + slot_ends[:-1], slot_ends) if p1 > p0]
    return (torch.cat([q.flatten() for q, _ in tiles]) if tiles else xp.new_empty(0, dtype=FP8_DTYPE),
            torch.cat([s.flatten() for _, s in tiles]) if tiles else xp.new_empty(0, dtype=torch.float32))


def _torch_blocks_t(w: Tensor) -> tuple[Tensor, Tensor]:
    """The blocks of w[e], transposed (a block's amax is the same set of values either way): the bf16 weights
    are read once and only fp8 bytes are transposed."""
    wq, ws = quantize_128x128(w)                                                 # [E, Kp, Np]
    return wq.transpose(1, 2).contiguous(), ws.transpose(1, 2).contiguous()


TORCH_QUANTISERS = Quantisers(rows=_torch_rows, cols=_torch_cols, blocks=quantize_128x128, blocks_t=_torch_blocks_t)


def _mm(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], out_dtype: torch.dtype) -> Tensor:
    return torch.ops.glm52.fp8_blockwise_mm(a[0], a[1], b[0], b[1], out_dtype)


def _experts_with_rows(ends: list[int], poffs: list[int]):
    """(e, slot [p0, p1), rows [r0, r1)) of every expert with rows, from host lists."""
    p0 = r0 = 0
    for e, (p1, r1) in enumerate(zip(poffs, ends)):
        if r1 > r0:
            yield e, p0, p1, r0, r1
        p0, r0 = p1, r1


def _slot_ends(ends: list[int]) -> list[int]:
    """The host copy of group_slots' ``poffs``: each group's end once every group is padded to 128 rows."""
    poffs, p, r0 = [], 0, 0
    for r1 in ends:
        p += (r1 - r0 + BLOCK - 1) // BLOCK * BLOCK
        poffs.append(p)
        r0 = r1
    return poffs


# Rows per cuBLASLt GEMM in the forward: an expert's rows run as one GEMM over the largest multiple of
# GEMM_ROWS rows, in place, plus one GEMM_ROWS-row GEMM for the rest (its extra rows are the next expert's or
# zero padding: rows are independent, only the tail's own rows are kept). torch._scaled_mm checks no row count
# for blockwise scales, but cuBLASLt does: on the H200 (torch 2.11, cu130) row counts that are multiples of 16
# pass tests/ops/test_fp8_grouped_mm_cuda.py, and any count (GEMM_ROWS = 1) fails with
# CUBLAS_STATUS_NOT_SUPPORTED in its heuristic query.
GEMM_ROWS = 16


def _mm_into(out: Tensor, a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> None:
    """out = dequant(a) @ dequant(b).T, b in 128x128 blocks; out [M, Np] is written in place on CUDA (cuBLASLt
    writes y's rows, no copy: ``glm52::fp8_blockwise_mm``'s CUDA kernel with ``out``), elsewhere through the op."""
    if out.is_cuda:
        blockwise_scaled_mm(a[0], a[1], b[0], b[1], out.dtype, out=out)
    else:
        out.copy_(_mm(a, b, out.dtype))


def _expert_gemms(y: Tensor, a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], r0: int, r1: int,
                  gemm_rows: int, at: int | None = None) -> None:
    """y[at:at + r1 - r0] (``at`` r0 by default) = rows [r0, r1) of a times b: one GEMM over a multiple of
    gemm_rows rows written in place, then the tail through a gemm_rows-row GEMM (a has gemm_rows - 1 rows past
    the last expert's)."""
    at = r0 if at is None else at
    body = r0 + (r1 - r0) // gemm_rows * gemm_rows
    if body > r0:
        _mm_into(y[at:at + body - r0], (a[0][r0:body], a[1][r0:body]), b)
    if r1 > body:
        tail = (a[0][body:body + gemm_rows], a[1][body:body + gemm_rows])
        y[at + body - r0:at + r1 - r0] = _mm(tail, b, y.dtype)[:r1 - body]


def _forward(x: Tensor, ws: list[Tensor], offs: Tensor, quant: Quantisers, gemm_rows: int,
             rows: Tensor | None) -> list[Tensor]:
    """x @ w[e] per expert's rows for each w of ``ws`` (x[rows] with ``rows``): x quantised once, in y's row order,
    read where it is; one blockwise FP8 GEMM per expert and weight, written in place."""
    R = out_rows(x, rows)
    if R == 0 or ws[0].shape[0] == 0:
        return [x.new_zeros((R, w.shape[2])) for w in ws]
    ends = host_ints(offs)                                                       # the op's one host sync
    end = ends[-1]
    if end:
        dest = torch.arange(end, device=x.device)
        src = dest if rows is None else rows[:end]
        xq, xs = quant.rows(x, src, dest, end + gemm_rows - 1)                   # [end + pad, Kp], zero pad rows
    ys = []
    for w in ws:
        N = w.shape[2]
        Np = (N + BLOCK - 1) // BLOCK * BLOCK
        y = x.new_empty((R, Np))                                                 # the GEMMs' width: in place
        y[end:].zero_()                                                          # rows of no expert
        if end:
            wq, wsc = quant.blocks_t(w)                                          # [E, Np, Kp] blocks of w[e].T
            for e, r0, r1 in expert_groups(ends):
                _expert_gemms(y, (xq, xs), (wq[e], wsc[e]), r0, r1, gemm_rows)
        ys.append(y if Np == N else y[:, :N].contiguous())                       # N % 128: the op's [R, N]
    return ys


def _backward(dys: list[Tensor], x: Tensor, ws: list[Tensor], offs: Tensor, quant: Quantisers,
              rows: Tensor | None) -> tuple[Tensor, list[Tensor]]:
    """(dx, [dw_i]): dgrads with each dy in 1x128 tiles along N and the weight blocks of w[e], summed per row
    before dx is written (into each token's rows with ``rows``); wgrads with x (quantised once, read where it is)
    and each dy in 1x128 tiles along tokens, each expert's rows in 128-row slots so that no tile straddles two
    experts."""
    R, K = dys[0].shape[0], x.shape[1]
    if R == 0 or ws[0].shape[0] == 0:
        return torch.zeros_like(x), [torch.zeros_like(w) for w in ws]
    ends = host_ints(offs)                                                       # the op's one host sync
    slot_ends = _slot_ends(ends)                                                 # poffs on the host
    dws = [torch.zeros_like(w) for w in ws]
    if rows is None:
        dx = torch.empty_like(x)
        dx[ends[-1]:].zero_()                                                    # rows of no expert
    else:
        dx = token_sum(x, x.shape)                                               # [T, K], summed per token
    src, dest, poffs = group_slots(offs, R, BLOCK)
    xt = quant.cols(x, src if rows is None else rows[src], dest, poffs, slot_ends)  # experts one after the other
    grads = [(quant.rows(dy, src, dest, slot_ends[-1]), quant.blocks(w), quant.cols(dy, src, dest, poffs, slot_ends),
              dy.shape[1]) for dy, w in zip(dys, ws)]                            # [Rp, Np], [E, Kp, Np], flat
    for e, p0, p1, r0, r1 in _experts_with_rows(ends, slot_ends):
        parts = [_mm((dyq[p0:p1], dysc[p0:p1]), (wq[e], wsc[e]), x.dtype)[:r1 - r0, :K]
                 for (dyq, dysc), (wq, wsc), _, _ in grads]
        if rows is not None:
            sum_into_rows(dx, rows, r0, r1, *parts)
        elif len(parts) == 1:
            dx[r0:r1] = parts[0]
        else:
            torch.add(*parts, out=dx[r0:r1])                                     # one rounding of the sum
        for dw, (_, _, dyt, N) in zip(dws, grads):
            dw[e] = _mm(expert_cols(*xt, K, p0, p1), expert_cols(*dyt, N, p0, p1), dw.dtype)
    return dx.to(x.dtype), dws


def fp8_grouped_mm_kernel(x: Tensor, w: Tensor, offs: Tensor, quant: Quantisers = TORCH_QUANTISERS,
                          gemm_rows: int = GEMM_ROWS, rows: Tensor | None = None) -> Tensor:
    """y[g] = x[g] @ w[e] (x[rows] with ``rows``): x quantised in y's row order, read where it is, one blockwise
    FP8 GEMM per expert on its rows (``gemm_rows``: see :data:`GEMM_ROWS`, the op's)."""
    _check(x, w, offs, rows)
    return _forward(x, [w], offs, quant, gemm_rows, rows)[0]


def fp8_grouped_mm_bwd_kernel(dy: Tensor, x: Tensor, w: Tensor, offs: Tensor, quant: Quantisers = TORCH_QUANTISERS,
                              rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """dgrad with dy in 1x128 tiles along N and the weight blocks of w[e]; wgrad with x and dy in 1x128 tiles
    along tokens, each expert's rows in 128-row slots so that no tile straddles two experts. With ``rows`` the
    quantisers read x's rows where they are and each expert's dgrad adds into its tokens' rows of dx."""
    _check(x, w, offs, rows)
    dx, (dw,) = _backward([dy], x, [w], offs, quant, rows)
    return dx, dw


def fp8_grouped_mm_pair_kernel(x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor, quant: Quantisers = TORCH_QUANTISERS,
                               gemm_rows: int = GEMM_ROWS, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(x @ w1[e], x @ w2[e]) per expert's rows, x quantised once for both."""
    _check_pair(x, w1, w2, offs, rows)
    y1, y2 = _forward(x, [w1, w2], offs, quant, gemm_rows, rows)
    return y1, y2


def fp8_grouped_mm_pair_bwd_kernel(dy1: Tensor, dy2: Tensor, x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor,
                                   quant: Quantisers = TORCH_QUANTISERS,
                                   rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw1, dw2): x quantised once for both wgrads, both dgrads summed per row before dx is written."""
    _check_pair(x, w1, w2, offs, rows)
    dx, (dw1, dw2) = _backward([dy1, dy2], x, [w1, w2], offs, quant, rows)
    return dx, dw1, dw2


def fp8_grouped_mm_combine_kernel(x: Tensor, w: Tensor, offs: Tensor, order: Tensor, weight: Tensor,
                                  quant: Quantisers = TORCH_QUANTISERS, gemm_rows: int = GEMM_ROWS) -> Tensor:
    """out [T, N] = each expert's rows of x @ w[e] (the forward's GEMMs, into one expert-sized buffer reused
    expert after expert), weighted and added into their tokens' rows of an fp32 sum: the [R, N] rows never
    exist."""
    _check_combine(x, w, offs, order, weight)
    R, N = x.shape[0], w.shape[2]
    out = token_sum(x, (weight.shape[0], N))
    if R == 0 or w.shape[0] == 0:
        return out.to(x.dtype)
    ends = host_ints(offs)                                                       # the op's one host sync
    end, Np = ends[-1], (N + BLOCK - 1) // BLOCK * BLOCK
    if end:
        tok, wrow = combine_rows(order, weight)
        rows = torch.arange(end, device=x.device)
        xq, xs = quant.rows(x, rows, rows, end + gemm_rows - 1)                  # [end + pad, Kp], zero pad rows
        wq, ws = quant.blocks_t(w)                                               # [E, Np, Kp] blocks of w[e].T
        groups = list(expert_groups(ends))
        part = x.new_empty((max(r1 - r0 for _, r0, r1 in groups), Np))         # one expert's rows, reused
        for e, r0, r1 in groups:
            _expert_gemms(part, (xq, xs), (wq[e], ws[e]), r0, r1, gemm_rows, at=0)
            sum_into_rows(out, tok, r0, r1, part[:r1 - r0, :N], scale=wrow)
    return out.to(x.dtype)


def fp8_grouped_mm_combine_bwd_kernel(dout: Tensor, x: Tensor, w: Tensor, offs: Tensor, order: Tensor, weight: Tensor,
                                      quant: Quantisers = TORCH_QUANTISERS) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dweight) with g = dout[token] @ w[e].T per row: dout's rows are quantised where they are (each
    row's token's, unweighted: 1x128 tiles along N are per row, so the weight scales g after the GEMM), dx =
    weight * g, dweight = <x, g> in fp32 (the row's output dotted with its token's gradient, without the output),
    dw[e] = (weight * x[g]).T @ dout[token] (the weight rides on x, the [R, K] side, in the wgrad's tiles along
    tokens)."""
    _check_combine(x, w, offs, order, weight)
    R, K = x.shape
    dweight = torch.zeros_like(weight)
    if R == 0 or w.shape[0] == 0:
        return torch.zeros_like(x), torch.zeros_like(w), dweight
    ends = host_ints(offs)                                                       # the op's one host sync
    slot_ends = _slot_ends(ends)
    tok, wrow = combine_rows(order, weight)
    dx, dw = torch.empty_like(x), torch.zeros_like(w)
    dx[ends[-1]:].zero_()                                                        # rows of no expert
    per_row = wrow.new_zeros(R)
    src, dest, poffs = group_slots(offs, R, BLOCK)
    dyq, dys = quant.rows(dout, tok[src], dest, slot_ends[-1])                   # [Rp, Np], dout's rows in place
    wq, ws = quant.blocks(w)                                                     # [E, Kp, Np] blocks of w[e]
    xt = quant.cols(torch.mul(x, wrow[:, None], out=torch.empty_like(x)), src, dest, poffs, slot_ends)  # fp32 product
    dyt = quant.cols(dout, tok[src], dest, poffs, slot_ends)
    N = dout.shape[1]
    for e, p0, p1, r0, r1 in _experts_with_rows(ends, slot_ends):
        g = _mm((dyq[p0:p1], dys[p0:p1]), (wq[e], ws[e]), x.dtype)[:r1 - r0, :K]
        per_row[r0:r1] = (x[r0:r1].to(per_row.dtype) * g.to(per_row.dtype)).sum(-1)
        torch.mul(g, wrow[r0:r1, None], out=dx[r0:r1])                           # in fp32, stored in x's dtype
        dw[e] = _mm(expert_cols(*xt, K, p0, p1), expert_cols(*dyt, N, p0, p1), w.dtype)
    return dx, dw, set_assignments(dweight, order, per_row)


# ---------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("glm52::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, rows: Tensor | None = None) -> Tensor:
    """y[g] = x[g] @ w[e] per expert's row group (x[rows] with ``rows``), both operands tile-wise FP8, fp32
    accumulation."""
    return fp8_grouped_mm_kernel(x, w, offs, rows=rows)


@torch.library.custom_op("glm52::fp8_grouped_mm_bwd", mutates_args=())
def fp8_grouped_mm_bwd(dy: Tensor, x: Tensor, w: Tensor, offs: Tensor,
                       rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dx[g] = dy[g] @ w[e].T, dw[e] = x[g].T @ dy[g]) in FP8; experts with no rows get dw = 0. With ``rows``,
    dx [T, K] sums each token's rows."""
    return fp8_grouped_mm_bwd_kernel(dy, x, w, offs, rows=rows)


register_grouped_family("fp8_grouped_mm")                    # fakes, autograd, FLOPs: grouped_mm's


@torch.library.custom_op("glm52::fp8_grouped_mm_pair", mutates_args=())
def fp8_grouped_mm_pair(x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor,
                        rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``glm52::grouped_mm_pair`` in FP8: (x @ w1[e], x @ w2[e]), x quantised once for both."""
    return fp8_grouped_mm_pair_kernel(x, w1, w2, offs, rows=rows)


@torch.library.custom_op("glm52::fp8_grouped_mm_pair_bwd", mutates_args=())
def fp8_grouped_mm_pair_bwd(dy1: Tensor, dy2: Tensor, x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor,
                            rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw1, dw2) of ``glm52::fp8_grouped_mm_pair`` in FP8."""
    return fp8_grouped_mm_pair_bwd_kernel(dy1, dy2, x, w1, w2, offs, rows=rows)


register_pair_family("fp8_grouped_mm_pair")                  # fakes, autograd, FLOPs: grouped_mm_pair's


@torch.library.custom_op("glm52::fp8_grouped_mm_combine", mutates_args=())
def fp8_grouped_mm_combine(x: Tensor, w: Tensor, offs: Tensor, order: Tensor, weight: Tensor) -> Tensor:
    """``glm52::grouped_mm_combine`` in FP8: out[t] = sum_j weight[t, j] * (x @ w[e]) at assignment t * k + j's row."""
    return fp8_grouped_mm_combine_kernel(x, w, offs, order, weight)


@torch.library.custom_op("glm52::fp8_grouped_mm_combine_bwd", mutates_args=())
def fp8_grouped_mm_combine_bwd(dout: Tensor, x: Tensor, w: Tensor, offs: Tensor, order: Tensor,
                               weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dweight) of ``glm52::fp8_grouped_mm_combine`` in FP8."""
    return fp8_grouped_mm_combine_bwd_kernel(dout, x, w, offs, order, weight)


register_combine_family("fp8_grouped_mm_combine")            # fakes, autograd, FLOPs: grouped_mm_combine's


# ---------------------------------------------------------------------------------------------- reference
def ref_fp8_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, rows: Tensor | None = None) -> Tensor:
    """Fake-quant loop over experts in fp32 (the forward only): quantise x[g] (of x[rows] with ``rows``) in 1x128
    tiles and w[e].T in 128x128 blocks, dequantise, matmul; rows past offs[-1] are 0."""
    if rows is not None:
        x = x[rows]
    K, N = x.shape[1], w.shape[2]
    y, start = x.new_zeros((x.shape[0], N), dtype=torch.float32), 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            xd = dequantize(*quantize_1x128(x[start:end]))[:, :K]
            wd = dequantize(*quantize_128x128(w[e].t()))[:N, :K]
            y[start:end] = xd @ wd.T
        start = end
    return y.to(x.dtype)
