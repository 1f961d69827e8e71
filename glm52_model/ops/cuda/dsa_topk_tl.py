"""TileLang kernels for `glm52::dsa_topk_indices` (the DSA lightning-indexer top-k).

Two kernels, run per chunk of query rows:

1. `build_indexer_logits`: score[i, j] = ks[j] * sum_h w[i, h] * relu(q[i, h] . k[j]) (bf16 or e4m3
   tensor-core GEMM, fp32 accumulate; ks = the keys' FP8 dequantisation scales, unused for bf16), with the
   per-row key range [starts[i], ends[i]) fused in (keys outside it get -inf); key tiles wholly outside
   the block's range are never computed. The ReLU, weights and head sum run on the GEMM accumulator's
   registers (`_EPILOGUE_CUDA`).
2. `build_topk_select`: one CTA per row, an exact top-k of the row's fp32 scores:
   a. sample a threshold: on a long row, a 12-bit and then an 8-bit histogram of every ``sample``-th group of
      vectors give ``tau``, a lower bound on the k-th largest score (with high probability); a short row takes
      the 12-bit histogram of all its keys and its threshold bin;
   b. collect the candidates: one pass copies the keys >= tau (or the threshold bin's keys, the keys above it
      going straight to the winners) to shared memory;
   c. rank: a long row's candidates are ranked at once by a counting sort and the first topk written out;
   d. otherwise radix rounds on the candidates (or on the row, where the bound missed or the bin overflowed)
      find the exact k-th key, a gather collects the winners, and a counting sort (or, where its buckets are
      skewed, a bitonic sort in registers) orders them by (score desc, key id asc).
   Rows with fewer valid keys than topk are padded with -1. The result is exact on every path.

The op's `scale` is folded into the weights before the logits kernel. The measured alternatives to these
choices are in docs/kernels.md.
"""


import functools

import torch

import tilelang
import tilelang.language as T

from ..dsa_topk import _check, _dsa_topk_kernel
from ._common import cuda_target, next_pow2, pad_dim, round_up, warn_once

RADIX_BITS = 8
RADIX = 1 << RADIX_BITS
FIRST_BITS = 12  # the select's first round
FIRST_BINS = 1 << FIRST_BITS
SAMPLE_MIN_ROW = 4  # rows of at least this many times `candidates` keys take the sampled first round
RANK_MAX = 32  # the most winners a counting-sort bucket may hold before the row takes the bitonic sort
_INT_MAX = 2147483647


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
LOGITS_BLOCK_N = 64   # keys a tile: one warpgroup's wgmma accumulator, the layout the epilogues read
LOGITS_THREADS = 128  # one warpgroup a CTA, no producer warps: several CTAs share an SM


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


