"""TileLang kernel of the DSA top-k's select: an exact top-k of each row's fp32 scores within [starts, ends),
int32 ids by descending score (ties: the lower id first), -1 padded. One CTA per row; :func:`build_topk_select`
runs these stages (:class:`SelectConfig` holds the tunables):

1. ``init_row``: the row's keys and the vectors holding them; the winners' places cleared.
2. ``first_histogram`` / ``first_threshold``: a 12-bit histogram (sign, exponent, 3 mantissa bits) of the row's
   keys, or on a long row (``SAMPLE_MIN_ROW * candidates`` keys or more) of a sample of them (one group of
   ``sample_group`` adjacent vectors in every ``sample`` groups), and the bin holding the k-th largest key (on a
   sample: the bin of a lower bound on it, the sample's expected share of the top-k plus four standard deviations).
3. Long rows: ``sampled_bound`` refines that bin by the next 8 bits of the sample, a 20-bit key ``tau`` below the
   row's k-th largest with high probability; ``collect_above_bound`` copies every key >= tau (about 1.3 topk of
   them) to shared memory as the candidates, and ``rank_candidates`` ranks them at once by a counting sort
   (``next_pow2(candidates)`` buckets between the largest and smallest finite score) and writes the first topk.
   A row whose bound missed (fewer than topk keys >= tau, or more than ``candidates``) takes the radix rounds on
   the row; one where a bucket holds more than ``RANK_MAX`` keys, the rounds on its candidates.
4. Shorter rows: ``split_threshold_bin`` sends the keys above the threshold bin to the winners and copies the bin's
   keys to the candidates (a bin of more than ``candidates`` keys: the rounds on the row).
5. ``radix_rounds``: 8-bit rounds on the candidates or the row find the exact k-th key; ``gather_winners`` collects
   the winners.
6. ``take_row``: rows with at most topk keys take all of them.
7. ``rank_winners``: a counting sort orders the winners (score desc, id asc), or, where a bucket holds more than
   ``RANK_MAX`` of them (ties, or an outlier squeezing the rest together), ``bitonic_sort`` in registers: stages
   whose partner is in the same thread or warp run in registers or through warp shuffles (``sort_in_thread``,
   ``sort_in_warp``), the few with a partner in another warp through shared memory (``sort_across_warps``), each
   (key, id) one uint64.

Every path is exact; ties at the k-th score go to the lower key ids where the candidates are ranked at once, else to
the gather's order. Keys are the scores as uint32 whose unsigned order is the float order (:func:`_ordered_key`).
The measured alternatives to these choices are in docs/kernels.md.
"""

from dataclasses import dataclass

import tilelang
import tilelang.language as T

from ._common import next_pow2
from .ahead import kernel_cache

RADIX_BITS = 8
RADIX = 1 << RADIX_BITS
FIRST_BITS = 12  # the select's first round
FIRST_BINS = 1 << FIRST_BITS
SAMPLE_MIN_ROW = 4  # rows of at least this many times `candidates` keys take the sampled first round
RANK_MAX = 32  # the most winners a counting-sort bucket may hold before the row takes the bitonic sort
_INT_MAX = 2147483647
_FLIP = T.uint32(0xFFFFFFFF)  # key ^ _FLIP: ascending = score descending


@dataclass(frozen=True)
class SelectConfig:
    """The select's tunables; the defaults are the op's."""

    threads: int = 512      # a row's CTA: a power of two dividing 4096 (the first round's bins), >= 256
    candidates: int = 3072  # keys shared memory holds for the rounds after the first; >= 1.25 topk (the bound's slack)
    vec: int = 4            # scores a thread loads per trip over the row, one vector load (divides the row padding)
    sort_elems: int = 8     # (key, id) pairs a thread in the register bitonic sort
    sample: int = 8         # a long row's first round reads one group of `sample_group` vectors in every `sample`
    sample_group: int = 4
    unroll: int = 2         # vectors a thread loads before it tests any (the sampled passes, the pass against tau)
    min_blocks: int = 3     # CTAs per SM the register allocation leaves room for (__launch_bounds__)


