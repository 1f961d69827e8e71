"""Lossy 8-bit packing of floating activations, for the offload runtime's ``ModelPlan(compress=...)``.

A value of ``n`` elements (bf16, fp16 or fp32), read in row-major order, is cut into tiles of 128 consecutive
elements; each tile keeps one fp32 scale and its elements in one byte each, in one of two formats
(:data:`FORMATS`):

- ``"fp8"``: float8 e4m3, the scale ``amax * (1 / 448)``, elements ``x / scale`` rounded to nearest. An element
  comes back within 1/16 of its own magnitude (three mantissa bits), and elements below ``amax * 2**-9`` within
  ``amax * 2**-10`` (e4m3's subnormals): a relative error whatever the element's size in its tile.
- ``"int8"``: the scale ``amax * (1 / 127)``, elements ``floor(x / scale + 1/2)`` as int8. Every element comes back
  within ``amax / 254`` of itself: an absolute error, about a quarter of e4m3's on Gaussian-like tiles (1/128 of
  the tile's largest element against e4m3's 1/16 of each element's own), larger on an element much smaller than
  an outlier in its tile.

The packed form takes ``n + 4 * ceil(n / 128)`` bytes in either: 0.52 of a bf16 value, 0.26 of an fp32 one. A
tile holding an inf or a NaN comes back as NaN: a step that overflowed stays visibly broken. Integer and bool
values (indices, masks: discrete decisions) are never packed: :func:`pack` refuses them.

On a GPU the tile loop is one Triton kernel each way (what the runtime runs); elsewhere, and as the reference
the GPU kernels are tested against, the same arithmetic in PyTorch ops, a bounded chunk at a time.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from .errors import OffloadError

__all__ = ["COMPRESSIBLE", "FORMATS", "TILE", "BF16_RATIO", "packed_bytes", "pack", "unpack", "pack_reference",
           "unpack_reference"]

TILE = 128  # elements per scale
FORMATS = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}  # format: (element dtype, largest)
COMPRESSIBLE = (torch.bfloat16, torch.float16, torch.float32)
BF16_RATIO = (1 + 4 / TILE) / 2  # packed bytes per byte of a bf16 value
_CHUNK = 1 << 24  # elements per step of the PyTorch path (its fp32 temporaries stay at 64 MiB)


def packed_bytes(numel: int) -> int:
    """Bytes of the packed form of ``numel`` elements: one byte each and one fp32 scale per tile."""
    return numel + 4 * (-(-numel // TILE))


def _format(fmt: str) -> tuple[torch.dtype, float]:
    if fmt not in FORMATS:
        raise OffloadError(f"sacpass: {fmt!r} is not a packing format; pass one of {', '.join(map(repr, FORMATS))}.")
    return FORMATS[fmt]


def _check(x: Tensor) -> None:
    if x.dtype not in COMPRESSIBLE:
        raise OffloadError(f"sacpass: 8-bit compression packs floating activations "
                           f"({', '.join(map(str, COMPRESSIBLE))}); "
                           f"a {x.dtype} value {tuple(x.shape)} is not one (indices and masks are discrete decisions "
                           f"and are never compressed). Offload it as it is.")


def _scales(tiles: Tensor, largest: float) -> Tensor:
    amax = tiles.abs().amax(dim=-1)
    # amax * (1 / largest) in fp32: a product, the same rounding on every device, as the kernel computes it
    return torch.where(amax > 0, amax * (1.0 / largest), torch.ones_like(amax))


def _empty_packed(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``x``'s elements in row-major order (a view when ``x`` is contiguous, else a copy), and its packed
    form's buffers: the one-byte elements (``dtype``) and the fp32 scales."""
    flat = x.reshape(-1)
    n = flat.numel()
    return flat, torch.empty(n, dtype=dtype, device=x.device), torch.empty(-(-n // TILE), dtype=torch.float32,
                                                                           device=x.device)


def _chunks(flat: Tensor):
    """(start, element count, the chunk as fp32 tiles of TILE, the last one zero-padded) over ``flat``, a bounded
    chunk at a time (chunks start on a tile)."""
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK].float()
        yield start, part.numel(), torch.nn.functional.pad(part, (0, -part.numel() % TILE)).view(-1, TILE)


