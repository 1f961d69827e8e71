"""TileLang kernels for `glm52::sparse_mla` and `glm52::sparse_mla_bwd` (absorbed sparse MLA).

Every query attends to the `topk` latent rows named in its index row (-1 = masked slot). Keys are the
full 576-wide latent (512 kv_lora + 64 rope), values its first 512 columns; one latent per token is
shared by all heads. Heads are processed in blocks of up to 64 (padded up to a power of two >= 16),
so a CTA is (query, head block); key slots stream through shared memory `block_I` at a time.

Forward: online softmax in base 2, out = P V, lse natural log (+inf for a row with no valid slot); two
kernels, picked by `FWD_KERNEL`: the serial one (all threads gather, then S, softmax, P V in turn) and,
for 64 heads, a warp-specialised one (a producer warpgroup gathers with cp.async into two shared stages
while two consumer warpgroups split the softmax and P V). Backward: dq per CTA in registers,
dkv accumulated with fp32 atomics into a [Sk, 576] buffer and cast to bf16 afterwards; delta =
rowsum(out * dout) in fp32 comes first (`DELTA_KERNEL`: PyTorch ops a chunk of rows at a time, or a small
kernel that reads each bf16 tensor once). Two kernels, picked by `BWD_KERNEL`:
the serial one (all threads gather, then the GEMM chain) and, for 64 heads, a warp-specialised one
(producer warpgroup gathering into two stages; one consumer warpgroup computes S / P while the other
computes dP, then they split the dKV and dQ GEMMs by latent columns). The measured alternatives are in
docs/kernels.md.
"""


import functools

import torch

import tilelang
import tilelang.language as T

from ..sparse_mla import _check, _sparse_mla_bwd_kernel, _sparse_mla_fwd_kernel
from ._common import cuda_target, next_pow2, pad_dim, round_up, warn_once

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

FWD_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}
# the warp-specialised forward's gather loops: cp.async without TileLang's implicit commit + wait
ASYNC_GATHER = {"parallel_prefer_async": True, "parallel_async_without_async_commit_wait": True}
BWD_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE: True,
}


def padded_heads(heads: int) -> int:
    """Heads as the kernels see them: a power of two >= 16 up to 64, else a multiple of 64."""
    if heads <= 64:
        return max(16, next_pow2(heads))
    return round_up(heads, 64)


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------
def online_softmax_macro(scale2: float):
    """The forward kernels' online-softmax step for one slot block, in base 2 (``scale2`` = sm_scale * log2 e):
    the running max ``m`` and sum ``l_sum`` take the block's scores ``acc_s`` [heads, slots], which become the
    block's unnormalised probabilities, and the output accumulator ``acc_o`` [heads, cols] is rescaled by
    ``alpha``. One definition for the serial and the warp-specialised forward."""

    @T.macro
    def online_softmax(acc_s, acc_o, m, m_prev, alpha, l_sum, l_blk):
        rows, slots = acc_s.shape
        cols = acc_o.shape[1]
        T.copy(m, m_prev)
        T.reduce_max(acc_s, m, dim=1, clear=False)
        for h in T.Parallel(rows):
            m[h] = T.max(m[h], m_prev[h])
            alpha[h] = T.exp2((m_prev[h] - m[h]) * scale2)
        for h, i in T.Parallel(rows, slots):
            acc_s[h, i] = T.exp2(acc_s[h, i] * scale2 - m[h] * scale2)
        T.reduce_sum(acc_s, l_blk, dim=1)
        for h in T.Parallel(rows):
            l_sum[h] = l_sum[h] * alpha[h] + l_blk[h]
        for h, d in T.Parallel(rows, cols):
            acc_o[h, d] = acc_o[h, d] * alpha[h]

    return online_softmax


