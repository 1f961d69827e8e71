"""Sparse MLA in absorbed (MQA) form: ``glm52::sparse_mla`` and its backward ``glm52::sparse_mla_bwd``.

Every head of query i attends to the same ``topk`` selected rows of one shared latent::

    q        [S, H, Dqk]   absorbed queries (kv_lora latent part + rope part; 576 wide in GLM-5.2)
    kv       [Sk, Dqk]     shared key latent; its first ``d_v`` columns are the value latent (512)
    indices  [S, T] int32  selected key rows, -1 = masked slot
    out      [S, H, d_v]   softmax(sm_scale * q . kv[idx]) @ kv[idx, :d_v], in q's dtype
    lse      [S, H] fp32   natural-log log-sum-exp of the scaled scores; +inf for a row with no
                           valid key (so exp(s - lse) = 0 and that row's out and grads are 0)

File layout: input checks, chunked PyTorch kernels (forward, backward), custom ops + fakes,
``register_autograd``, then the ``ref_`` dense reference. CUDA kernels (TileLang) are registered on the same
ops by ``glm52_model.ops.cuda`` and check their inputs with the same :func:`_check`.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ._trace import announced

__all__ = ["sparse_mla", "sparse_mla_bwd", "ref_sparse_mla"]

# Query rows per chunk keep one chunk's gathered [C, T, Dqk] latent and [C, H, T] scores bounded.
_CHUNK_ELEMENTS = 1 << 25


def _chunk_rows(S: int, H: int, T: int, D: int) -> int:
    return max(1, min(S, _CHUNK_ELEMENTS // max(1, T * (D + H))))


def _check(q: Tensor, kv: Tensor, indices: Tensor, d_v: int) -> None:
    torch._check(q.dim() == 3, lambda: f"sparse_mla: q must be [S, H, Dqk], got {tuple(q.shape)}")
    torch._check(kv.dim() == 2 and kv.shape[1] == q.shape[2],
                 lambda: f"sparse_mla: kv must be [Sk, Dqk={q.shape[2]}], got {tuple(kv.shape)}")
    torch._check(indices.dim() == 2 and indices.shape[0] == q.shape[0],
                 lambda: f"sparse_mla: indices must be [S={q.shape[0]}, topk], got {tuple(indices.shape)}")
    torch._check(indices.dtype == torch.int32, lambda: f"sparse_mla: indices must be int32, got {indices.dtype}")
    torch._check(0 < d_v <= q.shape[2], lambda: f"sparse_mla: d_v={d_v} must be in (0, Dqk={q.shape[2]}]")


def _gather(kv: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of kv for a chunk of IDs: ([C, T, D] fp32, valid [C, T], clamped long IDs [C, T])."""
    valid = idx >= 0
    safe = idx.long().clamp_min(0)
    return kv.float()[safe], valid, safe


def _probs(q: Tensor, kv_g: Tensor, valid: Tensor, lse: Tensor, sm_scale: float) -> Tensor:
    s = torch.einsum("chd,ctd->cht", q.float(), kv_g) * sm_scale                 # [C, H, T]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.exp(s - lse[..., None])                                        # 0 where masked / empty


def _sparse_mla_fwd_kernel(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                           d_v: int) -> tuple[Tensor, Tensor]:
    _check(q, kv, indices, d_v)
    S, H, D = q.shape
    out = q.new_empty((S, H, d_v))
    lse = torch.empty((S, H), dtype=torch.float32, device=q.device)
    C = _chunk_rows(S, H, indices.shape[1], D)
    for s0 in range(0, S, C):
        s1 = min(S, s0 + C)
        kv_g, valid, _ = _gather(kv, indices[s0:s1])                            # [C, T, D]
        s = torch.einsum("chd,ctd->cht", q[s0:s1].float(), kv_g) * sm_scale     # [C, H, T]
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        m = torch.logsumexp(s, dim=-1)                                          # [C, H], -inf if empty
        m = torch.where(torch.isneginf(m), float("inf"), m)
        p = torch.exp(s - m[..., None])
        out[s0:s1] = torch.einsum("cht,ctv->chv", p, kv_g[..., :d_v]).to(q.dtype)
        lse[s0:s1] = m
    return out, lse