@dataclass(frozen=True, eq=False)
class SelectSizes:
    """One build's sizes: the config's tunables and what topk makes of them (the stage macros' first argument).
    :meth:`of` checks the config against topk (an AssertionError names the broken constraint)."""

    topk: int
    threads: int
    candidates: int
    vec: int
    sample: int
    sample_group: int
    unroll: int
    min_blocks: int
    sort_n: int         # the winners' places: topk up to a power of two, >= 32
    log_n: int
    E: int              # pairs a sorting thread holds
    sort_threads: int   # threads of the bitonic sort (whole warps)
    rank_sort: bool     # the counting sort's buckets fit in the candidates' buffers
    rank_e: int         # winners a thread in the counting sort ...
    rank_b: int         # ... and buckets
    direct_rank: bool   # the sampled rows' candidates ranked at once
    cand_b: int         # the candidates' buckets (direct_rank) ...
    cand_e: int         # ... and candidates a thread
    sort_buf: int       # skey / sidx: the winners' places, and the ranked candidates' (direct_rank)
    per: int            # first-round bins a thread
    hist_n: int
    sample_min: int     # rows this long take the sampled first round
    seq_k: object       # the row length, a multiple of vec (aligned vector loads): a TIR expression

    @classmethod
    def of(cls, topk: int, c: SelectConfig) -> "SelectSizes":
        assert c.sample > 0 and c.sort_elems > 0, "the select samples long rows and sorts in registers"
        sort_n = max(next_pow2(topk), 32)
        E = min(max(c.sort_elems, sort_n // c.threads), sort_n // 32)
        sort_threads = sort_n // E
        assert E & (E - 1) == 0 and sort_threads <= c.threads and sort_threads % 32 == 0, (E, sort_threads)
        rank_sort = c.candidates >= sort_n
        rank_e = max(1, -(-sort_n // c.threads))
        direct_rank = rank_sort
        cand_b = next_pow2(c.candidates) if direct_rank else 0
        if direct_rank:
            assert cand_b <= FIRST_BINS and cand_b % c.threads == 0, "next_pow2(candidates) <= 4096 buckets"
        per = FIRST_BINS // c.threads
        assert c.threads & (c.threads - 1) == 0 and per * c.threads == FIRST_BINS, "threads must divide 4096"
        assert c.candidates >= topk + topk // 4, "candidates >= 1.25 topk (the sampled bound's slack)"
        assert c.threads >= RADIX and c.threads % 32 == 0
        return cls(topk=topk, threads=c.threads, candidates=c.candidates, vec=c.vec, sample=c.sample,
                   sample_group=c.sample_group, unroll=c.unroll, min_blocks=c.min_blocks, sort_n=sort_n,
                   log_n=sort_n.bit_length() - 1, E=E, sort_threads=sort_threads, rank_sort=rank_sort,
                   rank_e=rank_e, rank_b=rank_e, direct_rank=direct_rank, cand_b=cand_b,
                   cand_e=max(1, -(-c.candidates // c.threads)) if direct_rank else 0,
                   sort_buf=max(sort_n, c.candidates) if direct_rank else sort_n, per=per, hist_n=FIRST_BINS + 1,
                   sample_min=SAMPLE_MIN_ROW * c.candidates, seq_k=T.dynamic("seq_k_vecs") * c.vec)


# ---------------------------------------------------------------------------------------------- keys
def _ordered_key(x):
    """fp32 -> uint32 whose unsigned order is the float order."""
    bits = T.reinterpret(x, T.uint32)
    return T.if_then_else(x < 0, bits ^ T.uint32(0xFFFFFFFF), bits | T.uint32(0x80000000))


def _key_as(key, raw: bool, flipped: bool):
    """A key held ordered (``raw``) or ``^ _FLIP`` (ascending = score desc), as the form asked for."""
    return key ^ T.uint32(0xFFFFFFFF) if raw == flipped else key


def _from_ordered_key(key):
    """The inverse of :func:`_ordered_key`: uint32 -> the fp32 it orders."""
    return T.reinterpret(T.if_then_else(key >= T.uint32(0x80000000), key & T.uint32(0x7FFFFFFF),
                                        key ^ T.uint32(0xFFFFFFFF)), T.float32)


# ---------------------------------------------------------------------------------------------- building blocks
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


def _sampled_vector(sel, i):
    # the row's i-th sampled vector, counted from its first
    return (i // sel.sample_group) * (sel.sample * sel.sample_group) + i % sel.sample_group


@T.macro


def load_trip(sel, Logits, row, jv, end, xv, every_lane, o=0):
    # xv[o:o + vec] <- the `vec` scores of vector jv of the row; `every_lane`: lanes past the row's end load
    # zeros (for a trip every lane must run: the warp's ballots and matches), else they load nothing
    if every_lane:
        for v in T.vectorized(sel.vec):
            xv[o + v] = T.if_then_else(jv * sel.vec < end, Logits[row, jv * sel.vec + v], 0)
    else:
        if jv * sel.vec < end:
            for v in T.vectorized(sel.vec):
                xv[o + v] = Logits[row, jv * sel.vec + v]


@T.macro


def sampled_histogram(sel, Logits, row, tx, n_sv, base_v, start, end, xv, kv, hist, prefix, pmask, refine):
    # the histogram of the row's sampled keys: their top 12 bits, or (`refine`) the next 8 bits of those whose
    # top bits are `prefix` under `pmask`; each thread's `unroll` vectors of a trip loaded before any is binned
    for it in T.serial(T.ceildiv(n_sv, sel.threads * sel.unroll)):
        for u in T.unroll(sel.unroll):
            if (it * sel.unroll + u) * sel.threads + tx < n_sv:
                load_trip(sel, Logits, row, base_v + _sampled_vector(sel, (it * sel.unroll + u) * sel.threads + tx),
                          end, xv, False, u * sel.vec)
        for u in T.unroll(sel.unroll):
            if (it * sel.unroll + u) * sel.threads + tx < n_sv:
                jb = (base_v + _sampled_vector(sel, (it * sel.unroll + u) * sel.threads + tx)) * sel.vec
                for v in T.unroll(sel.vec):
                    if (jb + v >= start) & (jb + v < end):
                        kv[0] = _ordered_key(xv[u * sel.vec + v])
                        if refine:
                            if (kv[0] & pmask) == prefix:
                                T.atomic_add(hist[T.Cast(T.int32, (kv[0] >> T.uint32(32 - FIRST_BITS - RADIX_BITS))
                                                          & T.uint32(RADIX - 1))], 1)
                        else:
                            T.atomic_add(hist[T.Cast(T.int32, kv[0] >> T.uint32(32 - FIRST_BITS))], 1)


@T.macro


def rank_place(sel, tx, row, n_src, src_key, src_idx, raw, dst_key, dst_idx, n_b, e_n, b_n, hist, tsum, wsum, big,
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
        if e * sel.threads + tx < n_src:
            x = _from_ordered_key(_key_as(src_key[e * sel.threads + tx], raw, False))
            if (src_idx[e * sel.threads + tx] != _INT_MAX) & (x > -T.infinity(T.float32)) & (
                    x < T.infinity(T.float32)):
                xmx = T.max(xmx, x)
                xmn = T.min(xmn, x)
    for o in T.unroll(5):
        xmx = T.max(xmx, T.shfl_xor(xmx, 1 << o))
        xmn = T.min(xmn, T.shfl_xor(xmn, 1 << o))
    if tx % 32 == 0:
        wmx[tx // 32] = xmx
        wmn[tx // 32] = xmn
    for it in T.serial(T.ceildiv(n_b + 1, sel.threads)):
        if it * sel.threads + tx <= n_b:
            hist[it * sel.threads + tx] = 0
    if tx == 0:
        big[0] = 0
    T.sync_threads()
    for w in T.serial(sel.threads // 32):
        xmx = T.max(xmx, wmx[w])
        xmn = T.min(xmn, wmn[w])
    bscale = T.if_then_else(xmx > xmn, T.Cast(T.float32, n_b - 1) / (xmx - xmn), 0.0)
    for e in T.unroll(e_n):
        bkt[e] = -1
        if e * sel.threads + tx < n_src:
            if src_idx[e * sel.threads + tx] != _INT_MAX:
                ak = _key_as(src_key[e * sel.threads + tx], raw, False)
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
    suffix_scan(tx, sv, tsum, wsum, sel.threads)
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
                fk = _key_as(src_key[e * sel.threads + tx], raw, True)
                slot[0] = T.atomic_add(hist[bkt[e]], 1, return_prev=True)
                dst_key[slot[0]] = fk
                dst_idx[slot[0]] = src_idx[e * sel.threads + tx]
        T.sync_threads()
        for e in T.unroll(e_n):
            if bkt[e] >= 0:
                fk = _key_as(src_key[e * sel.threads + tx], raw, True)
                ai = src_idx[e * sel.threads + tx]
                r_lo = T.if_then_else(bkt[e] > 0, hist[T.max(bkt[e] - 1, 0)], 0)
                r_n = r_lo
                for j in T.serial(hist[bkt[e]] - r_lo):
                    if (dst_key[r_lo + j] < fk) | ((dst_key[r_lo + j] == fk) & (dst_idx[r_lo + j] < ai)):
                        r_n = r_n + 1
                if r_n < sel.topk:
                    Out[row, r_n] = ai
        for it in T.serial(T.ceildiv(sel.topk, sel.threads)):
            if (it * sel.threads + tx >= tsum[0]) & (it * sel.threads + tx < sel.topk):
                Out[row, it * sel.threads + tx] = -1


# The stages of the kernel, in order. Scalars they share are the kernel's `T.alloc_var`s, passed as `T.Ref`:
# a macro's plain parameter would bind a copy (a let), and its stores would not reach the caller.


@T.macro


def clear_hist(sel, tx, hist, n):
    """hist[0..n] <- 0: n bins and the suffix sums' hist[n]."""
    for it in T.serial(T.ceildiv(n + 1, sel.threads)):
        p = it * sel.threads + tx
        if p <= n:
            hist[p] = 0


@T.macro


def clear_winners(sel, tx, skey, sidx):
    """The sort_n winners' places <- (FLIP, _INT_MAX): no key, sorted last, written as -1."""
    for it in T.serial(T.ceildiv(sel.sort_n, sel.threads)):
        p = it * sel.threads + tx
        if p < sel.sort_n:
            skey[p] = _FLIP
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


def init_row(sel, row, tx, Starts, Ends, skey, sidx, ctl, cnt, start: T.Ref, end: T.Ref, prefix: T.Ref,
             pmask: T.Ref, krem: T.Ref, placed: T.Ref):
    """The row's keys [start, end) and the vectors holding them; the winners' places, counters, cleared.
    Returns n_valid, n_iter (keys a thread), base_v (the first vector), n_vit (vectors a thread), n_sv
    (sampled vectors)."""
    start = T.max(Starts[row], 0)
    end = T.min(Ends[row], sel.seq_k)
    prefix = T.uint32(0)
    pmask = T.uint32(0)
    krem = sel.topk
    placed = 0
    n_valid = end - start
    n_iter = T.ceildiv(T.max(n_valid, 0), sel.threads)                # the row's keys a thread
    base_v = start // sel.vec                                        # the row's first vector
    n_vit = T.ceildiv(T.max(end - base_v * sel.vec, 0), sel.threads * sel.vec)
    # sampled vectors: groups of `sample_group` adjacent ones, one group in every `sample` groups
    n_sv = (T.ceildiv(T.ceildiv(T.max(end - base_v * sel.vec, 0), sel.vec), sel.sample * sel.sample_group)
            * sel.sample_group)

    clear_winners(sel, tx, skey, sidx)
    if tx < 4:
        ctl[tx] = 0
    if tx == 0:
        cnt[0] = 0
    return n_valid, n_iter, base_v, n_vit, n_sv


@T.macro


def first_histogram(sel, Logits, row, tx, n_valid, base_v, n_vit, n_sv, xv, kv, hist, start: T.Ref, end: T.Ref,
                    prefix: T.Ref, pmask: T.Ref, key: T.Ref, sampled: T.Ref, want: T.Ref):
    """Round 0's histogram of the top 12 bits (sign, exponent, 3 mantissa bits; 8 bits would span a factor
    of 4 in score and put up to half a long row in one bin): over the row, or (sampled <- 1) over the
    sample of a row of sample_min keys or more."""
    T.sync_threads()
    clear_hist(sel, tx, hist, FIRST_BINS)
    sampled = 0
    if n_valid >= sel.sample_min:
        sampled = 1
    want = sel.topk
    T.sync_threads()
    if sampled == 1:
        sampled_histogram(sel, Logits, row, tx, n_sv, base_v, start, end, xv, kv, hist, prefix, pmask, False)
    else:
        for it in T.serial(n_vit):
            jb = (base_v + it * sel.threads + tx) * sel.vec
            load_trip(sel, Logits, row, base_v + it * sel.threads + tx, end, xv, False)
            for v in T.unroll(sel.vec):
                if (jb + v >= start) & (jb + v < end):
                    key = _ordered_key(xv[v])
                    T.atomic_add(hist[T.Cast(T.int32, key >> T.uint32(32 - FIRST_BITS))], 1)
    T.sync_threads()


@T.macro


def first_threshold(sel, tx, n_valid, hist, tsum, wsum, sv, ctl, sampled: T.Ref, want: T.Ref, bin_: T.Ref,
                    prefix: T.Ref, pmask: T.Ref):
    """Round 0's threshold bin, by a suffix scan of the histogram: the bin holding the want-th largest key
    (topk, or on a sample its bound below) -> ctl[0], the keys above it -> ctl[3], its 12 bits -> prefix
    under pmask."""
    val = T.alloc_var(T.int32)
    # suffix sums: each thread owns `per` consecutive bins; scan the threads' totals
    sv[0] = 0
    for i in T.serial(sel.per):
        sv[0] = sv[0] + hist[tx * sel.per + i]
    suffix_scan(tx, sv, tsum, wsum, sel.threads)
    if sampled == 1:
        # the sample's rank that bounds the row's top-k from below: its expected share of the top-k,
        # plus four standard deviations and a few (a row where it does not falls back below)
        mu = T.Cast(T.float32, sel.topk) * T.Cast(T.float32, tsum[0]) / T.Cast(T.float32, n_valid)
        want = T.min(T.Cast(T.int32, mu + 4.0 * T.sqrt(mu)) + 8, tsum[0])
    val = tsum[tx + 1]                                   # keys in bins above this thread's
    for i in T.serial(sel.per):
        bin_ = tx * sel.per + sel.per - 1 - i
        if val < want and val + hist[bin_] >= want:
            ctl[0] = bin_
            ctl[3] = val                                 # keys strictly above the bin
        val = val + hist[bin_]
    T.sync_threads()
    bin_ = ctl[0]
    prefix = T.Cast(T.uint32, bin_) << T.uint32(32 - FIRST_BITS)
    pmask = T.uint32((FIRST_BINS - 1) << (32 - FIRST_BITS))


@T.macro


def sampled_bound(sel, Logits, row, tx, base_v, n_sv, xv, kv, hist, sv, wsum, ctl, start: T.Ref, end: T.Ref,
                  prefix: T.Ref, pmask: T.Ref, want: T.Ref, tau: T.Ref):
    """Round 0 again on the sample, on the next 8 bits of the threshold bin's keys: tau <- a 20-bit lower
    bound on the row's k-th largest key."""
    want = want - ctl[3]
    T.sync_threads()
    clear_hist(sel, tx, hist, RADIX)
    T.sync_threads()
    sampled_histogram(sel, Logits, row, tx, n_sv, base_v, start, end, xv, kv, hist, prefix, pmask, True)
    radix_pick(tx, hist, sv, wsum, ctl, want)
    tau = prefix | (T.Cast(T.uint32, ctl[0]) << T.uint32(32 - FIRST_BITS - RADIX_BITS))


@T.macro


def collect_above_bound(sel, Logits, row, tx, base_v, n_vit, xv, slot, cnt, ckey, cidx, start: T.Ref, end: T.Ref,
                        key: T.Ref, tau: T.Ref, ncand: T.Ref, from_row: T.Ref, prefix: T.Ref, pmask: T.Ref,
                        n_rounds: T.Ref):
    """One pass keeps every key >= tau (about want * sample of them) in shared memory as the candidates;
    from_row <- 1 where the bound missed (fewer than topk of them, or more than the buffer holds). The
    rounds after it (if any) start over on all 32 bits."""
    if sel.rank_sort:
        # the candidates: every key >= tau, compared as floats (x >= tau_f; at the bottom, the bin of
        # -inf: every finite x) where the vector lies inside the row
        tau_f = T.alloc_var(T.float32)
        tau_f = T.if_then_else(tau <= T.uint32(0x007FFFFF), -T.infinity(T.float32), _from_ordered_key(tau))
        for it in T.serial(T.ceildiv(n_vit, sel.unroll)):
            for u in T.unroll(sel.unroll):
                load_trip(sel, Logits, row, base_v + (it * sel.unroll + u) * sel.threads + tx, end, xv, False,
                          u * sel.vec)
            for u in T.unroll(sel.unroll):
                jb = (base_v + (it * sel.unroll + u) * sel.threads + tx) * sel.vec
                if (jb >= start) & (jb + sel.vec <= end):        # the vector inside the row
                    for v in T.unroll(sel.vec):
                        if xv[u * sel.vec + v] >= tau_f:
                            slot[0] = T.atomic_add(cnt[0], 1, return_prev=True)
                            if slot[0] < sel.candidates:
                                ckey[slot[0]] = _ordered_key(xv[u * sel.vec + v])
                                cidx[slot[0]] = jb + v
                else:
                    for v in T.unroll(sel.vec):
                        key = _ordered_key(xv[u * sel.vec + v])
                        if (jb + v >= start) & (jb + v < end) & (key >= tau):
                            slot[0] = T.atomic_add(cnt[0], 1, return_prev=True)
                            if slot[0] < sel.candidates:
                                ckey[slot[0]] = key
                                cidx[slot[0]] = jb + v
    else:
        for it in T.serial(n_vit):
            jb = (base_v + it * sel.threads + tx) * sel.vec
            load_trip(sel, Logits, row, base_v + it * sel.threads + tx, end, xv, True)
            for v in T.unroll(sel.vec):
                key = _ordered_key(xv[v])
                append((jb + v >= start) & (jb + v < end) & (key >= tau), cnt[0], slot)
                if (jb + v >= start) & (jb + v < end) & (key >= tau):
                    if slot[0] < sel.candidates:
                        ckey[slot[0]] = key
                        cidx[slot[0]] = jb + v
    T.sync_threads()
    ncand = cnt[0]
    from_row = T.if_then_else((ncand < sel.topk) | (ncand > sel.candidates), 1, 0)  # the bound missed: the row
    prefix = T.uint32(0)
    pmask = T.uint32(0)
    n_rounds = 4


@T.macro


def rank_candidates(sel, tx, row, ckey, cidx, skey, sidx, hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot, Out,
                    ncand: T.Ref, from_row: T.Ref, placed: T.Ref, n_rounds: T.Ref):
    """(direct_rank) Where the bound held, every key >= tau is a candidate and there are >= topk of them:
    their own ranks are the row's, and the counting sort writes the first topk (placed <- 1, no rounds);
    where a bucket holds over RANK_MAX of them, the winners' places are cleared for the rounds below."""
    if sel.direct_rank:
        if from_row == 0:
            rank_place(sel, tx, row, ncand, ckey, cidx, True, skey, sidx, sel.cand_b, sel.cand_e,
                       sel.cand_b // sel.threads, hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot, Out)
            placed = T.if_then_else(big[0] == 0, 1, 0)
            if placed == 1:
                n_rounds = 0
            else:
                T.sync_threads()                     # the winners' places, cleared again
                clear_winners(sel, tx, skey, sidx)


@T.macro


def split_threshold_bin(sel, Logits, row, tx, base_v, n_vit, xv, slot, ctl, cnt, skey, sidx, ckey, cidx,
                        start: T.Ref, end: T.Ref, key: T.Ref, prefix: T.Ref, pmask: T.Ref, krem: T.Ref,
                        ncand: T.Ref, from_row: T.Ref, n_rounds: T.Ref):
    """(A row too short to sample) one pass: the keys above the threshold bin are winners, the bin's keys
    the candidates; from_row <- 1 where the bin holds more than the buffer. Lanes past the row's end load
    zeros and carry no key."""
    krem = krem - ctl[3]
    for it in T.serial(n_vit):
        jb = (base_v + it * sel.threads + tx) * sel.vec
        load_trip(sel, Logits, row, base_v + it * sel.threads + tx, end, xv, True)
        for v in T.unroll(sel.vec):
            key = _ordered_key(xv[v])
            append((jb + v >= start) & (jb + v < end) & ((key & pmask) > prefix), ctl[1],
                   slot)
            if (jb + v >= start) & (jb + v < end) & ((key & pmask) > prefix):
                skey[slot[0]] = key ^ _FLIP
                sidx[slot[0]] = jb + v
            append((jb + v >= start) & (jb + v < end) & ((key & pmask) == prefix), cnt[0],
                   slot)
            if (jb + v >= start) & (jb + v < end) & ((key & pmask) == prefix):
                if slot[0] < sel.candidates:
                    ckey[slot[0]] = key
                    cidx[slot[0]] = jb + v
    T.sync_threads()
    ncand = cnt[0]
    from_row = T.if_then_else(ncand > sel.candidates, 1, 0)
    n_rounds = 3
    if from_row == 1:
        T.sync_threads()
        if tx == 0:
            ctl[1] = 0                               # the gather below rewrites every winner


@T.macro


def radix_rounds(sel, Logits, row, tx, n_src, ckey, hist, sv, wsum, ctl, start: T.Ref, from_row: T.Ref,
                 n_rounds: T.Ref, x: T.Ref, key: T.Ref, krem: T.Ref, bin_: T.Ref, prefix: T.Ref,
                 pmask: T.Ref):
    """The other rounds, 8 bits each, on the n_src candidates or (from_row) keys of the row: prefix <- the
    exact k-th key, krem <- the winners equal to it. After the 12-bit round: bits 19-12, 11-4, 7-0 (the last
    overlaps the one before: its bits already match); after the sampled bound, all 32 bits."""
    for rnd in T.serial(n_rounds):
        shift = T.Cast(T.uint32, T.max(T.if_then_else(n_rounds == 4, 24, 32 - FIRST_BITS - RADIX_BITS)
                                       - rnd * RADIX_BITS, 0))
        T.sync_threads()
        clear_hist(sel, tx, hist, RADIX)
        T.sync_threads()
        for it in T.serial(T.ceildiv(n_src, sel.threads)):
            c = it * sel.threads + tx
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


def gather_winners(sel, Logits, row, tx, n_src, ckey, cidx, skey, sidx, ctl, slot, start: T.Ref, from_row: T.Ref,
                   x: T.Ref, key: T.Ref, krem: T.Ref, prefix: T.Ref):
    """The winners to their places: the keys above the k-th (prefix) after any already there (ctl[1]), then
    the first krem keys equal to it."""
    kid = T.alloc_var(T.int32)
    T.sync_threads()
    for it in T.serial(T.ceildiv(n_src, sel.threads)):
        c = it * sel.threads + tx
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
            skey[slot[0]] = key ^ _FLIP
            sidx[slot[0]] = kid
        append((c < n_src) & (key == prefix), ctl[2], slot)
        if (c < n_src) & (key == prefix):
            if slot[0] < krem:
                skey[sel.topk - krem + slot[0]] = key ^ _FLIP
                sidx[sel.topk - krem + slot[0]] = kid


@T.macro


def take_row(sel, Logits, row, tx, n_iter, skey, sidx, start: T.Ref, end: T.Ref, x: T.Ref):
    """(Rows of at most topk keys) every key is a winner."""
    T.sync_threads()
    for it in T.serial(n_iter):
        j = start + it * sel.threads + tx
        if j < end:
            x = Logits[row, j]
            skey[j - start] = _ordered_key(x) ^ _FLIP
            sidx[j - start] = j


@T.macro


def rank_winners(sel, tx, row, skey, sidx, ckey, cidx, hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot, Out,
                 placed: T.Ref, do_sort: T.Ref):
    """(rank_sort) The counting sort orders the winners and writes them, unless the candidates' already
    wrote the row; do_sort <- 1 where a bucket is skewed (or without rank_sort): the bitonic sort."""
    do_sort = 1
    if sel.rank_sort:
        if placed == 1:
            do_sort = 0
        else:
            rank_place(sel, tx, row, sel.sort_n, skey, sidx, False, ckey, cidx, sel.sort_n, sel.rank_e, sel.rank_b,
                       hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot, Out)
            do_sort = big[0]


def _pair(k, i):
    # a (key, id) as one uint64, key in the high word: ascending = (key, id) ascending
    return (T.Cast(T.uint64, k) << T.uint64(32)) | T.Cast(T.uint64, T.Cast(T.uint32, i))


def _pair_id(p):
    # the id of a pair
    return T.Cast(T.int32, T.Cast(T.uint32, p & T.uint64(0xFFFFFFFF)))


@T.macro


def sort_in_thread(sel, tx, kk, jj, rp, pa: T.Ref, pb: T.Ref):
    """A bitonic stage whose partner is in the same thread: a compare-exchange of two registers."""
    if tx < sel.sort_threads:
        for e in T.unroll(sel.E, explicit=True):
            if (e & (1 << (kk - jj))) == 0:
                pa = rp[e]
                pb = rp[e | (1 << (kk - jj))]
                if T.if_then_else(((tx * sel.E + e) & (2 << kk)) == 0, pa > pb, pb > pa):
                    rp[e] = pb
                    rp[e | (1 << (kk - jj))] = pa


@T.macro


def sort_in_warp(sel, tx, kk, jj, rp, po: T.Ref):
    """A bitonic stage whose partner is in the same warp: one full-mask shuffle of each pair."""
    if tx < sel.sort_threads:                # whole warps: full-mask shuffles
        for e in T.unroll(sel.E, explicit=True):
            po = T.shfl_xor(rp[e], (1 << (kk - jj)) // sel.E)
            if T.if_then_else(((tx & ((1 << (kk - jj)) // sel.E)) == 0)
                              == (((tx * sel.E + e) & (2 << kk)) == 0), rp[e] > po, po > rp[e]):
                rp[e] = po


@T.macro


def sort_across_warps(sel, tx, kk, jj, rp, skey, sidx, po: T.Ref):
    """A bitonic stage whose partner is in another warp: the pairs through shared memory."""
    T.sync_threads()
    if tx < sel.sort_threads:
        for e in T.unroll(sel.E, explicit=True):
            skey[tx * sel.E + e] = T.Cast(T.uint32, rp[e] >> T.uint64(32))
            sidx[tx * sel.E + e] = _pair_id(rp[e])
    T.sync_threads()
    if tx < sel.sort_threads:
        for e in T.unroll(sel.E, explicit=True):
            po = _pair(skey[(tx ^ ((1 << (kk - jj)) // sel.E)) * sel.E + e],
                       sidx[(tx ^ ((1 << (kk - jj)) // sel.E)) * sel.E + e])
            if T.if_then_else(((tx & ((1 << (kk - jj)) // sel.E)) == 0)
                              == (((tx * sel.E + e) & (2 << kk)) == 0), rp[e] > po, po > rp[e]):
                rp[e] = po


@T.macro


def bitonic_sort(sel, tx, row, skey, sidx, Out, do_sort: T.Ref):
    """(do_sort) The winners sorted ascending by (skey, sidx) in registers, and the first topk written.
    Element i = tx * E + e lives in register e of thread tx; partner i ^ d is in the same thread (d < E), the
    same warp (d < 32 E: a shuffle) or another warp (shared memory)."""
    rp = T.alloc_local([sel.E], T.uint64)  # this thread's (key, id) pairs
    pa = T.alloc_var(T.uint64)
    pb = T.alloc_var(T.uint64)
    po = T.alloc_var(T.uint64)
    if do_sort == 0:
        T.evaluate(0)
    else:
        T.sync_threads()
        if tx < sel.sort_threads:
            for e in T.unroll(sel.E, explicit=True):
                rp[e] = _pair(skey[tx * sel.E + e], sidx[tx * sel.E + e])
        for kk in T.unroll(sel.log_n, explicit=True):
            for jj in T.unroll(sel.log_n, explicit=True):
                if jj <= kk:
                    if (1 << (kk - jj)) < sel.E:
                        sort_in_thread(sel, tx, kk, jj, rp, pa, pb)
                    elif (1 << (kk - jj)) < 32 * sel.E:
                        sort_in_warp(sel, tx, kk, jj, rp, po)
                    else:
                        sort_across_warps(sel, tx, kk, jj, rp, skey, sidx, po)
        if tx < sel.sort_threads:
            for e in T.unroll(sel.E, explicit=True):
                if tx * sel.E + e < sel.topk:
                    Out[row, tx * sel.E + e] = T.if_then_else(
                        (rp[e] & T.uint64(0xFFFFFFFF)) == T.uint64(_INT_MAX), -1, _pair_id(rp[e]))



# ---------------------------------------------------------------------------------------------- the kernel
def build_topk_select(topk: int, config: SelectConfig = SelectConfig()):
    """Exact per-row top-k of fp32 scores [seq_q, seq_k] within [Starts, Ends); int32 ids sorted desc, -1 pad
    (the stages: this module's docstring). seq_k must be a multiple of ``config.vec`` (the launcher pads rows)."""
    sel = SelectSizes.of(topk, config)
    seq_q = T.dynamic("seq_q")

    @T.prim_func
    def topk_select(
        Logits: T.Tensor([seq_q, sel.seq_k], T.float32),
        Starts: T.Tensor([seq_q], T.int32),
        Ends: T.Tensor([seq_q], T.int32),
        Out: T.Tensor([seq_q, topk], T.int32),
    ):
        with T.Kernel(seq_q, threads=sel.threads) as row:
            if sel.min_blocks > 1:
                T.annotate_min_blocks_per_sm(sel.min_blocks)
            tx = T.get_thread_binding()
            hist = T.alloc_shared([sel.hist_n], T.int32)  # becomes suffix sums; hist[RADIX] = 0
            ctl = T.alloc_shared([4], T.int32)  # 0: threshold bin, 1: #greater, 2: #equal, 3: keys above the bin
            skey = T.alloc_shared([sel.sort_buf], T.uint32)  # ~ordered key: ascending = score desc
            sidx = T.alloc_shared([sel.sort_buf], T.int32)
            tsum = T.alloc_shared([sel.threads + 1], T.int32)  # per-thread bin totals, then their suffix sums
            ckey = T.alloc_shared([sel.candidates], T.uint32)  # the candidates' keys ...
            cidx = T.alloc_shared([sel.candidates], T.int32)  # ... and their key ids
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
            xv = T.alloc_local([sel.vec * sel.unroll], T.float32)
            slot = T.alloc_local([1], T.int32)
            do_sort = T.alloc_var(T.int32)                    # 0: the counting sort placed every winner
            placed = T.alloc_var(T.int32)                     # 1: the candidates' counting sort wrote the row
            if sel.rank_sort:
                big = T.alloc_shared([1], T.int32)            # a bucket holds more than RANK_MAX winners
                wmx = T.alloc_shared([32], T.float32)         # the warps' largest finite winner ...
                wmn = T.alloc_shared([32], T.float32)         # ... and smallest
                bkt = T.alloc_local([max(sel.rank_e, sel.cand_e)], T.int32)   # this thread's winners' buckets
            else:
                big = wmx = wmn = bkt = None                  # the counting sort's: unused

            n_valid, n_iter, base_v, n_vit, n_sv = init_row(sel, row, tx, Starts, Ends, skey, sidx, ctl, cnt, start,
                                                            end, prefix, pmask, krem, placed)
            if n_valid > topk:
                first_histogram(sel, Logits, row, tx, n_valid, base_v, n_vit, n_sv, xv, kv, hist, start, end, prefix,
                                pmask, key, sampled, want)
                first_threshold(sel, tx, n_valid, hist, tsum, wsum, sv, ctl, sampled, want, bin_, prefix, pmask)
                if sampled == 1:
                    sampled_bound(sel, Logits, row, tx, base_v, n_sv, xv, kv, hist, sv, wsum, ctl, start, end, prefix,
                                  pmask, want, tau)
                    collect_above_bound(sel, Logits, row, tx, base_v, n_vit, xv, slot, cnt, ckey, cidx, start, end,
                                        key, tau, ncand, from_row, prefix, pmask, n_rounds)
                    rank_candidates(sel, tx, row, ckey, cidx, skey, sidx, hist, tsum, wsum, big, wmx, wmn, bkt, sv,
                                    slot, Out, ncand, from_row, placed, n_rounds)
                else:
                    split_threshold_bin(sel, Logits, row, tx, base_v, n_vit, xv, slot, ctl, cnt, skey, sidx, ckey,
                                        cidx, start, end, key, prefix, pmask, krem, ncand, from_row, n_rounds)
                # the rounds and the gather: on the candidates in shared memory, or on the row when they did not
                # fit (one code path: the source is chosen per CTA, not per element)
                n_src = T.if_then_else(placed == 1, 0, T.if_then_else(from_row == 1, n_valid, ncand))
                radix_rounds(sel, Logits, row, tx, n_src, ckey, hist, sv, wsum, ctl, start, from_row, n_rounds, x,
                             key, krem, bin_, prefix, pmask)
                gather_winners(sel, Logits, row, tx, n_src, ckey, cidx, skey, sidx, ctl, slot, start, from_row, x,
                               key, krem, prefix)
            else:
                take_row(sel, Logits, row, tx, n_iter, skey, sidx, start, end, x)
            # order the winners: the counting sort, or the bitonic sort where its buckets are skewed
            rank_winners(sel, tx, row, skey, sidx, ckey, cidx, hist, tsum, wsum, big, wmx, wmn, bkt, sv, slot, Out,
                         placed, do_sort)
            bitonic_sort(sel, tx, row, skey, sidx, Out, do_sort)

    return topk_select


# The select places every barrier itself (the automatic pass would add one per loop trip). Every read of the scores
# is in bounds by construction (j < end <= seq_k, and vec divides seq_k), so the safe-memory pass's per-element
# guard, which also stops the vector loads, is off.
PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
                tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}


@kernel_cache
def compile_topk_select(topk: int, target_arch: str = "sm_90a", config: SelectConfig = SelectConfig()):
    """The select for ``topk`` built for ``target_arch`` (cached per arguments)."""
    return tilelang.compile(build_topk_select(topk, config), target={"kind": "cuda", "arch": target_arch},
                            pass_configs=PASS_CONFIGS)
