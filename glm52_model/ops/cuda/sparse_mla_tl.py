"""TileLang kernels for `glm52::sparse_mla` and `glm52::sparse_mla_bwd` (absorbed sparse MLA).

Every query attends to the `topk` latent rows named in its index row (-1 = masked slot). Keys are the
full 576-wide latent (512 kv_lora + 64 rope), values its first 512 columns; one latent per token is
shared by all heads. Heads are processed in blocks of up to 64 (padded up to a power of two >= 16),
so a CTA is (query, head block); key slots stream through shared memory `block_I` at a time.

Forward: online softmax in base 2, out = P V, lse natural log (+inf for a row with no valid slot). Two kernels:
the serial one (:func:`build_sparse_mla_fwd`: all threads gather a slot block, then its scores, the softmax step
and P V in turn) and, for 64 heads, a warp-specialised one (:func:`build_sparse_mla_fwd_ws`: a producer warpgroup
gathers with cp.async into two shared stages while two consumer warpgroups split the softmax and P V).
Backward: delta = rowsum(out * dout) in fp32 first (:func:`row_dot`, PyTorch ops a chunk of rows at a time), then
dq per CTA in registers and dkv accumulated with fp32 atomics into a [Sk, 576] buffer, cast to bf16 afterwards.
Two kernels: the serial one (:func:`build_sparse_mla_bwd`: all threads gather, then the GEMM chain) and, for 64
heads, a warp-specialised one (:func:`build_sparse_mla_bwd_ws`: a producer warpgroup gathering into two stages; one
consumer warpgroup computes S / P while the other computes dP, then they split the dKV and dQ GEMMs by latent
columns). Which kernels the launchers run, and their tunables: :class:`SparseMlaConfig`. The measured alternatives
are in docs/kernels.md.
"""

import functools
from dataclasses import dataclass, field

import torch

import tilelang
import tilelang.language as T

from ..sparse_mla import _check, _sparse_mla_bwd_kernel, _sparse_mla_fwd_kernel
from ._common import cuda_target, next_pow2, nondeterministic, pad_dim, round_up, warn_once
from .ahead import kernel_cache, on_trace, static

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
# configs
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FwdConfig:
    """The serial forward's tunables."""

    block_I: int = 64       # key slots a block in shared memory
    num_stages: int = 2     # TileLang's software pipeline over the slot blocks
    threads: int = 256


@dataclass(frozen=True)
class FwdWsConfig:
    """The warp-specialised forward's tunables: the slot block and each warpgroup's registers (the split must sum
    to <= 504, 168 x 3 at launch)."""

    block_I: int = 64
    nreg_softmax: int = 240  # warpgroup 0: S, the softmax, P V of the value columns' first half
    nreg_pv: int = 168       # warpgroup 1: P V of the second half
    nreg_gather: int = 96    # warpgroup 2: the producer's gathers (a multiple of 8)


@dataclass(frozen=True)
class BwdConfig:
    """The serial backward's tunables."""

    block_I: int = 32
    num_stages: int = 0
    threads: int = 256
    split_store: int = 2     # the dKV block leaves shared memory in this many parts (block_I a multiple)


@dataclass(frozen=True)
class BwdWsConfig:
    """The warp-specialised backward's tunables (the register split must sum to <= 504)."""

    block_I: int = 32
    chunk: int = 64          # latent columns a shared piece of Q / dO / KV (64: fewer spills than 128)
    nreg_s: int = 232        # warpgroup 0: S, P, half the dKV and dQ GEMMs
    nreg_dp: int = 232       # warpgroup 1: dP, dS, the other half
    nreg_gather: int = 40    # warpgroup 2: the producer's gathers (a multiple of 8)


@dataclass(frozen=True)
class SparseMlaConfig:
    """Which kernels :func:`sparse_mla_tl` / :func:`sparse_mla_bwd_tl` run and their tunables; the defaults are the
    ops' (the CUDA kernels of ``glm52::sparse_mla`` / ``glm52::sparse_mla_bwd`` always run them)."""

    pipelined_fwd: bool = True  # 64 padded heads, d_v a multiple of 128: the warp-specialised forward
    pipelined_bwd: bool = True  # 64 padded heads, d_v a multiple of 256: the warp-specialised backward
    fwd: FwdConfig = field(default_factory=FwdConfig)
    fwd_ws: FwdWsConfig = field(default_factory=FwdWsConfig)
    bwd: BwdConfig = field(default_factory=BwdConfig)
    # 16 / 32 padded heads: a 16/32-head block cannot feed 8 warps with 32-slot tiles
    bwd_few_heads: BwdConfig = field(default_factory=lambda: BwdConfig(block_I=64, threads=128))
    bwd_ws: BwdWsConfig = field(default_factory=BwdWsConfig)
    delta_chunk_bytes: int = 256 << 20  # fp32 temporaries of one chunk of rows of delta (three passes over them)

    def serial_bwd(self, padded_h: int) -> BwdConfig:
        """The serial backward's tunables at ``padded_h`` heads."""
        return self.bwd_few_heads if padded_h < 64 else self.bwd