def build_sparse_mla_fwd(heads: int, topk: int, sm_scale: float, *, dim_qk: int = 576,
                         dim_v: int = 512, block_I: int = 64, num_stages: int = 2,
                         threads: int = 256):
    """Forward. `heads` must be padded (see `padded_heads`), `topk` a multiple of block_I."""
    assert heads == padded_heads(heads) and topk % block_I == 0
    D, DT = dim_v, dim_qk - dim_v
    HB = min(heads, 64)
    NHB = heads // HB
    NI = topk // block_I
    scale2 = sm_scale * LOG2E
    online_softmax = online_softmax_macro(scale2)
    seq = T.dynamic("seq")
    seq_kv = T.dynamic("seq_kv")
    dtype, accum = T.bfloat16, T.float32

    @T.prim_func
    def sparse_mla_fwd(
        Q: T.Tensor([seq, heads, dim_qk], dtype),
        KV: T.Tensor([seq_kv, dim_qk], dtype),
        Idx: T.Tensor([seq, topk], T.int32),
        Out: T.Tensor([seq, heads, D], dtype),
        Lse: T.Tensor([seq, heads], accum),
    ):
        with T.Kernel(seq * NHB, threads=threads) as bx:
            q_s = T.alloc_shared([HB, D], dtype)
            qt_s = T.alloc_shared([HB, DT], dtype)
            kv_s = T.alloc_shared([block_I, D], dtype)
            kt_s = T.alloc_shared([block_I, DT], dtype)
            p_s = T.alloc_shared([HB, block_I], dtype)
            valid = T.alloc_fragment([block_I], "bool")
            acc_o = T.alloc_fragment([HB, D], accum)
            acc_s = T.alloc_fragment([HB, block_I], accum)
            m = T.alloc_fragment([HB], accum)
            m_prev = T.alloc_fragment([HB], accum)
            alpha = T.alloc_fragment([HB], accum)
            l_sum = T.alloc_fragment([HB], accum)
            l_blk = T.alloc_fragment([HB], accum)

            s_i = bx // NHB
            h0 = (bx % NHB) * HB
            T.fill(acc_o, 0)
            T.fill(l_sum, 0)
            T.fill(m, -(2.0**30))
            T.copy(Q[s_i, h0:h0 + HB, :D], q_s)
            T.copy(Q[s_i, h0:h0 + HB, D:], qt_s)

            for it in T.Pipelined(NI, num_stages=num_stages):
                for i in T.Parallel(block_I):
                    valid[i] = Idx[s_i, it * block_I + i] >= 0
                for i, d in T.Parallel(block_I, D):
                    kv_s[i, d] = KV[T.max(Idx[s_i, it * block_I + i], 0), d]
                for i, d in T.Parallel(block_I, DT):
                    kt_s[i, d] = KV[T.max(Idx[s_i, it * block_I + i], 0), D + d]
                for h, i in T.Parallel(HB, block_I):
                    acc_s[h, i] = T.if_then_else(valid[i], 0, -T.infinity(accum))
                T.gemm(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                online_softmax(acc_s, acc_o, m, m_prev, alpha, l_sum, l_blk)
                T.copy(acc_s, p_s)
                T.gemm(p_s, kv_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            for h, d in T.Parallel(HB, D):
                acc_o[h, d] = T.if_then_else(l_sum[h] > 0, acc_o[h, d] / l_sum[h], 0)
            for h in T.Parallel(HB):
                # +inf for a row with no valid slot, as the reference does (exp(s - lse) = 0)
                l_sum[h] = T.if_then_else(l_sum[h] > 0, (T.log2(l_sum[h]) + m[h] * scale2) * LN2,
                                          T.infinity(accum))
            T.copy(acc_o, Out[s_i, h0:h0 + HB, :])
            T.copy(l_sum, Lse[s_i, h0:h0 + HB])

    return sparse_mla_fwd


def build_sparse_mla_fwd_ws(heads: int, topk: int, sm_scale: float, *, dim_qk: int = 576,
                            dim_v: int = 512, block_I: int = 64, num_stages: int = 2,
                            nreg_softmax: int = 240, nreg_pv: int = 168, nreg_gather: int = 96):
    """Warp-specialised, pipelined forward for one 64-head block (GLM-5.2's heads): the signature and
    results of `build_sparse_mla_fwd`; one CTA per query, 384 threads in three warpgroups.

    - warpgroup 2, producer (`nreg_gather` registers): gathers the latent rows of slot block `it` with
      cp.async (16 B per copy) into shared stage `it % 2`, zero-filling masked slots, and arrives on
      `ready[stage]` when its copies have landed, after waiting for `free[stage]`;
    - warpgroup 0 (`nreg_softmax`): loads Q, then S = Q K^T as three wgmma chains (value halves +
      rope tail), the online softmax, P (bf16) and alpha to shared memory (arrive `p_ready`), and
      O[:, :D/2] += P V_l;
    - warpgroup 1 (`nreg_pv`): waits on `p_ready`, rescales its half by alpha, O[:, D/2:] += P V_r.

    Both consumers arrive on `free[stage]` after their GEMMs on it; warpgroup 0 overwrites P and alpha
    only once warpgroup 1 has used them (`p_free`), so S of block it+1 overlaps P V_r of block it.
    Q plus two stages of block_I x 576 bf16 use 224 KiB of shared memory: `num_stages` must be 2 and
    `topk` a multiple of 2 * block_I. The register split must sum to <= 504 (168 x 3 at launch).
    """
    assert heads == 64, "the warp-specialised forward is laid out for one 64-head block"
    assert num_stages == 2, "two KV stages fill the H200's shared memory (Q + 2 x 64 x 576 bf16)"
    assert topk % (2 * block_I) == 0 and block_I % 16 == 0
    assert nreg_softmax + nreg_pv + nreg_gather <= 504 and nreg_gather % 8 == 0
    D, DT = dim_v, dim_qk - dim_v
    assert D % 128 == 0 and DT % 8 == 0
    HB = heads
    DH = D // 2                          # value columns per consumer warpgroup
    NI = topk // block_I
    scale2 = sm_scale * LOG2E
    online_softmax = online_softmax_macro(scale2)
    seq = T.dynamic("seq")
    seq_kv = T.dynamic("seq_kv")
    dtype, accum = T.bfloat16, T.float32

    @T.macro
    def gather(KV, Idx, s_i, it, kv_l, kv_r, kt, ready):
        # cp.async without TileLang's commit + wait: the arrive on `ready` fires once they have landed
        for i, d in T.Parallel(block_I, DH, annotations=ASYNC_GATHER):
            kv_l[i, d] = T.if_then_else(Idx[s_i, it * block_I + i] >= 0,
                                        KV[Idx[s_i, it * block_I + i], d], 0)
        for i, d in T.Parallel(block_I, DH, annotations=ASYNC_GATHER):
            kv_r[i, d] = T.if_then_else(Idx[s_i, it * block_I + i] >= 0,
                                        KV[Idx[s_i, it * block_I + i], DH + d], 0)
        for i, d in T.Parallel(block_I, DT, annotations=ASYNC_GATHER):
            kt[i, d] = T.if_then_else(Idx[s_i, it * block_I + i] >= 0,
                                      KV[Idx[s_i, it * block_I + i], D + d], 0)
        T.cp_async_barrier_noinc(ready)

    @T.macro
    def softmax_step(Idx, s_i, it, q_l, q_r, qt_s, kv_l, kv_r, kt, p_s, alpha_s, valid, acc_s, acc_o,
                     m, m_prev, alpha, l_sum, l_blk, ready, free, p_ready, p_free):
        # warpgroup 0, slot block `it` in stage (kv_l, kv_r, kt); the index loads precede the wait
        for i in T.Parallel(block_I):
            valid[i] = Idx[s_i, it * block_I + i] >= 0
        T.barrier_wait(ready, (it // 2) & 1)
        for h, i in T.Parallel(HB, block_I):
            acc_s[h, i] = T.if_then_else(valid[i], 0, -T.infinity(accum))
        T.gemm(q_l, kv_l, acc_s, transpose_B=True, annotations={"wg_wait": -1})
        T.gemm(q_r, kv_r, acc_s, transpose_B=True, annotations={"wg_wait": -1})
        T.gemm(qt_s, kt, acc_s, transpose_B=True, annotations={"wg_wait": -1})
        T.wait_wgmma(0)
        online_softmax(acc_s, acc_o, m, m_prev, alpha, l_sum, l_blk)
        T.barrier_wait(p_free, (it & 1) ^ 1)          # warpgroup 1 is done with P of block it - 1
        T.copy(alpha, alpha_s)
        T.copy(acc_s, p_s)
        T.fence_proxy_async()                         # P is read by warpgroup 1's wgmma
        T.barrier_arrive(p_ready)
        T.gemm(p_s, kv_l, acc_o)
        T.barrier_arrive(free)

    @T.macro
    def pv_step(it, kv_r, p_s, alpha_s, acc_o, free, p_ready, p_free):
        # warpgroup 1, slot block `it`: P and alpha of warpgroup 0, values D/2.. of the stage
        T.barrier_wait(p_ready, it & 1)
        for h, d in T.Parallel(HB, DH):
            acc_o[h, d] = acc_o[h, d] * alpha_s[h]
        T.gemm(p_s, kv_r, acc_o)
        T.barrier_arrive(p_free)
        T.barrier_arrive(free)

    @T.prim_func
    def sparse_mla_fwd_ws(
        Q: T.Tensor([seq, heads, dim_qk], dtype),
        KV: T.Tensor([seq_kv, dim_qk], dtype),
        Idx: T.Tensor([seq, topk], T.int32),
        Out: T.Tensor([seq, heads, D], dtype),
        Lse: T.Tensor([seq, heads], accum),
    ):
        with T.Kernel(seq, threads=384) as s_i:
            q_l = T.alloc_shared([HB, DH], dtype)
            q_r = T.alloc_shared([HB, DH], dtype)
            qt_s = T.alloc_shared([HB, DT], dtype)
            kv_l0 = T.alloc_shared([block_I, DH], dtype)
            kv_r0 = T.alloc_shared([block_I, DH], dtype)
            kt0 = T.alloc_shared([block_I, DT], dtype)
            kv_l1 = T.alloc_shared([block_I, DH], dtype)
            kv_r1 = T.alloc_shared([block_I, DH], dtype)
            kt1 = T.alloc_shared([block_I, DT], dtype)
            p_s = T.alloc_shared([HB, block_I], dtype)      # P of the current block, bf16
            alpha_s = T.alloc_shared([HB], accum)           # its rescale factor, for warpgroup 1
            sum_s = T.alloc_shared([HB], accum)             # final softmax denominators
            valid = T.alloc_fragment([block_I], "bool")
            acc_s = T.alloc_fragment([HB, block_I], accum)
            acc_o_l = T.alloc_fragment([HB, DH], accum)     # warpgroup 0: O[:, :D/2]
            acc_o_r = T.alloc_fragment([HB, DH], accum)     # warpgroup 1: O[:, D/2:]
            m = T.alloc_fragment([HB], accum)
            m_prev = T.alloc_fragment([HB], accum)
            alpha = T.alloc_fragment([HB], accum)
            l_sum = T.alloc_fragment([HB], accum)
            l_blk = T.alloc_fragment([HB], accum)
            ready0 = T.alloc_barrier(arrive_count=128)
            ready1 = T.alloc_barrier(arrive_count=128)
            free0 = T.alloc_barrier(arrive_count=256)
            free1 = T.alloc_barrier(arrive_count=256)
            p_ready = T.alloc_barrier(arrive_count=128)
            p_free = T.alloc_barrier(arrive_count=128)
            done = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(nreg_softmax, 1)
                # Q [64, 576] by warpgroup 0 alone (its only reader), while the producer gathers
                T.copy(Q[s_i, :, :DH], q_l)
                T.copy(Q[s_i, :, DH:D], q_r)
                T.copy(Q[s_i, :, D:], qt_s)
                T.fence_proxy_async()
                T.fill(acc_o_l, 0)
                T.fill(l_sum, 0)
                T.fill(m, -(2.0**30))
                for i2 in T.serial(NI // 2):
                    softmax_step(Idx, s_i, 2 * i2, q_l, q_r, qt_s, kv_l0, kv_r0, kt0, p_s, alpha_s,
                                 valid, acc_s, acc_o_l, m, m_prev, alpha, l_sum, l_blk, ready0, free0,
                                 p_ready, p_free)
                    softmax_step(Idx, s_i, 2 * i2 + 1, q_l, q_r, qt_s, kv_l1, kv_r1, kt1, p_s,
                                 alpha_s, valid, acc_s, acc_o_l, m, m_prev, alpha, l_sum, l_blk, ready1,
                                 free1, p_ready, p_free)
                T.copy(l_sum, sum_s)
                T.barrier_arrive(done)
                for h, d in T.Parallel(HB, DH):
                    acc_o_l[h, d] = T.if_then_else(l_sum[h] > 0, acc_o_l[h, d] / l_sum[h], 0)
                for h in T.Parallel(HB):
                    # +inf for a row with no valid slot, as the reference does (exp(s - lse) = 0)
                    l_sum[h] = T.if_then_else(l_sum[h] > 0,
                                              (T.log2(l_sum[h]) + m[h] * scale2) * LN2,
                                              T.infinity(accum))
                T.copy(acc_o_l, Out[s_i, :, :DH])
                T.copy(l_sum, Lse[s_i, :])
            elif tx < 256:
                T.set_max_nreg(nreg_pv, 1)
                T.fill(acc_o_r, 0)
                for i2 in T.serial(NI // 2):
                    pv_step(2 * i2, kv_r0, p_s, alpha_s, acc_o_r, free0, p_ready, p_free)
                    pv_step(2 * i2 + 1, kv_r1, p_s, alpha_s, acc_o_r, free1, p_ready, p_free)
                T.barrier_wait(done, 0)
                for h, d in T.Parallel(HB, DH):
                    acc_o_r[h, d] = T.if_then_else(sum_s[h] > 0, acc_o_r[h, d] / sum_s[h], 0)
                T.copy(acc_o_r, Out[s_i, :, DH:])
            else:
                T.set_max_nreg(nreg_gather, 0)
                for i2 in T.serial(NI // 2):
                    T.barrier_wait(free0, (i2 & 1) ^ 1)
                    gather(KV, Idx, s_i, 2 * i2, kv_l0, kv_r0, kt0, ready0)
                    T.barrier_wait(free1, (i2 & 1) ^ 1)
                    gather(KV, Idx, s_i, 2 * i2 + 1, kv_l1, kv_r1, kt1, ready1)
                # stay until the last copies have landed (the consumers wait on the same phases)
                T.barrier_wait(ready0, (NI // 2 - 1) & 1)
                T.barrier_wait(ready1, (NI // 2 - 1) & 1)

    return sparse_mla_fwd_ws


def build_row_dot(dim: int, *, block_R: int = 32, block_D: int = 0, threads: int = 128):
    """The backward's preprocess: Delta[r] = sum_d O[r, d] * dO[r, d] in fp32 for bf16 [rows, dim] O and dO
    (rows = queries x heads), each read once; a block of `block_R` rows walks the columns `block_D` (default 128,
    or 64 where 128 does not divide `dim`) at a time."""
    block_D = block_D or (128 if dim % 128 == 0 else 64)
    assert dim % block_D == 0
    rows = T.dynamic("rows")
    dtype, accum = T.bfloat16, T.float32

    @T.prim_func
    def row_dot(
        O: T.Tensor([rows, dim], dtype),
        dO: T.Tensor([rows, dim], dtype),
        Delta: T.Tensor([rows], accum),
    ):
        with T.Kernel(T.ceildiv(rows, block_R), threads=threads) as bx:
            o = T.alloc_fragment([block_R, block_D], dtype)
            do = T.alloc_fragment([block_R, block_D], dtype)
            acc = T.alloc_fragment([block_R, block_D], accum)
            d = T.alloc_fragment([block_R], accum)
            T.clear(acc)
            for k in T.serial(dim // block_D):
                T.copy(O[bx * block_R:(bx + 1) * block_R, k * block_D:(k + 1) * block_D], o)
                T.copy(dO[bx * block_R:(bx + 1) * block_R, k * block_D:(k + 1) * block_D], do)
                for i, j in T.Parallel(block_R, block_D):
                    acc[i, j] += T.Cast(accum, o[i, j]) * T.Cast(accum, do[i, j])
            T.reduce_sum(acc, d, dim=1)
            T.copy(d, Delta[bx * block_R:(bx + 1) * block_R])

    return row_dot


def build_sparse_mla_bwd(heads: int, topk: int, sm_scale: float, *, dim_qk: int = 576,
                         dim_v: int = 512, block_I: int = 32, num_stages: int = 0,
                         threads: int = 256, split_store: int = 2):
    """Backward: dq [seq, heads, 576] bf16 and fp32 dkv accumulated in place ([seq_kv, 576],
    zero-initialised by the caller). `heads` padded, `topk` a multiple of block_I."""
    assert heads == padded_heads(heads) and topk % block_I == 0 and block_I % split_store == 0
    D, DT = dim_v, dim_qk - dim_v
    HB = min(heads, 64)
    NHB = heads // HB
    NI = topk // block_I
    BS = block_I // split_store
    scale2 = sm_scale * LOG2E
    seq = T.dynamic("seq")
    seq_kv = T.dynamic("seq_kv")
    dtype, accum = T.bfloat16, T.float32

    @T.prim_func
    def sparse_mla_bwd(
        Q: T.Tensor([seq, heads, dim_qk], dtype),
        KV: T.Tensor([seq_kv, dim_qk], dtype),
        dO: T.Tensor([seq, heads, D], dtype),
        Idx: T.Tensor([seq, topk], T.int32),
        Lse: T.Tensor([seq, heads], accum),
        Delta: T.Tensor([seq, heads], accum),
        dQ: T.Tensor([seq, heads, dim_qk], dtype),
        dKV: T.Tensor([seq_kv, dim_qk], accum),
    ):
        with T.Kernel(seq * NHB, threads=threads) as bx:
            q_s = T.alloc_shared([HB, D], dtype)
            qt_s = T.alloc_shared([HB, DT], dtype)
            do_s = T.alloc_shared([HB, D], dtype)
            kv_s = T.alloc_shared([block_I, D], dtype)
            kt_s = T.alloc_shared([block_I, DT], dtype)
            p_s = T.alloc_shared([HB, block_I], dtype)
            ds_s = T.alloc_shared([HB, block_I], dtype)
            dkv_s = T.alloc_shared([BS, D], accum)
            dkt_s = T.alloc_shared([BS, DT], accum)
            valid = T.alloc_fragment([block_I], "bool")
            acc_p = T.alloc_fragment([HB, block_I], accum)
            acc_dp = T.alloc_fragment([HB, block_I], accum)
            acc_dq = T.alloc_fragment([HB, D], accum)
            acc_dqt = T.alloc_fragment([HB, DT], accum)
            acc_dkv = T.alloc_fragment([block_I, D], accum)
            acc_dkt = T.alloc_fragment([block_I, DT], accum)
            lse2 = T.alloc_fragment([HB], accum)
            delta = T.alloc_fragment([HB], accum)

            s_i = bx // NHB
            h0 = (bx % NHB) * HB
            T.copy(Q[s_i, h0:h0 + HB, :D], q_s)
            T.copy(Q[s_i, h0:h0 + HB, D:], qt_s)
            T.copy(dO[s_i, h0:h0 + HB, :], do_s)
            for h in T.Parallel(HB):
                lse2[h] = Lse[s_i, h0 + h] * LOG2E
                delta[h] = Delta[s_i, h0 + h]
            T.clear(acc_dq)
            T.clear(acc_dqt)

            for it in T.Pipelined(NI, num_stages=num_stages):
                for i in T.Parallel(block_I):
                    valid[i] = Idx[s_i, it * block_I + i] >= 0
                for h, i in T.Parallel(HB, block_I):
                    acc_p[h, i] = T.if_then_else(valid[i], 0, -T.infinity(accum))
                for i, d in T.Parallel(block_I, D):
                    kv_s[i, d] = KV[T.max(Idx[s_i, it * block_I + i], 0), d]
                for i, d in T.Parallel(block_I, DT):
                    kt_s[i, d] = KV[T.max(Idx[s_i, it * block_I + i], 0), D + d]
                T.gemm(q_s, kv_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(qt_s, kt_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for h, i in T.Parallel(HB, block_I):
                    acc_p[h, i] = T.exp2(acc_p[h, i] * scale2 - lse2[h])
                T.copy(acc_p, p_s)
                T.gemm(do_s, kv_s, acc_dp, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                for h, i in T.Parallel(HB, block_I):
                    acc_dp[h, i] = acc_p[h, i] * (acc_dp[h, i] - delta[h]) * sm_scale
                T.copy(acc_dp, ds_s)
                T.gemm(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(ds_s, kt_s, acc_dqt, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(ds_s, q_s, acc_dkv, transpose_A=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(ds_s, qt_s, acc_dkt, transpose_A=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                for part in T.serial(split_store):
                    for i, d in T.Parallel(block_I, D):
                        if i // BS == part:
                            dkv_s[i % BS, d] = acc_dkv[i, d]
                    for i, d in T.Parallel(block_I, DT):
                        if i // BS == part:
                            dkt_s[i % BS, d] = acc_dkt[i, d]
                    for i, d4 in T.Parallel(BS, D // 4):
                        if Idx[s_i, it * block_I + part * BS + i] >= 0:
                            T.atomic_addx4(dKV[Idx[s_i, it * block_I + part * BS + i], d4 * 4],
                                           dkv_s[i, d4 * 4])
                    for i, d4 in T.Parallel(BS, DT // 4):
                        if Idx[s_i, it * block_I + part * BS + i] >= 0:
                            T.atomic_addx4(dKV[Idx[s_i, it * block_I + part * BS + i], D + d4 * 4],
                                           dkt_s[i, d4 * 4])

            T.copy(acc_dq, dQ[s_i, h0:h0 + HB, :D])
            T.copy(acc_dqt, dQ[s_i, h0:h0 + HB, D:])

    return sparse_mla_bwd


def build_sparse_mla_bwd_ws(heads: int, topk: int, sm_scale: float, *, dim_qk: int = 576,
                            dim_v: int = 512, block_I: int = 32, chunk: int = 64,
                            nreg_s: int = 232, nreg_dp: int = 232, nreg_gather: int = 40):
    """Warp-specialised backward for one 64-head block (GLM-5.2's heads): the signature and results of
    `build_sparse_mla_bwd`; one CTA per query, 384 threads in three warpgroups. H200, 64 heads, 16K, top-k
    2048, chunk 64: 53.3 ms (222 TFLOP/s).

    Shared memory (224 KiB dynamic at chunk 128): Q [64, 576] and dO [64, 512], kept in `chunk`-column
    pieces so that every GEMM operand is a whole buffer; two KV stages of block_I x 576; P and dS
    [64, block_I] bf16, one pair per stage. Nothing else fits, so dKV leaves registers directly as fp32
    atomics: dKV [slot, latent] on mma.sync (TileLang picks it for M = 32 slots, below wgmma's 64); a thread
    holds pairs of consecutive latent columns, so the atomics are x2 (ptxas, CUDA 13.0: 188 B spilled at chunk
    64). The dKV GEMMs (40% of the FLOPs) run on the older tensor-core path.

    - warpgroup 2, producer (`nreg_gather` registers): after `free[st]`, gathers the latent rows of slot
      block `it` with cp.async into stage st = it % 2 (zero fill for masked slots), arrives `ready[st]`;
    - warpgroup 0 (`nreg_s`): S = Q K^T, P = exp(S - lse) -> p_s[st] (arrive `p_ready[st]`);
      dKV[c] = P^T dO_c for the value chunks c < NC/2 (its first GEMM overlaps warpgroup 1 forming dS);
      after `ds_ready[st]`: dKV[c] += dS^T Q_c, atomics; dQ[:, :D/2] and dQ_rope += dS K; then arrives
      `ds_free[st]` and `free[st]`;
    - warpgroup 1 (`nreg_dp`): dP = dO V^T (concurrently with S); after `p_ready[st]`: dS = P (dP - delta)
      scale -> ds_s[st] (after `ds_free[st]` of block it - 2; arrive `ds_ready[st]`); dKV for the value
      chunks >= NC/2 (then arrives `p_free[st]`: its last read of P) and the rope tail (Q_rope^T dS);
      dQ[:, D/2:D] += dS K; arrives `free[st]`.

    Work per slot and head (multiply-adds): warpgroup 0 576 (S) + 320 (dQ) + 512 (dKV) = 1408, warpgroup 1
    512 (dP) + 256 (dQ) + 576 (dKV) = 1344. P reaches warpgroup 1 as bf16 (p_s), so dS uses the rounded P
    (the serial kernel: fp32). `topk` a multiple of 2 * block_I; the register split must sum to <= 504 (168 x 3 at launch).
    """
    assert heads == 64, "the warp-specialised backward is laid out for one 64-head block"
    assert topk % (2 * block_I) == 0 and block_I % 16 == 0
    assert nreg_s + nreg_dp + nreg_gather <= 504 and nreg_gather % 8 == 0
    D, DT = dim_v, dim_qk - dim_v
    assert D % (2 * chunk) == 0 and DT % 8 == 0 and DT <= chunk
    HB = heads
    NC = D // chunk                       # value chunks of Q, dO and each KV stage
    NC0 = NC // 2                         # chunks 0..NC0-1: warpgroup 0's dKV / dQ columns
    CH, CH0, CH1 = list(range(NC)), list(range(NC0)), list(range(NC0, NC))   # Python-unrolled
    CHR = list(range(NC - NC0))
    NI = topk // block_I
    scale2 = sm_scale * LOG2E
    seq = T.dynamic("seq")
    seq_kv = T.dynamic("seq_kv")
    dtype, accum = T.bfloat16, T.float32

    @T.macro
    def gather(KV, Idx, s_i, it, kvc, kt, ready):
        for c in CH:
            for i, d in T.Parallel(block_I, chunk, annotations=ASYNC_GATHER):
                kvc[c][i, d] = T.if_then_else(Idx[s_i, it * block_I + i] >= 0,
                                              KV[Idx[s_i, it * block_I + i], c * chunk + d], 0)
        for i, d in T.Parallel(block_I, DT, annotations=ASYNC_GATHER):
            kt[i, d] = T.if_then_else(Idx[s_i, it * block_I + i] >= 0,
                                      KV[Idx[s_i, it * block_I + i], D + d], 0)
        T.cp_async_barrier_noinc(ready)

    @T.macro
    def scatter(dKV, slot, col0, ncols, acc):
        # acc = dKV [block_I slots, ncols latent], to dKV[slot, col0:col0 + ncols] as paired fp32 atomics; `slot`
        # holds the block's latent rows (-1 masked) in registers, loaded once per block
        for j, l2 in T.Parallel(block_I, ncols // 2):
            if slot[j] >= 0:
                T.atomic_addx2(dKV[slot[j], col0 + 2 * l2], acc[j, 2 * l2])

    @T.macro
    def dkv_gemm(a_t, b_s, acc, clear):
        # dKV += b_s^T a_t ([slots, cols])
        T.gemm(b_s, a_t, acc, transpose_A=True, clear_accum=clear)

    @T.macro
    def s_step(Idx, dKV, s_i, it, qc, qt_s, doc, kvc, kt, p_s, ds_s, lse2, slot, kslot, acc_s, acc_dq,
               acc_dqt, acc_kv, ready, free, p_ready, p_free, ds_ready, ds_free):
        # warpgroup 0, slot block `it` in stage (kvc, kt); the index loads precede the wait. `kslot`: the
        # same rows in the dKV accumulator's layout
        for i in T.Parallel(block_I):
            slot[i] = Idx[s_i, it * block_I + i]
        for i in T.Parallel(block_I):
            kslot[i] = Idx[s_i, it * block_I + i]
        T.barrier_wait(ready, (it // 2) & 1)
        for h, i in T.Parallel(HB, block_I):
            acc_s[h, i] = T.if_then_else(slot[i] >= 0, 0, -T.infinity(accum))
        for c in CH:
            T.gemm(qc[c], kvc[c], acc_s, transpose_B=True, annotations={"wg_wait": -1})
        T.gemm(qt_s, kt, acc_s, transpose_B=True, annotations={"wg_wait": -1})
        T.wait_wgmma(0)
        for h, i in T.Parallel(HB, block_I):
            acc_s[h, i] = T.exp2(acc_s[h, i] * scale2 - lse2[h])
        T.barrier_wait(p_free, ((it // 2) & 1) ^ 1)   # warpgroup 1 is done with P of block it - 2
        T.copy(acc_s, p_s)
        T.fence_proxy_async()                         # P is read by the tensor cores (both warpgroups' dKV)
        T.barrier_arrive(p_ready)
        for c in CH0:
            dkv_gemm(doc[c], p_s, acc_kv, True)
            if c == 0:
                T.barrier_wait(ds_ready, (it // 2) & 1)
            dkv_gemm(qc[c], ds_s, acc_kv, False)
            scatter(dKV, kslot, c * chunk, chunk, acc_kv)
        for c in CH0:
            T.gemm(ds_s, kvc[c], acc_dq[c], annotations={"wg_wait": -1})
        T.gemm(ds_s, kt, acc_dqt, annotations={"wg_wait": -1})
        T.wait_wgmma(0)
        T.barrier_arrive(ds_free)
        T.barrier_arrive(free)

    @T.macro
    def dp_step(Idx, dKV, s_i, it, qc, qt_s, doc, kvc, kt, p_s, ds_s, delta, slot, acc_dp, p_frag,
                acc_dq, acc_kv, acc_kt, ready, free, p_ready, p_free, ds_ready, ds_free):
        # warpgroup 1, slot block `it` in stage (kvc, kt)
        for i in T.Parallel(block_I):
            slot[i] = Idx[s_i, it * block_I + i]
        T.barrier_wait(ready, (it // 2) & 1)
        for c in CH:
            T.gemm(doc[c], kvc[c], acc_dp, transpose_B=True, clear_accum=(c == 0),
                   annotations={"wg_wait": -1})
        T.wait_wgmma(0)
        T.barrier_wait(p_ready, (it // 2) & 1)
        T.copy(p_s, p_frag)
        for h, i in T.Parallel(HB, block_I):
            acc_dp[h, i] = p_frag[h, i] * (acc_dp[h, i] - delta[h]) * sm_scale
        T.barrier_wait(ds_free, ((it // 2) & 1) ^ 1)  # warpgroup 0 is done with dS of block it - 2
        T.copy(acc_dp, ds_s)
        T.fence_proxy_async()
        T.barrier_arrive(ds_ready)
        for c in CH1:
            dkv_gemm(doc[c], p_s, acc_kv, True)
            dkv_gemm(qc[c], ds_s, acc_kv, False)
            scatter(dKV, slot, c * chunk, chunk, acc_kv)
        T.barrier_arrive(p_free)                      # last read of this P (its dKV GEMMs)
        dkv_gemm(qt_s, ds_s, acc_kt, True)
        scatter(dKV, slot, D, DT, acc_kt)
        for c in CH1:
            T.gemm(ds_s, kvc[c], acc_dq[c - NC0], annotations={"wg_wait": -1})
        T.wait_wgmma(0)
        T.barrier_arrive(free)

    @T.prim_func
    def sparse_mla_bwd_ws(
        Q: T.Tensor([seq, heads, dim_qk], dtype),
        KV: T.Tensor([seq_kv, dim_qk], dtype),
        dO: T.Tensor([seq, heads, D], dtype),
        Idx: T.Tensor([seq, topk], T.int32),
        Lse: T.Tensor([seq, heads], accum),
        Delta: T.Tensor([seq, heads], accum),
        dQ: T.Tensor([seq, heads, dim_qk], dtype),
        dKV: T.Tensor([seq_kv, dim_qk], accum),
    ):
        with T.Kernel(seq, threads=384) as s_i:
            qc = [T.alloc_shared([HB, chunk], dtype) for _ in range(NC)]
            qt_s = T.alloc_shared([HB, DT], dtype)
            doc = [T.alloc_shared([HB, chunk], dtype) for _ in range(NC)]
            kvc0 = [T.alloc_shared([block_I, chunk], dtype) for _ in range(NC)]
            kt0 = T.alloc_shared([block_I, DT], dtype)
            kvc1 = [T.alloc_shared([block_I, chunk], dtype) for _ in range(NC)]
            kt1 = T.alloc_shared([block_I, DT], dtype)
            p_s0 = T.alloc_shared([HB, block_I], dtype)     # P and dS of an even block, bf16
            ds_s0 = T.alloc_shared([HB, block_I], dtype)
            p_s1 = T.alloc_shared([HB, block_I], dtype)     # of an odd block
            ds_s1 = T.alloc_shared([HB, block_I], dtype)
            lse2 = T.alloc_fragment([HB], accum)
            delta = T.alloc_fragment([HB], accum)
            slot0 = T.alloc_fragment([block_I], T.int32)    # latent rows of the block, warpgroup 0
            slot1 = T.alloc_fragment([block_I], T.int32)    # the same, warpgroup 1
            kslot0 = T.alloc_fragment([block_I], T.int32)
            acc_s = T.alloc_fragment([HB, block_I], accum)
            acc_dp = T.alloc_fragment([HB, block_I], accum)
            p_frag = T.alloc_fragment([HB, block_I], dtype)
            acc_dq0 = [T.alloc_fragment([HB, chunk], accum) for _ in range(NC0)]
            acc_dq1 = [T.alloc_fragment([HB, chunk], accum) for _ in range(NC - NC0)]
            acc_dqt = T.alloc_fragment([HB, DT], accum)
            acc_kv0 = T.alloc_fragment([block_I, chunk], accum)
            acc_kv1 = T.alloc_fragment([block_I, chunk], accum)
            acc_kt = T.alloc_fragment([block_I, DT], accum)
            ready0 = T.alloc_barrier(arrive_count=128)
            ready1 = T.alloc_barrier(arrive_count=128)
            free0 = T.alloc_barrier(arrive_count=256)
            free1 = T.alloc_barrier(arrive_count=256)
            loaded = T.alloc_barrier(arrive_count=256)
            p_ready0 = T.alloc_barrier(arrive_count=128)    # P of an even block written (WG0)
            p_ready1 = T.alloc_barrier(arrive_count=128)
            p_free0 = T.alloc_barrier(arrive_count=128)     # ... and read for the last time (WG1)
            p_free1 = T.alloc_barrier(arrive_count=128)
            ds_ready0 = T.alloc_barrier(arrive_count=128)   # dS of an even block written (WG1)
            ds_ready1 = T.alloc_barrier(arrive_count=128)
            ds_free0 = T.alloc_barrier(arrive_count=128)    # ... and read for the last time (WG0)
            ds_free1 = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(nreg_s, 1)
                for c in CH:
                    T.copy(Q[s_i, :, c * chunk:(c + 1) * chunk], qc[c])
                T.copy(Q[s_i, :, D:], qt_s)
                T.fence_proxy_async()
                T.barrier_arrive(loaded)
                for h in T.Parallel(HB):
                    lse2[h] = Lse[s_i, h] * LOG2E
                for c in CH0:
                    T.clear(acc_dq0[c])
                T.clear(acc_dqt)
                T.barrier_wait(loaded, 0)
                for i2 in T.serial(NI // 2):
                    s_step(Idx, dKV, s_i, 2 * i2, qc, qt_s, doc, kvc0, kt0, p_s0, ds_s0, lse2, slot0, kslot0,
                           acc_s, acc_dq0, acc_dqt, acc_kv0, ready0, free0, p_ready0, p_free0,
                           ds_ready0, ds_free0)
                    s_step(Idx, dKV, s_i, 2 * i2 + 1, qc, qt_s, doc, kvc1, kt1, p_s1, ds_s1, lse2,
                           slot0, kslot0, acc_s, acc_dq0, acc_dqt, acc_kv0, ready1, free1, p_ready1, p_free1,
                           ds_ready1, ds_free1)
                for c in CH0:
                    T.copy(acc_dq0[c], dQ[s_i, :, c * chunk:(c + 1) * chunk])
                T.copy(acc_dqt, dQ[s_i, :, D:])
            elif tx < 256:
                T.set_max_nreg(nreg_dp, 1)
                for c in CH:
                    T.copy(dO[s_i, :, c * chunk:(c + 1) * chunk], doc[c])
                T.fence_proxy_async()
                T.barrier_arrive(loaded)
                for h in T.Parallel(HB):
                    delta[h] = Delta[s_i, h]
                for c in CHR:
                    T.clear(acc_dq1[c])
                T.barrier_wait(loaded, 0)
                for i2 in T.serial(NI // 2):
                    dp_step(Idx, dKV, s_i, 2 * i2, qc, qt_s, doc, kvc0, kt0, p_s0, ds_s0, delta,
                            slot1, acc_dp, p_frag, acc_dq1, acc_kv1, acc_kt, ready0, free0,
                            p_ready0, p_free0, ds_ready0, ds_free0)
                    dp_step(Idx, dKV, s_i, 2 * i2 + 1, qc, qt_s, doc, kvc1, kt1, p_s1, ds_s1, delta,
                            slot1, acc_dp, p_frag, acc_dq1, acc_kv1, acc_kt, ready1, free1,
                            p_ready1, p_free1, ds_ready1, ds_free1)
                for c in CHR:
                    T.copy(acc_dq1[c], dQ[s_i, :, (NC0 + c) * chunk:(NC0 + c + 1) * chunk])
            else:
                T.set_max_nreg(nreg_gather, 0)
                for i2 in T.serial(NI // 2):
                    T.barrier_wait(free0, (i2 & 1) ^ 1)
                    gather(KV, Idx, s_i, 2 * i2, kvc0, kt0, ready0)
                    T.barrier_wait(free1, (i2 & 1) ^ 1)
                    gather(KV, Idx, s_i, 2 * i2 + 1, kvc1, kt1, ready1)
                T.barrier_wait(ready0, (NI // 2 - 1) & 1)
                T.barrier_wait(ready1, (NI // 2 - 1) & 1)

    return sparse_mla_bwd_ws


def _compiler(build, pass_configs: dict):
    """A cached ``(heads, topk, sm_scale, target_arch, **tunables) -> kernel`` compiling ``build``'s kernel;
    one per kernel, so that tests and benchmarks can patch or wrap each."""
    @functools.lru_cache(maxsize=None)
    def compile_kernel(heads: int, topk: int, sm_scale: float, target_arch: str = "sm_90a", **tunables):
        return tilelang.compile(build(heads, topk, sm_scale, **tunables),
                                target={"kind": "cuda", "arch": target_arch}, pass_configs=pass_configs)
    compile_kernel.__name__ = compile_kernel.__qualname__ = f"compile_{build.__name__.removeprefix('build_')}"
    return compile_kernel


compile_sparse_mla_fwd = _compiler(build_sparse_mla_fwd, FWD_PASS_CONFIGS)
# the warp-specialised kernels are specialised by hand: TileLang's own (auto WS, TMA lowering) stays off, and
# the backward gets no shared-memory merging (all its buffers are live)
compile_sparse_mla_fwd_ws = _compiler(build_sparse_mla_fwd_ws, FWD_PASS_CONFIGS)
compile_sparse_mla_bwd_ws = _compiler(build_sparse_mla_bwd_ws, FWD_PASS_CONFIGS)
compile_sparse_mla_bwd = _compiler(build_sparse_mla_bwd, BWD_PASS_CONFIGS)


@functools.lru_cache(maxsize=None)
def compile_row_dot(dim: int, target_arch: str = "sm_90a"):
    return tilelang.compile(build_row_dot(dim), target={"kind": "cuda", "arch": target_arch},
                            pass_configs=FWD_PASS_CONFIGS)


def ci_builds(target_arch: str = "sm_90a") -> dict:
    """name -> thunk building (not running) one kernel of this family for `target_arch` (CI), through the
    same compile functions the launchers call (uncached). One head count (64, GLM-5.2's) per kernel; other
    head counts change only the tile sizes."""
    scale = 576 ** -0.5
    ws = {"block_I": BWD_WS_BLOCK_I, "chunk": BWD_WS_CHUNK}
    builds = {
        "sparse_mla_fwd[h64,k2048]": (compile_sparse_mla_fwd, {"block_I": FWD_BLOCK_I}),
        "sparse_mla_fwd_ws[h64,k2048]": (compile_sparse_mla_fwd_ws, {"block_I": FWD_BLOCK_I}),
        "sparse_mla_bwd[h64,k2048]": (compile_sparse_mla_bwd, bwd_tunables(64)),
        "sparse_mla_bwd_ws[h64,k2048]": (compile_sparse_mla_bwd_ws, ws),
        "sparse_mla_bwd_ws_chunk128[h64,k2048]": (compile_sparse_mla_bwd_ws, {**ws, "chunk": 128}),  # bench sweep
    }
    thunks = {name: functools.partial(fn.__wrapped__, 64, 2048, scale, target_arch, **tun)
              for name, (fn, tun) in builds.items()}
    thunks["row_dot[d512]"] = functools.partial(compile_row_dot.__wrapped__, 512, target_arch)
    return thunks


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------
FWD_BLOCK_I = 64
# Forward kernel for 64 padded heads (GLM-5.2's), read at every call (a benchmark may patch it):
# "serial" = build_sparse_mla_fwd, "pipelined" = build_sparse_mla_fwd_ws (warp-specialised). Other
# head counts (and d_v not a multiple of 128) always run the serial kernel. H200, 64 heads, S=16K, top-k
# 2048: pipelined 10.16 ms / 460 TFLOP/s (benchmarks/results/sparse_mla_16k_h200.json) against 14.91 ms / 313
# serial (docs/kernels.md); both pass tests/gpu/test_sparse_mla_cuda.py.
FWD_KERNEL = "pipelined"


# Backward kernel for 64 padded heads, read at every call like FWD_KERNEL: "serial" =
# build_sparse_mla_bwd, "pipelined" = build_sparse_mla_bwd_ws (warp-specialised; d_v a multiple of 256,
# topk padded to a multiple of 2 * BWD_WS_BLOCK_I). Other head counts always run the serial kernel.
# H200, 64 heads, S=16K, top-k 2048: pipelined 52.8 ms / 224 TFLOP/s, serial 71.7 ms / 165
# (benchmarks/results/sparse_mla_16k_h200.json). Both pass the GPU tests.
BWD_KERNEL = "pipelined"
BWD_WS_BLOCK_I = 32
BWD_WS_CHUNK = 64       # latent columns per shared piece of Q / dO / KV


def bwd_tunables(padded_h: int) -> dict:
    """Backward tile choice: a 16/32-head block cannot feed 8 warps with 32-slot tiles."""
    if padded_h < 64:
        return {"block_I": 64, "threads": 128}
    return {"block_I": 32, "threads": 256}


def _takes(q: torch.Tensor, kv: torch.Tensor, d_v: int, op: str) -> bool:
    """Whether the TileLang kernels take these (valid) inputs; warns once per op when they do not (the
    caller then runs the PyTorch kernel)."""
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        warn_once(f"{op}:dtype", f"{op}: the TileLang kernel takes bfloat16 q and kv; {q.dtype} / {kv.dtype} "
                                 f"inputs run the PyTorch reference kernel (slower) instead")
        return False
    if q.shape[-1] - d_v != 64 or d_v % 64:
        warn_once(f"{op}:shape", f"{op}: the TileLang kernel wants a 64-wide rope tail (Dqk = d_v + 64, d_v "
                                 f"a multiple of 64); Dqk={q.shape[-1]}, d_v={d_v} run the PyTorch reference "
                                 f"kernel (slower) instead")
        return False
    return True


def _prep_indices(indices: torch.Tensor, block: int) -> torch.Tensor:
    topk = indices.shape[1]
    return pad_dim(indices.to(torch.int32), 1, round_up(max(topk, 1), block), value=-1)


def sparse_mla_tl(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                  d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA kernel of `glm52::sparse_mla`: out [S, H, d_v] bf16, lse [S, H] fp32 (natural log), for bf16
    q and kv (other inputs: the PyTorch kernel, see :func:`_takes`)."""
    _check(q, kv, indices, d_v)
    if not _takes(q, kv, d_v, "glm52::sparse_mla"):
        return _sparse_mla_fwd_kernel(q, kv, indices, sm_scale, d_v)
    S, H, Dqk = q.shape
    Hp = padded_heads(H)
    if FWD_KERNEL not in ("serial", "pipelined"):
        raise ValueError(f"sparse_mla_tl: FWD_KERNEL must be 'serial' or 'pipelined', got {FWD_KERNEL!r}")
    pipelined = FWD_KERNEL == "pipelined" and Hp == 64 and d_v % 128 == 0
    # the pipelined kernel walks the slots two blocks (one per shared stage) at a time
    idx = _prep_indices(indices, 2 * FWD_BLOCK_I if pipelined else FWD_BLOCK_I)
    qp = pad_dim(q, 1, Hp)
    compile_fwd = compile_sparse_mla_fwd_ws if pipelined else compile_sparse_mla_fwd
    kernel = compile_fwd(Hp, idx.shape[1], float(sm_scale), cuda_target(q.device)["arch"],
                         dim_qk=Dqk, dim_v=d_v, block_I=FWD_BLOCK_I)
    out = torch.empty(S, Hp, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(S, Hp, dtype=torch.float32, device=q.device)
    if S:
        kernel(qp, kv.contiguous(), idx, out, lse)
    if Hp != H:
        out, lse = out[:, :H].contiguous(), lse[:, :H].contiguous()
    return out, lse


# delta = rowsum(out * dout) in fp32 before the backward kernel, read at every call like BWD_KERNEL: "pytorch" =
# fp32 copies and a sum, _ROW_DOT_BYTES of temporaries at a time (three fp32 passes over the tensors), "tilelang"
# = build_row_dot (one read of each bf16 tensor, no temporaries); both pass the GPU tests'
# comparison with a float64 sum, and `benchmarks/bench_kernels.py --mla-seq` times them side by side.
DELTA_KERNEL = "pytorch"
_ROW_DOT_BYTES = 256 << 20  # fp32 temporaries of one chunk of rows ("pytorch")


def _rows16(x: torch.Tensor, d_v: int) -> torch.Tensor:
    """``x`` as contiguous bf16 [rows, d_v] whose data is 16-byte aligned (the kernel's vector loads)."""
    x = x.to(torch.bfloat16).contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    return x.view(-1, d_v)


def _row_dot(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """sum(out * dout, -1) in fp32, [S, H], for [S, H, d_v] out and dout, by `DELTA_KERNEL`: the PyTorch form a
    chunk of rows at a time, so the fp32 copies of the two tensors (twice their bf16 bytes each) never exist
    whole, or one kernel over the bf16 tensors."""
    if DELTA_KERNEL not in ("pytorch", "tilelang"):
        raise ValueError(f"sparse_mla_bwd_tl: DELTA_KERNEL must be 'pytorch' or 'tilelang', got {DELTA_KERNEL!r}")
    S, d_v = out.shape[0], out.shape[-1]
    delta = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    if not delta.numel():
        return delta
    if DELTA_KERNEL == "tilelang":
        kernel = compile_row_dot(d_v, cuda_target(out.device)["arch"])
        kernel(_rows16(out, d_v), _rows16(dout, d_v), delta.view(-1))
        return delta
    rows = max(1, _ROW_DOT_BYTES // max(1, 4 * out[0].numel()))
    for a in range(0, S, rows):
        b = min(S, a + rows)
        torch.sum(out[a:b].float() * dout[a:b].float(), -1, out=delta[a:b])
    return delta


def sparse_mla_bwd_tl(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                      indices: torch.Tensor, lse: torch.Tensor, sm_scale: float,
                      d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA kernel of `glm52::sparse_mla_bwd`: dq like q, dkv like kv, for bf16 q and kv (other inputs:
    the PyTorch kernel, see :func:`_takes`)."""
    _check(q, kv, indices, d_v)
    if not _takes(q, kv, d_v, "glm52::sparse_mla_bwd"):
        return _sparse_mla_bwd_kernel(q, kv, out, dout, indices, lse, sm_scale, d_v)
    S, H, Dqk = q.shape
    Hp = padded_heads(H)
    if BWD_KERNEL not in ("serial", "pipelined"):
        raise ValueError(f"sparse_mla_bwd_tl: BWD_KERNEL must be 'serial' or 'pipelined', got {BWD_KERNEL!r}")
    pipelined = BWD_KERNEL == "pipelined" and Hp == 64 and d_v % 256 == 0
    if pipelined:
        # two shared stages: the pipelined kernel walks the slots two blocks at a time
        tun = {"block_I": BWD_WS_BLOCK_I, "chunk": BWD_WS_CHUNK}
        idx = _prep_indices(indices, 2 * BWD_WS_BLOCK_I)
        compile_bwd = compile_sparse_mla_bwd_ws
    else:
        tun = bwd_tunables(Hp)
        idx = _prep_indices(indices, tun["block_I"])
        compile_bwd = compile_sparse_mla_bwd
    delta = _row_dot(out, dout)  # [S, H]
    qp = pad_dim(q, 1, Hp)
    dop = pad_dim(dout.to(torch.bfloat16), 1, Hp)
    lsep = pad_dim(lse.float(), 1, Hp)
    deltap = pad_dim(delta, 1, Hp)
    kernel = compile_bwd(Hp, idx.shape[1], float(sm_scale), cuda_target(q.device)["arch"],
                         dim_qk=Dqk, dim_v=d_v, **tun)
    dq = torch.empty(S, Hp, Dqk, dtype=torch.bfloat16, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    if S:
        kernel(qp, kv.contiguous(), dop, idx, lsep, deltap, dq, dkv)
    if Hp != H:
        dq = dq[:, :H].contiguous()
    return dq, dkv.to(kv.dtype)


def sparse_mla_flops(S: int, H: int, topk: int, dim_qk: int = 576, dim_v: int = 512) -> tuple[int, int]:
    """(forward, backward) FLOPs, counting every slot as valid."""
    fwd = 2 * S * H * topk * (dim_qk + dim_v)
    bwd = 2 * S * H * topk * (dim_qk + dim_v + dim_qk + dim_qk + dim_v)
    return fwd, bwd


def register() -> None:
    torch.library.register_kernel("glm52::sparse_mla", "cuda")(sparse_mla_tl)
    torch.library.register_kernel("glm52::sparse_mla_bwd", "cuda")(sparse_mla_bwd_tl)


__all__ = ["sparse_mla_tl", "sparse_mla_bwd_tl", "sparse_mla_flops", "register"]
