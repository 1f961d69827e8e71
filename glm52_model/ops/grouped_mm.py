"""Grouped GEMM for MoE experts: ``glm52::grouped_mm`` and its backward ``glm52::grouped_mm_bwd``; two of them
over the same rows, ``glm52::grouped_mm_pair`` (the SwiGLU's gate and up: the rows read once, the dgrads summed
before they are written); one with the routing's weighted sum into tokens, ``glm52::grouped_mm_combine``; each
with its ``_bwd`` op.

Rows of ``x`` are sorted by expert; ``offs`` (int32 [E], cumulative row counts) ends each expert's
group, so the number of rows per expert is data, not shape: one compiled graph serves every routing.

    x [R, K], w [E, K, N], offs [E] int32  ->  y [R, N],  y[g] = x[g] @ w[e] for group g of expert e

With ``rows`` (int [R]), row i of y reads row ``rows[i]`` of x [T, K] (the routed experts: each token's row once
per expert it picked, without materialising them): y[i] = x[rows[i]] @ w[e(i)], and dx [T, K] sums the gradients
of every row that read a token, expert by expert (an ``index_add`` per expert: a token picks an expert at most
once, so no two adds of one call land on one row and the sum has a fixed order).

``grouped_mm_combine(x, w, offs, order, weight)`` -> out [T, N] is the last GEMM of the routed experts and their
weighted sum: x's rows are the assignments ``order`` (sorted by expert; assignment t * k + j is token t's j-th
pick, weighted ``weight[t, j]``), out[t] = sum_j weight[t, j] * (x @ w[e]) at that assignment's row, added in
fp32 expert by expert the same way. Neither direction keeps the [R, N] rows: the backward takes the weight's
gradient as <x row, dout[token] @ w[e].T> (equal to <output row, dout[token]>) from the dgrad it computes anyway.
This module's kernels gather the rows they need (the bf16 family is the reference and the CPU's); the FP8
family's (:mod:`glm52_model.ops.fp8_grouped_mm`) quantise them where they are.

A custom op because ``aten._grouped_mm``'s meta function only accepts bf16 while the CPU tests run in
fp32; its kernels call ``torch._grouped_mm`` (CPU: any float dtype; CUDA: bf16, offs int32).
"""
from __future__ import annotations

import threading
import warnings

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ._trace import announced

__all__ = ["combine_rows", "expert_groups", "group_slots", "grouped_mm", "grouped_mm_bwd", "grouped_mm_combine",
           "grouped_mm_combine_bwd", "grouped_mm_pair", "grouped_mm_pair_bwd", "host_ints", "out_rows",
           "ref_grouped_mm", "register_combine_family", "register_grouped_family", "register_pair_family",
           "set_assignments", "slot_rows", "sum_into_rows", "token_sum"]

_TYPESTR = {torch.int32: "<i4", torch.int64: "<i8"}
_PINNED = threading.local()  # per thread (the forward's, autograd's): {(device, dtype): (pinned host, its device view)}


def _device_view(host: Tensor, device: torch.device) -> Tensor:
    """A CUDA tensor over pinned ``host`` memory (mapped into the device's address space): a kernel writes it
    over the bus."""
    class Mapped:
        __cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": _TYPESTR[host.dtype], "version": 3,
                                    "data": (host.data_ptr(), False), "strides": None}
    with torch.cuda.device(device):
        return torch.as_tensor(Mapped(), device=device)


def host_ints(t: Tensor) -> list[int]:
    """``t.tolist()`` for a small int32 or int64 tensor (an op's per-expert row ends). On a GPU a kernel writes the
    values into pinned host memory instead of a copy engine copying them, so the read does not queue behind the
    device-to-host copies running meanwhile (activation offloads: ~70 ms behind 4 GiB on an H100,
    ``benchmarks/host_read_beside_copies.py``); like ``tolist`` it waits for the current stream's work."""
    if t.device.type != "cuda" or t.dtype not in _TYPESTR:
        return t.tolist()
    flat, n = t.reshape(-1), t.numel()
    bufs = _PINNED.__dict__.setdefault("bufs", {})
    key = (t.device.index, t.dtype)
    if key not in bufs or bufs[key][0].numel() < n:
        host = torch.empty(max(n, 1024), dtype=t.dtype, pin_memory=True)
        try:
            bufs[key] = (host, _device_view(host, t.device))
        except (RuntimeError, TypeError, ValueError) as e:  # a torch that will not map pinned memory
            warnings.warn(f"glm52_model: the row counts are read with tolist() on {t.device}: a device view of "
                          f"pinned host memory failed ({e}); beside offload copies each read waits for them")
            bufs[key] = (host, None)
    host, view = bufs[key]
    if view is None:
        return t.tolist()
    torch.add(flat, 0, out=view[:n])  # an elementwise kernel: stores over the bus, no copy engine
    torch.cuda.current_stream(t.device).synchronize()
    return host[:n].tolist()


