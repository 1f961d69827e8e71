"""Bytes: what a value takes in sacpass's host pool, and the layout of its host copy. Pure functions, read by
the planner at compile time and by the runtime."""
from __future__ import annotations

import torch
from torch import Tensor

from .. import compression

__all__ = ["ALIGN", "pool_bytes", "packs", "packed_pool_bytes", "host_pool_bytes", "dense", "host_layout",
           "format_bytes"]

ALIGN = 512  # bytes: every block of the pool starts and ends on this boundary


def pool_bytes(nbytes: int) -> int:
    """The pool bytes one offloaded tensor of ``nbytes`` takes (its block: rounded up to ``ALIGN``)."""
    return -(-nbytes // ALIGN) * ALIGN


def packs(dtype: torch.dtype, compress: str | None) -> bool:
    """Whether a value of ``dtype`` goes to the host packed under a plan that compresses (``compress``: its packing
    format, None for none; floating values only)."""
    return compress is not None and dtype in compression.COMPRESSIBLE


def packed_pool_bytes(numel: int) -> int:
    """The pool bytes of ``numel`` elements packed: the blocks of the elements and of their scales."""
    return pool_bytes(numel) + pool_bytes(compression.packed_bytes(numel) - numel)


def host_pool_bytes(numel: int, dtype: torch.dtype, compress: str | None = None) -> int:
    """The pool bytes a value of ``numel`` elements of ``dtype`` takes on the host: its block, or with
    ``compress`` and a floating dtype the blocks of its one-byte elements and their scales
    (:mod:`sacpass.compression`)."""
    return packed_pool_bytes(numel) if packs(dtype, compress) else pool_bytes(numel * dtype.itemsize)


def dense(x: Tensor) -> bool:
    """Whether ``x``'s elements fill one span of memory, each once (its dims, by stride, step over each other
    exactly). Sizes and strides known: a few integer steps, as the runtime needs once per value it places (PyTorch's
    own check builds a class at every call on some versions, milliseconds a region). Symbolic ones (a graph
    compiled with dynamic shapes): PyTorch's check, which answers False rather than guard."""
    sizes, strides = x.shape, x.stride()
    if not all(type(v) is int for v in (*sizes, *strides)):
        return torch._prims_common.is_non_overlapping_and_dense_or_false(x)
    if x.numel() < 2:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(sizes, strides) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def host_layout(x: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(sizes, strides, bytes) of ``x``'s host copy: its own strides where they are dense, else contiguous."""
    shape = tuple(x.shape)
    if dense(x):
        stride = tuple(x.stride())
    else:
        stride = tuple(torch._prims_common.make_contiguous_strides_for(shape)) if shape else ()
    extent = 0 if x.numel() == 0 else 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    return shape, stride, extent * x.element_size()


def format_bytes(nbytes: int) -> str:
    """GiB from one up, bytes below (a small limit reads as what it is)."""
    return f"{nbytes / 2 ** 30:.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes} bytes"
