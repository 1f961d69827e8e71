"""TileLang kernels for `glm52::dsa_topk_indices` (the DSA lightning-indexer top-k).

Two kernels, run per chunk of query rows:

1. `build_indexer_logits`: score[i, j] = ks[j] * sum_h w[i, h] * relu(q[i, h] . k[j]) (bf16 or e4m3
   tensor-core GEMM, fp32 accumulate; ks = the keys' FP8 dequantisation scales, ones for bf16), with the
   per-row key range [starts[i], ends[i]) fused in (keys outside it get -inf); key tiles wholly outside
   the block's range are never computed.
2. `build_topk_select`: one CTA per row; an exact 4-pass 8-bit radix select over the fp32 scores of
   the row's key range finds the k-th largest value, a gather pass collects the winners into shared
   memory, and a bitonic sort orders them by (score desc, key id asc). Rows with fewer valid keys
   than top-k are padded with -1. With ``candidates`` (``SELECT_TUNABLES``): a 12-bit first round,
   then one pass that keeps the winners and copies the threshold bin to shared memory, where the
   other rounds run: two reads of the row instead of five.

The op's `scale` is folded into the weights before the logits kernel.
"""


import functools

import torch

import tilelang
import tilelang.language as T

from ..dsa_topk import _check, _dsa_topk_kernel
from ._common import cuda_target, next_pow2, pad_dim, round_up, warn_once