def _sparse_mla_bwd_kernel(q: Tensor, kv: Tensor, out: Tensor, dout: Tensor, indices: Tensor, lse: Tensor,
                           sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    _check(q, kv, indices, d_v)
    S, H, D = q.shape
    dq = q.new_empty(q.shape)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    C = _chunk_rows(S, H, indices.shape[1], D)
    for s0 in range(0, S, C):
        s1 = min(S, s0 + C)
        kv_g, valid, safe = _gather(kv, indices[s0:s1])                         # [C, T, D]
        p = _probs(q[s0:s1], kv_g, valid, lse[s0:s1], sm_scale)                 # [C, H, T]
        do = dout[s0:s1].float()                                                # [C, H, d_v]
        dp = torch.einsum("chv,ctv->cht", do, kv_g[..., :d_v])                  # dL/dp
        delta = (do * out[s0:s1].float()).sum(-1, keepdim=True)                # [C, H, 1] = sum_t p*dp
        ds = p * (dp - delta) * sm_scale                                        # dL/d(q.k)
        dq[s0:s1] = torch.einsum("cht,ctd->chd", ds, kv_g).to(q.dtype)
        dkv_g = torch.einsum("cht,chd->ctd", ds, q[s0:s1].float())              # [C, T, D]
        dkv_g[..., :d_v] += torch.einsum("cht,chv->ctv", p, do)
        dkv_g = dkv_g * valid[..., None]
        dkv.index_add_(0, safe.flatten(), dkv_g.flatten(0, 1))
    return dq, dkv.to(kv.dtype)


# ------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("glm52::sparse_mla", mutates_args=())
def sparse_mla(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """Absorbed sparse MLA forward: (out [S, H, d_v] in q.dtype, lse [S, H] fp32)."""
    return _sparse_mla_fwd_kernel(q, kv, indices, sm_scale, d_v)


@sparse_mla.register_fake
@announced("glm52::sparse_mla")
def _(q, kv, indices, sm_scale, d_v):
    _check(q, kv, indices, d_v)
    S, H, _ = q.shape
    return q.new_empty((S, H, d_v)), q.new_empty((S, H), dtype=torch.float32)


@torch.library.custom_op("glm52::sparse_mla_bwd", mutates_args=())
def sparse_mla_bwd(q: Tensor, kv: Tensor, out: Tensor, dout: Tensor, indices: Tensor, lse: Tensor,
                   sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """Backward of :func:`sparse_mla`: (dq like q, dkv like kv). Needs the forward's out and lse."""
    return _sparse_mla_bwd_kernel(q, kv, out, dout, indices, lse, sm_scale, d_v)


@sparse_mla_bwd.register_fake
@announced("glm52::sparse_mla_bwd")
def _(q, kv, out, dout, indices, lse, sm_scale, d_v):
    return torch.empty_like(q), torch.empty_like(kv)


def _setup_context(ctx, inputs, output):
    q, kv, indices, sm_scale, d_v = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, indices, out, lse)
    ctx.sm_scale, ctx.d_v = sm_scale, d_v
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, kv, indices, out, lse = ctx.saved_tensors
    dq, dkv = torch.ops.glm52.sparse_mla_bwd(q, kv, out, dout.contiguous(), indices, lse, ctx.sm_scale,
                                             ctx.d_v)
    return dq, dkv, None, None, None


sparse_mla.register_autograd(_backward, setup_context=_setup_context)


# FLOPs (torch.utils.flop_counter; sacpass's planner prices a recompute with them): q.k and p.v per head
# and selected key, and for the backward the score recompute, dq, dkv and dp.
@register_flop_formula(torch.ops.glm52.sparse_mla)
def _sparse_mla_flops(q_shape, kv_shape, indices_shape, sm_scale, d_v, *args, **kwargs) -> int:
    S, H, D = q_shape
    return 2 * S * H * indices_shape[1] * (D + d_v)


@register_flop_formula(torch.ops.glm52.sparse_mla_bwd)
def _sparse_mla_bwd_flops(q_shape, kv_shape, out_shape, dout_shape, indices_shape, lse_shape, sm_scale, d_v,
                          *args, **kwargs) -> int:
    S, H, D = q_shape
    return 2 * S * H * indices_shape[1] * (3 * D + 2 * d_v)


# ------------------------------------------------------------------------------------------ reference
def ref_sparse_mla(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """Dense attention over all keys, masked to the selected ones (differentiable; fp32)."""
    S, H, _ = q.shape
    Sk = kv.shape[0]
    mask = torch.zeros(S, Sk + 1, dtype=torch.bool, device=q.device)
    mask.scatter_(1, torch.where(indices >= 0, indices.long(), Sk), True)
    mask = mask[:, :Sk]                                                         # [S, Sk]
    s = torch.einsum("shd,kd->shk", q.float(), kv.float()) * sm_scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("shk,kv->shv", p, kv.float()[:, :d_v])
    return out.to(q.dtype), torch.where(torch.isneginf(lse), float("inf"), lse)
