"""TileLang kernels for the tile-wise FP8 quantisation of the routed experts (``glm52::fp8_grouped_mm``).

The PyTorch quantisers of :mod:`glm52_model.ops.fp8` take ~6 passes over an fp32 copy of their input; on the
bench layer's experts (131,072 rows x 6144 at 16K tokens) that cost 6x the FP8 GEMMs themselves (H200,
``bench_kernels.py``). These kernels read the bf16 input once and write the fp8 data and its scales once,
with the same math (scale = max(amax, 1e-12) / 448, q = clamp(x / scale, +-448) cast to e4m3, IEEE
division: TileLang builds without fast math):

1. ``quant_rows``: 1x128 tiles along a row -> q [Rp, Kp], scales [Rp, Kp/128]. A row map (int32, -1 for a
   zero row) says which input row each output row reads, so the experts' 128-row slots are filled in the
   same pass (no gather copy).
2. ``quant_cols``: 1x128 tiles along the rows, written transposed -> q [C, Rp], scales [C, Rp/128] (the
   weight-gradient operands), through the same row map.
3. ``quant_blocks``: 128x128 blocks of a batch of matrices -> q [B, Np, Kp], scales [B, Np/128, Kp/128].

``ci_builds`` lists one build of each for CI (sm_90a, on the CPU).
"""

import functools

import torch

import tilelang
import tilelang.language as T

from ._common import cuda_target, round_up

FP8_MAX = 448.0
EPS = 1e-12
TILE = 128
_DTYPES = {torch.bfloat16: T.bfloat16, torch.float32: T.float32, torch.float16: T.float16}


def _quant(v, scale):
    return T.Cast(T.float8_e4m3fn, T.clamp(v / scale, -FP8_MAX, FP8_MAX))


def build_quant_rows(cols: int, in_dtype=T.bfloat16, *, block_M: int = 32, threads: int = 128):
    """x [rows_in, cols] -> q [rows_out, Kp] fp8, s [rows_out, Kp/128]; rows_out a multiple of block_M."""
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
                amax[i] = T.max(amax[i], EPS) / FP8_MAX
            for i, j in T.Parallel(block_M, TILE):
                Q[r0 + i, c0 + j] = _quant(x[i, j], amax[i])
            for i in T.Parallel(block_M):
                S[r0 + i, by] = amax[i]

    return quant_rows


