"""TileLang kernels for `glm52::dsa_topk_indices` (the DSA lightning-indexer top-k), run per chunk of query rows:

1. `build_indexer_logits`: score[i, j] = ks[j] * sum_h w[i, h] * relu(q[i, h] . k[j]) (bf16 or e4m3 tensor-core
   GEMM, fp32 accumulate; ks = the keys' FP8 dequantisation scales, unused for bf16), with the per-row key range
   [starts[i], ends[i]) fused in (keys outside it get -inf). Its stages, per CTA of ``block_Q`` queries:
   ``block_key_range`` (the key tiles some query of the block reads: tiles wholly outside every range are never
   computed), ``load_block`` (the block's queries and weights, once), then per 64-key tile ``load_key_tile`` and
   ``tile_logits`` (one wgmma, then a register epilogue that applies the ReLU, weights and head sum to the GEMM
   accumulator's registers and stores the tile's logits: :func:`logits_epilogue`, ``_EPILOGUE_CUDA``).
2. The select (:mod:`.topk_select_tl`): one CTA per row, an exact top-k of the row's fp32 scores.

:func:`dsa_topk_indices_tl` is the op's CUDA kernel: it folds the op's `scale` into the weights, pads keys and
queries to the kernels' tiles, and runs the two kernels chunk after chunk of queries (:class:`TopkConfig`: the
kernels' tunables and the chunks; the defaults are what the op runs). The measured alternatives to these choices are
in docs/kernels.md.
"""

import functools
from dataclasses import dataclass, field

import torch

import tilelang
import tilelang.language as T

from ..dsa_topk import _check, _dsa_topk_kernel
from ._common import cuda_target, nondeterministic, pad_dim, round_up, warn_once
from .ahead import kernel_cache, on_trace, static
from .topk_select_tl import SelectConfig, compile_topk_select