@dataclass(frozen=True)
class _Tiles:
    """One build's sizes (the stage macros' first argument)."""

    HB: int             # heads a CTA
    block_I: int        # key slots a block
    NI: int             # slot blocks a query
    D: int              # value columns (dim_v)
    DT: int             # rope columns (dim_qk - dim_v)
    sm_scale: float
    chunk: int = 0      # latent columns a shared piece (the warp-specialised backward)

    @property
    def scale2(self) -> float:      # scores to base-2 exponents
        return self.sm_scale * LOG2E

    @property
    def DH(self) -> int:            # value columns per consumer warpgroup (the warp-specialised forward)
        return self.D // 2

    @property
    def CH(self) -> list:           # value chunks of Q, dO and each KV stage (Python-unrolled)
        return list(range(self.D // self.chunk))

    @property
    def CH0(self) -> list:          # warpgroup 0's dKV / dQ chunks ...
        return self.CH[:len(self.CH) // 2]

    @property
    def CH1(self) -> list:          # ... and warpgroup 1's
        return self.CH[len(self.CH) // 2:]


# --------------------------------------------------------------------------------------------------
# stages the kernels share
# --------------------------------------------------------------------------------------------------
@T.macro
def slot_valid(t, Idx, s_i, it, valid):
    """valid[i] <- slot i of block `it` names a latent row."""
    for i in T.Parallel(t.block_I):
        valid[i] = Idx[s_i, it * t.block_I + i] >= 0


@T.macro
def gather_slots(t, KV, Idx, s_i, it, kv_s, kt_s):
    """The latent rows of slot block `it` to shared memory, values and rope tail (a masked slot reads row 0)."""
    for i, d in T.Parallel(t.block_I, t.D):
        kv_s[i, d] = KV[T.max(Idx[s_i, it * t.block_I + i], 0), d]
    for i, d in T.Parallel(t.block_I, t.DT):
        kt_s[i, d] = KV[T.max(Idx[s_i, it * t.block_I + i], 0), t.D + d]


@T.macro
def mask_scores(t, valid, acc):
    """acc [heads, slots] <- 0 for a valid slot, -inf for a masked one (the scores' GEMMs accumulate onto it)."""
    for h, i in T.Parallel(t.HB, t.block_I):
        acc[h, i] = T.if_then_else(valid[i], 0, -T.infinity(T.float32))


@T.macro
def online_softmax(scale2, acc_s, acc_o, m, m_prev, alpha, l_sum, l_blk):
    """The forward kernels' online-softmax step for one slot block, in base 2 (``scale2`` = sm_scale * log2 e):
    the running max ``m`` and sum ``l_sum`` take the block's scores ``acc_s`` [heads, slots], which become the
    block's unnormalised probabilities, and the output accumulator ``acc_o`` [heads, cols] is rescaled by
    ``alpha``."""
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


@T.macro
def normalise(t, cols, acc_o, l_sum):
    """out = acc_o / l_sum (0 for a row with no valid slot)."""
    for h, d in T.Parallel(t.HB, cols):
        acc_o[h, d] = T.if_then_else(l_sum[h] > 0, acc_o[h, d] / l_sum[h], 0)


@T.macro
def row_lse(t, l_sum, m):
    """l_sum <- the rows' lse, natural log: +inf for a row with no valid slot, as the reference (exp(s - lse) = 0)."""
    for h in T.Parallel(t.HB):
        l_sum[h] = T.if_then_else(l_sum[h] > 0, (T.log2(l_sum[h]) + m[h] * t.scale2) * LN2, T.infinity(T.float32))


# --------------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------------
def build_sparse_mla_fwd(heads: int, topk: int, sm_scale: float, *, dim_qk: int = 576, dim_v: int = 512,
                         config: FwdConfig = FwdConfig()):
    """Forward. `heads` must be padded (see `padded_heads`), `topk` a multiple of block_I."""
    block_I = config.block_I
    assert heads == padded_heads(heads) and topk % block_I == 0
    t = _Tiles(HB=min(heads, 64), block_I=block_I, NI=topk // block_I, D=dim_v, DT=dim_qk - dim_v,
               sm_scale=sm_scale)
    HB, D, DT = t.HB, t.D, t.DT
    NHB = heads // HB
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
        with T.Kernel(seq * NHB, threads=config.threads) as bx:
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

            for it in T.Pipelined(t.NI, num_stages=config.num_stages):
                slot_valid(t, Idx, s_i, it, valid)
                gather_slots(t, KV, Idx, s_i, it, kv_s, kt_s)
                mask_scores(t, valid, acc_s)
                T.gemm(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                online_softmax(t.scale2, acc_s, acc_o, m, m_prev, alpha, l_sum, l_blk)
                T.copy(acc_s, p_s)
                T.gemm(p_s, kv_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            normalise(t, D, acc_o, l_sum)
            row_lse(t, l_sum, m)
            T.copy(acc_o, Out[s_i, h0:h0 + HB, :])
            T.copy(l_sum, Lse[s_i, h0:h0 + HB])

    return sparse_mla_fwd


@dataclass(frozen=True, eq=False)
class _FwdStage:
    """One shared stage of the warp-specialised forward: a slot block's gathered latent rows and its barriers."""

    kv_l: object        # [block_I, D/2] values, warpgroup 0's half
    kv_r: object        # [block_I, D/2] values, warpgroup 1's half
    kt: object          # [block_I, DT] rope tail
    ready: object       # the producer's copies have landed
    free: object        # both consumers are done with it


@T.macro
def fwd_gather(t, KV, Idx, s_i, it, st):
    """Producer: the latent rows of slot block `it` into stage `st` with cp.async (16 B a copy, zero fill for a
    masked slot), without TileLang's commit + wait: the arrive on `st.ready` fires once they have landed."""
    for i, d in T.Parallel(t.block_I, t.DH, annotations=ASYNC_GATHER):
        st.kv_l[i, d] = T.if_then_else(Idx[s_i, it * t.block_I + i] >= 0, KV[Idx[s_i, it * t.block_I + i], d], 0)
    for i, d in T.Parallel(t.block_I, t.DH, annotations=ASYNC_GATHER):
        st.kv_r[i, d] = T.if_then_else(Idx[s_i, it * t.block_I + i] >= 0,
                                       KV[Idx[s_i, it * t.block_I + i], t.DH + d], 0)
    for i, d in T.Parallel(t.block_I, t.DT, annotations=ASYNC_GATHER):
        st.kt[i, d] = T.if_then_else(Idx[s_i, it * t.block_I + i] >= 0, KV[Idx[s_i, it * t.block_I + i], t.D + d], 0)
    T.cp_async_barrier_noinc(st.ready)


@T.macro
def fwd_softmax_step(t, Idx, s_i, it, st, q_l, q_r, qt_s, p_s, alpha_s, valid, acc_s, acc_o, m, m_prev, alpha,
                     l_sum, l_blk, p_ready, p_free):
    """Warpgroup 0, slot block `it` in stage `st`: S = Q K^T as three wgmma chains (value halves + rope tail), the
    online softmax, P (bf16) and alpha to shared memory for warpgroup 1 (once it is done with block it - 1), then
    O[:, :D/2] += P V_l. The index loads precede the wait."""
    slot_valid(t, Idx, s_i, it, valid)
    T.barrier_wait(st.ready, (it // 2) & 1)
    mask_scores(t, valid, acc_s)
    T.gemm(q_l, st.kv_l, acc_s, transpose_B=True, annotations={"wg_wait": -1})
    T.gemm(q_r, st.kv_r, acc_s, transpose_B=True, annotations={"wg_wait": -1})
    T.gemm(qt_s, st.kt, acc_s, transpose_B=True, annotations={"wg_wait": -1})
    T.wait_wgmma(0)
    online_softmax(t.scale2, acc_s, acc_o, m, m_prev, alpha, l_sum, l_blk)
    T.barrier_wait(p_free, (it & 1) ^ 1)          # warpgroup 1 is done with P of block it - 1
    T.copy(alpha, alpha_s)
    T.copy(acc_s, p_s)
    T.fence_proxy_async()                         # P is read by warpgroup 1's wgmma
    T.barrier_arrive(p_ready)
    T.gemm(p_s, st.kv_l, acc_o)
    T.barrier_arrive(st.free)


@T.macro
def fwd_pv_step(t, it, st, p_s, alpha_s, acc_o, p_ready, p_free):
    """Warpgroup 1, slot block `it`: its half of O rescaled by warpgroup 0's alpha, O[:, D/2:] += P V_r."""
    T.barrier_wait(p_ready, it & 1)
    for h, d in T.Parallel(t.HB, t.DH):
        acc_o[h, d] = acc_o[h, d] * alpha_s[h]
    T.gemm(p_s, st.kv_r, acc_o)
    T.barrier_arrive(p_free)
    T.barrier_arrive(st.free)


@T.macro
def producer(t, gather, KV, Idx, s_i, st0, st1):
    """Warpgroup 2 of the warp-specialised kernels: the slot blocks two at a time, each into its stage by
    ``gather`` once the consumers have freed it; then it stays until the last copies have landed (the consumers
    wait on the same phases)."""
    for i2 in T.serial(t.NI // 2):
        T.barrier_wait(st0.free, (i2 & 1) ^ 1)
        gather(t, KV, Idx, s_i, 2 * i2, st0)
        T.barrier_wait(st1.free, (i2 & 1) ^ 1)
        gather(t, KV, Idx, s_i, 2 * i2 + 1, st1)
    T.barrier_wait(st0.ready, (t.NI // 2 - 1) & 1)
    T.barrier_wait(st1.ready, (t.NI // 2 - 1) & 1)


def build_sparse_mla_fwd_ws(heads: int, topk: int, sm_scale: float, *, dim_qk: int = 576, dim_v: int = 512,
                            config: FwdWsConfig = FwdWsConfig()):
    """Warp-specialised, pipelined forward for one 64-head block (GLM-5.2's heads): the signature and results of
    `build_sparse_mla_fwd`; one CTA per query, 384 threads in three warpgroups: warpgroup 2 gathers slot blocks
    into two shared stages (:func:`producer`, :func:`fwd_gather`), warpgroup 0 loads Q and runs S, the softmax and P V of the value
    columns' first half (:func:`fwd_softmax_step`), warpgroup 1 P V of the second half (:func:`fwd_pv_step`), so S
    of block it+1 overlaps P V_r of block it. Q plus two stages of block_I x 576 bf16 use 224 KiB of shared
    memory: two stages, and `topk` a multiple of 2 * block_I.
    """
    block_I = config.block_I
    assert heads == 64, "the warp-specialised forward is laid out for one 64-head block"
    assert topk % (2 * block_I) == 0 and block_I % 16 == 0
    assert config.nreg_softmax + config.nreg_pv + config.nreg_gather <= 504 and config.nreg_gather % 8 == 0
    t = _Tiles(HB=heads, block_I=block_I, NI=topk // block_I, D=dim_v, DT=dim_qk - dim_v, sm_scale=sm_scale)
    assert t.D % 128 == 0 and t.DT % 8 == 0
    HB, D, DH, DT = t.HB, t.D, t.DH, t.DT
    seq = T.dynamic("seq")
    seq_kv = T.dynamic("seq_kv")
    dtype, accum = T.bfloat16, T.float32

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
            st0 = _FwdStage(kv_l0, kv_r0, kt0, ready0, free0)
            st1 = _FwdStage(kv_l1, kv_r1, kt1, ready1, free1)

            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(config.nreg_softmax, 1)
                # Q [64, 576] by warpgroup 0 alone (its only reader), while the producer gathers
                T.copy(Q[s_i, :, :DH], q_l)
                T.copy(Q[s_i, :, DH:D], q_r)
                T.copy(Q[s_i, :, D:], qt_s)
                T.fence_proxy_async()
                T.fill(acc_o_l, 0)
                T.fill(l_sum, 0)
                T.fill(m, -(2.0**30))
                for i2 in T.serial(t.NI // 2):
                    fwd_softmax_step(t, Idx, s_i, 2 * i2, st0, q_l, q_r, qt_s, p_s, alpha_s, valid, acc_s, acc_o_l, m,
                                     m_prev, alpha, l_sum, l_blk, p_ready, p_free)
                    fwd_softmax_step(t, Idx, s_i, 2 * i2 + 1, st1, q_l, q_r, qt_s, p_s, alpha_s, valid, acc_s,
                                     acc_o_l, m, m_prev, alpha, l_sum, l_blk, p_ready, p_free)
                T.copy(l_sum, sum_s)
                T.barrier_arrive(done)
                normalise(t, DH, acc_o_l, l_sum)
                row_lse(t, l_sum, m)
                T.copy(acc_o_l, Out[s_i, :, :DH])
                T.copy(l_sum, Lse[s_i, :])
            elif tx < 256:
                T.set_max_nreg(config.nreg_pv, 1)
                T.fill(acc_o_r, 0)
                for i2 in T.serial(t.NI // 2):
                    fwd_pv_step(t, 2 * i2, st0, p_s, alpha_s, acc_o_r, p_ready, p_free)
                    fwd_pv_step(t, 2 * i2 + 1, st1, p_s, alpha_s, acc_o_r, p_ready, p_free)
                T.barrier_wait(done, 0)
                normalise(t, DH, acc_o_r, sum_s)
                T.copy(acc_o_r, Out[s_i, :, DH:])
            else:
                T.set_max_nreg(config.nreg_gather, 0)
                producer(t, fwd_gather, KV, Idx, s_i, st0, st1)

    return sparse_mla_fwd_ws


# --------------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------------
@T.macro
def bwd_load_row(t, Q, dO, Lse, Delta, s_i, h0, q_s, qt_s, do_s, lse2, delta):
    """The CTA's queries (value columns and rope tail), their output gradients, lse (base 2) and delta."""
    T.copy(Q[s_i, h0:h0 + t.HB, :t.D], q_s)
    T.copy(Q[s_i, h0:h0 + t.HB, t.D:], qt_s)
    T.copy(dO[s_i, h0:h0 + t.HB, :], do_s)
    for h in T.Parallel(t.HB):
        lse2[h] = Lse[s_i, h0 + h] * LOG2E
        delta[h] = Delta[s_i, h0 + h]


@T.macro
def bwd_probabilities(t, q_s, qt_s, kv_s, kt_s, lse2, acc_p, p_s):
    """P = exp(S - lse) of the slot block (S accumulated onto the mask), to shared memory as bf16 too."""
    T.gemm(q_s, kv_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
    T.gemm(qt_s, kt_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
    for h, i in T.Parallel(t.HB, t.block_I):
        acc_p[h, i] = T.exp2(acc_p[h, i] * t.scale2 - lse2[h])
    T.copy(acc_p, p_s)


@T.macro
def bwd_score_grads(t, do_s, kv_s, acc_p, delta, acc_dp, ds_s):
    """dS = P (dP - delta) scale, dP = dO V^T; to shared memory as bf16."""
    T.gemm(do_s, kv_s, acc_dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
    for h, i in T.Parallel(t.HB, t.block_I):
        acc_dp[h, i] = acc_p[h, i] * (acc_dp[h, i] - delta[h]) * t.sm_scale
    T.copy(acc_dp, ds_s)


@T.macro
def bwd_latent_grads(ds_s, p_s, q_s, qt_s, do_s, kv_s, kt_s, acc_dq, acc_dqt, acc_dkv, acc_dkt):
    """dQ += dS K (values and rope tail); the block's dKV = dS^T Q + P^T dO and its rope tail dS^T Q_rope."""
    T.gemm(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullCol)
    T.gemm(ds_s, kt_s, acc_dqt, policy=T.GemmWarpPolicy.FullCol)
    T.gemm(ds_s, q_s, acc_dkv, transpose_A=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
    T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
    T.gemm(ds_s, qt_s, acc_dkt, transpose_A=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)


@T.macro
def bwd_scatter_dkv(t, split_store, dKV, Idx, s_i, it, acc_dkv, acc_dkt, dkv_s, dkt_s):
    """The block's dKV rows into dKV[slot] with fp32 vector atomics, `split_store` parts of the slots through
    shared memory one after the other (masked slots skipped)."""
    BS = t.block_I // split_store
    for part in T.serial(split_store):
        for i, d in T.Parallel(t.block_I, t.D):
            if i // BS == part:
                dkv_s[i % BS, d] = acc_dkv[i, d]
        for i, d in T.Parallel(t.block_I, t.DT):
            if i // BS == part:
                dkt_s[i % BS, d] = acc_dkt[i, d]
        for i, d4 in T.Parallel(BS, t.D // 4):
            if Idx[s_i, it * t.block_I + part * BS + i] >= 0:
                T.atomic_addx4(dKV[Idx[s_i, it * t.block_I + part * BS + i], d4 * 4], dkv_s[i, d4 * 4])
        for i, d4 in T.Parallel(BS, t.DT // 4):
            if Idx[s_i, it * t.block_I + part * BS + i] >= 0:
                T.atomic_addx4(dKV[Idx[s_i, it * t.block_I + part * BS + i], t.D + d4 * 4], dkt_s[i, d4 * 4])


def build_sparse_mla_bwd(heads: int, topk: int, sm_scale: float, *, dim_qk: int = 576, dim_v: int = 512,
                         config: BwdConfig = BwdConfig()):
    """Backward: dq [seq, heads, 576] bf16 and fp32 dkv accumulated in place ([seq_kv, 576],
    zero-initialised by the caller). `heads` padded, `topk` a multiple of block_I."""
    block_I, split_store = config.block_I, config.split_store
    assert heads == padded_heads(heads) and topk % block_I == 0 and block_I % split_store == 0
    t = _Tiles(HB=min(heads, 64), block_I=block_I, NI=topk // block_I, D=dim_v, DT=dim_qk - dim_v,
               sm_scale=sm_scale)
    HB, D, DT = t.HB, t.D, t.DT
    NHB = heads // HB
    BS = block_I // split_store
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
        with T.Kernel(seq * NHB, threads=config.threads) as bx:
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
            bwd_load_row(t, Q, dO, Lse, Delta, s_i, h0, q_s, qt_s, do_s, lse2, delta)
            T.clear(acc_dq)
            T.clear(acc_dqt)

            for it in T.Pipelined(t.NI, num_stages=config.num_stages):
                slot_valid(t, Idx, s_i, it, valid)
                mask_scores(t, valid, acc_p)
                gather_slots(t, KV, Idx, s_i, it, kv_s, kt_s)
                bwd_probabilities(t, q_s, qt_s, kv_s, kt_s, lse2, acc_p, p_s)
                bwd_score_grads(t, do_s, kv_s, acc_p, delta, acc_dp, ds_s)
                bwd_latent_grads(ds_s, p_s, q_s, qt_s, do_s, kv_s, kt_s, acc_dq, acc_dqt, acc_dkv, acc_dkt)
                bwd_scatter_dkv(t, split_store, dKV, Idx, s_i, it, acc_dkv, acc_dkt, dkv_s, dkt_s)

            T.copy(acc_dq, dQ[s_i, h0:h0 + HB, :D])
            T.copy(acc_dqt, dQ[s_i, h0:h0 + HB, D:])

    return sparse_mla_bwd


@dataclass(frozen=True, eq=False)
class _BwdStage:
    """One shared stage of the warp-specialised backward: a slot block's gathered latent rows, its P and dS, and
    their barriers."""

    kvc: list           # [block_I, chunk] value pieces
    kt: object          # [block_I, DT] rope tail
    p_s: object         # P of the block, bf16
    ds_s: object        # dS of the block, bf16
    ready: object       # the producer's copies have landed
    free: object        # both consumers are done with the rows
    p_ready: object     # P written (warpgroup 0) ...
    p_free: object      # ... and read for the last time (warpgroup 1)
    ds_ready: object    # dS written (warpgroup 1) ...
    ds_free: object     # ... and read for the last time (warpgroup 0)


@T.macro
def bwd_gather(t, KV, Idx, s_i, it, st):
    """Producer: the latent rows of slot block `it` into stage `st` with cp.async (zero fill for a masked slot);
    the arrive on `st.ready` fires once they have landed."""
    for c in t.CH:
        for i, d in T.Parallel(t.block_I, t.chunk, annotations=ASYNC_GATHER):
            st.kvc[c][i, d] = T.if_then_else(Idx[s_i, it * t.block_I + i] >= 0,
                                             KV[Idx[s_i, it * t.block_I + i], c * t.chunk + d], 0)
    for i, d in T.Parallel(t.block_I, t.DT, annotations=ASYNC_GATHER):
        st.kt[i, d] = T.if_then_else(Idx[s_i, it * t.block_I + i] >= 0, KV[Idx[s_i, it * t.block_I + i], t.D + d], 0)
    T.cp_async_barrier_noinc(st.ready)


@T.macro
def bwd_scatter(t, dKV, slot, col0, ncols, acc):
    """acc = dKV [block_I slots, ncols latent], to dKV[slot, col0:col0 + ncols] as paired fp32 atomics; `slot`
    holds the block's latent rows (-1 masked) in registers, loaded once per block."""
    for j, l2 in T.Parallel(t.block_I, ncols // 2):
        if slot[j] >= 0:
            T.atomic_addx2(dKV[slot[j], col0 + 2 * l2], acc[j, 2 * l2])


@T.macro
def dkv_gemm(a_t, b_s, acc, clear):
    """dKV += b_s^T a_t ([slots, cols])."""
    T.gemm(b_s, a_t, acc, transpose_A=True, clear_accum=clear)


@T.macro
def bwd_s_step(t, Idx, dKV, s_i, it, st, qc, qt_s, doc, lse2, slot, kslot, acc_s, acc_dq, acc_dqt, acc_kv):
    """Warpgroup 0, slot block `it` in stage `st`: S = Q K^T, P = exp(S - lse) -> st.p_s (once warpgroup 1 is done
    with P of block it - 2); dKV[c] = P^T dO_c for the value chunks c < NC/2 (its first GEMM overlaps warpgroup 1
    forming dS), then after dS: dKV[c] += dS^T Q_c, atomics; dQ[:, :D/2] and dQ_rope += dS K. The index loads
    precede the wait; `kslot`: the same rows in the dKV accumulator's layout."""
    for i in T.Parallel(t.block_I):
        slot[i] = Idx[s_i, it * t.block_I + i]
    for i in T.Parallel(t.block_I):
        kslot[i] = Idx[s_i, it * t.block_I + i]
    T.barrier_wait(st.ready, (it // 2) & 1)
    for h, i in T.Parallel(t.HB, t.block_I):
        acc_s[h, i] = T.if_then_else(slot[i] >= 0, 0, -T.infinity(T.float32))
    for c in t.CH:
        T.gemm(qc[c], st.kvc[c], acc_s, transpose_B=True, annotations={"wg_wait": -1})
    T.gemm(qt_s, st.kt, acc_s, transpose_B=True, annotations={"wg_wait": -1})
    T.wait_wgmma(0)
    for h, i in T.Parallel(t.HB, t.block_I):
        acc_s[h, i] = T.exp2(acc_s[h, i] * t.scale2 - lse2[h])
    T.barrier_wait(st.p_free, ((it // 2) & 1) ^ 1)   # warpgroup 1 is done with P of block it - 2
    T.copy(acc_s, st.p_s)
    T.fence_proxy_async()                         # P is read by the tensor cores (both warpgroups' dKV)
    T.barrier_arrive(st.p_ready)
    for c in t.CH0:
        dkv_gemm(doc[c], st.p_s, acc_kv, True)
        if c == 0:
            T.barrier_wait(st.ds_ready, (it // 2) & 1)
        dkv_gemm(qc[c], st.ds_s, acc_kv, False)
        bwd_scatter(t, dKV, kslot, c * t.chunk, t.chunk, acc_kv)
    for c in t.CH0:
        T.gemm(st.ds_s, st.kvc[c], acc_dq[c], annotations={"wg_wait": -1})
    T.gemm(st.ds_s, st.kt, acc_dqt, annotations={"wg_wait": -1})
    T.wait_wgmma(0)
    T.barrier_arrive(st.ds_free)
    T.barrier_arrive(st.free)


@T.macro
def bwd_dp_step(t, Idx, dKV, s_i, it, st, qc, qt_s, doc, delta, slot, acc_dp, p_frag, acc_dq, acc_kv, acc_kt):
    """Warpgroup 1, slot block `it` in stage `st`: dP = dO V^T (concurrently with S); after P: dS = P (dP - delta)
    scale -> st.ds_s (once warpgroup 0 is done with dS of block it - 2); dKV for the value chunks >= NC/2 and the
    rope tail (Q_rope^T dS); dQ[:, D/2:D] += dS K."""
    for i in T.Parallel(t.block_I):
        slot[i] = Idx[s_i, it * t.block_I + i]
    T.barrier_wait(st.ready, (it // 2) & 1)
    for c in t.CH:
        T.gemm(doc[c], st.kvc[c], acc_dp, transpose_B=True, clear_accum=(c == 0), annotations={"wg_wait": -1})
    T.wait_wgmma(0)
    T.barrier_wait(st.p_ready, (it // 2) & 1)
    T.copy(st.p_s, p_frag)
    for h, i in T.Parallel(t.HB, t.block_I):
        acc_dp[h, i] = p_frag[h, i] * (acc_dp[h, i] - delta[h]) * t.sm_scale
    T.barrier_wait(st.ds_free, ((it // 2) & 1) ^ 1)  # warpgroup 0 is done with dS of block it - 2
    T.copy(acc_dp, st.ds_s)
    T.fence_proxy_async()
    T.barrier_arrive(st.ds_ready)
    for c in t.CH1:
        dkv_gemm(doc[c], st.p_s, acc_kv, True)
        dkv_gemm(qc[c], st.ds_s, acc_kv, False)
        bwd_scatter(t, dKV, slot, c * t.chunk, t.chunk, acc_kv)
    T.barrier_arrive(st.p_free)                   # last read of this P (its dKV GEMMs)
    dkv_gemm(qt_s, st.ds_s, acc_kt, True)
    bwd_scatter(t, dKV, slot, t.D, t.DT, acc_kt)
    for c in t.CH1:
        T.gemm(st.ds_s, st.kvc[c], acc_dq[c - len(t.CH0)], annotations={"wg_wait": -1})
    T.wait_wgmma(0)
    T.barrier_arrive(st.free)


def build_sparse_mla_bwd_ws(heads: int, topk: int, sm_scale: float, *, dim_qk: int = 576, dim_v: int = 512,
                            config: BwdWsConfig = BwdWsConfig()):
    """Warp-specialised backward for one 64-head block (GLM-5.2's heads): the signature and results of
    `build_sparse_mla_bwd`; one CTA per query, 384 threads in three warpgroups: warpgroup 2 gathers slot blocks
    into two shared stages (:func:`producer`, :func:`bwd_gather`), warpgroup 0 forms S and P and half the dKV and dQ GEMMs
    (:func:`bwd_s_step`), warpgroup 1 dP and dS and the other half (:func:`bwd_dp_step`).

    Shared memory (224 KiB dynamic at chunk 128): Q [64, 576] and dO [64, 512], kept in `chunk`-column
    pieces so that every GEMM operand is a whole buffer; two KV stages of block_I x 576; P and dS
    [64, block_I] bf16, one pair per stage. Nothing else fits, so dKV leaves registers directly as fp32
    atomics: dKV [slot, latent] on mma.sync (TileLang picks it for M = 32 slots, below wgmma's 64); a thread
    holds pairs of consecutive latent columns, so the atomics are x2. The dKV GEMMs (40% of the FLOPs) run on the
    older tensor-core path.

    Work per slot and head (multiply-adds): warpgroup 0 576 (S) + 320 (dQ) + 512 (dKV) = 1408, warpgroup 1
    512 (dP) + 256 (dQ) + 576 (dKV) = 1344. P reaches warpgroup 1 as bf16 (p_s), so dS uses the rounded P
    (the serial kernel: fp32). `topk` a multiple of 2 * block_I.
    """
    block_I, chunk = config.block_I, config.chunk
    assert heads == 64, "the warp-specialised backward is laid out for one 64-head block"
    assert topk % (2 * block_I) == 0 and block_I % 16 == 0
    assert config.nreg_s + config.nreg_dp + config.nreg_gather <= 504 and config.nreg_gather % 8 == 0
    t = _Tiles(HB=heads, block_I=block_I, NI=topk // block_I, D=dim_v, DT=dim_qk - dim_v, sm_scale=sm_scale,
               chunk=chunk)
    HB, D, DT = t.HB, t.D, t.DT
    assert D % (2 * chunk) == 0 and DT % 8 == 0 and DT <= chunk
    NC, NC0 = len(t.CH), len(t.CH0)
    CHR = list(range(NC - NC0))          # warpgroup 1's dQ chunks, from 0 (Python-unrolled)
    seq = T.dynamic("seq")
    seq_kv = T.dynamic("seq_kv")
    dtype, accum = T.bfloat16, T.float32

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
            st0 = _BwdStage(kvc0, kt0, p_s0, ds_s0, ready0, free0, p_ready0, p_free0, ds_ready0, ds_free0)
            st1 = _BwdStage(kvc1, kt1, p_s1, ds_s1, ready1, free1, p_ready1, p_free1, ds_ready1, ds_free1)

            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(config.nreg_s, 1)
                for c in t.CH:
                    T.copy(Q[s_i, :, c * chunk:(c + 1) * chunk], qc[c])
                T.copy(Q[s_i, :, D:], qt_s)
                T.fence_proxy_async()
                T.barrier_arrive(loaded)
                for h in T.Parallel(HB):
                    lse2[h] = Lse[s_i, h] * LOG2E
                for c in t.CH0:
                    T.clear(acc_dq0[c])
                T.clear(acc_dqt)
                T.barrier_wait(loaded, 0)
                for i2 in T.serial(t.NI // 2):
                    bwd_s_step(t, Idx, dKV, s_i, 2 * i2, st0, qc, qt_s, doc, lse2, slot0, kslot0, acc_s, acc_dq0,
                               acc_dqt, acc_kv0)
                    bwd_s_step(t, Idx, dKV, s_i, 2 * i2 + 1, st1, qc, qt_s, doc, lse2, slot0, kslot0, acc_s, acc_dq0,
                               acc_dqt, acc_kv0)
                for c in t.CH0:
                    T.copy(acc_dq0[c], dQ[s_i, :, c * chunk:(c + 1) * chunk])
                T.copy(acc_dqt, dQ[s_i, :, D:])
            elif tx < 256:
                T.set_max_nreg(config.nreg_dp, 1)
                for c in t.CH:
                    T.copy(dO[s_i, :, c * chunk:(c + 1) * chunk], doc[c])
                T.fence_proxy_async()
                T.barrier_arrive(loaded)
                for h in T.Parallel(HB):
                    delta[h] = Delta[s_i, h]
                for c in CHR:
                    T.clear(acc_dq1[c])
                T.barrier_wait(loaded, 0)
                for i2 in T.serial(t.NI // 2):
                    bwd_dp_step(t, Idx, dKV, s_i, 2 * i2, st0, qc, qt_s, doc, delta, slot1, acc_dp, p_frag, acc_dq1,
                                acc_kv1, acc_kt)
                    bwd_dp_step(t, Idx, dKV, s_i, 2 * i2 + 1, st1, qc, qt_s, doc, delta, slot1, acc_dp, p_frag,
                                acc_dq1, acc_kv1, acc_kt)
                for c in CHR:
                    T.copy(acc_dq1[c], dQ[s_i, :, (NC0 + c) * chunk:(NC0 + c + 1) * chunk])
            else:
                T.set_max_nreg(config.nreg_gather, 0)
                producer(t, bwd_gather, KV, Idx, s_i, st0, st1)

    return sparse_mla_bwd_ws


# --------------------------------------------------------------------------------------------------
# compile caches and CI builds
# --------------------------------------------------------------------------------------------------
def _compiler(build, config_type: type, pass_configs: dict):
    """A cached ``(heads, topk, sm_scale, target_arch, dim_qk, dim_v, config) -> kernel`` compiling ``build``'s
    kernel (one per kernel, so that a test can tell which one ran; named as the module's global it is assigned to,
    which is how a build-ahead worker finds it)."""
    def compile_kernel(heads: int, topk: int, sm_scale: float, target_arch: str = "sm_90a", dim_qk: int = 576,
                       dim_v: int = 512, config: config_type = config_type()):
        return tilelang.compile(build(heads, topk, sm_scale, dim_qk=dim_qk, dim_v=dim_v, config=config),
                                target={"kind": "cuda", "arch": target_arch}, pass_configs=pass_configs)
    compile_kernel.__name__ = compile_kernel.__qualname__ = f"compile_{build.__name__.removeprefix('build_')}"
    return kernel_cache(compile_kernel)


compile_sparse_mla_fwd = _compiler(build_sparse_mla_fwd, FwdConfig, FWD_PASS_CONFIGS)
# the warp-specialised kernels are specialised by hand: TileLang's own (auto WS, TMA lowering) stays off, and
# the backward gets no shared-memory merging (all its buffers are live)
compile_sparse_mla_fwd_ws = _compiler(build_sparse_mla_fwd_ws, FwdWsConfig, FWD_PASS_CONFIGS)
compile_sparse_mla_bwd_ws = _compiler(build_sparse_mla_bwd_ws, BwdWsConfig, FWD_PASS_CONFIGS)
compile_sparse_mla_bwd = _compiler(build_sparse_mla_bwd, BwdConfig, BWD_PASS_CONFIGS)


def ci_builds(target_arch: str = "sm_90a") -> dict:
    """name -> thunk building (not running) one kernel of this family for `target_arch` (CI), through the
    same compile functions the launchers call (uncached), with the ops' configs. One head count (64, GLM-5.2's)
    per kernel; other head counts change only the tile sizes."""
    scale, ops = 576 ** -0.5, SparseMlaConfig()
    builds = {
        "sparse_mla_fwd[h64,k2048]": (compile_sparse_mla_fwd, ops.fwd),
        "sparse_mla_fwd_ws[h64,k2048]": (compile_sparse_mla_fwd_ws, ops.fwd_ws),
        "sparse_mla_bwd[h64,k2048]": (compile_sparse_mla_bwd, ops.serial_bwd(64)),
        "sparse_mla_bwd_ws[h64,k2048]": (compile_sparse_mla_bwd_ws, ops.bwd_ws),
    }
    return {name: functools.partial(fn.__wrapped__, 64, 2048, scale, target_arch, config=config)
            for name, (fn, config) in builds.items()}


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------
# the ops whose TileLang kernels vary from run to run, and why (under torch.use_deterministic_algorithms they run
# their PyTorch kernels: the backward's adds into dKV are index_add_ there, deterministic on CUDA in that mode)
NONDETERMINISTIC = {"glm52::sparse_mla_bwd": "adds each query's dKV rows into dKV with fp32 atomics, in an order "
                                             "that varies from run to run"}


def _refused(q: torch.Tensor, kv: torch.Tensor, d_v: int, op: str) -> tuple | None:
    """None where ``op``'s TileLang kernels take these (valid) inputs, else (warning key, message): other dtypes or
    widths, or torch.use_deterministic_algorithms on for an op in :data:`NONDETERMINISTIC`."""
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return (f"{op}:dtype", f"{op}: the TileLang kernel takes bfloat16 q and kv; {q.dtype} / {kv.dtype} inputs "
                               f"run the PyTorch reference kernel (slower) instead")
    if q.shape[-1] - d_v != 64 or d_v % 64:
        return (f"{op}:shape", f"{op}: the TileLang kernel wants a 64-wide rope tail (Dqk = d_v + 64, d_v a multiple "
                               f"of 64); Dqk={q.shape[-1]}, d_v={d_v} run the PyTorch reference kernel (slower) "
                               f"instead")
    return nondeterministic(op, NONDETERMINISTIC[op]) if op in NONDETERMINISTIC else None


def _takes(q: torch.Tensor, kv: torch.Tensor, d_v: int, op: str) -> bool:
    """Whether the TileLang kernels take these (valid) inputs; warns once per op when they do not (the
    caller then runs the PyTorch kernel)."""
    refused = _refused(q, kv, d_v, op)
    if refused is not None:
        warn_once(*refused)
    return refused is None


def _kernel(choice: tuple, heads: int, topk: int, sm_scale: float, arch: str, dim_qk: int, d_v: int) -> tuple:
    """(compile function, its arguments) of the kernel a ``*_kernel_choice`` picked, for ``heads`` x ``topk``
    inputs; the second argument is the slots the indices are padded to (a multiple of the kernel's block)."""
    compile_kernel, kernel_config, block = choice
    return compile_kernel, (heads, round_up(max(topk, 1), block), float(sm_scale), arch, dim_qk, d_v, kernel_config)


def fwd_kernel(q: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
               config: SparseMlaConfig = SparseMlaConfig()) -> tuple:
    """(compile function, its arguments) of the forward kernel the op runs for these inputs."""
    Hp = padded_heads(q.shape[1])
    return _kernel(fwd_kernel_choice(Hp, d_v, config), Hp, indices.shape[1], sm_scale, cuda_target(q.device)["arch"],
                   q.shape[2], d_v)


def bwd_kernel(q: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
               config: SparseMlaConfig = SparseMlaConfig()) -> tuple:
    """(compile function, its arguments) of the backward kernel the op runs for these inputs."""
    Hp = padded_heads(q.shape[1])
    return _kernel(bwd_kernel_choice(Hp, d_v, config), Hp, indices.shape[1], sm_scale, cuda_target(q.device)["arch"],
                   q.shape[2], d_v)


def _pad_indices(indices: torch.Tensor, slots: int) -> torch.Tensor:
    return pad_dim(indices.to(torch.int32), 1, slots, value=-1)


def fwd_kernel_choice(padded_h: int, d_v: int, config: SparseMlaConfig) -> tuple:
    """(compile function, its kernel config, the slots the indices are padded to) of the forward ``config`` runs
    at ``padded_h`` heads: the pipelined kernel walks the slots two blocks (one per shared stage) at a time."""
    if config.pipelined_fwd and padded_h == 64 and d_v % 128 == 0:
        return compile_sparse_mla_fwd_ws, config.fwd_ws, 2 * config.fwd_ws.block_I
    return compile_sparse_mla_fwd, config.fwd, config.fwd.block_I


def sparse_mla_tl(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
                  config: SparseMlaConfig = SparseMlaConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA kernel of `glm52::sparse_mla`: out [S, H, d_v] bf16, lse [S, H] fp32 (natural log), for bf16
    q and kv (other inputs: the PyTorch kernel, see :func:`_takes`). ``config``: the op's by default."""
    _check(q, kv, indices, d_v)
    if not _takes(q, kv, d_v, "glm52::sparse_mla"):
        return _sparse_mla_fwd_kernel(q, kv, indices, sm_scale, d_v)
    S, H, Dqk = q.shape
    compile_kernel, args = fwd_kernel(q, indices, sm_scale, d_v, config)
    Hp, idx = args[0], _pad_indices(indices, args[1])
    kernel = compile_kernel(*args)
    qp = pad_dim(q, 1, Hp)
    out = torch.empty(S, Hp, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(S, Hp, dtype=torch.float32, device=q.device)
    if S:
        kernel(qp, kv.contiguous(), idx, out, lse)
    if Hp != H:
        out, lse = out[:, :H].contiguous(), lse[:, :H].contiguous()
    return out, lse


def row_dot(out: torch.Tensor, dout: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """delta = sum(out * dout, -1) in fp32, [S, H], for [S, H, d_v] out and dout: a chunk of rows at a time, so the
    fp32 copies of the two tensors (twice their bf16 bytes each) never exist whole (at most ``chunk_bytes`` each)."""
    S = out.shape[0]
    delta = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    if not delta.numel():
        return delta
    rows = max(1, chunk_bytes // max(1, 4 * out[0].numel()))
    for a in range(0, S, rows):
        b = min(S, a + rows)
        torch.sum(out[a:b].float() * dout[a:b].float(), -1, out=delta[a:b])
    return delta


def bwd_kernel_choice(padded_h: int, d_v: int, config: SparseMlaConfig) -> tuple:
    """(compile function, its kernel config, the slots the indices are padded to) of the backward ``config`` runs
    at ``padded_h`` heads: the pipelined kernel walks the slots two blocks (one per shared stage) at a time."""
    if config.pipelined_bwd and padded_h == 64 and d_v % 256 == 0:
        return compile_sparse_mla_bwd_ws, config.bwd_ws, 2 * config.bwd_ws.block_I
    serial = config.serial_bwd(padded_h)
    return compile_sparse_mla_bwd, serial, serial.block_I


def sparse_mla_bwd_tl(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                      indices: torch.Tensor, lse: torch.Tensor, sm_scale: float, d_v: int,
                      config: SparseMlaConfig = SparseMlaConfig(), compile_kernel=None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA kernel of `glm52::sparse_mla_bwd`: dq like q, dkv like kv, for bf16 q and kv (other inputs:
    the PyTorch kernel, see :func:`_takes`). ``config``: the op's by default. ``compile_kernel``: a stand-in for
    the compile function of the kernel ``config`` picks (:func:`bwd_kernel_choice`; same signature), for a
    benchmark's ablation of that kernel."""
    _check(q, kv, indices, d_v)
    if not _takes(q, kv, d_v, "glm52::sparse_mla_bwd"):
        return _sparse_mla_bwd_kernel(q, kv, out, dout, indices, lse, sm_scale, d_v)
    S, H, Dqk = q.shape
    compile_chosen, args = bwd_kernel(q, indices, sm_scale, d_v, config)
    Hp, idx = args[0], _pad_indices(indices, args[1])
    kernel = (compile_kernel or compile_chosen)(*args)
    delta = row_dot(out, dout, config.delta_chunk_bytes)  # [S, H]
    qp = pad_dim(q, 1, Hp)
    dop = pad_dim(dout.to(torch.bfloat16), 1, Hp)
    lsep = pad_dim(lse.float(), 1, Hp)
    deltap = pad_dim(delta, 1, Hp)
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


def _fwd_ahead(q, kv, indices, sm_scale, d_v):
    if q.is_cuda and static(*q.shape[1:], indices.shape[1]) and _refused(q, kv, d_v, "glm52::sparse_mla") is None:
        fn, args = fwd_kernel(q, indices, sm_scale, d_v)
        fn.ahead(*args)


def _bwd_ahead(q, kv, out, dout, indices, lse, sm_scale, d_v):
    if q.is_cuda and static(*q.shape[1:], indices.shape[1]) and _refused(q, kv, d_v, "glm52::sparse_mla_bwd") is None:
        fn, args = bwd_kernel(q, indices, sm_scale, d_v)
        fn.ahead(*args)


def register() -> None:
    torch.library.register_kernel("glm52::sparse_mla", "cuda")(sparse_mla_tl)
    torch.library.register_kernel("glm52::sparse_mla_bwd", "cuda")(sparse_mla_bwd_tl)
    on_trace("glm52::sparse_mla", _fwd_ahead)
    on_trace("glm52::sparse_mla_bwd", _bwd_ahead)


__all__ = ["FwdConfig", "FwdWsConfig", "BwdConfig", "BwdWsConfig", "SparseMlaConfig", "fwd_kernel_choice",
           "bwd_kernel_choice", "fwd_kernel", "bwd_kernel", "sparse_mla_tl", "sparse_mla_bwd_tl", "row_dot",
           "sparse_mla_flops", "register"]