def build_indexer_logits(heads: int, dim: int, in_dtype=T.bfloat16, *, block_Q: int | None = None,
                         min_blocks: int = 1):
    """Masked indexer logits, fp32 [Sq, Sk], from q and k in ``in_dtype`` (bf16 or float8_e4m3fn). Sq must
    be a multiple of block_Q, Sk of ``LOGITS_BLOCK_N``.

    ``block_Q`` queries a CTA (block_Q * heads rows form the GEMM's N side); ``min_blocks``: the CTAs per SM the
    register allocation must leave room for (``__launch_bounds__``). Per key tile: the tile's keys (and FP8
    scales) to shared memory, one wgmma against the block's queries, then the epilogue (:func:`logits_epilogue`)
    stores the tile's logits from the registers that summed them; a tile inside every one of the block's query
    ranges (all but the last one or two of a causal row) stores them without the per-key range test.
    """
    if block_Q is None:
        block_Q = max(1, 128 // heads)
    block_N, threads = LOGITS_BLOCK_N, LOGITS_THREADS
    rows = block_Q * heads
    seq_q = T.dynamic("seq_q")
    seq_k = T.dynamic("seq_k")
    dtype, accum = in_dtype, T.float32
    # the keys' FP8 scales multiply each tile's output, from shared memory; bf16 builds leave them out
    scaled = in_dtype != T.bfloat16
    epilogue = logits_epilogue(heads, block_Q, scaled)
    pairs = epilogue == "mma_pairs"
    if pairs:
        fn = f"dsa_logits::mma_pairs<{heads}, {str(scaled).lower()}"
    else:
        fn = f"dsa_logits::{epilogue}<{block_Q}, {heads}, {str(scaled).lower()}"

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
        with T.Kernel(T.ceildiv(seq_q, block_Q), threads=threads) as bx:
            T.import_source(_EPILOGUE_CUDA)
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            q_shared = T.alloc_shared([rows, dim], dtype)
            k_shared = T.alloc_shared([block_N, dim], dtype)
            ks_shared = T.alloc_shared([block_N], accum)
            s = T.alloc_fragment([block_N, rows], accum)
            if epilogue == "lanes":
                w = T.alloc_local([rows // 4], accum)             # the thread's weights, accumulator order
            else:
                w = T.alloc_local([rows // 8], T.uint32)          # the weights' mma B fragments, bf16 pairs
            lo = T.alloc_var(T.int32)
            hi = T.alloc_var(T.int32)
            in_lo = T.alloc_var(T.int32)                     # keys valid for every query of the block
            in_hi = T.alloc_var(T.int32)

            # the block's key range: the union of its queries' ranges, and their intersection
            q0 = bx * block_Q
            lo = seq_k
            hi = 0
            in_lo = 0
            in_hi = seq_k
            for i in T.serial(block_Q):
                lo = T.min(lo, Starts[q0 + i])
                hi = T.max(hi, Ends[q0 + i])
                in_lo = T.max(in_lo, Starts[q0 + i])
                in_hi = T.min(in_hi, Ends[q0 + i])
            hi = T.min(hi, seq_k)
            lo = lo // block_N * block_N
            n_tiles = T.max(T.ceildiv(hi - lo, block_N), 0)

            # the block's queries and weights, once
            T.copy(Q[q0 * heads, 0], q_shared)
            if epilogue == "lanes":
                T.call_extern("handle", f"dsa_logits::load_w<{rows}>", T.access_ptr(w, "w"),
                              T.access_ptr(W[q0, 0], "r"))
            elif pairs:
                T.call_extern("handle", f"dsa_logits::load_wb<{rows}, {heads}, 2>", T.access_ptr(w, "w"),
                              T.access_ptr(W[q0, 0], "r"))
            else:
                T.call_extern("handle", f"dsa_logits::load_wb<{rows}, {heads}>", T.access_ptr(w, "w"),
                              T.access_ptr(W[q0, 0], "r"))
            for t in T.Pipelined(n_tiles, num_stages=1):
                # the key tile (and its scales), the GEMM, the epilogue's store
                k0 = lo + t * block_N
                if pairs:
                    # row 16w + g + 8r of the tile holds key 16w + 2g + r: a lane's two keys adjacent
                    for n, d in T.Parallel(block_N, dim):
                        k_shared[n, d] = K[k0 + n // 16 * 16 + n % 8 * 2 + n % 16 // 8, d]
                else:
                    T.copy(K[k0, 0], k_shared)
                if scaled:
                    T.copy(KS[k0], ks_shared)
                T.gemm(k_shared, q_shared, s, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                # s.data, not an access_ptr: TileLang would then infer a replicated layout for s
                args = (s.data, T.access_ptr(w, "r"), T.access_ptr(ks_shared, "r"),
                        T.access_ptr(Logits[q0, k0], "w"), seq_k, T.access_ptr(Starts[q0], "r"),
                        T.access_ptr(Ends[q0], "r"), k0)
                if (k0 >= in_lo) and (k0 + block_N <= in_hi):
                    T.call_extern("handle", fn + ", true>", *args)
                else:
                    T.call_extern("handle", fn + ", false>", *args)

    return indexer_logits


def _ordered_key(x):
    """fp32 -> uint32 whose unsigned order is the float order."""
    bits = T.reinterpret(x, T.uint32)
    return T.if_then_else(x < 0, bits ^ T.uint32(0xFFFFFFFF), bits | T.uint32(0x80000000))


def _key_as(key, raw: bool, flipped: bool):
    """A key held ordered (``raw``) or ``^ FLIP`` (ascending = score desc), as the form asked for."""
    return key ^ T.uint32(0xFFFFFFFF) if raw == flipped else key


def _from_ordered_key(key):
    """The inverse of :func:`_ordered_key`: uint32 -> the fp32 it orders."""
    return T.reinterpret(T.if_then_else(key >= T.uint32(0x80000000), key & T.uint32(0x7FFFFFFF),
                                        key ^ T.uint32(0xFFFFFFFF)), T.float32)


def build_topk_select(topk: int, *, threads: int = 512, candidates: int = 3072, vec: int = 4, sort_elems: int = 8,
                      sample: int = 8, sample_group: int = 4, unroll: int = 2, min_blocks: int = 1):
    """Exact per-row top-k of fp32 scores within [starts, ends); int32 ids sorted desc, -1 pad.

    ``threads`` per row's CTA (a power of two dividing 4096). ``candidates``: the keys shared memory holds for
    the rounds after the first (at least 1.25 topk: the sampled bound's slack). ``vec``: scores each thread loads
    per trip over the row, as one vector load (seq_k must then be a multiple of ``vec``; the launcher pads rows
    to BLOCK_N). ``sort_elems``: (key, id) pairs per thread in the register bitonic sort. ``sample``: a row of
    ``SAMPLE_MIN_ROW * candidates`` keys or more takes its first round on one group of ``sample_group`` adjacent
    vectors in every ``sample`` groups. ``unroll``: vectors each thread loads before it tests any of them, in
    the sampled passes and the pass against the float bound. ``min_blocks``: CTAs per SM the register
    allocation must leave room for (``__launch_bounds__``).

    The stages (every path exact; ties at the k-th score go to the lower key ids where the candidates are
    ranked at once, else to the gather's order):

    1. Sample a threshold (rows of ``SAMPLE_MIN_ROW * candidates`` keys or more): the sampled keys' top 12 bits,
       then the next 8 within the threshold bin, give a 20-bit key ``tau`` below the row's k-th largest with
       high probability (the sample's expected share of the top-k plus four standard deviations). One pass
       over the row copies every key >= tau (about 1.3 topk of them) to the candidates, comparing each score
       with tau as a float.
    2. Rank the candidates at once: a counting sort on their scores (``next_pow2(candidates)`` buckets between
       the largest and smallest finite score) writes the first topk. A row whose bound missed (fewer than topk
       keys >= tau, or more than ``candidates``) takes the rounds on the row; one where a bucket holds more
       than ``RANK_MAX`` keys takes the rounds on its candidates.
    3. Shorter rows: the 12-bit histogram of all their keys gives the threshold bin; one pass sends the keys
       above it to the winners and copies the bin's keys to the candidates (a bin over ``candidates`` keys:
       the rounds on the row).
    4. Radix rounds (8 bits each) on the candidates or the row find the exact k-th key; a gather collects the
       winners; a counting sort orders them (score desc, id asc), or, where a bucket holds more than
       ``RANK_MAX`` of them (ties, or an outlier squeezing the rest together), the bitonic sort in registers:
       stages whose partner is in the same thread or warp run in registers or through warp shuffles, the few
       with a partner in another warp through shared memory, each (key, id) one uint64.
    5. Rows with at most topk keys: all of them, sorted.
    """
    assert sample > 0 and sort_elems > 0, "the select samples long rows and sorts in registers"
    sort_n = max(next_pow2(topk), 32)
    log_n = sort_n.bit_length() - 1
    E = min(max(sort_elems, sort_n // threads), sort_n // 32)      # pairs per sorting thread
    sort_threads = sort_n // E                                     # whole warps
    assert E & (E - 1) == 0 and sort_threads <= threads and sort_threads % 32 == 0, (E, sort_threads)
    rank_sort = candidates >= sort_n                     # the counting sort's buckets live in the candidates' buffers
    rank_e = max(1, -(-sort_n // threads))                        # winners per thread in the counting sort
    rank_b = rank_e                                              # ... and buckets
    direct_rank = rank_sort                                      # the sampled rows' candidates ranked at once
    cand_b = next_pow2(candidates) if direct_rank else 0          # the candidates' buckets (direct_rank) ...
    cand_e = max(1, -(-candidates // threads)) if direct_rank else 0   # ... and candidates per thread
    if direct_rank:
        assert cand_b <= FIRST_BINS and cand_b % threads == 0, "next_pow2(candidates) <= 4096 buckets"
    sort_buf = max(sort_n, candidates) if direct_rank else sort_n   # skey / sidx: the ranked candidates' places too
    seq_q = T.dynamic("seq_q")
    seq_k = T.dynamic("seq_k_vecs") * vec                        # a multiple of vec: aligned vector loads
    per = FIRST_BINS // threads                                  # first-round bins per thread
    assert threads & (threads - 1) == 0 and per * threads == FIRST_BINS, "threads must divide 4096"
    hist_n = FIRST_BINS + 1
    sample_min = SAMPLE_MIN_ROW * candidates                      # rows this long take the sampled round 0
    assert candidates >= topk + topk // 4, "candidates >= 1.25 topk (the sampled bound's slack)"
    assert threads >= RADIX and threads % 32 == 0
    FLIP = T.uint32(0xFFFFFFFF)

    @T.macro
    def append(pred, counter, slot):
        # slot[0] <- where this thread's key goes when `pred`: the counter's value before it
        if pred:
            slot[0] = T.atomic_add(counter, 1, return_prev=True)

    @T.macro
    def suffix_scan(tx, sv, tsum, wsum, n):
        # tsum[t] <- the sum of sv[0] over threads t..n-1 (t < n), tsum[n] <- 0, then a barrier; n is a
        # multiple of 32: shuffles within each warp, then the warps' totals (two barriers)
        if tx < n:
            for o in T.unroll(5):
                sv[1] = T.shfl_down(sv[0], 1 << o)          # every lane, then the add where it applies
                if tx % 32 + (1 << o) < 32:
                    sv[0] = sv[0] + sv[1]
            if tx % 32 == 0:
                wsum[tx // 32] = sv[0]
        T.sync_threads()
        if tx < n:
            for w in T.serial(n // 32):
                if w > tx // 32:
                    sv[0] = sv[0] + wsum[w]
            tsum[tx] = sv[0]
        if tx == 0:
            tsum[n] = 0
        T.sync_threads()

    @T.macro
    def radix_suffix(tx, hist, sv, wsum):
        # hist[0..RADIX) <- its suffix sums in place (hist[RADIX] = 0), after the histogram's atomics
        T.sync_threads()
        if tx < RADIX:
            sv[0] = hist[tx]
        suffix_scan(tx, sv, hist, wsum, RADIX)

    def sampled_vector(i):
        # the row's i-th sampled vector, counted from its first
        return (i // sample_group) * (sample * sample_group) + i % sample_group

    @T.macro
    def load_trip(Logits, row, jv, end, xv, every_lane, o=0):
        # xv[o:o + vec] <- the `vec` scores of vector jv of the row; `every_lane`: lanes past the row's end load
        # zeros (for a trip every lane must run: the warp's ballots and matches), else they load nothing
        if every_lane:
            for v in T.vectorized(vec):
                xv[o + v] = T.if_then_else(jv * vec < end, Logits[row, jv * vec + v], 0)
        else:
            if jv * vec < end:
                for v in T.vectorized(vec):
                    xv[o + v] = Logits[row, jv * vec + v]

    @T.macro
    def sampled_histogram(Logits, row, tx, n_sv, base_v, start, end, xv, kv, hist, prefix, pmask, refine):
        # the histogram of the row's sampled keys: their top 12 bits, or (`refine`) the next 8 bits of those whose
        # top bits are `prefix` under `pmask`; each thread's `unroll` vectors of a trip loaded before any is binned
        for it in T.serial(T.ceildiv(n_sv, threads * unroll)):
            for u in T.unroll(unroll):
                if (it * unroll + u) * threads + tx < n_sv:
                    load_trip(Logits, row, base_v + sampled_vector((it * unroll + u) * threads + tx), end, xv, False,
                              u * vec)
            for u in T.unroll(unroll):
                if (it * unroll + u) * threads + tx < n_sv:
                    jb = (base_v + sampled_vector((it * unroll + u) * threads + tx)) * vec
                    for v in T.unroll(vec):
                        if (jb + v >= start) & (jb + v < end):
                            kv[0] = _ordered_key(xv[u * vec + v])
                            if refine:
                                if (kv[0] & pmask) == prefix:
                                    T.atomic_add(hist[T.Cast(T.int32, (kv[0] >> T.uint32(32 - FIRST_BITS - RADIX_BITS))
                                                              & T.uint32(RADIX - 1))], 1)
                            else:
                                T.atomic_add(hist[T.Cast(T.int32, kv[0] >> T.uint32(32 - FIRST_BITS))], 1)

    @T.macro
    def rank_place(tx, row, n_src, src_key, src_idx, raw, dst_key, dst_idx, n_b, e_n, b_n, hist, tsum, wsum, big,
                   wmx, wmn, bkt, sv, slot, Out):
        # the counting sort: element p < n_src of thread p % threads (key src_key[p], ordered (raw) or ^ FLIP; id
        # src_idx[p], _INT_MAX: none) goes to bucket (its score's place between the largest and smallest finite
        # score, n_b buckets; +inf and NaNs first, -inf last), so buckets are in score order and the prefix sums of
        # their counts give each bucket's first place; its rank is that place plus the bucket's keys ordering before
        # it (score desc, id asc), and the ranks < topk are written to Out. big[0] <- 1 (and Out untouched) when a
        # bucket holds more than RANK_MAX: the caller sorts otherwise. dst_key / dst_idx: n_src scratch places.
        xmx = T.alloc_var(T.float32)
        xmn = T.alloc_var(T.float32)
        bscale = T.alloc_var(T.float32)
        x = T.alloc_var(T.float32)
        ak = T.alloc_var(T.uint32)
        fk = T.alloc_var(T.uint32)
        ai = T.alloc_var(T.int32)
        val = T.alloc_var(T.int32)
        r_lo = T.alloc_var(T.int32)
        r_n = T.alloc_var(T.int32)
        T.sync_threads()
        xmx = -T.infinity(T.float32)
        xmn = T.infinity(T.float32)
        for e in T.unroll(e_n):
            if e * threads + tx < n_src:
                x = _from_ordered_key(_key_as(src_key[e * threads + tx], raw, False))
                if (src_idx[e * threads + tx] != _INT_MAX) & (x > -T.infinity(T.float32)) & (
                        x < T.infinity(T.float32)):
                    xmx = T.max(xmx, x)
                    xmn = T.min(xmn, x)
        for o in T.unroll(5):
            xmx = T.max(xmx, T.shfl_xor(xmx, 1 << o))
            xmn = T.min(xmn, T.shfl_xor(xmn, 1 << o))
        if tx % 32 == 0:
            wmx[tx // 32] = xmx
            wmn[tx // 32] = xmn
        for it in T.serial(T.ceildiv(n_b + 1, threads)):
            if it * threads + tx <= n_b:
                hist[it * threads + tx] = 0
        if tx == 0:
            big[0] = 0
        T.sync_threads()
        for w in T.serial(threads // 32):
            xmx = T.max(xmx, wmx[w])
            xmn = T.min(xmn, wmn[w])
        bscale = T.if_then_else(xmx > xmn, T.Cast(T.float32, n_b - 1) / (xmx - xmn), 0.0)
        for e in T.unroll(e_n):
            bkt[e] = -1
            if e * threads + tx < n_src:
                if src_idx[e * threads + tx] != _INT_MAX:
                    ak = _key_as(src_key[e * threads + tx], raw, False)
                    x = _from_ordered_key(ak)
                    bkt[e] = T.if_then_else(
                        (x > -T.infinity(T.float32)) & (x < T.infinity(T.float32)),
                        T.Cast(T.int32, T.min(T.max((xmx - x) * bscale, 0.0), T.Cast(T.float32, n_b - 1))),
                        T.if_then_else(ak > T.uint32(0x80000000), 0, n_b - 1))
                    T.atomic_add(hist[bkt[e]], 1)
        T.sync_threads()
        sv[0] = 0
        for i in T.serial(b_n):
            if tx * b_n + i < n_b:
                sv[0] = sv[0] + hist[tx * b_n + i]
        suffix_scan(tx, sv, tsum, wsum, threads)
        val = tsum[0] - tsum[tx]                            # elements in the buckets before this thread's
        for i in T.serial(b_n):
            if tx * b_n + i < n_b:
                r_n = hist[tx * b_n + i]
                hist[tx * b_n + i] = val
                val = val + r_n
                if r_n > RANK_MAX:
                    big[0] = 1
        T.sync_threads()
        if big[0] == 0:
            # each bucket's elements side by side in dst; hist[b] becomes the end of bucket b, so bucket b is
            # [hist[b - 1], hist[b])
            for e in T.unroll(e_n):
                if bkt[e] >= 0:
                    fk = _key_as(src_key[e * threads + tx], raw, True)
                    slot[0] = T.atomic_add(hist[bkt[e]], 1, return_prev=True)
                    dst_key[slot[0]] = fk
                    dst_idx[slot[0]] = src_idx[e * threads + tx]
            T.sync_threads()
            for e in T.unroll(e_n):
                if bkt[e] >= 0:
                    fk = _key_as(src_key[e * threads + tx], raw, True)
                    ai = src_idx[e * threads + tx]
                    r_lo = T.if_then_else(bkt[e] > 0, hist[T.max(bkt[e] - 1, 0)], 0)
                    r_n = r_lo
                    for j in T.serial(hist[bkt[e]] - r_lo):
                        if (dst_key[r_lo + j] < fk) | ((dst_key[r_lo + j] == fk) & (dst_idx[r_lo + j] < ai)):
                            r_n = r_n + 1
                    if r_n < topk:
                        Out[row, r_n] = ai
            for it in T.serial(T.ceildiv(topk, threads)):
                if (it * threads + tx >= tsum[0]) & (it * threads + tx < topk):
                    Out[row, it * threads + tx] = -1

    # The stages of the kernel, in order. Scalars they share are the kernel's `T.alloc_var`s, passed as `T.Ref`:
    # a macro's plain parameter would bind a copy (a let), and its stores would not reach the caller.

    @T.macro
    def clear_hist(tx, hist, n):
        """hist[0..n] <- 0: n bins and the suffix sums' hist[n]."""
        for it in T.serial(T.ceildiv(n + 1, threads)):
            p = it * threads + tx
            if p <= n:
                hist[p] = 0

    @T.macro
    def clear_winners(tx, skey, sidx):
        """The sort_n winners' places <- (FLIP, _INT_MAX): no key, sorted last, written as -1."""
        for it in T.serial(T.ceildiv(sort_n, threads)):
            p = it * threads + tx
            if p < sort_n:
                skey[p] = FLIP
                sidx[p] = _INT_MAX

    @T.macro
    def radix_pick(tx, hist, sv, wsum, ctl, want: T.Ref):
        """After an 8-bit histogram's atomics: its suffix sums, and ctl[0] <- the bin holding the want-th key."""
        radix_suffix(tx, hist, sv, wsum)
        if tx < RADIX:
            if hist[tx] >= want and hist[tx + 1] < want:
                ctl[0] = tx
        T.sync_threads()

    @T.macro
    def init_row(row, tx, Starts, Ends, skey, sidx, ctl, cnt, start: T.Ref, end: T.Ref, prefix: T.Ref,
                 pmask: T.Ref, krem: T.Ref, placed: T.Ref):
        """The row's keys [start, end) and the vectors holding them; the winners' places, counters, cleared.
        Returns n_valid, n_iter (keys a thread), base_v (the first vector), n_vit (vectors a thread), n_sv
        (sampled vectors)."""
        start = T.max(Starts[row], 0)
        end = T.min(Ends[row], seq_k)
        prefix = T.uint32(0)
        pmask = T.uint32(0)
        krem = topk
        placed = 0
        n_valid = end - start
        n_iter = T.ceildiv(T.max(n_valid, 0), threads)                # the row's keys a thread
        base_v = start // vec                                        # the row's first vector
        n_vit = T.ceildiv(T.max(end - base_v * vec, 0), threads * vec)
        # sampled vectors: groups of `sample_group` adjacent ones, one group in every `sample` groups
        n_sv = T.ceildiv(T.ceildiv(T.max(end - base_v * vec, 0), vec), sample * sample_group) * sample_group

        clear_winners(tx, skey, sidx)
        if tx < 4:
            ctl[tx] = 0
        if tx == 0:
            cnt[0] = 0
        return n_valid, n_iter, base_v, n_vit, n_sv

    @T.macro
    def first_histogram(Logits, row, tx, n_valid, base_v, n_vit, n_sv, xv, kv, hist, start: T.Ref, end: T.Ref,
                        prefix: T.Ref, pmask: T.Ref, key: T.Ref, sampled: T.Ref, want: T.Ref):
        """Round 0's histogram of the top 12 bits (sign, exponent, 3 mantissa bits; 8 bits would span a factor
        of 4 in score and put up to half a long row in one bin): over the row, or (sampled <- 1) over the
        sample of a row of sample_min keys or more."""
        T.sync_threads()
        clear_hist(tx, hist, FIRST_BINS)
        sampled = 0
        if n_valid >= sample_min:
            sampled = 1
        want = topk
        T.sync_threads()
        if sampled == 1:
            sampled_histogram(Logits, row, tx, n_sv, base_v, start, end, xv, kv, hist, prefix, pmask, False)
        else:
            for it in T.serial(n_vit):
                jb = (base_v + it * threads + tx) * vec
                load_trip(Logits, row, base_v + it * threads + tx, end, xv, False)
                for v in T.unroll(vec):
                    if (jb + v >= start) & (jb + v < end):
                        key = _ordered_key(xv[v])
                        T.atomic_add(hist[T.Cast(T.int32, key >> T.uint32(32 - FIRST_BITS))], 1)
        T.sync_threads()

    @T.macro
    def first_threshold(tx, n_valid, hist, tsum, wsum, sv, ctl, sampled: T.Ref, want: T.Ref, bin_: T.Ref,
                        prefix: T.Ref, pmask: T.Ref):
        """Round 0's threshold bin, by a suffix scan of the histogram: the bin holding the want-th largest key
        (topk, or on a sample its bound below) -> ctl[0], the keys above it -> ctl[3], its 12 bits -> prefix
        under pmask."""
        val = T.alloc_var(T.int32)
        # suffix sums: each thread owns `per` consecutive bins; scan the threads' totals
        sv[0] = 0
        for i in T.serial(per):
            sv[0] = sv[0] + hist[tx * per + i]
        suffix_scan(tx, sv, tsum, wsum, threads)
        if sampled == 1:
            # the sample's rank that bounds the row's top-k from below: its expected share of the top-k,
            # plus four standard deviations and a few (a row where it does not falls back below)
            mu = T.Cast(T.float32, topk) * T.Cast(T.float32, tsum[0]) / T.Cast(T.float32, n_valid)
            want = T.min(T.Cast(T.int32, mu + 4.0 * T.sqrt(mu)) + 8, tsum[0])
        val = tsum[tx + 1]                                   # keys in bins above this thread's
        for i in T.serial(per):
            bin_ = tx * per + per - 1 - i
            if val < want and val + hist[bin_] >= want:
                ctl[0] = bin_
                ctl[3] = val                                 # keys strictly above the bin
            val = val + hist[bin_]
        T.sync_threads()
        bin_ = ctl[0]
        prefix = T.Cast(T.uint32, bin_) << T.uint32(32 - FIRST_BITS)
        pmask = T.uint32((FIRST_BINS - 1) << (32 - FIRST_BITS))

    @T.macro
    def sampled_bound(Logits, row, tx, base_v, n_sv, xv, kv, hist, sv, wsum, ctl, start: T.Ref, end: T.Ref,
                      prefix: T.Ref, pmask: T.Ref, want: T.Ref, tau: T.Ref):
        """Round 0 again on the sample, on the next 8 bits of the threshold bin's keys: tau <- a 20-bit lower
        bound on the row's k-th largest key."""
        want = want - ctl[3]
        T.sync_threads()
        clear_hist(tx, hist, RADIX)
        T.sync_threads()
        sampled_histogram(Logits, row, tx, n_sv, base_v, start, end, xv, kv, hist, prefix, pmask, True)
        radix_pick(tx, hist, sv, wsum, ctl, want)
        tau = prefix | (T.Cast(T.uint32, ctl[0]) << T.uint32(32 - FIRST_BITS - RADIX_BITS))

    @T.macro
    def collect_above_bound(Logits, row, tx, base_v, n_vit, xv, slot, cnt, ckey, cidx, start: T.Ref, end: T.Ref,
                            key: T.Ref, tau: T.Ref, ncand: T.Ref, from_row: T.Ref, prefix: T.Ref, pmask: T.Ref,
                            n_rounds: T.Ref):
        """One pass keeps every key >= tau (about want * sample of them) in shared memory as the candidates;
        from_row <- 1 where the bound missed (fewer than topk of them, or more than the buffer holds). The
        rounds after it (if any) start over on all 32 bits."""
        if rank_sort:
            # the candidates: every key >= tau, compared as floats (x >= tau_f; at the bottom, the bin of
            # -inf: every finite x) where the vector lies inside the row
            tau_f = T.alloc_var(T.float32)
            tau_f = T.if_then_else(tau <= T.uint32(0x007FFFFF), -T.infinity(T.float32), _from_ordered_key(tau))
            for it in T.serial(T.ceildiv(n_vit, unroll)):
                for u in T.unroll(unroll):
                    load_trip(Logits, row, base_v + (it * unroll + u) * threads + tx, end, xv, False, u * vec)
                for u in T.unroll(unroll):
                    jb = (base_v + (it * unroll + u) * threads + tx) * vec
                    if (jb >= start) & (jb + vec <= end):        # the vector inside the row
                        for v in T.unroll(vec):
                            if xv[u * vec + v] >= tau_f:
                                slot[0] = T.atomic_add(cnt[0], 1, return_prev=True)
                                if slot[0] < candidates:
                                    ckey[slot[0]] = _ordered_key(xv[u * vec + v])
                                    cidx[slot[0]] = jb + v
                    else:
                        for v in T.unroll(vec):
                            key = _ordered_key(xv[u * vec + v])
                            if (jb + v >= start) & (jb + v < end) & (key >= tau):
                                slot[0] = T.atomic_add(cnt[0], 1, return_prev=True)
                                if slot[0] < candidates:
                                    ckey[slot[0]] = key
                                    cidx[slot[0]] = jb + v
        else:
            for it in T.serial(n_vit):
                jb = (base_v + it * threads + tx) * vec
                load_trip(Logits, row, base_v + it * threads + tx, end, xv, True)
                for v in T.unroll(vec):
                    key = _ordered_key(xv[v])
                    append((jb + v >= start) & (jb + v < end) & (key >= tau), cnt[0], slot)
                    if (jb + v >= start) & (jb + v < end) & (key >= tau):
                        if slot[0] < candidates:
                            ckey[slot[0]] = key
                            cidx[slot[0]] = jb + v
        T.sync_threads()
        ncand = cnt[0]
        from_row = T.if_then_else((ncand < topk) | (ncand > candidates), 1, 0)  # the bound missed: the row
        prefix = T.uint32(0)
        pmask = T.uint32(0)
        n_rounds = 4

    @T.macro
    def rank_candidates(tx, row, ckey, cidx, skey, sidx, hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot, Out,
                        ncand: T.Ref, from_row: T.Ref, placed: T.Ref, n_rounds: T.Ref):
        """(direct_rank) Where the bound held, every key >= tau is a candidate and there are >= topk of them:
        their own ranks are the row's, and the counting sort writes the first topk (placed <- 1, no rounds);
        where a bucket holds over RANK_MAX of them, the winners' places are cleared for the rounds below."""
        if direct_rank:
            if from_row == 0:
                rank_place(tx, row, ncand, ckey, cidx, True, skey, sidx, cand_b, cand_e, cand_b // threads,
                           hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot, Out)
                placed = T.if_then_else(big[0] == 0, 1, 0)
                if placed == 1:
                    n_rounds = 0
                else:
                    T.sync_threads()                     # the winners' places, cleared again
                    clear_winners(tx, skey, sidx)

    @T.macro
    def split_threshold_bin(Logits, row, tx, base_v, n_vit, xv, slot, ctl, cnt, skey, sidx, ckey, cidx,
                            start: T.Ref, end: T.Ref, key: T.Ref, prefix: T.Ref, pmask: T.Ref, krem: T.Ref,
                            ncand: T.Ref, from_row: T.Ref, n_rounds: T.Ref):
        """(A row too short to sample) one pass: the keys above the threshold bin are winners, the bin's keys
        the candidates; from_row <- 1 where the bin holds more than the buffer. Lanes past the row's end load
        zeros and carry no key."""
        krem = krem - ctl[3]
        for it in T.serial(n_vit):
            jb = (base_v + it * threads + tx) * vec
            load_trip(Logits, row, base_v + it * threads + tx, end, xv, True)
            for v in T.unroll(vec):
                key = _ordered_key(xv[v])
                append((jb + v >= start) & (jb + v < end) & ((key & pmask) > prefix), ctl[1],
                       slot)
                if (jb + v >= start) & (jb + v < end) & ((key & pmask) > prefix):
                    skey[slot[0]] = key ^ FLIP
                    sidx[slot[0]] = jb + v
                append((jb + v >= start) & (jb + v < end) & ((key & pmask) == prefix), cnt[0],
                       slot)
                if (jb + v >= start) & (jb + v < end) & ((key & pmask) == prefix):
                    if slot[0] < candidates:
                        ckey[slot[0]] = key
                        cidx[slot[0]] = jb + v
        T.sync_threads()
        ncand = cnt[0]
        from_row = T.if_then_else(ncand > candidates, 1, 0)
        n_rounds = 3
        if from_row == 1:
            T.sync_threads()
            if tx == 0:
                ctl[1] = 0                               # the gather below rewrites every winner

    @T.macro
    def radix_rounds(Logits, row, tx, n_src, ckey, hist, sv, wsum, ctl, start: T.Ref, from_row: T.Ref,
                     n_rounds: T.Ref, x: T.Ref, key: T.Ref, krem: T.Ref, bin_: T.Ref, prefix: T.Ref,
                     pmask: T.Ref):
        """The other rounds, 8 bits each, on the n_src candidates or (from_row) keys of the row: prefix <- the
        exact k-th key, krem <- the winners equal to it. After the 12-bit round: bits 19-12, 11-4, 7-0 (the last
        overlaps the one before: its bits already match); after the sampled bound, all 32 bits."""
        for rnd in T.serial(n_rounds):
            shift = T.Cast(T.uint32, T.max(T.if_then_else(n_rounds == 4, 24, 32 - FIRST_BITS - RADIX_BITS)
                                           - rnd * RADIX_BITS, 0))
            T.sync_threads()
            clear_hist(tx, hist, RADIX)
            T.sync_threads()
            for it in T.serial(T.ceildiv(n_src, threads)):
                c = it * threads + tx
                if c < n_src:
                    if from_row == 1:
                        x = Logits[row, start + c]
                        key = _ordered_key(x)
                    else:
                        key = ckey[c]
                    if (key & pmask) == prefix:
                        T.atomic_add(hist[T.Cast(T.int32, (key >> shift) & T.uint32(RADIX - 1))], 1)
            radix_pick(tx, hist, sv, wsum, ctl, krem)
            bin_ = ctl[0]
            krem = krem - hist[bin_ + 1]
            prefix = prefix | (T.Cast(T.uint32, bin_) << shift)
            pmask = pmask | (T.uint32(RADIX - 1) << shift)

    @T.macro
    def gather_winners(Logits, row, tx, n_src, ckey, cidx, skey, sidx, ctl, slot, start: T.Ref, from_row: T.Ref,
                       x: T.Ref, key: T.Ref, krem: T.Ref, prefix: T.Ref):
        """The winners to their places: the keys above the k-th (prefix) after any already there (ctl[1]), then
        the first krem keys equal to it."""
        kid = T.alloc_var(T.int32)
        T.sync_threads()
        for it in T.serial(T.ceildiv(n_src, threads)):
            c = it * threads + tx
            key = T.uint32(0)
            kid = 0
            if c < n_src:
                if from_row == 1:
                    x = Logits[row, start + c]
                    key = _ordered_key(x)
                    kid = start + c
                else:
                    key = ckey[c]
                    kid = cidx[c]
            append((c < n_src) & (key > prefix), ctl[1], slot)
            if (c < n_src) & (key > prefix):
                skey[slot[0]] = key ^ FLIP
                sidx[slot[0]] = kid
            append((c < n_src) & (key == prefix), ctl[2], slot)
            if (c < n_src) & (key == prefix):
                if slot[0] < krem:
                    skey[topk - krem + slot[0]] = key ^ FLIP
                    sidx[topk - krem + slot[0]] = kid

    @T.macro
    def take_row(Logits, row, tx, n_iter, skey, sidx, start: T.Ref, end: T.Ref, x: T.Ref):
        """(Rows of at most topk keys) every key is a winner."""
        T.sync_threads()
        for it in T.serial(n_iter):
            j = start + it * threads + tx
            if j < end:
                x = Logits[row, j]
                skey[j - start] = _ordered_key(x) ^ FLIP
                sidx[j - start] = j

    @T.macro
    def rank_winners(tx, row, skey, sidx, ckey, cidx, hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot, Out,
                     placed: T.Ref, do_sort: T.Ref):
        """(rank_sort) The counting sort orders the winners and writes them, unless the candidates' already
        wrote the row; do_sort <- 1 where a bucket is skewed (or without rank_sort): the bitonic sort."""
        do_sort = 1
        if rank_sort:
            if placed == 1:
                do_sort = 0
            else:
                rank_place(tx, row, sort_n, skey, sidx, False, ckey, cidx, sort_n, rank_e, rank_b, hist, tsum,
                           wsum, big, wmx, wmn, bkt, sv, slot, Out)
                do_sort = big[0]

    def pair(k, i):
        # a (key, id) as one uint64, key in the high word: ascending = (key, id) ascending
        return (T.Cast(T.uint64, k) << T.uint64(32)) | T.Cast(T.uint64, T.Cast(T.uint32, i))

    def pair_id(p):
        # the id of a pair
        return T.Cast(T.int32, T.Cast(T.uint32, p & T.uint64(0xFFFFFFFF)))

    @T.macro
    def sort_in_thread(tx, kk, jj, rp, pa: T.Ref, pb: T.Ref):
        """A bitonic stage whose partner is in the same thread: a compare-exchange of two registers."""
        if tx < sort_threads:
            for e in T.unroll(E, explicit=True):
                if (e & (1 << (kk - jj))) == 0:
                    pa = rp[e]
                    pb = rp[e | (1 << (kk - jj))]
                    if T.if_then_else(((tx * E + e) & (2 << kk)) == 0, pa > pb, pb > pa):
                        rp[e] = pb
                        rp[e | (1 << (kk - jj))] = pa

    @T.macro
    def sort_in_warp(tx, kk, jj, rp, po: T.Ref):
        """A bitonic stage whose partner is in the same warp: one full-mask shuffle of each pair."""
        if tx < sort_threads:                # whole warps: full-mask shuffles
            for e in T.unroll(E, explicit=True):
                po = T.shfl_xor(rp[e], (1 << (kk - jj)) // E)
                if T.if_then_else(((tx & ((1 << (kk - jj)) // E)) == 0)
                                  == (((tx * E + e) & (2 << kk)) == 0), rp[e] > po, po > rp[e]):
                    rp[e] = po

    @T.macro
    def sort_across_warps(tx, kk, jj, rp, skey, sidx, po: T.Ref):
        """A bitonic stage whose partner is in another warp: the pairs through shared memory."""
        T.sync_threads()
        if tx < sort_threads:
            for e in T.unroll(E, explicit=True):
                skey[tx * E + e] = T.Cast(T.uint32, rp[e] >> T.uint64(32))
                sidx[tx * E + e] = pair_id(rp[e])
        T.sync_threads()
        if tx < sort_threads:
            for e in T.unroll(E, explicit=True):
                po = pair(skey[(tx ^ ((1 << (kk - jj)) // E)) * E + e], sidx[(tx ^ ((1 << (kk - jj)) // E)) * E + e])
                if T.if_then_else(((tx & ((1 << (kk - jj)) // E)) == 0)
                                  == (((tx * E + e) & (2 << kk)) == 0), rp[e] > po, po > rp[e]):
                    rp[e] = po

    @T.macro
    def bitonic_sort(tx, row, skey, sidx, Out, do_sort: T.Ref):
        """(do_sort) The winners sorted ascending by (skey, sidx) in registers, and the first topk written.
        Element i = tx * E + e lives in register e of thread tx; partner i ^ d is in the same thread (d < E), the
        same warp (d < 32 E: a shuffle) or another warp (shared memory)."""
        rp = T.alloc_local([E], T.uint64)  # this thread's (key, id) pairs
        pa = T.alloc_var(T.uint64)
        pb = T.alloc_var(T.uint64)
        po = T.alloc_var(T.uint64)
        if do_sort == 0:
            T.evaluate(0)
        else:
            T.sync_threads()
            if tx < sort_threads:
                for e in T.unroll(E, explicit=True):
                    rp[e] = pair(skey[tx * E + e], sidx[tx * E + e])
            for kk in T.unroll(log_n, explicit=True):
                for jj in T.unroll(log_n, explicit=True):
                    if jj <= kk:
                        if (1 << (kk - jj)) < E:
                            sort_in_thread(tx, kk, jj, rp, pa, pb)
                        elif (1 << (kk - jj)) < 32 * E:
                            sort_in_warp(tx, kk, jj, rp, po)
                        else:
                            sort_across_warps(tx, kk, jj, rp, skey, sidx, po)
            if tx < sort_threads:
                for e in T.unroll(E, explicit=True):
                    if tx * E + e < topk:
                        Out[row, tx * E + e] = T.if_then_else(
                            (rp[e] & T.uint64(0xFFFFFFFF)) == T.uint64(_INT_MAX), -1, pair_id(rp[e]))

    @T.prim_func
    def topk_select(
        Logits: T.Tensor([seq_q, seq_k], T.float32),
        Starts: T.Tensor([seq_q], T.int32),
        Ends: T.Tensor([seq_q], T.int32),
        Out: T.Tensor([seq_q, topk], T.int32),
    ):
        with T.Kernel(seq_q, threads=threads) as row:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            hist = T.alloc_shared([hist_n], T.int32)  # becomes suffix sums; hist[RADIX] = 0
            ctl = T.alloc_shared([4], T.int32)  # 0: threshold bin, 1: #greater, 2: #equal, 3: keys above the bin
            skey = T.alloc_shared([sort_buf], T.uint32)  # ~ordered key: ascending = score desc
            sidx = T.alloc_shared([sort_buf], T.int32)
            tsum = T.alloc_shared([threads + 1], T.int32)  # per-thread bin totals, then their suffix sums
            ckey = T.alloc_shared([candidates], T.uint32)  # the candidates' keys ...
            cidx = T.alloc_shared([candidates], T.int32)  # ... and their key ids
            cnt = T.alloc_shared([1], T.int32)  # how many keys the candidates are
            ncand = T.alloc_var(T.int32)
            sv = T.alloc_local([2], T.int32)                  # a scan's value in this thread, a shuffled one
            wsum = T.alloc_shared([32], T.int32)              # the scans' warp totals
            sampled = T.alloc_var(T.int32)
            want = T.alloc_var(T.int32)
            from_row = T.alloc_var(T.int32)
            n_rounds = T.alloc_var(T.int32)
            tau = T.alloc_var(T.uint32)
            start = T.alloc_var(T.int32)
            end = T.alloc_var(T.int32)
            prefix = T.alloc_var(T.uint32)
            pmask = T.alloc_var(T.uint32)
            krem = T.alloc_var(T.int32)
            bin_ = T.alloc_var(T.int32)
            key = T.alloc_var(T.uint32)
            kv = T.alloc_local([1], T.uint32)                 # a sampled key (sampled_histogram)
            x = T.alloc_var(T.float32)
            xv = T.alloc_local([vec * unroll], T.float32)
            slot = T.alloc_local([1], T.int32)
            do_sort = T.alloc_var(T.int32)                    # 0: the counting sort placed every winner
            placed = T.alloc_var(T.int32)                     # 1: the candidates' counting sort wrote the row
            if rank_sort:
                big = T.alloc_shared([1], T.int32)            # a bucket holds more than RANK_MAX winners
                wmx = T.alloc_shared([32], T.float32)         # the warps' largest finite winner ...
                wmn = T.alloc_shared([32], T.float32)         # ... and smallest
                bkt = T.alloc_local([max(rank_e, cand_e)], T.int32)   # this thread's winners' (candidates') buckets
            else:
                big = wmx = wmn = bkt = None                  # the counting sort's: unused

            n_valid, n_iter, base_v, n_vit, n_sv = init_row(row, tx, Starts, Ends, skey, sidx, ctl, cnt, start, end,
                                                            prefix, pmask, krem, placed)
            if n_valid > topk:
                first_histogram(Logits, row, tx, n_valid, base_v, n_vit, n_sv, xv, kv, hist, start, end, prefix,
                                pmask, key, sampled, want)
                first_threshold(tx, n_valid, hist, tsum, wsum, sv, ctl, sampled, want, bin_, prefix, pmask)
                if sampled == 1:
                    sampled_bound(Logits, row, tx, base_v, n_sv, xv, kv, hist, sv, wsum, ctl, start, end, prefix,
                                  pmask, want, tau)
                    collect_above_bound(Logits, row, tx, base_v, n_vit, xv, slot, cnt, ckey, cidx, start, end, key,
                                        tau, ncand, from_row, prefix, pmask, n_rounds)
                    rank_candidates(tx, row, ckey, cidx, skey, sidx, hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot,
                                    Out, ncand, from_row, placed, n_rounds)
                else:
                    split_threshold_bin(Logits, row, tx, base_v, n_vit, xv, slot, ctl, cnt, skey, sidx, ckey, cidx,
                                        start, end, key, prefix, pmask, krem, ncand, from_row, n_rounds)
                # the rounds and the gather: on the candidates in shared memory, or on the row when they did not
                # fit (one code path: the source is chosen per CTA, not per element)
                n_src = T.if_then_else(placed == 1, 0, T.if_then_else(from_row == 1, n_valid, ncand))
                radix_rounds(Logits, row, tx, n_src, ckey, hist, sv, wsum, ctl, start, from_row, n_rounds, x, key,
                             krem, bin_, prefix, pmask)
                gather_winners(Logits, row, tx, n_src, ckey, cidx, skey, sidx, ctl, slot, start, from_row, x, key,
                               krem, prefix)
            else:
                take_row(Logits, row, tx, n_iter, skey, sidx, start, end, x)
            # order the winners: the counting sort, or the bitonic sort where its buckets are skewed
            rank_winners(tx, row, skey, sidx, ckey, cidx, hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot, Out,
                         placed, do_sort)
            bitonic_sort(tx, row, skey, sidx, Out, do_sort)

    return topk_select


# The select kernel places every barrier itself (the automatic pass would add one per loop trip).
# Every read of the scores is in bounds by construction (j < end <= seq_k, and vec divides seq_k), so the
# safe-memory pass's per-element guard, which also stops the vector loads, is off.
_SELECT_PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
                        tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}
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


@functools.lru_cache(maxsize=None)
def compile_indexer_logits(heads: int, dim: int, target_arch: str = "sm_90a", in_dtype=torch.bfloat16,
                           **tunables):
    """The logits kernel for ``heads`` x ``dim`` inputs in ``in_dtype``; ``tunables``: block_Q, min_blocks."""
    return tilelang.compile(build_indexer_logits(heads, dim, _IN_DTYPES[in_dtype], **tunables),
                            target={"kind": "cuda", "arch": target_arch}, pass_configs=dict(_LOGITS_PASS_CONFIGS))


# The logits kernel's register bound, read per call (a benchmark times others beside it): registers for 4 CTAs per
# SM (ptxas, CUDA 13.0: 112 registers with "mma_pairs", no spills).
LOGITS_TUNABLES = {"min_blocks": 4}


def logits_kernel(heads: int, dim: int, in_dtype: torch.dtype, target_arch: str):
    """The logits kernel the op runs: ``block_Q * heads = 128`` GEMM rows, :data:`LOGITS_TUNABLES`."""
    return compile_indexer_logits(heads, dim, target_arch, in_dtype,
                                  **({"block_Q": max(1, 128 // heads)} | LOGITS_TUNABLES))


# The select the op runs (build_topk_select's arguments), read per call like LOGITS_TUNABLES: 512 threads, 3072
# shared-memory candidates (the sampled bound keeps ~1.3 topk), float4 loads, 8 pairs a thread in the register
# sort, a sample of one 64-byte group of 4 vectors in every 8, 2 vectors a thread in flight, registers for 3 CTAs
# per SM (as many as their shared memory allows).
SELECT_TUNABLES = {"threads": 512, "candidates": 3072, "vec": 4, "sort_elems": 8, "sample": 8, "sample_group": 4,
                   "unroll": 2, "min_blocks": 3}


def select_kernel(topk: int, target_arch: str):
    """The select kernel the op runs: :data:`SELECT_TUNABLES`."""
    assert BLOCK_N % SELECT_TUNABLES.get("vec", 1) == 0, "SELECT_TUNABLES: vec must divide BLOCK_N"
    return compile_topk_select(topk, target_arch, **SELECT_TUNABLES)


@functools.lru_cache(maxsize=None)
def compile_topk_select(topk: int, target_arch: str = "sm_90a", **tunables):
    return tilelang.compile(build_topk_select(topk, **tunables),
                            target={"kind": "cuda", "arch": target_arch},
                            pass_configs=_SELECT_PASS_CONFIGS)


def ci_builds(target_arch: str = "sm_90a") -> dict:
    """name -> thunk building (not running) one kernel of this family for `target_arch` (CI), uncached: each
    register epilogue the op dispatches to and the op's select."""
    logits = lambda heads, dtype: (lambda: compile_indexer_logits.__wrapped__(        # noqa: E731
        heads, 128, target_arch, dtype, **({"block_Q": 128 // heads} | LOGITS_TUNABLES)))
    return {
        "indexer_logits[h32,d128]": logits(32, torch.bfloat16),                     # "lanes"
        "indexer_logits_fp8[h32,d128]": logits(32, torch.float8_e4m3fn),            # "mma_pairs"
        "indexer_logits_fp8[h64,d128]": logits(64, torch.float8_e4m3fn),            # "mma"
        "topk_select[k2048]": lambda: compile_topk_select.__wrapped__(2048, target_arch, **SELECT_TUNABLES),
    }


# --------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------
# fp32 scores materialised per query chunk. 2 GiB: 8K queries a chunk at 64K keys, 4K at 128K, so each logits
# launch has thousands of one-warpgroup CTAs
LOGITS_BUDGET_BYTES = 2 << 30
BLOCK_N = 128
# How the op runs its chunks. ``buffers`` 2: the select of chunk c runs on a side stream while the logits of
# chunk c + 1 fill the other buffer (the select's CTAs fill the SMs the logits' wave tails leave), at twice the
# buffer memory when the op has more than one chunk; 1: one buffer, logits then select, in order on the caller's
# stream. ``select_priority``: the side stream's priority (lower is higher, CUDA's convention; 0 the default).
# Two buffers are 1-3% faster at 64K / 128K for 2 GiB more (docs/kernels.md); the layer at 128K already peaks
# within a few GiB of the H200's memory, so the op keeps one.
LAUNCH_TUNABLES = {"buffers": 1, "select_priority": 0}


@functools.cache
def _side_stream(device_index: int, priority: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index, priority=priority)


def dsa_topk_indices_tl(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, starts: torch.Tensor,
                        ends: torch.Tensor, topk: int, scale: float,
                        k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA kernel of `glm52::dsa_topk_indices`: q [S, H, D], k [Sk, D] both bf16 or both float8_e4m3fn with
    ``k_scale`` [Sk], weights [S, H] (fp32 or bf16), starts/ends [S] int32 -> int32 [S, topk], ids by
    descending score, -1 padded. Other q/k dtypes run the PyTorch kernel (the logits GEMM would round them)."""
    _check(q, k, weights, starts, ends, topk, k_scale)
    if q.dtype not in _IN_DTYPES or k.dtype != q.dtype:
        warn_once("glm52::dsa_topk_indices:dtype",
                  f"glm52::dsa_topk_indices: the TileLang kernel takes bfloat16 or float8_e4m3fn q and k; "
                  f"{q.dtype} / {k.dtype} inputs run the PyTorch reference kernel (slower) instead")
        return _dsa_topk_kernel(q, k, weights, starts, ends, topk, scale, k_scale)
    S, H, D = q.shape
    if H not in KERNEL_HEADS:
        warn_once(f"glm52::dsa_topk_indices:heads{H}",
                  f"glm52::dsa_topk_indices: the TileLang logits kernel takes {sorted(KERNEL_HEADS)} indexer heads; "
                  f"{H} heads run the PyTorch reference kernel (slower) instead")
        return _dsa_topk_kernel(q, k, weights, starts, ends, topk, scale, k_scale)
    Sk = k.shape[0]
    dev = q.device
    out = torch.empty(S, topk, dtype=torch.int32, device=dev)
    if S == 0:
        return out
    arch = cuda_target(dev)["arch"]
    block_Q = max(1, 128 // H)
    logits_k = logits_kernel(H, D, q.dtype, arch)
    select_k = select_kernel(topk, arch)

    q = q.contiguous()
    Skp = round_up(max(Sk, 1), BLOCK_N)
    k_pad = pad_dim(k.view(torch.uint8), 0, Skp).view(k.dtype)                  # fp8 pads as bytes
    ks = k_scale.float() if k_scale is not None else torch.ones(Sk, dtype=torch.float32, device=dev)
    ks = pad_dim(ks, 0, Skp)
    w = (weights.to(torch.float32) * scale).contiguous()
    starts = starts.clamp(0, Sk).contiguous()
    ends = ends.clamp(0, Sk).contiguous()

    chunk = max(block_Q, (LOGITS_BUDGET_BYTES // (Skp * 4)) // block_Q * block_Q)
    chunk = min(chunk, round_up(S, block_Q))
    n_buf = max(1, min(int(LAUNCH_TUNABLES["buffers"]), -(-S // chunk)))
    bufs = [torch.empty(chunk, Skp, dtype=torch.float32, device=dev) for _ in range(n_buf)]
    main = torch.cuda.current_stream(dev)
    side = _side_stream(dev.index if dev.index is not None else torch.cuda.current_device(),
                        int(LAUNCH_TUNABLES["select_priority"])) if n_buf > 1 else None
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
    return out


def register() -> None:
    torch.library.register_kernel("glm52::dsa_topk_indices", "cuda")(dsa_topk_indices_tl)