RADIX_BITS = 8
RADIX = 1 << RADIX_BITS
FIRST_BITS = 12  # the two-read select's first round
FIRST_BINS = 1 << FIRST_BITS
_INT_MAX = 2147483647


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------
def build_indexer_logits(heads: int, dim: int, in_dtype=T.bfloat16, *, block_Q: int | None = None,
                         block_N: int = 128, num_stages: int = 2, threads: int = 256, min_blocks: int = 1):
    """Masked indexer logits, fp32 [Sq, Sk], from q and k in ``in_dtype`` (bf16 or float8_e4m3fn). Sq must
    be a multiple of block_Q, Sk of block_N.

    Tunables: block_Q queries per CTA (block_Q * heads rows form the GEMM's N side), block_N keys per
    tile, pipeline depth, threads, and min_blocks, the CTAs per SM the register allocation must leave room
    for (``__launch_bounds__``; at 1, 3 fit, limited by registers: Nsight Compute, H200, 128 threads).
    Whether TileLang splits producer and consumer warps is a pass config (:func:`compile_indexer_logits`).
    The logits are stored from the registers that reduced them: a version
    staging each tile in shared memory and copying whole rows out was no faster on the H200 and gave wrong
    logits there, so it was dropped.
    """
    if block_Q is None:
        block_Q = max(1, 128 // heads)
    rows = block_Q * heads
    seq_q = T.dynamic("seq_q")
    seq_k = T.dynamic("seq_k")
    dtype, accum = in_dtype, T.float32
    # the keys' FP8 scales multiply each tile's output, from shared memory; bf16 builds leave them out (the
    # per-element global read of a ones vector cost the bf16 kernel 1.6x on the H200: 4.07 vs 2.57 ms at 16K)
    scaled = in_dtype != T.bfloat16

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
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            q_shared = T.alloc_shared([rows, dim], dtype)
            k_shared = T.alloc_shared([block_N, dim], dtype)
            if scaled:
                ks_shared = T.alloc_shared([block_N], accum)
            s = T.alloc_fragment([block_N, rows], accum)
            s3 = T.reshape(s, (block_N, block_Q, heads))
            logits = T.alloc_fragment([block_N, block_Q], accum)
            w = T.alloc_fragment([block_Q, heads], accum)
            lo = T.alloc_var(T.int32)
            hi = T.alloc_var(T.int32)

            q0 = bx * block_Q
            lo = seq_k
            hi = 0
            for i in T.serial(block_Q):
                lo = T.min(lo, Starts[q0 + i])
                hi = T.max(hi, Ends[q0 + i])
            hi = T.min(hi, seq_k)
            lo = lo // block_N * block_N
            n_tiles = T.max(T.ceildiv(hi - lo, block_N), 0)

            T.copy(Q[q0 * heads, 0], q_shared)
            T.copy(W[q0, 0], w)
            for t in T.Pipelined(n_tiles, num_stages=num_stages):
                k0 = lo + t * block_N
                T.copy(K[k0, 0], k_shared)
                if scaled:
                    T.copy(KS[k0], ks_shared)
                T.gemm(k_shared, q_shared, s, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                for n, i, h in T.Parallel(block_N, block_Q, heads):
                    s3[n, i, h] = T.max(s3[n, i, h], 0) * w[i, h]
                T.reduce_sum(s3, logits, dim=-1, clear=True)
                if scaled:
                    for n, i in T.Parallel(block_N, block_Q):
                        logits[n, i] = logits[n, i] * ks_shared[n]
                for i, n in T.Parallel(block_Q, block_N):
                    Logits[q0 + i, k0 + n] = T.if_then_else(
                        (k0 + n >= Starts[q0 + i]) & (k0 + n < Ends[q0 + i]), logits[n, i],
                        -T.infinity(accum))

    return indexer_logits


def _ordered_key(x):
    """fp32 -> uint32 whose unsigned order is the float order."""
    bits = T.reinterpret(x, T.uint32)
    return T.if_then_else(x < 0, bits ^ T.uint32(0xFFFFFFFF), bits | T.uint32(0x80000000))


def build_topk_select(topk: int, *, threads: int = 1024, candidates: int = 0, vec: int = 1, sort_elems: int = 0,
                      warp_append: bool = False, hist_aggregate: bool = False):
    """Exact per-row top-k of fp32 scores within [starts, ends); int32 ids sorted desc, -1 pad.

    ``candidates > 0``: two reads of the row instead of five. After the first radix round (top 12 bits), one
    pass sends the keys above the threshold bin to the winners and copies the threshold bin's keys (up to
    ``candidates`` of them) to shared memory, where the three other rounds and the final gather run. A row
    whose threshold bin holds more keys runs the three rounds on the row as before. ``candidates=0`` builds
    the four-round kernel.

    The rest are about the shared-memory pipe, which bounds this kernel (Nsight Compute on the H200, S=16K:
    L1/shared 93% busy, DRAM 4%; benchmarks/results/ncu_topk_16k_h200.txt):

    - ``vec``: scores each thread loads per trip over the row, as one vector load (seq_k must then be a
      multiple of ``vec``; the launcher pads rows to BLOCK_N).
    - ``warp_append``: a key that joins the winners or the candidates takes its slot from one atomic per
      warp (ballot, popc, shuffle) instead of one per key on the same shared counter (which serialises).
    - ``sort_elems > 0``: the final bitonic sort keeps ``sort_elems`` (key, id) pairs per thread in
      registers: the stages whose partner is in the same thread or warp run in registers or through warp
      shuffles, only the few with a partner in another warp through shared memory (66 shared-memory stages
      for 2048 ids, with a barrier each, become 6). ``0``: every stage through shared memory.
    - ``hist_aggregate`` (with ``candidates``): the first round's histogram takes one atomic per distinct bin
      per warp (``match_any``; the lowest lane of each group adds the group's size) instead of one per key;
      keys of a row that fall in few bins otherwise serialise on them. Built for the next measurement; the
      op does not use it.
    """
    sort_n = max(next_pow2(topk), 32 if sort_elems else 1)
    log_n = sort_n.bit_length() - 1
    pairs = sort_n // 2
    if sort_elems:
        E = min(max(sort_elems, sort_n // threads), sort_n // 32)      # pairs per sorting thread
        sort_threads = sort_n // E                                     # whole warps
        assert E & (E - 1) == 0 and sort_threads <= threads and sort_threads % 32 == 0, (E, sort_threads)
    seq_q = T.dynamic("seq_q")
    seq_k = T.dynamic("seq_k_vecs") * vec                        # a multiple of vec: aligned vector loads
    per = FIRST_BINS // threads                                  # first-round bins per thread
    if candidates:
        assert threads & (threads - 1) == 0 and per * threads == FIRST_BINS, "threads must divide 4096"
    hist_n = (FIRST_BINS if candidates else RADIX) + 1
    FLIP = T.uint32(0xFFFFFFFF)

    @T.macro
    def append(tx, pred, counter, wb, slot):
        # slot[0] <- where this thread's key goes when `pred`: the counter's value before it. With warp_append
        # every lane of the warp must get here (the ballot), whatever its `pred`.
        if warp_append:
            lane = tx % 32
            ballot = T.Cast(T.uint32, T.ballot_sync(pred))
            wb[0] = 0
            if (lane == 0) & (ballot != T.uint32(0)):
                wb[0] = T.atomic_add(counter, T.Cast(T.int32, T.popcount(ballot)), return_prev=True)
            slot[0] = T.shfl_sync(wb[0], 0) + T.Cast(
                T.int32, T.popcount(ballot & ((T.uint32(1) << T.Cast(T.uint32, lane)) - T.uint32(1))))
        else:
            if pred:
                slot[0] = T.atomic_add(counter, 1, return_prev=True)

    @T.macro
    def load_trip(Logits, row, jv, end, xv, every_lane):
        # the `vec` scores of vector jv of the row; `every_lane`: lanes past the row's end load zeros (for a
        # trip every lane must run: the warp's ballots and matches), else they load nothing
        if every_lane:
            for v in T.vectorized(vec):
                xv[v] = T.if_then_else(jv * vec < end, Logits[row, jv * vec + v], 0)
        else:
            if jv * vec < end:
                for v in T.vectorized(vec):
                    xv[v] = Logits[row, jv * vec + v]

    @T.macro
    def take_other(mk, mi, ok, oi, lower, asc):
        # bitonic compare-exchange seen from one side: whether this side takes the other's (key, id); the
        # lower index keeps the smaller pair when the block sorts ascending, the larger when descending
        return T.if_then_else(lower == asc, (mk > ok) | ((mk == ok) & (mi > oi)),
                              (ok > mk) | ((ok == mk) & (oi > mi)))

    @T.prim_func
    def topk_select(
        Logits: T.Tensor([seq_q, seq_k], T.float32),
        Starts: T.Tensor([seq_q], T.int32),
        Ends: T.Tensor([seq_q], T.int32),
        Out: T.Tensor([seq_q, topk], T.int32),
    ):
        with T.Kernel(seq_q, threads=threads) as row:
            tx = T.get_thread_binding()
            hist = T.alloc_shared([hist_n], T.int32)  # becomes suffix sums; hist[RADIX] = 0
            ctl = T.alloc_shared([4], T.int32)  # 0: threshold bin, 1: #greater, 2: #equal
            skey = T.alloc_shared([sort_n], T.uint32)  # ~ordered key: ascending = score desc
            sidx = T.alloc_shared([sort_n], T.int32)
            if candidates:
                tsum = T.alloc_shared([threads + 1], T.int32)  # per-thread bin totals, then their suffix sums
                ckey = T.alloc_shared([candidates], T.uint32)  # the threshold bin's keys ...
                cidx = T.alloc_shared([candidates], T.int32)  # ... and their key ids
                cnt = T.alloc_shared([1], T.int32)  # how many keys the threshold bin holds
                ncand = T.alloc_var(T.int32)
                kid = T.alloc_var(T.int32)
            if sort_elems:
                rk = T.alloc_local([E], T.uint32)  # this thread's pairs while sorting
                ri = T.alloc_local([E], T.int32)
                ok = T.alloc_var(T.uint32)
                oi = T.alloc_var(T.int32)

            start = T.alloc_var(T.int32)
            end = T.alloc_var(T.int32)
            prefix = T.alloc_var(T.uint32)
            pmask = T.alloc_var(T.uint32)
            krem = T.alloc_var(T.int32)
            val = T.alloc_var(T.int32)
            bin_ = T.alloc_var(T.int32)
            key = T.alloc_var(T.uint32)
            x = T.alloc_var(T.float32)
            xv = T.alloc_local([vec], T.float32)
            slot = T.alloc_local([1], T.int32)
            wb = T.alloc_local([1], T.int32)
            ak = T.alloc_var(T.uint32)
            bk = T.alloc_var(T.uint32)
            ai = T.alloc_var(T.int32)
            bi = T.alloc_var(T.int32)

            start = T.max(Starts[row], 0)
            end = T.min(Ends[row], seq_k)
            prefix = T.uint32(0)
            pmask = T.uint32(0)
            krem = topk
            n_valid = end - start
            n_iter = T.ceildiv(T.max(n_valid, 0), threads)
            base_v = start // vec                                        # the row's first vector
            n_vit = T.ceildiv(T.max(end - base_v * vec, 0), threads * vec)

            for it in T.serial(T.ceildiv(sort_n, threads)):
                p = it * threads + tx
                if p < sort_n:
                    skey[p] = FLIP
                    sidx[p] = _INT_MAX
            if tx < 4:
                ctl[tx] = 0
            if candidates:
                if tx == 0:
                    cnt[0] = 0

            if candidates and n_valid > topk:
                # round 0 on the row: the threshold bin of the top 12 bits (sign, exponent, 3 mantissa bits;
                # 8 bits would span a factor of 4 in score and put up to half a long row in one bin)
                T.sync_threads()
                for it in T.serial(T.ceildiv(FIRST_BINS + 1, threads)):
                    p = it * threads + tx
                    if p <= FIRST_BINS:
                        hist[p] = 0
                T.sync_threads()
                for it in T.serial(n_vit):
                    jb = (base_v + it * threads + tx) * vec
                    if hist_aggregate:                       # every lane runs every trip (the match)
                        load_trip(Logits, row, base_v + it * threads + tx, end, xv, True)
                        for v in T.unroll(vec):
                            # lanes without a key match on FIRST_BINS, a bin no key has
                            bin_ = T.if_then_else((jb + v >= start) & (jb + v < end),
                                                  T.Cast(T.int32, _ordered_key(xv[v]) >> T.uint32(32 - FIRST_BITS)),
                                                  FIRST_BINS)
                            peers = T.match_any_sync(bin_)
                            if (bin_ < FIRST_BINS) & ((peers & ((T.uint32(1) << T.Cast(T.uint32, tx % 32))
                                                                - T.uint32(1))) == T.uint32(0)):
                                T.atomic_add(hist[bin_], T.Cast(T.int32, T.popcount(peers)))
                    else:
                        load_trip(Logits, row, base_v + it * threads + tx, end, xv, False)
                        for v in T.unroll(vec):
                            if (jb + v >= start) & (jb + v < end):
                                key = _ordered_key(xv[v])
                                T.atomic_add(hist[T.Cast(T.int32, key >> T.uint32(32 - FIRST_BITS))], 1)
                T.sync_threads()
                # suffix sums: each thread owns `per` consecutive bins; scan the threads' totals
                val = 0
                for i in T.serial(per):
                    val = val + hist[tx * per + i]
                tsum[tx] = val
                if tx == 0:
                    tsum[threads] = 0
                for step in T.serial(threads.bit_length() - 1):
                    T.sync_threads()
                    val = tsum[tx]
                    if tx + (1 << step) < threads:
                        val = val + tsum[tx + (1 << step)]
                    T.sync_threads()
                    tsum[tx] = val
                T.sync_threads()
                val = tsum[tx + 1]                                   # keys in bins above this thread's
                for i in T.serial(per):
                    bin_ = tx * per + per - 1 - i
                    if val < krem and val + hist[bin_] >= krem:
                        ctl[0] = bin_
                        ctl[3] = val                                 # keys strictly above the bin
                    val = val + hist[bin_]
                T.sync_threads()
                bin_ = ctl[0]
                krem = krem - ctl[3]
                prefix = T.Cast(T.uint32, bin_) << T.uint32(32 - FIRST_BITS)
                pmask = T.uint32((FIRST_BINS - 1) << (32 - FIRST_BITS))
                # one pass: keys above the bin are winners; the bin's keys go to shared memory. Every lane runs
                # every trip (the warp's appends); lanes past the row's end carry no key.
                for it in T.serial(n_vit):
                    jb = (base_v + it * threads + tx) * vec
                    load_trip(Logits, row, base_v + it * threads + tx, end, xv, True)
                    for v in T.unroll(vec):
                        key = _ordered_key(xv[v])
                        append(tx, (jb + v >= start) & (jb + v < end) & ((key & pmask) > prefix), ctl[1], wb,
                               slot)
                        if (jb + v >= start) & (jb + v < end) & ((key & pmask) > prefix):
                            skey[slot[0]] = key ^ FLIP
                            sidx[slot[0]] = jb + v
                        append(tx, (jb + v >= start) & (jb + v < end) & ((key & pmask) == prefix), cnt[0], wb,
                               slot)
                        if (jb + v >= start) & (jb + v < end) & ((key & pmask) == prefix):
                            if slot[0] < candidates:
                                ckey[slot[0]] = key
                                cidx[slot[0]] = jb + v
                T.sync_threads()
                ncand = cnt[0]
                # rounds 1-3 and the gather: on the candidates in shared memory, or on the row when the
                # threshold bin overflowed (one code path: the source is chosen per CTA, not per element)
                if ncand > candidates:
                    T.sync_threads()
                    if tx == 0:
                        ctl[1] = 0                                   # the gather below rewrites every winner
                n_src = T.if_then_else(ncand <= candidates, ncand, n_valid)
                for rnd in T.serial(3):
                    shift = T.Cast(T.uint32, T.max(32 - FIRST_BITS - RADIX_BITS - rnd * RADIX_BITS, 0))
                    T.sync_threads()
                    for it in T.serial(T.ceildiv(RADIX + 1, threads)):
                        p = it * threads + tx
                        if p <= RADIX:
                            hist[p] = 0
                    T.sync_threads()
                    for it in T.serial(T.ceildiv(n_src, threads)):
                        c = it * threads + tx
                        if c < n_src:
                            if ncand <= candidates:
                                key = ckey[c]
                            else:
                                x = Logits[row, start + c]
                                key = _ordered_key(x)
                            if (key & pmask) == prefix:
                                T.atomic_add(hist[T.Cast(T.int32, (key >> shift) & T.uint32(RADIX - 1))], 1)
                    for step in T.serial(RADIX_BITS):
                        T.sync_threads()
                        if tx < RADIX:
                            val = hist[tx]
                            if tx + (1 << step) < RADIX:
                                val = val + hist[tx + (1 << step)]
                        T.sync_threads()
                        if tx < RADIX:
                            hist[tx] = val
                    T.sync_threads()
                    if tx < RADIX:
                        if hist[tx] >= krem and hist[tx + 1] < krem:
                            ctl[0] = tx
                    T.sync_threads()
                    bin_ = ctl[0]
                    krem = krem - hist[bin_ + 1]
                    prefix = prefix | (T.Cast(T.uint32, bin_) << shift)
                    pmask = pmask | (T.uint32(RADIX - 1) << shift)
                T.sync_threads()
                for it in T.serial(T.ceildiv(n_src, threads)):
                    c = it * threads + tx
                    key = T.uint32(0)
                    kid = 0
                    if c < n_src:
                        if ncand <= candidates:
                            key = ckey[c]
                            kid = cidx[c]
                        else:
                            x = Logits[row, start + c]
                            key = _ordered_key(x)
                            kid = start + c
                    append(tx, (c < n_src) & (key > prefix), ctl[1], wb, slot)
                    if (c < n_src) & (key > prefix):
                        skey[slot[0]] = key ^ FLIP
                        sidx[slot[0]] = kid
                    append(tx, (c < n_src) & (key == prefix), ctl[2], wb, slot)
                    if (c < n_src) & (key == prefix):
                        if slot[0] < krem:
                            skey[topk - krem + slot[0]] = key ^ FLIP
                            sidx[topk - krem + slot[0]] = kid
            elif n_valid > topk:
                # radix select: find the exact 32-bit key of the k-th largest score
                for rnd in T.serial(4):
                    shift = T.Cast(T.uint32, 24 - rnd * RADIX_BITS)
                    T.sync_threads()
                    for it in T.serial(T.ceildiv(RADIX + 1, threads)):
                        p = it * threads + tx
                        if p <= RADIX:
                            hist[p] = 0
                    T.sync_threads()
                    for it in T.serial(n_vit):
                        jb = (base_v + it * threads + tx) * vec
                        load_trip(Logits, row, base_v + it * threads + tx, end, xv, False)
                        for v in T.unroll(vec):
                            if (jb + v >= start) & (jb + v < end):
                                key = _ordered_key(xv[v])
                                if (key & pmask) == prefix:
                                    T.atomic_add(hist[T.Cast(T.int32, (key >> shift) & T.uint32(RADIX - 1))], 1)
                    # suffix sums over the RADIX bins (Hillis-Steele)
                    for step in T.serial(RADIX_BITS):
                        T.sync_threads()
                        if tx < RADIX:
                            val = hist[tx]
                            if tx + (1 << step) < RADIX:
                                val = val + hist[tx + (1 << step)]
                        T.sync_threads()
                        if tx < RADIX:
                            hist[tx] = val
                    T.sync_threads()
                    if tx < RADIX:
                        if hist[tx] >= krem and hist[tx + 1] < krem:
                            ctl[0] = tx
                    T.sync_threads()
                    bin_ = ctl[0]
                    krem = krem - hist[bin_ + 1]
                    prefix = prefix | (T.Cast(T.uint32, bin_) << shift)
                    pmask = pmask | (T.uint32(RADIX - 1) << shift)
                T.sync_threads()
                # gather: all keys > threshold, then `krem` of the keys == threshold
                for it in T.serial(n_vit):
                    jb = (base_v + it * threads + tx) * vec
                    load_trip(Logits, row, base_v + it * threads + tx, end, xv, True)
                    for v in T.unroll(vec):
                        key = _ordered_key(xv[v])
                        append(tx, (jb + v >= start) & (jb + v < end) & (key > prefix), ctl[1], wb, slot)
                        if (jb + v >= start) & (jb + v < end) & (key > prefix):
                            skey[slot[0]] = key ^ FLIP
                            sidx[slot[0]] = jb + v
                        append(tx, (jb + v >= start) & (jb + v < end) & (key == prefix), ctl[2], wb, slot)
                        if (jb + v >= start) & (jb + v < end) & (key == prefix):
                            if slot[0] < krem:
                                skey[topk - krem + slot[0]] = key ^ FLIP
                                sidx[topk - krem + slot[0]] = jb + v
            else:
                T.sync_threads()
                for it in T.serial(n_iter):
                    j = start + it * threads + tx
                    if j < end:
                        x = Logits[row, j]
                        skey[j - start] = _ordered_key(x) ^ FLIP
                        sidx[j - start] = j

            # bitonic sort ascending by (skey, sidx)
            if sort_elems:
                # element i = tx * E + e lives in register e of thread tx; partner i ^ d is in the same thread
                # (d < E), the same warp (d < 32 E: a shuffle) or another warp (shared memory)
                T.sync_threads()
                if tx < sort_threads:
                    for e in T.vectorized(E):
                        rk[e] = skey[tx * E + e]
                    for e in T.vectorized(E):
                        ri[e] = sidx[tx * E + e]
                for kk in T.unroll(log_n, explicit=True):
                    for jj in T.unroll(log_n, explicit=True):
                        if jj <= kk:
                            if (1 << (kk - jj)) < E:
                                if tx < sort_threads:
                                    for e in T.unroll(E, explicit=True):
                                        if (e & (1 << (kk - jj))) == 0:
                                            ak = rk[e]
                                            ai = ri[e]
                                            bk = rk[e | (1 << (kk - jj))]
                                            bi = ri[e | (1 << (kk - jj))]
                                            if take_other(ak, ai, bk, bi, True, ((tx * E + e) & (2 << kk)) == 0):
                                                rk[e] = bk
                                                ri[e] = bi
                                                rk[e | (1 << (kk - jj))] = ak
                                                ri[e | (1 << (kk - jj))] = ai
                            elif (1 << (kk - jj)) < 32 * E:
                                if tx < sort_threads:                # whole warps: full-mask shuffles
                                    for e in T.unroll(E, explicit=True):
                                        ok = T.shfl_xor(rk[e], (1 << (kk - jj)) // E)
                                        oi = T.shfl_xor(ri[e], (1 << (kk - jj)) // E)
                                        if take_other(rk[e], ri[e], ok, oi, (tx & ((1 << (kk - jj)) // E)) == 0,
                                                      ((tx * E + e) & (2 << kk)) == 0):
                                            rk[e] = ok
                                            ri[e] = oi
                            else:
                                T.sync_threads()
                                if tx < sort_threads:
                                    for e in T.vectorized(E):
                                        skey[tx * E + e] = rk[e]
                                    for e in T.vectorized(E):
                                        sidx[tx * E + e] = ri[e]
                                T.sync_threads()
                                if tx < sort_threads:
                                    for e in T.unroll(E, explicit=True):
                                        ok = skey[(tx ^ ((1 << (kk - jj)) // E)) * E + e]
                                        oi = sidx[(tx ^ ((1 << (kk - jj)) // E)) * E + e]
                                        if take_other(rk[e], ri[e], ok, oi, (tx & ((1 << (kk - jj)) // E)) == 0,
                                                      ((tx * E + e) & (2 << kk)) == 0):
                                            rk[e] = ok
                                            ri[e] = oi
                if tx < sort_threads:
                    for e in T.unroll(E, explicit=True):
                        if tx * E + e < topk:
                            Out[row, tx * E + e] = T.if_then_else(ri[e] == _INT_MAX, -1, ri[e])
            else:
                for kk in T.serial(log_n):
                    for jj in T.serial(kk + 1):
                        T.sync_threads()
                        sh = kk - jj
                        for it in T.serial(T.ceildiv(pairs, threads)):
                            p = it * threads + tx
                            if p < pairs:
                                a = ((p >> sh) << (sh + 1)) | (p & ((1 << sh) - 1))
                                b = a + (1 << sh)
                                ak = skey[a]
                                bk = skey[b]
                                ai = sidx[a]
                                bi = sidx[b]
                                if ((ak > bk) | ((ak == bk) & (ai > bi))) == ((a & (2 << kk)) == 0):
                                    skey[a] = bk
                                    skey[b] = ak
                                    sidx[a] = bi
                                    sidx[b] = ai
                T.sync_threads()
                for it in T.serial(T.ceildiv(topk, threads)):
                    p = it * threads + tx
                    if p < topk:
                        Out[row, p] = T.if_then_else(sidx[p] == _INT_MAX, -1, sidx[p])

    return topk_select


# The select kernel places every barrier itself (the automatic pass would add one per loop trip).
# Every read of the scores is in bounds by construction (j < end <= seq_k, and vec divides seq_k), so the
# safe-memory pass's per-element guard, which also stops the vector loads, is off.
_SELECT_PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
                        tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}


_IN_DTYPES = {torch.bfloat16: T.bfloat16, torch.float8_e4m3fn: T.float8_e4m3fn}


@functools.lru_cache(maxsize=None)
def compile_indexer_logits(heads: int, dim: int, target_arch: str = "sm_90a", in_dtype=torch.bfloat16,
                           warp_specialized: bool = True, **tunables):
    """``warp_specialized=False`` keeps every warp on the math (no producer warpgroup), so that smaller CTAs
    fit several to an SM and one CTA's epilogue overlaps another's MMAs."""
    configs = {} if warp_specialized else {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
                                           tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True}
    return tilelang.compile(build_indexer_logits(heads, dim, _IN_DTYPES[in_dtype], **tunables),
                            target={"kind": "cuda", "arch": target_arch}, pass_configs=configs)


# The logits kernel's tile choice, read per call (a benchmark times others beside it). block_N must divide
# BLOCK_N, the keys' padding. H200, S=32K, logits kernel alone (bench_kernels.py --logits-sweep): one
# warpgroup per CTA with 64-key tiles and no producer warps, so several CTAs share an SM and one's epilogue
# runs under another's MMAs: 8.76 ms bf16 / 6.01 ms FP8, against 10.04 / 11.00 for the 128-key tiles with a
# producer warpgroup (the two math warpgroups then wait for their MMAs together, and FP8 gained nothing).
# What bounds it (Nsight Compute, S=16K FP8, benchmarks/results/ncu_topk_16k_h200.txt): latency, not a pipe:
# issue slots 57% busy, ALU 40%, the tensor pipe less, with 3 CTAs (12 warps) per SM, limited by registers.
# A version that ran tile t+1's MMA asynchronously into a second accumulator under tile t's epilogue (a ring
# of four key tiles; 2026-12-02) was slower: 12.67 ms bf16 at 32K against 8.93 in the same run (2 CTAs per
# SM), so it was dropped. ptxas (CUDA 13.0, FP8 tiles): 156 registers, no spills; with min_blocks=4 (4 CTAs per
# SM) 128, no spills; min_blocks=5: 96, 84 B spilled. min_blocks 4 and 5 are in bench_kernels' sweep, not yet run.
LOGITS_TUNABLES = {"block_N": 64, "num_stages": 1, "threads": 128, "warp_specialized": False}


def logits_kernel(heads: int, dim: int, in_dtype: torch.dtype, target_arch: str):
    """The logits kernel the op runs: ``block_Q * heads = 128`` GEMM rows, :data:`LOGITS_TUNABLES`."""
    tunables = {"block_Q": max(1, 128 // heads)} | LOGITS_TUNABLES
    assert BLOCK_N % tunables["block_N"] == 0, "LOGITS_TUNABLES: block_N must divide BLOCK_N"
    return compile_indexer_logits(heads, dim, target_arch, in_dtype, **tunables)


# The select the op runs. candidates > 0 = the two-read kernel with this many shared-memory candidates; 0 =
# the four-round kernel. H200 (bench_kernels.py --logits-sweep, same logits), ms at 32K / 64K: four rounds, 1024 threads 7.35 /
# 22.9; two reads, 1024 threads, 3072 candidates 6.47 / 16.6; 512 threads, 2048 candidates 5.51 / 14.5 (less
# shared memory: more rows' CTAs per SM). All pass tests/gpu/test_dsa_topk_cuda.py, including rows whose
# threshold bin overflows into the fallback rounds. Then (2026-12-02) vector loads, per-warp slot atomics and
# the register sort: the FP8 op at 64K 41.5 ms against 43.0 with the select before them, at 128K 153.1 against
# 163.8 (benchmarks/results/bench_kernels_run10_h200.json; vector loads alone, at 32K: 5.40 against 5.76 ms).
# Read per call like LOGITS_TUNABLES (a benchmark patches the whole dict to time another select beside it);
# keys it leaves out take build_topk_select's defaults, the select before any of these choices.
SELECT_TUNABLES = {
    "candidates": 2048,
    "threads": 512,       # per row's CTA (a power of two dividing 4096 for the two-read select)
    "vec": 4,             # scores per thread per trip over the row (one float4 load); must divide BLOCK_N
    "sort_elems": 8,      # (key, id) pairs per thread in the register bitonic sort; 0 = all in shared memory
    "warp_append": True,  # one shared atomic per warp for the winners' and candidates' slots
}


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
    """name -> thunk building (not running) one kernel of this family for `target_arch` (CI)."""
    return {
        # the op's tiles (LOGITS_TUNABLES), uncached: CI builds every time
        "indexer_logits[h32,d128]": lambda: compile_indexer_logits.__wrapped__(
            32, 128, target_arch, torch.bfloat16, **({"block_Q": 4} | LOGITS_TUNABLES)),
        "indexer_logits_fp8[h32,d128]": lambda: compile_indexer_logits.__wrapped__(
            32, 128, target_arch, torch.float8_e4m3fn, **({"block_Q": 4} | LOGITS_TUNABLES)),
        "indexer_logits_fp8_min4[h32,d128]": lambda: compile_indexer_logits.__wrapped__(     # bench_kernels
            32, 128, target_arch, torch.float8_e4m3fn, **({"block_Q": 4} | LOGITS_TUNABLES | {"min_blocks": 4})),
        "topk_select[k2048]": lambda: compile_topk_select.__wrapped__(2048, target_arch),
        "topk_select_two_reads[k2048]": lambda: compile_topk_select.__wrapped__(       # the op's select
            2048, target_arch, **SELECT_TUNABLES),
        "topk_select_hist_aggregate[k2048]": lambda: compile_topk_select.__wrapped__(  # bench_kernels' sweep
            2048, target_arch, **(SELECT_TUNABLES | {"hist_aggregate": True})),
    }


# --------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------
# fp32 scores materialised per query chunk. 2 GiB: 8K queries a chunk at 64K keys, 4K at 128K, so each logits
# launch has thousands of one-warpgroup CTAs (with 1 GiB, 128K ran 64 chunks of 512 CTAs: an SM-wave tail each)
LOGITS_BUDGET_BYTES = 2 << 30
BLOCK_N = 128


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
    logits = torch.empty(chunk, Skp, dtype=torch.float32, device=dev)
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        n = c1 - c0
        n_pad = round_up(n, block_Q)
        qc = pad_dim(q[c0:c1].view(torch.uint8), 0, n_pad).view(q.dtype).view(n_pad * H, D)
        wc = pad_dim(w[c0:c1], 0, n_pad)
        sc = pad_dim(starts[c0:c1], 0, n_pad)
        ec = pad_dim(ends[c0:c1], 0, n_pad)
        logits_k(qc, k_pad, ks, wc, sc, ec, logits[:n_pad])
        select_k(logits[:n], sc[:n], ec[:n], out[c0:c1])
    return out


def register() -> None:
    torch.library.register_kernel("glm52::dsa_topk_indices", "cuda")(dsa_topk_indices_tl)