def build_quant_cols(cols: int, in_dtype=T.bfloat16, *, block_C: int = 64, threads: int = 128):
    """x [rows_in, cols] -> q [cols, rows_out] fp8 (tiles of 128 rows, transposed), s [cols, rows_out/128];
    rows_out a multiple of 128."""
    rows_in = T.dynamic("rows_in")
    rows_out = T.dynamic("rows_out")

    @T.prim_func
    def quant_cols(
        X: T.Tensor([rows_in, cols], in_dtype),
        RowMap: T.Tensor([rows_out], T.int32),
        Q: T.Tensor([cols, rows_out], T.float8_e4m3fn),
        S: T.Tensor([cols, rows_out // TILE], T.float32),
    ):
        with T.Kernel(T.ceildiv(cols, block_C), T.ceildiv(rows_out, TILE), threads=threads) as (bx, by):
            xs = T.alloc_shared([TILE, block_C], T.float32)
            xt = T.alloc_fragment([block_C, TILE], T.float32)
            amax = T.alloc_fragment([block_C], T.float32)
            c0, r0 = bx * block_C, by * TILE
            for i, j in T.Parallel(TILE, block_C):                     # coalesced along the input's row
                src = RowMap[r0 + i]
                xs[i, j] = T.if_then_else((src >= 0) & (c0 + j < cols), T.Cast(T.float32, X[src, c0 + j]), 0.0)
            for j, i in T.Parallel(block_C, TILE):
                xt[j, i] = xs[i, j]
            T.reduce_absmax(xt, amax, dim=1)
            for j in T.Parallel(block_C):
                amax[j] = T.max(amax[j], EPS) / FP8_MAX
            for j, i in T.Parallel(block_C, TILE):                     # coalesced along the output's row
                if c0 + j < cols:
                    Q[c0 + j, r0 + i] = _quant(xt[j, i], amax[j])
            for j in T.Parallel(block_C):
                if c0 + j < cols:
                    S[c0 + j, by] = amax[j]

    return quant_cols


def build_quant_blocks(rows: int, cols: int, in_dtype=T.bfloat16, *, threads: int = 256):
    """w [batch, rows, cols] -> q [batch, Np, Kp] fp8, s [batch, Np/128, Kp/128] (zero padded blocks)."""
    np_, kp = round_up(rows, TILE), round_up(cols, TILE)
    batch = T.dynamic("batch")

    @T.prim_func
    def quant_blocks(
        W: T.Tensor([batch, rows, cols], in_dtype),
        Q: T.Tensor([batch, np_, kp], T.float8_e4m3fn),
        S: T.Tensor([batch, np_ // TILE, kp // TILE], T.float32),
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
            scale = T.max(scale, EPS) / FP8_MAX
            for i, j in T.Parallel(TILE, TILE):
                Q[bz, r0 + i, c0 + j] = _quant(x[i, j], scale)
            if T.get_thread_binding() == 0:
                S[bz, by, bx] = scale

    return quant_blocks


# --------------------------------------------------------------------------------------------------
# compile caches and CI builds
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _compiled(kind: str, shape: tuple, dtype: torch.dtype, arch: str):
    build = {"rows": build_quant_rows, "cols": build_quant_cols, "blocks": build_quant_blocks}[kind]
    return tilelang.compile(build(*shape, _DTYPES[dtype]), target={"kind": "cuda", "arch": arch})


def ci_builds(target_arch: str = "sm_90a") -> dict:
    """name -> thunk building (not running) one kernel of this family for `target_arch` (CI)."""
    target = {"kind": "cuda", "arch": target_arch}
    return {
        "fp8_quant_rows[k6144]": lambda: tilelang.compile(build_quant_rows(6144), target=target),
        "fp8_quant_cols[c2048]": lambda: tilelang.compile(build_quant_cols(2048), target=target),
        "fp8_quant_blocks[2048x6144]": lambda: tilelang.compile(build_quant_blocks(2048, 6144), target=target),
    }


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
    s.fill_(EPS / FP8_MAX)


def quant_rows(x: torch.Tensor, rmap: torch.Tensor, total: int, block_M: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along K of rows ``rmap`` of x: (q [total, Kp], s [total, Kp/128]); rmap holds
    round_up(total, block_M) entries."""
    x = x.contiguous()
    rows, cols = rmap.shape[0], x.shape[1]
    kp = round_up(cols, TILE)
    q = torch.empty(rows, kp, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, kp // TILE, dtype=torch.float32, device=x.device)
    if rows and x.shape[0]:
        _compiled("rows", (cols,), x.dtype, cuda_target(x.device)["arch"])(x, rmap, q, s)
    elif rows:                                               # no input rows: all-zero tiles, as the kernel writes
        _zero_tiles(q, s)
    return q[:total], s[:total]


def quant_cols(x: torch.Tensor, rmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the rows ``rmap`` (a multiple of 128 entries) of x, transposed: (q [C, len(rmap)],
    s [C, len(rmap)/128])."""
    x = x.contiguous()
    rows, cols = rmap.shape[0], x.shape[1]
    q = torch.empty(cols, rows, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(cols, rows // TILE, dtype=torch.float32, device=x.device)
    if rows and cols and x.shape[0]:
        _compiled("cols", (cols,), x.dtype, cuda_target(x.device)["arch"])(x, rmap, q, s)
    elif rows and cols:
        _zero_tiles(q, s)
    return q, s


def quant_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks of each matrix of w [B, N, K]: (q [B, Np, Kp], s [B, Np/128, Kp/128])."""
    w = w.contiguous()
    B, N, K = w.shape
    q = torch.empty(B, round_up(N, TILE), round_up(K, TILE), dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(B, q.shape[1] // TILE, q.shape[2] // TILE, dtype=torch.float32, device=w.device)
    if B and N and K:
        _compiled("blocks", (N, K), w.dtype, cuda_target(w.device)["arch"])(w, q, s)
    return q, s


__all__ = ["build_quant_rows", "build_quant_cols", "build_quant_blocks", "ci_builds", "takes", "row_map",
           "quant_rows", "quant_cols", "quant_blocks", "register", "DENSE", "fp8_quantize_cuda"]


# --------------------------------------------------------------------------------------------------
# registration: the routed experts' FP8 grouped GEMM quantises with these kernels on CUDA
# --------------------------------------------------------------------------------------------------
def _rows(x, src, dest, total):
    return quant_rows(x, row_map(src, dest, total, 32), total)


def _cols(x, src, dest, total):
    return quant_cols(x, row_map(src, dest, total, TILE))


# Whether the dense FP8 linears' ``glm52::fp8_quantize`` runs these kernels on CUDA too. Off until they have
# run on the H200 (tests/gpu/test_fp8_grouped_mm_cuda.py checks them bit for bit against the PyTorch ones).
DENSE = False


def fp8_quantize_cuda(x: torch.Tensor, tiles: str) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA kernel of ``glm52::fp8_quantize``: these kernels when :data:`DENSE` and they take ``x``, else the
    PyTorch quantisers (the op's own kernel)."""
    from ..fp8 import _QUANTISERS, _fp8_quantize_kernel

    if not (DENSE and takes(x) and x.dim() == 2 and tiles in _QUANTISERS):
        return _fp8_quantize_kernel(x, tiles)
    R = x.shape[0]
    rows = torch.arange(R, device=x.device)
    if tiles == "1x128":
        q, s = quant_rows(x, row_map(rows, rows, R, 32), R)
    elif tiles == "1x128_t":
        q, s = quant_cols(x, row_map(rows, rows, round_up(R, TILE), TILE))
    else:
        q, s = quant_blocks(x[None])
        q, s = q[0], s[0]
    return q.contiguous(), s.contiguous()


def register() -> None:
    from ..fp8_grouped_mm import TORCH_QUANTISERS, Quantisers, fp8_grouped_mm_bwd_kernel, fp8_grouped_mm_kernel

    tilelang_quantisers = Quantisers(rows=_rows, cols=_cols, blocks=quant_blocks)

    def fp8_grouped_mm_cuda(x, w, offs):
        quant = tilelang_quantisers if takes(x) and takes(w) else TORCH_QUANTISERS
        return fp8_grouped_mm_kernel(x, w, offs, quant)

    def fp8_grouped_mm_bwd_cuda(dy, x, w, offs):
        quant = tilelang_quantisers if takes(dy) and takes(x) and takes(w) else TORCH_QUANTISERS
        return fp8_grouped_mm_bwd_kernel(dy, x, w, offs, quant)

    torch.library.register_kernel("glm52::fp8_quantize", "cuda")(fp8_quantize_cuda)
    torch.library.register_kernel("glm52::fp8_grouped_mm", "cuda")(fp8_grouped_mm_cuda)
    torch.library.register_kernel("glm52::fp8_grouped_mm_bwd", "cuda")(fp8_grouped_mm_bwd_cuda)
