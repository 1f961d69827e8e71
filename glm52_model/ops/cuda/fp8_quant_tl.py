"""TileLang kernels for the tile-wise FP8 quantisation of the routed experts (``glm52::fp8_grouped_mm``).

The PyTorch quantisers of :mod:`glm52_model.ops.fp8` take ~6 passes over an fp32 copy of their input. These kernels
read the bf16 input once and write the fp8 data and its scales once, with the same math as PyTorch on CUDA, bit for
bit: scale = max(amax, 1e-12) * fp32(1/448) (PyTorch's CUDA
division by a Python scalar multiplies by the scalar's fp32 reciprocal), q = clamp(x / scale, +-448) cast to
e4m3 (IEEE division: TileLang builds without fast math):

1. ``quant_rows``: 1x128 tiles along a row -> q [Rp, Kp], scales [Rp, Kp/128]. A row map (int32, -1 for a
   zero row) says which input row each output row reads, so the experts' 128-row slots are filled in the
   same pass (no gather copy).
2. ``quant_cols``: 1x128 tiles along the rows, written transposed and slot after slot (each expert's [C, slot
   rows] operand contiguous, so the weight-gradient GEMMs read it in place), through the same row map.
3. ``quant_blocks``: 128x128 blocks of a batch of matrices -> q [B, Np, Kp], scales [B, Np/128, Kp/128], or
   the blocks of each matrix's transpose (the forward's w[e].T), written transposed through shared memory.

Each builder takes its tunables as a small frozen config (:class:`RowsConfig`, :class:`ColsConfig`,
:class:`BlocksConfig`; the defaults are what the ops run). ``ci_builds`` lists one build of each for CI (sm_90a, on
the CPU). The dense FP8 linears' ``glm52::fp8_quantize`` runs these kernels on CUDA too.
"""

import functools
from dataclasses import dataclass

import torch

import tilelang
import tilelang.language as T

from ._common import cuda_target, round_up
from .ahead import kernel_cache, on_trace, static

FP8_MAX = 448.0
INV_FP8_MAX = (torch.tensor(1.0) / torch.tensor(FP8_MAX)).item()   # the fp32 reciprocal, exact as a double
EPS = 1e-12
TILE = 128
_DTYPES = {torch.bfloat16: T.bfloat16, torch.float32: T.float32, torch.float16: T.float16}


def _quant(v, scale):
    return T.Cast(T.float8_e4m3fn, T.clamp(v / scale, -FP8_MAX, FP8_MAX))


def _scale(amax):
    return T.max(amax, EPS) * INV_FP8_MAX


@dataclass(frozen=True)
class RowsConfig:
    """``quant_rows``' tunables."""

    block_M: int = 32       # rows a CTA (the row map holds a multiple of it)
    threads: int = 128


@dataclass(frozen=True)
class ColsConfig:
    """``quant_cols``' tunables."""

    block_C: int = 64       # columns a CTA (one amax per thread)
    threads: int = 128


@dataclass(frozen=True)
class BlocksConfig:
    """``quant_blocks``' tunables."""

    threads: int = 256