# --------------------------------------------------------------------------------------------------
# logits kernel
# --------------------------------------------------------------------------------------------------
# The logits kernel's register epilogues ("lanes" / "mma" / "mma_pairs"), CUDA device functions called on the
# wgmma accumulator of one 64-key tile. Its layout (one warpgroup, 64 x N, fp32): the thread of warp w,
# lane 4g + t holds, for each 8-column group j, tile rows 16w + g + 8r and GEMM columns 8j + 2t + c at
# acc[4j + 2r + c] (r, c in {0, 1}), the layout TileLang's own fragment for it reports; GEMM column
# i * H + h is query i's head h. Tile row n is key n, except with "mma_pairs" (see there).
_EPILOGUE_CUDA = r"""
namespace dsa_logits {
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// the thread's weights, in accumulator order: w[2j + c] = W[8j + 2t + c] (W: the block's [QB, H] weights)
template <int N>
__device__ __forceinline__ void load_w(float* w, const float* __restrict__ W) {
  const int t = threadIdx.x & 3;
  #pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const float2 v = *reinterpret_cast<const float2*>(W + 8 * j + 2 * t);
    w[2 * j] = v.x;
    w[2 * j + 1] = v.y;
  }
}

// one (query, key) logit: the key's scale (the tile's copy in shared memory), the query's key range outside
// interior tiles, the store
template <bool SCALED, bool FULL>
__device__ __forceinline__ void put(float x, int q, int nk, const float* ks, float* __restrict__ out,
                                    long long seq_k, const int* __restrict__ starts, const int* __restrict__ ends,
                                    int k0) {
  if (SCALED) x *= ks[nk];
  if (!FULL) {
    const int key = k0 + nk;
    if (key < starts[q] || key >= ends[q]) x = neg_inf();
  }
  out[q * seq_k + nk] = x;
}

// "lanes": sum_h w[i, h] * relu(acc) in fp32 FMAs over the thread's 2 * H / 8 terms per (query, row), then a
// butterfly over the 4 lanes sharing those rows (lane bits 1, then 0), each step halving what a lane keeps.
template <int QB, int H, bool SCALED, bool FULL>
__device__ __forceinline__ void lanes(const float* acc, const float* w, const float* ks, float* __restrict__ out,
                                      long long seq_k, const int* __restrict__ starts,
                                      const int* __restrict__ ends, int k0) {
  constexpr int G = H / 8;   // column groups per query
  constexpr int V = 2 * QB;  // (query, row) sums per thread, at v[2q + r]
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  float v[V];
  #pragma unroll
  for (int q = 0; q < QB; ++q) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      float a = 0.f;
      #pragma unroll
      for (int g = 0; g < G; ++g) {
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int j = q * G + g;
          a = fmaf(fmaxf(acc[4 * j + 2 * r + c], 0.f), w[2 * j + c], a);
        }
      }
      v[2 * q + r] = a;
    }
  }
  int n = V;
  #pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int m = 2 >> s;
    const bool hi = (lane & m) != 0;
    if (n >= 2) {
      #pragma unroll
      for (int u = 0; u < V / 2; ++u) {
        if (u < n / 2) {
          const float keep = hi ? v[u + n / 2] : v[u];
          const float send = hi ? v[u] : v[u + n / 2];
          v[u] = keep + __shfl_xor_sync(0xffffffffu, send, m);
        }
      }
      n /= 2;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], m);
    }
  }
  #pragma unroll
  for (int u = 0; u < (V >= 4 ? V / 4 : 1); ++u) {
    const int idx = V >= 4 ? ((lane >> 1) & 1) * (V / 2) + (lane & 1) * (V / 4) + u : (lane >> 1) & 1;
    if (V >= 4 || (lane & 1) == 0)
      put<SCALED, FULL>(v[u], idx >> 1, warp * 16 + (lane >> 2) + 8 * (idx & 1), ks, out, seq_k, starts, ends,
                        k0);
  }
}

__device__ __forceinline__ unsigned int bf16x2(float lo, float hi) {
  unsigned int d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ unsigned int relu_bf16x2(float lo, float hi) {
  unsigned int d;
  asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// "mma": B fragments (mma.m16n8k16, bf16) of the block-diagonal [N, 8] weights: B[i * H + h, i * P + h / (H / P)] =
// w[i, h], each query's heads in P columns of H / P ("mma": P = 1; "mma_pairs": P = 2). The lane of group g holds
// column g, so only that column's k-steps are non-zero.
template <int N, int H, int P = 1>
__device__ __forceinline__ void load_wb(unsigned int* b, const float* __restrict__ W) {
  const int g = (threadIdx.x >> 2) & 7, t = threadIdx.x & 3;
  #pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    const bool mine = (16 * kk) / (H / P) == g;
    const float* wk = W + 16 * kk;
    b[2 * kk] = mine ? bf16x2(wk[2 * t], wk[2 * t + 1]) : 0u;
    b[2 * kk + 1] = mine ? bf16x2(wk[2 * t + 8], wk[2 * t + 9]) : 0u;
  }
}

// relu(acc) rounded to bf16 in the accumulator's own registers is the A fragment of mma.m16n8k16 (the warp's 16
// key rows x 16 GEMM columns a k-step), times the weights' B: each warp's [16 keys, 8 columns] sums in fp32, two
// independent accumulation chains d[0], d[1]. The lane 4g + t gets key rows g, g + 8 of columns 2t, 2t + 1.
template <int N>
__device__ __forceinline__ void head_sum(const float* acc, const unsigned int* b, float (&d)[2][4]) {
  #pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    const float* x = acc + 8 * kk;   // column groups 2kk, 2kk + 1
    const unsigned int a0 = relu_bf16x2(x[0], x[1]), a1 = relu_bf16x2(x[2], x[3]);
    const unsigned int a2 = relu_bf16x2(x[4], x[5]), a3 = relu_bf16x2(x[6], x[7]);
    float* e = d[kk & 1];
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(e[0]), "+f"(e[1]), "+f"(e[2]), "+f"(e[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b[2 * kk]), "r"(b[2 * kk + 1]));
  }
}

// "mma": the head sum with one column a query: the lane 4g + t gets keys g, g + 8 for queries 2t, 2t + 1.
template <int QB, int H, bool SCALED, bool FULL>
__device__ __forceinline__ void mma(const float* acc, const unsigned int* b, const float* ks, float* __restrict__ out,
                                    long long seq_k, const int* __restrict__ starts, const int* __restrict__ ends,
                                    int k0) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  head_sum<QB * H>(acc, b, d);
  const int g = lane >> 2, t = lane & 3;
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int q = 2 * t + c;
      if (q < QB)
        put<SCALED, FULL>(d[0][2 * r + c] + d[1][2 * r + c], q, warp * 16 + g + 8 * r, ks, out, seq_k, starts,
                          ends, k0);
    }
  }
}

// "mma_pairs" (32 heads, 4 queries a block): the head sum with two columns a query (P = 2, half its heads each), so
// every lane's sums are its own query's (lane 4g + t: query t), and the key tile's rows loaded permuted (the
// kernel's copy: row 16w + g + 8r holds key 16w + 2g + r) so that the lane's two keys are adjacent: one 8-byte
// store of keys 16w + 2g, 16w + 2g + 1 a tile, and one 8-byte read of their scales.
template <int H, bool SCALED, bool FULL>
__device__ __forceinline__ void mma_pairs(const float* acc, const unsigned int* b, const float* ks,
                                          float* __restrict__ out, long long seq_k, const int* __restrict__ starts,
                                          const int* __restrict__ ends, int k0) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  head_sum<4 * H>(acc, b, d);
  const int g = lane >> 2, t = lane & 3, nk = warp * 16 + 2 * g;
  float2 v = make_float2((d[0][0] + d[1][0]) + (d[0][1] + d[1][1]), (d[0][2] + d[1][2]) + (d[0][3] + d[1][3]));
  if (SCALED) {
    const float2 s2 = *reinterpret_cast<const float2*>(ks + nk);
    v.x *= s2.x;
    v.y *= s2.y;
  }
  if (!FULL) {
    const int key = k0 + nk, lo = starts[t], end = ends[t];
    if (key < lo || key >= end) v.x = neg_inf();
    if (key + 1 < lo || key + 1 >= end) v.y = neg_inf();
  }
  *reinterpret_cast<float2*>(out + t * seq_k + nk) = v;
}
}  // namespace dsa_logits
"""


