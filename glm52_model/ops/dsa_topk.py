"""DSA lightning-indexer top-k: ``glm52::dsa_topk_indices``.

For query i and key j in its valid range ``[starts[i], ends[i])``::

    score[i, j] = scale * sum_h weights[i, h] * relu(q[i, h] . k[j])      (fp32)

and the op returns, per query, the ``topk`` key IDs of highest score, sorted by descending score, as a
contiguous int32 ``[S, topk]`` tensor padded with -1 where fewer than ``topk`` keys are valid.

The IDs are integers: the op has no autograd (nothing flows back through a selection). It is cheap to
store and expensive to recompute, which is why it is declared must-save for sacpass at import.

File layout: input checks and kernel (chunked PyTorch, any device), custom op + fake, the ``ref_`` naive
reference. The CUDA kernel (TileLang) is registered on the same op by ``glm52_model.ops.cuda`` and checks
its inputs with the same :func:`_check`. Tests count executions with ``sacpass.testing.OpCounter``.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from sacpass import register_must_save

__all__ = ["dsa_topk_indices", "ref_dsa_topk_indices", "ref_dsa_scores"]

# Query rows per chunk are chosen so that one chunk's [C, H, Sk] fp32 score block stays under this many
# elements (64 Mi elements = 256 MiB), which bounds the kernel's memory independently of S.
_CHUNK_ELEMENTS = 1 << 26


# ---------------------------------------------------------------------------------------------- kernel
def _check(q: Tensor, k: Tensor, weights: Tensor, starts: Tensor, ends: Tensor, topk: int) -> None:
    torch._check(q.dim() == 3, lambda: f"dsa_topk_indices: q must be [S, H, D], got {tuple(q.shape)}")
    torch._check(k.dim() == 2 and k.shape[1] == q.shape[2],
                 lambda: f"dsa_topk_indices: k must be [Sk, D={q.shape[2]}], got {tuple(k.shape)}")
    torch._check(weights.shape == q.shape[:2],
                 lambda: f"dsa_topk_indices: weights must be [S, H]={tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    torch._check(starts.shape == (q.shape[0],) and ends.shape == (q.shape[0],),
                 lambda: "dsa_topk_indices: starts and ends must be [S]")
    torch._check(starts.dtype == torch.int32 and ends.dtype == torch.int32,
                 lambda: "dsa_topk_indices: starts and ends must be int32")
    torch._check(topk > 0, lambda: f"dsa_topk_indices: topk must be positive, got {topk}")


def _dsa_topk_kernel(q: Tensor, k: Tensor, weights: Tensor, starts: Tensor, ends: Tensor, topk: int,
                     scale: float) -> Tensor:
    """Chunked PyTorch kernel: score a block of queries against every key, mask, then top-k."""
    _check(q, k, weights, starts, ends, topk)
    S, H, _ = q.shape
    Sk = k.shape[0]
    out = torch.full((S, topk), -1, dtype=torch.int32, device=q.device)
    if S == 0 or Sk == 0:
        return out
    kk = min(topk, Sk)
    chunk = max(1, min(S, _CHUNK_ELEMENTS // max(1, H * Sk)))
    kf = k.float()                                                            # [Sk, D]
    cols = torch.arange(Sk, device=q.device)
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        logits = torch.einsum("chd,kd->chk", q[s0:s1].float(), kf).relu_()    # [C, H, Sk]
        score = torch.einsum("chk,ch->ck", logits, weights[s0:s1].float()) * scale  # [C, Sk]
        valid = (cols >= starts[s0:s1, None]) & (cols < ends[s0:s1, None])    # [C, Sk]
        score = score.masked_fill(~valid, float("-inf"))
        val, idx = torch.topk(score, kk, dim=-1, sorted=True)                 # [C, kk] descending
        out[s0:s1, :kk] = torch.where(torch.isinf(val), -1, idx).to(torch.int32)
    return out


# ------------------------------------------------------------------------------------------- custom op
@torch.library.custom_op("glm52::dsa_topk_indices", mutates_args=())
def dsa_topk_indices(q: Tensor, k: Tensor, weights: Tensor, starts: Tensor, ends: Tensor, topk: int,
                     scale: float) -> Tensor:
    """Top-k key IDs per query, int32 [S, topk], -1 padded. See the module docstring."""
    return _dsa_topk_kernel(q, k, weights, starts, ends, topk, scale)


@dsa_topk_indices.register_fake
def _(q, k, weights, starts, ends, topk, scale):
    _check(q, k, weights, starts, ends, topk)
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


def _no_grad_backward(ctx, grad):
    # The output is integer: nothing flows back. Registered so that calling the op on inputs that
    # require grad is allowed (autograd records no graph for an integer output).
    return None, None, None, None, None, None, None


dsa_topk_indices.register_autograd(_no_grad_backward)


@register_flop_formula(torch.ops.glm52.dsa_topk_indices)
def _dsa_topk_flops(q_shape, k_shape, weights_shape, starts_shape, ends_shape, topk, scale, *args, **kwargs) -> int:
    """The logits of every head against every key (half of them masked by causality): S * Sk * H * D."""
    S, H, D = q_shape
    return S * k_shape[0] * H * D

register_must_save(torch.ops.glm52.dsa_topk_indices.default)


# ------------------------------------------------------------------------------------------ reference
def ref_dsa_scores(q: Tensor, k: Tensor, weights: Tensor, starts: Tensor, ends: Tensor,
                   scale: float) -> Tensor:
    """Naive dense [S, Sk] fp32 scores with -inf outside each query's [start, end)."""
    S, H, _ = q.shape
    score = torch.zeros(S, k.shape[0], dtype=torch.float32, device=q.device)
    for h in range(H):
        score += weights[:, h, None].float() * torch.relu(q[:, h].float() @ k.float().T)
    score = score * scale
    cols = torch.arange(k.shape[0], device=q.device)
    valid = (cols >= starts[:, None].long()) & (cols < ends[:, None].long())
    return score.masked_fill(~valid, float("-inf"))


def ref_dsa_topk_indices(q: Tensor, k: Tensor, weights: Tensor, starts: Tensor, ends: Tensor, topk: int,
                         scale: float) -> Tensor:
    """Naive reference: dense scores, then a per-row sort."""
    score = ref_dsa_scores(q, k, weights, starts, ends, scale)
    order = torch.argsort(score, dim=-1, descending=True, stable=True)[:, :topk]
    vals = torch.gather(score, 1, order)
    ids = torch.where(torch.isinf(vals), -1, order).to(torch.int32)
    if ids.shape[1] < topk:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], topk - ids.shape[1]), -1)], dim=1)
    return ids.contiguous()