def _check(x: Tensor, w: Tensor, offs: Tensor, rows: Tensor | None = None) -> None:
    torch._check(x.dim() == 2 and w.dim() == 3 and x.shape[1] == w.shape[1],
                 lambda: f"grouped_mm: x [R, K] and w [E, K, N] needed, got {tuple(x.shape)}, {tuple(w.shape)}")
    torch._check(offs.dim() == 1 and offs.shape[0] == w.shape[0] and offs.dtype == torch.int32,
                 lambda: f"grouped_mm: offs must be int32 [E={w.shape[0]}], got {offs.dtype} {tuple(offs.shape)}")
    if rows is not None:
        torch._check(rows.dim() == 1 and rows.dtype in (torch.int32, torch.int64),
                     lambda: f"grouped_mm: rows must be int32 or int64 [R] (x's row of each of y's rows), got "
                             f"{rows.dtype} {tuple(rows.shape)}")


def _check_pair(x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor, rows: Tensor | None) -> None:
    _check(x, w1, offs, rows)
    _check(x, w2, offs, rows)


def expert_groups(ends: list[int]):
    """(e, r0, r1): each expert with rows, its rows [r0, r1), from the group ends on the host."""
    r0 = 0
    for e, r1 in enumerate(ends):
        if r1 > r0:
            yield e, r0, r1
        r0 = r1


def out_rows(x: Tensor, rows: Tensor | None) -> int:
    """R, y's rows: x's, or one per entry of ``rows``."""
    return x.shape[0] if rows is None else rows.shape[0]


def sum_into_rows(acc: Tensor, rows: Tensor, r0: int, r1: int, *parts: Tensor, scale: Tensor | None = None) -> None:
    """acc[rows[r0:r1]] += the sum of ``parts`` (times ``scale[r0:r1]`` per row), in acc's dtype: one expert's rows
    [r0, r1) in one ``index_add``, whose adds land on distinct rows when the expert's rows name distinct tokens, so
    the sum does not depend on the device's order (the experts', one call after the other)."""
    first, *more = parts
    src = (first.to(acc.dtype, copy=bool(more)) if scale is None
           else first * scale[r0:r1, None].to(acc.dtype))                        # one pass: cast and scale
    for part in more:
        src.add_(part)
    acc.index_add_(0, rows[r0:r1], src)


def token_sum(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A zeroed per-token accumulator of rows like x's: fp32 (or x's dtype if wider), cast to x's dtype once."""
    return x.new_zeros(shape, dtype=torch.promote_types(x.dtype, torch.float32))


def _check_combine(x: Tensor, w: Tensor, offs: Tensor, order: Tensor, weight: Tensor) -> None:
    _check(x, w, offs)
    torch._check(weight.dim() == 2 and weight.is_floating_point(),
                 lambda: f"grouped_mm_combine: weight must be a float [T, k] (each token's k routing weights), got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    torch._check(order.dim() == 1 and order.dtype in (torch.int32, torch.int64)
                 and order.shape[0] == x.shape[0] == weight.shape[0] * weight.shape[1],
                 lambda: f"grouped_mm_combine: order must be int32 or int64 [R = T * k] (the assignment t * k + j "
                         f"of each of x's rows), got {order.dtype} {tuple(order.shape)} for x {tuple(x.shape)} and "
                         f"weight {tuple(weight.shape)}")