def logits_epilogue(heads: int, block_Q: int, fp8: bool) -> str:
    """The register epilogue a logits build takes:

    - ``"mma_pairs"`` (FP8, 32 heads, 4 queries a block): ReLU and the rounding to bf16 in one ``cvt`` per two
      products, then the head sum as a second, tiny GEMM on the tensor cores (``mma.m16n8k16`` against the
      block-diagonal weights, held in registers) whose 8 columns are (query, half of its heads), so that each
      lane's sums are its own query's; the key tile's rows are loaded permuted so that a lane's two keys are
      adjacent: one 8-byte store and one 8-byte read of the scales a lane and tile.
    - ``"mma"`` (other FP8 builds with heads a multiple of 16): the same products and sums with one column a
      query, four 4-byte stores on half the lanes.
    - ``"lanes"`` (bf16 builds, and FP8 with other head counts): one fp32 FMA per product, then a butterfly over
      the 4 lanes sharing a row that splits the sums between them, each lane storing its own.

    The bf16 rounding of the "mma" products (2^-9 relative) is far below the e4m3 inputs' own (2^-4), not
    below bf16's, so bf16 builds keep fp32 throughout.
    """
    if fp8 and (heads, block_Q) == (32, 4):
        return "mma_pairs"
    if fp8 and heads % 16 == 0:
        return "mma"
    return "lanes"


