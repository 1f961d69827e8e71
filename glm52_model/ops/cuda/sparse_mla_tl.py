"""TileLang kernels for `glm52::sparse_mla` and `glm52::sparse_mla_bwd` (absorbed sparse MLA).

Every query attends to the `topk` latent rows named in its index row (-1 = masked slot). Keys are the
full 576-wide latent (512 kv_lora + 64 rope), values its first 512 columns; one latent per token is
shared by all heads. Heads are processed in blocks of up to 64 (padded up to a power of two >= 16),
so a CTA is (query, head block); key slots stream through shared memory `block_I` at a time.

Forward: online softmax in base 2, out = P V, lse natural log (+inf for a row with no valid slot). Backward: dq per CTA in registers,
dkv accumulated with fp32 vector atomics into a [Sk, 576] buffer and cast to bf16 afterwards;
delta = rowsum(out * dout) is computed with PyTorch before the kernel.
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
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for h in T.Parallel(HB):
                    m[h] = T.max(m[h], m_prev[h])
                    alpha[h] = T.exp2((m_prev[h] - m[h]) * scale2)
                for h, i in T.Parallel(HB, block_I):
                    acc_s[h, i] = T.exp2(acc_s[h, i] * scale2 - m[h] * scale2)
                T.reduce_sum(acc_s, l_blk, dim=1)
                for h in T.Parallel(HB):
                    l_sum[h] = l_sum[h] * alpha[h] + l_blk[h]
                for h, d in T.Parallel(HB, D):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
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


@functools.lru_cache(maxsize=None)
def compile_sparse_mla_fwd(heads: int, topk: int, sm_scale: float, target_arch: str = "sm_90a",
                           **tunables):
    return tilelang.compile(build_sparse_mla_fwd(heads, topk, sm_scale, **tunables),
                            target={"kind": "cuda", "arch": target_arch},
                            pass_configs=FWD_PASS_CONFIGS)


@functools.lru_cache(maxsize=None)
def compile_sparse_mla_bwd(heads: int, topk: int, sm_scale: float, target_arch: str = "sm_90a",
                           **tunables):
    return tilelang.compile(build_sparse_mla_bwd(heads, topk, sm_scale, **tunables),
                            target={"kind": "cuda", "arch": target_arch},
                            pass_configs=BWD_PASS_CONFIGS)


def ci_builds(target_arch: str = "sm_90a") -> dict:
    """name -> thunk building (not running) one kernel of this family for `target_arch` (CI).
    One head count (64, GLM-5.2's) per kernel; other head counts change only the tile sizes."""
    scale = 576 ** -0.5
    target = {"kind": "cuda", "arch": target_arch}
    return {
        "sparse_mla_fwd[h64,k2048]": lambda: tilelang.compile(
            build_sparse_mla_fwd(64, 2048, scale, block_I=FWD_BLOCK_I), target=target,
            pass_configs=FWD_PASS_CONFIGS),
        "sparse_mla_bwd[h64,k2048]": lambda: tilelang.compile(
            build_sparse_mla_bwd(64, 2048, scale, **bwd_tunables(64)), target=target,
            pass_configs=BWD_PASS_CONFIGS),
    }


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------
FWD_BLOCK_I = 64


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
    idx = _prep_indices(indices, FWD_BLOCK_I)
    qp = pad_dim(q, 1, Hp)
    kernel = compile_sparse_mla_fwd(Hp, idx.shape[1], float(sm_scale), cuda_target(q.device)["arch"],
                                    dim_qk=Dqk, dim_v=d_v, block_I=FWD_BLOCK_I)
    out = torch.empty(S, Hp, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(S, Hp, dtype=torch.float32, device=q.device)
    if S:
        kernel(qp, kv.contiguous(), idx, out, lse)
    if Hp != H:
        out, lse = out[:, :H].contiguous(), lse[:, :H].contiguous()
    return out, lse


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
    tun = bwd_tunables(Hp)
    idx = _prep_indices(indices, tun["block_I"])
    delta = (out.float() * dout.float()).sum(-1)  # [S, H]
    qp = pad_dim(q, 1, Hp)
    dop = pad_dim(dout.to(torch.bfloat16), 1, Hp)
    lsep = pad_dim(lse.float(), 1, Hp)
    deltap = pad_dim(delta, 1, Hp)
    kernel = compile_sparse_mla_bwd(Hp, idx.shape[1], float(sm_scale), cuda_target(q.device)["arch"],
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