def combine_rows(order: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's token and routing weight (fp32 or wider) when the rows are the assignments ``order`` of
    each token's k picks: row i is assignment order[i], of token order[i] // k, weighted weight.flatten()[order[i]]."""
    wide = torch.promote_types(weight.dtype, torch.float32)
    return order // weight.shape[1], weight.reshape(-1)[order].to(wide)


def set_assignments(dweight: Tensor, order: Tensor, per_row: Tensor) -> Tensor:
    """dweight [T, k] with assignment order[i] set to per_row[i] (every assignment is one row)."""
    dweight.view(-1)[order] = per_row.to(dweight.dtype)
    return dweight


def _forward(x: Tensor, ws: list[Tensor], offs: Tensor, rows: Tensor | None) -> list[Tensor]:
    """x @ w[e] per expert's rows for each w of ``ws`` (x[rows] with ``rows``), x gathered once."""
    xs = (x if rows is None else x[rows]).contiguous()                           # this family gathers them
    return [_zero_tail(torch._grouped_mm(xs, w.contiguous(), offs=offs), offs) for w in ws]


def _backward(dys: list[Tensor], x: Tensor, ws: list[Tensor], offs: Tensor,
              rows: Tensor | None) -> tuple[Tensor, list[Tensor]]:
    """(dx = sum_i dy_i[g] @ w_i[e].T, [dw_i[e] = x[g].T @ dy_i[g]]); with ``rows``, dx [T, K] sums each token's
    rows."""
    xs = x if rows is None else x[rows]
    dys = [dy.contiguous() for dy in dys]
    parts = [_zero_tail(torch._grouped_mm(dy, w.transpose(1, 2).contiguous(), offs=offs), offs)
             for dy, w in zip(dys, ws)]
    # dw reads x.T [K, R] grouped along its columns; _grouped_mm needs every group (and the row stride)
    # to span a multiple of 16 bytes, so each expert's rows are copied into a zero-padded slot
    dws = []
    for dy in dys:
        xp, dyp, poffs = _align_groups(xs, dy, offs, max(1, 16 // x.element_size()))
        dws.append(torch._grouped_mm(xp.t().contiguous(), dyp, offs=poffs))
    if rows is None:
        return sum(parts[1:], parts[0]), dws
    dx = token_sum(x, x.shape)
    for _, r0, r1 in expert_groups(host_ints(offs)):
        sum_into_rows(dx, rows, r0, r1, *(p[r0:r1] for p in parts))
    return dx.to(x.dtype), dws


@torch.library.custom_op("glm52::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor, rows: Tensor | None = None) -> Tensor:
    """y[g] = x[g] @ w[e] for each expert's contiguous row group (x[rows] for x with ``rows``)."""
    _check(x, w, offs, rows)
    return _forward(x, [w], offs, rows)[0]


@torch.library.custom_op("glm52::grouped_mm_bwd", mutates_args=())
def grouped_mm_bwd(dy: Tensor, x: Tensor, w: Tensor, offs: Tensor,
                   rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dx = dy[g] @ w[e].T, dw[e] = x[g].T @ dy[g]); experts with no rows get dw = 0. With ``rows``, dx [T, K]
    sums each token's rows."""
    dx, (dw,) = _backward([dy], x, [w], offs, rows)
    return dx, dw


@torch.library.custom_op("glm52::grouped_mm_pair", mutates_args=())
def grouped_mm_pair(x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor,
                    rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(x @ w1[e], x @ w2[e]) per expert's rows: ``grouped_mm`` twice over the same rows (the SwiGLU's gate and
    up), which are read once."""
    _check_pair(x, w1, w2, offs, rows)
    y1, y2 = _forward(x, [w1, w2], offs, rows)
    return y1, y2


@torch.library.custom_op("glm52::grouped_mm_pair_bwd", mutates_args=())
def grouped_mm_pair_bwd(dy1: Tensor, dy2: Tensor, x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor,
                        rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw1, dw2): dx sums both GEMMs' dgrads (each token's rows with ``rows``) before it is written."""
    dx, (dw1, dw2) = _backward([dy1, dy2], x, [w1, w2], offs, rows)
    return dx, dw1, dw2


def _zero_tail(y: Tensor, offs: Tensor) -> Tensor:
    """Rows past offs[-1] belong to no expert: _grouped_mm leaves them unwritten, the op defines them 0."""
    if offs.numel():
        y[int(offs[-1]):] = 0
    return y


def group_slots(offs: Tensor, rows: int, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """Where each expert's rows go when every group is padded to a multiple of ``align`` rows.

    Returns ``src`` (the row ids that belong to an expert: rows past offs[-1] are dropped), ``dest`` (their
    rows in the padded layout) and ``poffs`` (int32 [E], the padded group ends). Eager only: the caller reads
    the padded total, ``int(poffs[-1])``.
    """
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()                 # [E]
    padded = (counts + align - 1) // align * align
    poffs = torch.cumsum(padded, 0)
    src = torch.arange(rows, device=offs.device)
    group = torch.searchsorted(offs.long(), src, right=True)                    # expert of each row
    keep = group < offs.shape[0]
    src, group = src[keep], group[keep]
    dest = (poffs - padded)[group] + src - (offs.long() - counts)[group]
    return src, dest, poffs.to(torch.int32)


def slot_rows(x: Tensor, src: Tensor, dest: Tensor, total: int) -> Tensor:
    """Rows ``src`` of x at rows ``dest`` of a zeroed [total, ...] tensor (the layout of :func:`group_slots`)."""
    xp = x.new_zeros((total, *x.shape[1:]))
    xp[dest] = x[src]
    return xp


def _align_groups(x: Tensor, dy: Tensor, offs: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """Copy each expert's rows of x and dy into slots padded to a multiple of ``align`` rows (rows past
    offs[-1] belong to no expert and are dropped)."""
    src, dest, poffs = group_slots(offs, x.shape[0], align)
    total = int(poffs[-1]) if offs.numel() else 0
    return slot_rows(x, src, dest, total), slot_rows(dy, src, dest, total), poffs


def _register(name: str, fake, fake_bwd, backward, setup_context, flops, flops_bwd) -> None:
    """A forward / backward op pair's fakes, autograd and FLOP formulas."""
    torch.library.register_fake(f"glm52::{name}")(announced(f"glm52::{name}")(fake))
    torch.library.register_fake(f"glm52::{name}_bwd")(announced(f"glm52::{name}_bwd")(fake_bwd))
    torch.library.register_autograd(f"glm52::{name}", backward, setup_context=setup_context)
    register_flop_formula(getattr(torch.ops.glm52, name))(flops)
    register_flop_formula(getattr(torch.ops.glm52, f"{name}_bwd"))(flops_bwd)


def register_grouped_family(name: str) -> None:
    """Fakes, autograd and FLOP formulas of a grouped GEMM pair ``glm52::<name>`` / ``glm52::<name>_bwd`` with
    this module's contract: the forward saves (x, w, offs) and its backward is the ``_bwd`` op. Shared by the
    bf16 family here and the FP8 one (:mod:`glm52_model.ops.fp8_grouped_mm`)."""
    bwd = getattr(torch.ops.glm52, f"{name}_bwd")

    def fake(x, w, offs, rows=None):
        _check(x, w, offs, rows)
        return x.new_empty((out_rows(x, rows), w.shape[2]))

    def fake_bwd(dy, x, w, offs, rows=None):
        _check(x, w, offs, rows)
        return torch.empty_like(x), torch.empty_like(w)

    def setup_context(ctx, inputs, output):
        x, w, offs, rows = inputs
        ctx.save_for_backward(x, w, offs, rows)

    def backward(ctx, dy):
        x, w, offs, rows = ctx.saved_tensors
        dx, dw = bwd(dy, x, w, offs, rows)
        return dx, dw, None, None

    def flops(x_shape, w_shape, offs_shape, rows_shape=None, *args, **kwargs) -> int:
        return 2 * (rows_shape or x_shape)[0] * x_shape[1] * w_shape[2]

    def flops_bwd(dy_shape, x_shape, w_shape, offs_shape, rows_shape=None, *args, **kwargs) -> int:
        return 4 * dy_shape[0] * x_shape[1] * w_shape[2]

    _register(name, fake, fake_bwd, backward, setup_context, flops, flops_bwd)


register_grouped_family("grouped_mm")


def register_pair_family(name: str) -> None:
    """Fakes, autograd and FLOP formulas of ``glm52::<name>`` / ``glm52::<name>_bwd``, two grouped GEMMs of the
    same rows (x, w1, w2, offs, rows) -> (y1, y2): the forward saves its inputs and its backward is the ``_bwd``
    op. Shared by the bf16 family here and the FP8 one."""
    bwd = getattr(torch.ops.glm52, f"{name}_bwd")

    def fake(x, w1, w2, offs, rows=None):
        _check_pair(x, w1, w2, offs, rows)
        return x.new_empty((out_rows(x, rows), w1.shape[2])), x.new_empty((out_rows(x, rows), w2.shape[2]))

    def fake_bwd(dy1, dy2, x, w1, w2, offs, rows=None):
        _check_pair(x, w1, w2, offs, rows)
        return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, dy1, dy2):
        x, w1, w2, offs, rows = ctx.saved_tensors
        dx, dw1, dw2 = bwd(dy1, dy2, x, w1, w2, offs, rows)
        return dx, dw1, dw2, None, None

    def flops(x_shape, w1_shape, w2_shape, offs_shape, rows_shape=None, *args, **kwargs) -> int:
        return 2 * (rows_shape or x_shape)[0] * x_shape[1] * (w1_shape[2] + w2_shape[2])

    def flops_bwd(dy1_shape, dy2_shape, x_shape, w1_shape, w2_shape, *args, **kwargs) -> int:
        return 4 * dy1_shape[0] * x_shape[1] * (w1_shape[2] + w2_shape[2])

    _register(name, fake, fake_bwd, backward, setup_context, flops, flops_bwd)


register_pair_family("grouped_mm_pair")


@torch.library.custom_op("glm52::grouped_mm_combine", mutates_args=())
def grouped_mm_combine(x: Tensor, w: Tensor, offs: Tensor, order: Tensor, weight: Tensor) -> Tensor:
    """out [T, N]: y = grouped_mm(x, w, offs) weighted and summed into tokens, out[t] = sum_j weight[t, j] *
    y[the row of assignment t * k + j] (rows are the assignments ``order``), in fp32, expert by expert."""
    _check_combine(x, w, offs, order, weight)
    (y,) = _forward(x, [w], offs, None)
    tok, wrow = combine_rows(order, weight)
    out = token_sum(x, (weight.shape[0], w.shape[2]))
    for _, r0, r1 in expert_groups(host_ints(offs)):
        sum_into_rows(out, tok, r0, r1, y[r0:r1], scale=wrow)
    return out.to(x.dtype)


@torch.library.custom_op("glm52::grouped_mm_combine_bwd", mutates_args=())
def grouped_mm_combine_bwd(dout: Tensor, x: Tensor, w: Tensor, offs: Tensor, order: Tensor,
                           weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dweight): with g = dout[token] @ w[e].T per row, dx = weight * g, dweight = <x, g> (the row's
    output dotted with its token's gradient, without the output), dw[e] = (weight * x[g]).T @ dout[token]."""
    tok, wrow = combine_rows(order, weight)
    dys = dout[tok].contiguous()                                                 # this family gathers them
    g = _zero_tail(torch._grouped_mm(dys, w.transpose(1, 2).contiguous(), offs=offs), offs)
    dweight = set_assignments(torch.zeros_like(weight), order, (x.to(wrow.dtype) * g.to(wrow.dtype)).sum(-1))
    xw = torch.mul(x, wrow[:, None], out=torch.empty_like(x))                   # in fp32, stored in x's dtype
    xp, dyp, poffs = _align_groups(xw, dys, offs, max(1, 16 // x.element_size()))
    dw = torch._grouped_mm(xp.t().contiguous(), dyp, offs=poffs)
    return torch.mul(g, wrow[:, None], out=torch.empty_like(x)), dw, dweight


def register_combine_family(name: str) -> None:
    """Fakes, autograd and FLOP formulas of a grouped GEMM with the routing's weighted sum into tokens,
    ``glm52::<name>`` / ``glm52::<name>_bwd`` (x [R, K], w, offs, order [R], weight [T, k] -> out [T, N]): the
    forward saves its inputs, not its [R, N] rows, and its backward is the ``_bwd`` op. Shared by the bf16
    family here and the FP8 one."""
    bwd = getattr(torch.ops.glm52, f"{name}_bwd")

    def fake(x, w, offs, order, weight):
        _check_combine(x, w, offs, order, weight)
        return x.new_empty((weight.shape[0], w.shape[2]))

    def fake_bwd(dout, x, w, offs, order, weight):
        _check_combine(x, w, offs, order, weight)
        return torch.empty_like(x), torch.empty_like(w), torch.empty_like(weight)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, dout):
        dx, dw, dweight = bwd(dout, *ctx.saved_tensors)
        return dx, dw, None, None, dweight

    def flops(x_shape, w_shape, *args, **kwargs) -> int:
        return 2 * x_shape[0] * x_shape[1] * w_shape[2]

    def flops_bwd(dout_shape, x_shape, w_shape, *args, **kwargs) -> int:
        return 4 * x_shape[0] * x_shape[1] * w_shape[2]

    _register(name, fake, fake_bwd, backward, setup_context, flops, flops_bwd)


register_combine_family("grouped_mm_combine")


def ref_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, rows: Tensor | None = None) -> Tensor:
    """Loop over experts with plain matmuls (differentiable); ``rows`` gathers x's rows first."""
    if rows is not None:
        x = x[rows]
    outs, start = [], 0
    for e, end in enumerate(offs.tolist()):
        outs.append(x[start:end] @ w[e])
        start = end
    outs.append(x.new_zeros((x.shape[0] - start, w.shape[2])))                     # rows past offs[-1]
    return torch.cat(outs)