LOGITS_BLOCK_N = 64   # keys a tile: one warpgroup's wgmma accumulator, the layout the epilogues read
LOGITS_THREADS = 128  # one warpgroup a CTA, no producer warps: several CTAs share an SM


@dataclass(frozen=True)
class LogitsConfig:
    """The logits kernel's tunables; the defaults are the op's."""

    block_Q: int | None = None  # queries a CTA (block_Q * heads GEMM rows); None: 128 // heads, one wgmma tile
    min_blocks: int = 4         # CTAs per SM the register allocation leaves room for (__launch_bounds__)

    def queries_per_block(self, heads: int) -> int:
        return self.block_Q or max(1, 128 // heads)


@dataclass(frozen=True)
class _Logits:
    """One build's sizes (the stage macros' first argument)."""

    heads: int
    dim: int
    block_Q: int
    rows: int           # block_Q * heads: the GEMM's N side
    scaled: bool        # FP8: the keys' scales multiply each tile's output; bf16 builds leave them out
    epilogue: str       # logits_epilogue(heads, block_Q, scaled)
    fn: str             # the epilogue's call, up to its last template argument (FULL)

    @classmethod
    def of(cls, heads: int, dim: int, scaled: bool, block_Q: int) -> "_Logits":
        epilogue = logits_epilogue(heads, block_Q, scaled)
        if epilogue == "mma_pairs":
            fn = f"dsa_logits::mma_pairs<{heads}, {str(scaled).lower()}"
        else:
            fn = f"dsa_logits::{epilogue}<{block_Q}, {heads}, {str(scaled).lower()}"
        return cls(heads=heads, dim=dim, block_Q=block_Q, rows=block_Q * heads, scaled=scaled, epilogue=epilogue,
                   fn=fn)


@T.macro
def block_key_range(lg, Starts, Ends, q0, seq_k, lo: T.Ref, hi: T.Ref, in_lo: T.Ref, in_hi: T.Ref):
    """The block's key range: [lo, hi) the union of its queries' ranges (lo down to a tile's start), [in_lo, in_hi)
    their intersection (keys valid for every query of the block)."""
    lo = seq_k
    hi = 0
    in_lo = 0
    in_hi = seq_k
    for i in T.serial(lg.block_Q):
        lo = T.min(lo, Starts[q0 + i])
        hi = T.max(hi, Ends[q0 + i])
        in_lo = T.max(in_lo, Starts[q0 + i])
        in_hi = T.min(in_hi, Ends[q0 + i])
    hi = T.min(hi, seq_k)
    lo = lo // LOGITS_BLOCK_N * LOGITS_BLOCK_N


@T.macro
def load_block(lg, Q, W, q0, q_shared, w):
    """The block's queries to shared memory, and its weights to registers in the epilogue's order: the thread's
    weights ("lanes"), or the B fragments of the head sum's mma ("mma", "mma_pairs")."""
    T.copy(Q[q0 * lg.heads, 0], q_shared)
    if lg.epilogue == "lanes":
        T.call_extern("handle", f"dsa_logits::load_w<{lg.rows}>", T.access_ptr(w, "w"),
                      T.access_ptr(W[q0, 0], "r"))
    elif lg.epilogue == "mma_pairs":
        T.call_extern("handle", f"dsa_logits::load_wb<{lg.rows}, {lg.heads}, 2>", T.access_ptr(w, "w"),
                      T.access_ptr(W[q0, 0], "r"))
    else:
        T.call_extern("handle", f"dsa_logits::load_wb<{lg.rows}, {lg.heads}>", T.access_ptr(w, "w"),
                      T.access_ptr(W[q0, 0], "r"))


@T.macro
def load_key_tile(lg, K, KS, k0, k_shared, ks_shared):
    """The key tile at k0 (and its FP8 scales) to shared memory; "mma_pairs" loads its rows permuted."""
    if lg.epilogue == "mma_pairs":
        # row 16w + g + 8r of the tile holds key 16w + 2g + r: a lane's two keys adjacent
        for n, d in T.Parallel(LOGITS_BLOCK_N, lg.dim):
            k_shared[n, d] = K[k0 + n // 16 * 16 + n % 8 * 2 + n % 16 // 8, d]
    else:
        T.copy(K[k0, 0], k_shared)
    if lg.scaled:
        T.copy(KS[k0], ks_shared)


@T.macro
def tile_logits(lg, Logits, Starts, Ends, q0, k0, seq_k, k_shared, q_shared, ks_shared, s, w, in_lo: T.Ref,
                in_hi: T.Ref):
    """The tile's GEMM, then the epilogue's store of its logits; a tile inside every one of the block's query
    ranges (all but the last one or two of a causal row) stores them without the per-key range test."""
    T.gemm(k_shared, q_shared, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
    # s.data, not an access_ptr: TileLang would then infer a replicated layout for s
    args = (s.data, T.access_ptr(w, "r"), T.access_ptr(ks_shared, "r"), T.access_ptr(Logits[q0, k0], "w"), seq_k,
            T.access_ptr(Starts[q0], "r"), T.access_ptr(Ends[q0], "r"), k0)
    if (k0 >= in_lo) and (k0 + LOGITS_BLOCK_N <= in_hi):
        T.call_extern("handle", lg.fn + ", true>", *args)
    else:
        T.call_extern("handle", lg.fn + ", false>", *args)


def build_indexer_logits(heads: int, dim: int, in_dtype=T.bfloat16, config: LogitsConfig = LogitsConfig()):
    """Masked indexer logits, fp32 [Sq, Sk], from q and k in ``in_dtype`` (bf16 or float8_e4m3fn). Sq must
    be a multiple of the block's queries (``config.queries_per_block(heads)``), Sk of ``LOGITS_BLOCK_N``."""
    lg = _Logits.of(heads, dim, in_dtype != T.bfloat16, config.queries_per_block(heads))
    block_Q, block_N, rows = lg.block_Q, LOGITS_BLOCK_N, lg.rows
    seq_q = T.dynamic("seq_q")
    seq_k = T.dynamic("seq_k")
    dtype, accum = in_dtype, T.float32

    @T.prim_func
    def indexer_logits(
        Q: T.Tensor([seq_q * heads, dim], dtype),  # [Sq * H, D]
        K: T.Tensor([seq_k, dim], dtype),  # [Sk, D]
        KS: T.Tensor([seq_k], accum),  # [Sk] key dequantisation scales (FP8 only; bf16 builds never read it)
        W: T.Tensor([seq_q, heads], accum),  # [Sq, H], scale (and q's FP8 scales) folded in
        Starts: T.Tensor([seq_q], T.int32),
        Ends: T.Tensor([seq_q], T.int32),
        Logits: T.Tensor([seq_q, seq_k], accum),  # [Sq, Sk]
    ):
        with T.Kernel(T.ceildiv(seq_q, block_Q), threads=LOGITS_THREADS) as bx:
            T.import_source(_EPILOGUE_CUDA)
            if config.min_blocks > 1:
                T.annotate_min_blocks_per_sm(config.min_blocks)
            q_shared = T.alloc_shared([rows, dim], dtype)
            k_shared = T.alloc_shared([block_N, dim], dtype)
            ks_shared = T.alloc_shared([block_N], accum)
            s = T.alloc_fragment([block_N, rows], accum)
            if lg.epilogue == "lanes":
                w = T.alloc_local([rows // 4], accum)             # the thread's weights, accumulator order
            else:
                w = T.alloc_local([rows // 8], T.uint32)          # the weights' mma B fragments, bf16 pairs
            lo = T.alloc_var(T.int32)
            hi = T.alloc_var(T.int32)
            in_lo = T.alloc_var(T.int32)                     # keys valid for every query of the block
            in_hi = T.alloc_var(T.int32)

            q0 = bx * block_Q
            block_key_range(lg, Starts, Ends, q0, seq_k, lo, hi, in_lo, in_hi)
            n_tiles = T.max(T.ceildiv(hi - lo, block_N), 0)
            load_block(lg, Q, W, q0, q_shared, w)
            for t in T.Pipelined(n_tiles, num_stages=1):
                k0 = lo + t * block_N
                load_key_tile(lg, K, KS, k0, k_shared, ks_shared)
                tile_logits(lg, Logits, Starts, Ends, q0, k0, seq_k, k_shared, q_shared, ks_shared, s, w, in_lo,
                            in_hi)

    return indexer_logits


# The logits kernel keeps every warp on the math (no producer warpgroup), so that its one-warpgroup CTAs fit
# several to an SM and one CTA's epilogue overlaps another's MMAs; every access is in bounds when the query rows
# are a multiple of block_Q and the keys of LOGITS_BLOCK_N, as the launcher pads them, so the safe-memory pass's
# per-element bounds tests are off.
_LOGITS_PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
                        tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
                        tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}
_IN_DTYPES = {torch.bfloat16: T.bfloat16, torch.float8_e4m3fn: T.float8_e4m3fn}
# Head counts the logits kernel is built for: a block of 128 // heads queries fills the 128 rows of one
# wgmma tile. Fewer than 8 heads (16+ queries a block) select wrong keys on the H200, so they run the
# reference kernel.
KERNEL_HEADS = frozenset({8, 16, 32, 64, 128})


@kernel_cache
def compile_indexer_logits(heads: int, dim: int, target_arch: str = "sm_90a", in_dtype=torch.bfloat16,
                           config: LogitsConfig = LogitsConfig()):
    """The logits kernel for ``heads`` x ``dim`` inputs in ``in_dtype`` built for ``target_arch`` (cached)."""
    return tilelang.compile(build_indexer_logits(heads, dim, _IN_DTYPES[in_dtype], config),
                            target={"kind": "cuda", "arch": target_arch}, pass_configs=dict(_LOGITS_PASS_CONFIGS))


# --------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------
BLOCK_N = 128   # keys are padded to a multiple of this (of LOGITS_BLOCK_N and of the select's vec)


@dataclass(frozen=True)
class TopkConfig:
    """How :func:`dsa_topk_indices_tl` runs: its kernels' tunables and its chunks of queries; the defaults are the
    op's (the ``glm52::dsa_topk_indices`` CUDA kernel always runs them)."""

    logits: LogitsConfig = field(default_factory=LogitsConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    # fp32 scores materialised per query chunk: 8K queries a chunk at 64K keys, 4K at 128K, so each logits launch
    # has thousands of one-warpgroup CTAs
    logits_budget_bytes: int = 2 << 30
    # 2: the select of chunk c runs on a side stream while the logits of chunk c + 1 fill the other buffer (its CTAs
    # fill the SMs the logits' wave tails leave), at twice the buffer memory; 1: logits then select, in order on
    # the caller's stream. The op keeps one: the layer at 128K tokens already peaks within a few GiB of the H200's
    # memory, which a second buffer would take (docs/kernels.md)
    buffers: int = 1
    select_priority: int = 0    # the side stream's priority (lower is higher, CUDA's convention)

    def __post_init__(self):
        assert BLOCK_N % self.select.vec == 0, "TopkConfig: the select's vec must divide BLOCK_N"


def logits_kernel(heads: int, dim: int, in_dtype: torch.dtype, target_arch: str,
                  config: LogitsConfig = LogitsConfig()):
    """The logits kernel the op runs for these inputs (``config``: the op's by default)."""
    return compile_indexer_logits(heads, dim, target_arch, in_dtype, config)


def select_kernel(topk: int, target_arch: str, config: SelectConfig = SelectConfig()):
    """The select kernel the op runs for ``topk`` (``config``: the op's by default)."""
    return compile_topk_select(topk, target_arch, config)


# why the select is not deterministic (under torch.use_deterministic_algorithms the op runs its PyTorch kernel,
# whose torch.topk is deterministic on CUDA)
TIE_ORDER = ("gives ties at the k-th score, on its radix paths, to the keys gathered first, an order that varies from "
             "run to run")


def _refused(q: torch.Tensor, k: torch.Tensor) -> tuple | None:
    """None where the kernels take these (valid) q and k, else (warning key, message): other dtypes or head
    counts, or torch.use_deterministic_algorithms on."""
    if q.dtype not in _IN_DTYPES or k.dtype != q.dtype:
        return ("glm52::dsa_topk_indices:dtype",
                f"glm52::dsa_topk_indices: the TileLang kernel takes bfloat16 or float8_e4m3fn q and k; "
                f"{q.dtype} / {k.dtype} inputs run the PyTorch reference kernel (slower) instead")
    if q.shape[1] not in KERNEL_HEADS:
        return (f"glm52::dsa_topk_indices:heads{q.shape[1]}",
                f"glm52::dsa_topk_indices: the TileLang logits kernel takes {sorted(KERNEL_HEADS)} indexer heads; "
                f"{q.shape[1]} heads run the PyTorch reference kernel (slower) instead")
    return nondeterministic("glm52::dsa_topk_indices", TIE_ORDER)


def op_kernels(q: torch.Tensor, topk: int, config: TopkConfig = TopkConfig()) -> tuple:
    """((compile function, its arguments) of the logits kernel, the same of the select) the op runs for q [S, H, D]
    (of a dtype and head count the kernels take) and ``topk``."""
    arch = cuda_target(q.device)["arch"]
    return ((compile_indexer_logits, (q.shape[1], q.shape[2], arch, q.dtype, config.logits)),
            (compile_topk_select, (topk, arch, config.select)))


def ci_builds(target_arch: str = "sm_90a") -> dict:
    """name -> thunk building (not running) one kernel of this family for `target_arch` (CI), uncached: each
    register epilogue the op dispatches to and the op's select."""
    logits = lambda heads, dtype: functools.partial(compile_indexer_logits.__wrapped__,  # noqa: E731
                                                    heads, 128, target_arch, dtype, LogitsConfig())
    return {
        "indexer_logits[h32,d128]": logits(32, torch.bfloat16),                     # "lanes"
        "indexer_logits_fp8[h32,d128]": logits(32, torch.float8_e4m3fn),            # "mma_pairs"
        "indexer_logits_fp8[h64,d128]": logits(64, torch.float8_e4m3fn),            # "mma"
        "topk_select[k2048]": functools.partial(compile_topk_select.__wrapped__, 2048, target_arch, SelectConfig()),
    }


@functools.cache
def _side_stream(device_index: int, priority: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index, priority=priority)


def dsa_topk_indices_tl(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, starts: torch.Tensor,
                        ends: torch.Tensor, topk: int, scale: float, k_scale: torch.Tensor | None = None,
                        config: TopkConfig = TopkConfig()) -> torch.Tensor:
    """CUDA kernel of `glm52::dsa_topk_indices`: q [S, H, D], k [Sk, D] both bf16 or both float8_e4m3fn with
    ``k_scale`` [Sk], weights [S, H] (fp32 or bf16), starts/ends [S] int32 -> int32 [S, topk], ids by
    descending score, -1 padded. Other q/k dtypes run the PyTorch kernel (the logits GEMM would round them).
    ``config``: the op's by default (a benchmark times others)."""
    _check(q, k, weights, starts, ends, topk, k_scale)
    refused = _refused(q, k)
    if refused is not None:
        warn_once(*refused)
        return _dsa_topk_kernel(q, k, weights, starts, ends, topk, scale, k_scale)
    S, H, D = q.shape
    out = torch.empty(S, topk, dtype=torch.int32, device=q.device)
    if S == 0:
        return out
    kernels = tuple(fn(*args) for fn, args in op_kernels(q, topk, config))
    Sk = k.shape[0]
    Skp = round_up(max(Sk, 1), BLOCK_N)
    k_pad = pad_dim(k.view(torch.uint8), 0, Skp).view(k.dtype)                  # fp8 pads as bytes
    ks = k_scale.float() if k_scale is not None else torch.ones(Sk, dtype=torch.float32, device=q.device)
    inputs = (q.contiguous(), k_pad, pad_dim(ks, 0, Skp), (weights.to(torch.float32) * scale).contiguous(),
              starts.clamp(0, Sk).contiguous(), ends.clamp(0, Sk).contiguous())
    _run_chunks(kernels, inputs, out, config)
    return out


def _run_chunks(kernels, inputs, out: torch.Tensor, config: TopkConfig) -> None:
    """The logits of one chunk of queries into a buffer, then the select on them, chunk after chunk: in order on
    the caller's stream (one buffer), or the selects on a side stream beside the next chunks' logits."""
    logits_k, select_k = kernels
    q, k_pad, ks, w, starts, ends = inputs
    (S, H, D), Skp, dev = q.shape, k_pad.shape[0], q.device
    block_Q = config.logits.queries_per_block(H)
    chunk = max(block_Q, (config.logits_budget_bytes // (Skp * 4)) // block_Q * block_Q)
    chunk = min(chunk, round_up(S, block_Q))
    n_buf = max(1, min(int(config.buffers), -(-S // chunk)))
    bufs = [torch.empty(chunk, Skp, dtype=torch.float32, device=dev) for _ in range(n_buf)]
    main = torch.cuda.current_stream(dev)
    side = _side_stream(dev.index if dev.index is not None else torch.cuda.current_device(),
                        int(config.select_priority)) if n_buf > 1 else None
    freed = [None] * n_buf          # per buffer: the event after the select that last read it
    held = []                       # the side stream's inputs, alive until it is joined
    for c, c0 in enumerate(range(0, S, chunk)):
        c1 = min(S, c0 + chunk)
        n = c1 - c0
        n_pad = round_up(n, block_Q)
        logits = bufs[c % n_buf][:n_pad]
        qc = pad_dim(q[c0:c1].view(torch.uint8), 0, n_pad).view(q.dtype).view(n_pad * H, D)
        wc = pad_dim(w[c0:c1], 0, n_pad)
        sc = pad_dim(starts[c0:c1], 0, n_pad)
        ec = pad_dim(ends[c0:c1], 0, n_pad)
        if freed[c % n_buf] is not None:
            main.wait_event(freed[c % n_buf])
        logits_k(qc, k_pad, ks, wc, sc, ec, logits)
        if side is None:
            select_k(logits[:n], sc[:n], ec[:n], out[c0:c1])
            continue
        side.wait_stream(main)
        with torch.cuda.stream(side):
            select_k(logits[:n], sc[:n], ec[:n], out[c0:c1])
        freed[c % n_buf] = side.record_event()
        held.append((sc, ec))
    if side is not None:
        main.wait_stream(side)      # before `bufs` and `held` go back to the caller stream's allocator


def _topk_ahead(q, k, weights, starts, ends, topk, scale, k_scale=None):
    if q.is_cuda and static(q.shape[1], q.shape[2]) and _refused(q, k) is None:
        for fn, args in op_kernels(q, topk):
            fn.ahead(*args)


def register() -> None:
    torch.library.register_kernel("glm52::dsa_topk_indices", "cuda")(dsa_topk_indices_tl)
    on_trace("glm52::dsa_topk_indices", _topk_ahead)