def pack_reference(x: Tensor, fmt: str = "fp8") -> tuple[Tensor, Tensor]:
    """(elements [n] in ``fmt``'s dtype, scales as fp32 [ceil(n / 128)]) in PyTorch ops; see the module
    docstring."""
    dtype, largest = _format(fmt)
    _check(x)
    flat, q, s = _empty_packed(x, dtype)
    for start, m, tiles in _chunks(flat):
        scale = _scales(tiles, largest)
        vals = (tiles / scale[:, None]).clamp_(-largest, largest)
        if not dtype.is_floating_point:
            vals = torch.floor(vals + 0.5)
        q[start:start + m] = vals.to(dtype).view(-1)[:m]
        s[start // TILE:start // TILE + scale.numel()] = scale
    return q, s


def unpack_reference(q: Tensor, s: Tensor, out: Tensor) -> Tensor:
    """Write the unpacked values into ``out`` (contiguous, the value's shape and dtype) and return it."""
    flat = out.view(-1)
    for start, m, tiles in _chunks(q):
        vals = tiles * s[start // TILE:start // TILE + tiles.shape[0], None]
        flat[start:start + m] = vals.view(-1)[:m].to(out.dtype)
    return out


@functools.cache
def _kernels():
    """The Triton kernels (None where Triton is missing)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def pack_kernel(x_ptr, q_ptr, s_ptr, n, LARGEST: tl.constexpr, INV_MAX: tl.constexpr, INT: tl.constexpr,
                    ROWS: tl.constexpr, TILE_: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * TILE_ + tl.arange(0, TILE_)[None, :]
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, amax * INV_MAX, 1.0)
        vals = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        vals = tl.minimum(tl.maximum(vals, -LARGEST), LARGEST)
        if INT:
            vals = tl.floor(vals + 0.5)
        tl.store(q_ptr + offs, vals.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows, scale, mask=rows * TILE_ < n)

    @triton.jit
    def unpack_kernel(q_ptr, s_ptr, out_ptr, n, ROWS: tl.constexpr, TILE_: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * TILE_ + tl.arange(0, TILE_)[None, :]
        mask = offs < n
        q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(s_ptr + rows, mask=rows * TILE_ < n, other=1.0)
        tl.store(out_ptr + offs, (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)

    return triton, pack_kernel, unpack_kernel


_ROWS = 32


def _use_triton(x: Tensor) -> bool:
    return x.is_cuda and _kernels() is not None


def pack(x: Tensor, fmt: str = "fp8") -> tuple[Tensor, Tensor]:
    """``x`` packed in ``fmt`` (:data:`FORMATS`): (its one-byte elements [n], fp32 scales [ceil(n / 128)]), on
    ``x``'s device and stream."""
    dtype, largest = _format(fmt)
    _check(x)
    if not _use_triton(x):
        return pack_reference(x, fmt)
    triton, pack_kernel, _ = _kernels()
    flat, q, s = _empty_packed(x, dtype)
    n = flat.numel()
    if n:
        with torch.cuda.device(x.device):
            pack_kernel[(triton.cdiv(s.numel(), _ROWS),)](flat, q, s, n, LARGEST=largest, INV_MAX=1.0 / largest,
                                                          INT=not dtype.is_floating_point, ROWS=_ROWS, TILE_=TILE)
    return q, s


def unpack(q: Tensor, s: Tensor, out: Tensor) -> Tensor:
    """Write the values ``q`` and ``s`` pack into ``out`` (the value's shape, strides and dtype); returns ``out``.
    The format is ``q``'s dtype."""
    if not out.is_contiguous():  # the packed form is row-major
        return out.copy_(unpack(q, s, torch.empty(out.shape, dtype=out.dtype, device=out.device)))
    if not _use_triton(out):
        return unpack_reference(q, s, out)
    triton, _, unpack_kernel = _kernels()
    flat = out.view(-1)
    n = q.numel()
    if n:
        with torch.cuda.device(out.device):
            unpack_kernel[(triton.cdiv(s.numel(), _ROWS),)](q, s, flat, n, ROWS=_ROWS, TILE_=TILE)
    return out