def build_quant_rows(cols: int, in_dtype=T.bfloat16, config: RowsConfig = RowsConfig()):
    """x [rows_in, cols] -> q [rows_out, Kp] fp8, s [rows_out, Kp/128]; rows_out a multiple of block_M."""
    block_M, threads = config.block_M, config.threads
    kp = round_up(cols, TILE)
    rows_in = T.dynamic("rows_in")
    rows_out = T.dynamic("rows_out")

    @T.prim_func
    def quant_rows(
        X: T.Tensor([rows_in, cols], in_dtype),
        RowMap: T.Tensor([rows_out], T.int32),
        Q: T.Tensor([rows_out, kp], T.float8_e4m3fn),
        S: T.Tensor([rows_out, kp // TILE], T.float32),
    ):
        with T.Kernel(T.ceildiv(rows_out, block_M), kp // TILE, threads=threads) as (bx, by):
            x = T.alloc_fragment([block_M, TILE], T.float32)
            amax = T.alloc_fragment([block_M], T.float32)
            r0, c0 = bx * block_M, by * TILE
            for i, j in T.Parallel(block_M, TILE):
                src = RowMap[r0 + i]
                x[i, j] = T.if_then_else((src >= 0) & (c0 + j < cols), T.Cast(T.float32, X[src, c0 + j]), 0.0)
            T.reduce_absmax(x, amax, dim=1)
            for i in T.Parallel(block_M):
                amax[i] = _scale(amax[i])
            for i, j in T.Parallel(block_M, TILE):
                Q[r0 + i, c0 + j] = _quant(x[i, j], amax[i])
            for i in T.Parallel(block_M):
                S[r0 + i, by] = amax[i]

    return quant_rows


def build_quant_cols(cols: int, in_dtype=T.bfloat16, config: ColsConfig = ColsConfig()):
    """x [rows_in, cols] -> 1x128 tiles along the rows, transposed, expert after expert: the 128-row tile ``t``
    of slot [p0, p1) (TileBase[t] = p0 / 128, TileWidth[t] = (p1 - p0) / 128) goes to the slot's [cols, p1 - p0]
    matrix, which starts at element cols * p0 of the flat q [cols * rows_out] (scales: cols * p0 / 128 of the
    flat s). One slot over all rows is the plain transposed layout [cols, rows_out]."""
    block_C, threads = config.block_C, config.threads
    rows_in = T.dynamic("rows_in")
    rows_out = T.dynamic("rows_out")

    @T.prim_func
    def quant_cols(
        X: T.Tensor([rows_in, cols], in_dtype),
        RowMap: T.Tensor([rows_out], T.int32),
        TileBase: T.Tensor([rows_out // TILE], T.int32),
        TileWidth: T.Tensor([rows_out // TILE], T.int32),
        Q: T.Tensor([cols * rows_out // TILE, TILE], T.float8_e4m3fn),
        S: T.Tensor([cols * rows_out // TILE], T.float32),
    ):
        with T.Kernel(T.ceildiv(cols, block_C), rows_out // TILE, threads=threads) as (bx, by):
            xs = T.alloc_shared([TILE, block_C + 1], T.float32)     # +1: a column's reads hit 32 banks
            scale = T.alloc_shared([block_C], T.float32)
            m = T.alloc_var(T.float32)
            tx = T.get_thread_binding()
            c0 = bx * block_C
            base, width = TileBase[by], TileWidth[by]
            for i, j in T.Parallel(TILE, block_C):                     # coalesced along the input's row
                src = RowMap[by * TILE + i]
                xs[i, j] = T.if_then_else((src >= 0) & (c0 + j < cols), T.Cast(T.float32, X[src, c0 + j]), 0.0)
            T.sync_threads()
            if tx < block_C:                                           # one column's amax per thread
                m = 0.0
                for i in T.serial(TILE):
                    m = T.max(m, T.abs(xs[i, tx]))
                scale[tx] = _scale(m)
            T.sync_threads()
            for j, i in T.Parallel(block_C, TILE):                     # coalesced along the output's row
                if c0 + j < cols:
                    Q[base * cols + (c0 + j) * width + by - base, i] = _quant(xs[i, j], scale[j])
            for j in T.Parallel(block_C):
                if c0 + j < cols:
                    S[base * cols + (c0 + j) * width + by - base] = scale[j]

    return quant_cols


def build_quant_blocks(rows: int, cols: int, in_dtype=T.bfloat16, *, transpose: bool = False,
                       config: BlocksConfig = BlocksConfig()):
    """w [batch, rows, cols] -> 128x128 blocks of each w[b] (q [batch, Np, Kp], s [batch, Np/128, Kp/128]), or
    with ``transpose`` the blocks of each w[b].T (q [batch, Kp, Np], s [batch, Kp/128, Np/128]): the same
    scales, the bytes written transposed through shared memory. Padding blocks are zero."""
    threads = config.threads
    np_, kp = round_up(rows, TILE), round_up(cols, TILE)
    batch = T.dynamic("batch")
    q_shape, s_shape = ([batch, kp, np_], [batch, kp // TILE, np_ // TILE]) if transpose else \
        ([batch, np_, kp], [batch, np_ // TILE, kp // TILE])

    @T.prim_func
    def quant_blocks(
        W: T.Tensor([batch, rows, cols], in_dtype),
        Q: T.Tensor(q_shape, T.float8_e4m3fn),
        S: T.Tensor(s_shape, T.float32),
    ):
        with T.Kernel(kp // TILE, np_ // TILE, batch, threads=threads) as (bx, by, bz):
            x = T.alloc_fragment([TILE, TILE], T.float32)
            rmax = T.alloc_fragment([TILE], T.float32)
            rs = T.alloc_shared([TILE], T.float32)
            scale = T.alloc_var(T.float32)
            r0, c0 = by * TILE, bx * TILE
            for i, j in T.Parallel(TILE, TILE):
                x[i, j] = T.if_then_else((r0 + i < rows) & (c0 + j < cols), T.Cast(T.float32, W[bz, r0 + i, c0 + j]), 0.0)
            T.reduce_absmax(x, rmax, dim=1)
            T.copy(rmax, rs)
            scale = 0.0
            for t in T.serial(TILE):
                scale = T.max(scale, rs[t])
            scale = _scale(scale)
            if transpose:
                xs = T.alloc_shared([TILE, TILE + 1], T.float32)      # +1: a column's reads hit 32 banks
                for i, j in T.Parallel(TILE, TILE):
                    xs[i, j] = x[i, j]
                for j, i in T.Parallel(TILE, TILE):
                    Q[bz, c0 + j, r0 + i] = _quant(xs[i, j], scale)
                if T.get_thread_binding() == 0:
                    S[bz, bx, by] = scale
            else:
                for i, j in T.Parallel(TILE, TILE):
                    Q[bz, r0 + i, c0 + j] = _quant(x[i, j], scale)
                if T.get_thread_binding() == 0:
                    S[bz, by, bx] = scale

    return quant_blocks


# --------------------------------------------------------------------------------------------------
# compile caches and CI builds
# --------------------------------------------------------------------------------------------------
@kernel_cache
def _compiled(kind: str, shape: tuple, dtype: torch.dtype, arch: str, transpose: bool = False):
    """The ``kind`` kernel ("rows", "cols", "blocks") for inputs of ``shape`` (the builder's leading arguments) in
    ``dtype``, with the builder's default config; ``transpose`` for "blocks" (the blocks of each matrix's
    transpose)."""
    build = {"rows": build_quant_rows, "cols": build_quant_cols, "blocks": build_quant_blocks}[kind]
    options = {"transpose": True} if transpose else {}
    return tilelang.compile(build(*shape, _DTYPES[dtype], **options), target={"kind": "cuda", "arch": arch})


def quant_kernel(kind: str, x: torch.Tensor) -> tuple:
    """The arguments of :func:`_compiled` for the kernel that quantises ``x`` as ``kind``: "rows" or "cols" of a
    [R, C] activation (one kernel per width C), "blocks" or "blocks_t" (transposed) of a [..., N, K] weight."""
    shape = tuple(x.shape[-2:]) if kind.startswith("blocks") else (x.shape[1],)
    return kind.removesuffix("_t"), shape, x.dtype, cuda_target(x.device)["arch"], kind == "blocks_t"


def ci_builds(target_arch: str = "sm_90a") -> dict:
    """name -> thunk building (not running) one kernel of this family for `target_arch` (CI), through the
    launchers' compile function (uncached)."""
    builds = {
        "fp8_quant_rows[k6144]": ("rows", (6144,), {}),
        "fp8_quant_cols[c2048]": ("cols", (2048,), {}),
        "fp8_quant_blocks[2048x6144]": ("blocks", (2048, 6144), {}),
        "fp8_quant_blocks_t[6144x2048]": ("blocks", (6144, 2048), {"transpose": True}),
    }
    return {name: functools.partial(_compiled.__wrapped__, kind, shape, torch.bfloat16, target_arch, **options)
            for name, (kind, shape, options) in builds.items()}


def build_ahead(*quantised: tuple) -> None:
    """Start building (:mod:`.ahead`) the kernels of ``(kind, tensor)`` pairs (kinds of :func:`quant_kernel`) where
    these kernels take every one of the tensors, as the CUDA ops decide; nothing for a symbolic width."""
    if all(takes(x) for _, x in quantised):
        for kind, x in quantised:
            args = quant_kernel(kind, x)
            if static(*args[1]):
                _compiled.ahead(*args)


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------
def takes(x: torch.Tensor) -> bool:
    """Whether these kernels take ``x`` (a CUDA bf16/fp16/fp32 tensor)."""
    return x.is_cuda and x.dtype in _DTYPES


def row_map(src: torch.Tensor, dest: torch.Tensor, total: int, multiple: int = 1) -> torch.Tensor:
    """int32 [round_up(total, multiple)]: out row dest[i] reads input row src[i], every other row is 0."""
    m = torch.full((round_up(max(total, 1), multiple),), -1, dtype=torch.int32, device=src.device)
    m[dest] = src.to(torch.int32)
    return m


def _zero_tiles(q: torch.Tensor, s: torch.Tensor) -> None:
    q.view(torch.uint8).zero_()
    s.fill_(EPS).mul_(INV_FP8_MAX)                          # fp32 ops, as the kernels and PyTorch round


def quant_rows(x: torch.Tensor, rmap: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along K of rows ``rmap`` of x: (q [total, Kp], s [total, Kp/128]); rmap holds
    round_up(total, RowsConfig().block_M) entries (:func:`row_map`)."""
    x = x.contiguous()
    rows, cols = rmap.shape[0], x.shape[1]
    kp = round_up(cols, TILE)
    q = torch.empty(rows, kp, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, kp // TILE, dtype=torch.float32, device=x.device)
    if rows and x.shape[0]:
        _compiled(*quant_kernel("rows", x))(x, rmap, q, s)
    elif rows:                                               # no input rows: all-zero tiles, as the kernel writes
        _zero_tiles(q, s)
    return q[:total], s[:total]


def slot_tiles(poffs: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each 128-row tile of the slots ending at ``poffs`` (int32 [E], multiples of 128): its slot's start and
    width, in tiles (int32 [poffs[-1] / 128] each): the layout :func:`quant_cols` writes. ``total`` is
    ``poffs[-1]`` when the caller has it on the host (else it is read, a host sync)."""
    ends = poffs.long() // TILE
    tile = torch.arange((int(poffs[-1]) if total is None else total) // TILE, device=poffs.device)
    slot = torch.searchsorted(ends, tile, right=True)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return starts[slot].to(torch.int32), (ends - starts)[slot].to(torch.int32)


def quant_cols(x: torch.Tensor, rmap: torch.Tensor, tile_base: torch.Tensor,
               tile_width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the rows ``rmap`` (a multiple of 128 entries) of x, transposed, slot after slot
    (:func:`slot_tiles`): flat (q [C * len(rmap)], s [C * len(rmap) / 128])."""
    x = x.contiguous()
    rows, cols = rmap.shape[0], x.shape[1]
    q = torch.empty(cols * rows // TILE, TILE, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(cols * rows // TILE, dtype=torch.float32, device=x.device)
    if rows and cols and x.shape[0]:
        _compiled(*quant_kernel("cols", x))(x, rmap, tile_base, tile_width, q, s)
    elif rows and cols:
        _zero_tiles(q, s)
    return q.view(-1), s


def quant_blocks(w: torch.Tensor, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks of each matrix of w [B, N, K]: (q [B, Np, Kp], s [B, Np/128, Kp/128]); with ``transpose``
    the blocks of each w[b].T: (q [B, Kp, Np], s [B, Kp/128, Np/128])."""
    w = w.contiguous()
    B, N, K = w.shape
    np_, kp = round_up(N, TILE), round_up(K, TILE)
    shape = (B, kp, np_) if transpose else (B, np_, kp)
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(B, shape[1] // TILE, shape[2] // TILE, dtype=torch.float32, device=w.device)
    if B and N and K:
        _compiled(*quant_kernel("blocks_t" if transpose else "blocks", w))(w, q, s)
    return q, s


__all__ = ["RowsConfig", "ColsConfig", "BlocksConfig", "build_quant_rows", "build_quant_cols", "build_quant_blocks",
           "ci_builds", "quant_kernel", "build_ahead", "takes", "row_map", "quant_rows", "quant_cols", "quant_blocks",
           "slot_tiles", "register", "fp8_quantize_cuda", "tilelang_quantisers"]


# --------------------------------------------------------------------------------------------------
# registration: the routed experts' FP8 grouped GEMM quantises with these kernels on CUDA
# --------------------------------------------------------------------------------------------------
def _rows(x, src, dest, total):
    return quant_rows(x, row_map(src, dest, total, RowsConfig().block_M), total)


def _cols(x, src, dest, poffs, slot_ends):
    return quant_cols(x, row_map(src, dest, slot_ends[-1], TILE), *slot_tiles(poffs, slot_ends[-1]))


def _blocks_t(w):
    return quant_blocks(w, transpose=True)


def fp8_quantize_cuda(x: torch.Tensor, tiles: str) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA kernel of ``glm52::fp8_quantize`` (the dense FP8 linears): these kernels where they take ``x`` (the
    PyTorch quantisers' bytes and scales bit for bit, in one pass instead of about six over an fp32 copy), else the
    PyTorch quantisers (the op's own kernel)."""
    from ..fp8 import _QUANTISERS, _fp8_quantize_kernel

    if not (takes(x) and x.dim() == 2 and tiles in _QUANTISERS):
        return _fp8_quantize_kernel(x, tiles)
    R = x.shape[0]
    rows = torch.arange(R, device=x.device)
    if tiles == "1x128":
        q, s = quant_rows(x, row_map(rows, rows, R, RowsConfig().block_M), R)
    elif tiles == "1x128_t":
        rp = round_up(R, TILE)
        one_slot = torch.tensor([rp], dtype=torch.int32, device=x.device)
        q, s = quant_cols(x, row_map(rows, rows, rp, TILE), *slot_tiles(one_slot, rp))
        q, s = q.view(x.shape[1], rp), s.view(x.shape[1], rp // TILE)
    else:
        q, s = quant_blocks(x[None])
        q, s = q[0], s[0]
    return q.contiguous(), s.contiguous()


def tilelang_quantisers():
    """The four quantisations of ``glm52::fp8_grouped_mm(_bwd)`` (:class:`~glm52_model.ops.fp8_grouped_mm.Quantisers`)
    by these kernels."""
    from ..fp8_grouped_mm import Quantisers

    return Quantisers(rows=_rows, cols=_cols, blocks=quant_blocks, blocks_t=_blocks_t)


def register() -> None:
    from ..fp8_grouped_mm import (TORCH_QUANTISERS, fp8_grouped_mm_bwd_kernel, fp8_grouped_mm_combine_bwd_kernel,
                                  fp8_grouped_mm_combine_kernel, fp8_grouped_mm_kernel, fp8_grouped_mm_pair_bwd_kernel,
                                  fp8_grouped_mm_pair_kernel)

    quantisers = tilelang_quantisers()

    def fp8_grouped_mm_cuda(x, w, offs, rows=None):
        quant = quantisers if takes(x) and takes(w) else TORCH_QUANTISERS
        return fp8_grouped_mm_kernel(x, w, offs, quant, rows=rows)

    def fp8_grouped_mm_bwd_cuda(dy, x, w, offs, rows=None):
        quant = quantisers if takes(dy) and takes(x) and takes(w) else TORCH_QUANTISERS
        return fp8_grouped_mm_bwd_kernel(dy, x, w, offs, quant, rows=rows)

    torch.library.register_kernel("glm52::fp8_quantize", "cuda")(fp8_quantize_cuda)
    torch.library.register_kernel("glm52::fp8_grouped_mm", "cuda")(fp8_grouped_mm_cuda)
    torch.library.register_kernel("glm52::fp8_grouped_mm_bwd", "cuda")(fp8_grouped_mm_bwd_cuda)

    def fp8_grouped_mm_combine_cuda(x, w, offs, order, weight):
        quant = quantisers if takes(x) and takes(w) else TORCH_QUANTISERS
        return fp8_grouped_mm_combine_kernel(x, w, offs, order, weight, quant)

    def fp8_grouped_mm_combine_bwd_cuda(dout, x, w, offs, order, weight):
        quant = quantisers if takes(dout) and takes(x) and takes(w) else TORCH_QUANTISERS
        return fp8_grouped_mm_combine_bwd_kernel(dout, x, w, offs, order, weight, quant)

    def fp8_grouped_mm_pair_cuda(x, w1, w2, offs, rows=None):
        quant = quantisers if takes(x) and takes(w1) and takes(w2) else TORCH_QUANTISERS
        return fp8_grouped_mm_pair_kernel(x, w1, w2, offs, quant, rows=rows)

    def fp8_grouped_mm_pair_bwd_cuda(dy1, dy2, x, w1, w2, offs, rows=None):
        quant = (quantisers if takes(dy1) and takes(dy2) and takes(x) and takes(w1) and takes(w2)
                 else TORCH_QUANTISERS)
        return fp8_grouped_mm_pair_bwd_kernel(dy1, dy2, x, w1, w2, offs, quant, rows=rows)

    torch.library.register_kernel("glm52::fp8_grouped_mm_pair", "cuda")(fp8_grouped_mm_pair_cuda)
    torch.library.register_kernel("glm52::fp8_grouped_mm_pair_bwd", "cuda")(fp8_grouped_mm_pair_bwd_cuda)
    torch.library.register_kernel("glm52::fp8_grouped_mm_combine", "cuda")(fp8_grouped_mm_combine_cuda)
    torch.library.register_kernel("glm52::fp8_grouped_mm_combine_bwd", "cuda")(fp8_grouped_mm_combine_bwd_cuda)
    for op, fn in _LISTENERS.items():
        on_trace(op, fn)


# what each op quantises with these kernels on CUDA, from its traced inputs: (kind, tensor) pairs for build_ahead
_TILES = {"1x128": "rows", "1x128_t": "cols", "128x128": "blocks"}


def _quantize_ahead(x, tiles):
    if x.dim() == 2 and tiles in _TILES:
        build_ahead((_TILES[tiles], x))


def _quantize_pair_ahead(x):
    if x.dim() == 2:
        build_ahead(("rows", x), ("cols", x))


def _grouped_ahead(x, w, offs, rows=None):
    build_ahead(("rows", x), ("blocks_t", w))


def _grouped_bwd_ahead(dy, x, w, offs, rows=None):
    build_ahead(("cols", x), ("rows", dy), ("blocks", w), ("cols", dy))


def _pair_ahead(x, w1, w2, offs, rows=None):
    build_ahead(("rows", x), ("blocks_t", w1), ("blocks_t", w2))


def _pair_bwd_ahead(dy1, dy2, x, w1, w2, offs, rows=None):
    build_ahead(("cols", x), ("rows", dy1), ("blocks", w1), ("cols", dy1), ("rows", dy2), ("blocks", w2),
                ("cols", dy2))


def _combine_ahead(x, w, offs, order, weight):
    build_ahead(("rows", x), ("blocks_t", w))


def _combine_bwd_ahead(dout, x, w, offs, order, weight):
    build_ahead(("rows", dout), ("blocks", w), ("cols", x), ("cols", dout))


_LISTENERS = {"glm52::fp8_quantize": _quantize_ahead, "glm52::fp8_quantize_pair": _quantize_pair_ahead,
              "glm52::fp8_grouped_mm": _grouped_ahead, "glm52::fp8_grouped_mm_bwd": _grouped_bwd_ahead,
              "glm52::fp8_grouped_mm_pair": _pair_ahead, "glm52::fp8_grouped_mm_pair_bwd": _pair_bwd_ahead,
              "glm52::fp8_grouped_mm_combine": _combine_ahead, "glm52::fp8_grouped_mm_combine_bwd": _combine_bwd_ahead}
