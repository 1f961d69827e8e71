"""DSA lightning-indexer top-k: ``glm52::dsa_topk_indices``.

For query i and key j in its valid range ``[starts[i], ends[i])``::

    score[i, j] = scale * sum_h weights[i, h] * relu(q[i, h] . k[j])      (fp32)

and the op returns, per query, the ``topk`` key IDs of highest score, sorted by descending score, as a
contiguous int32 ``[S, topk]`` tensor padded with -1 where fewer than ``topk`` keys are valid.

**FP8 logits** (DeepSeek's ``fp8_mqa_logits``): q and k may come as float8 e4m3 with ``k_scale`` [Sk] fp32,
the dequantisation scale of each key row (``k ~= k_fp8 * k_scale[:, None]``). The query's per-(token, head)
scales are folded into ``weights`` by the caller (a ReLU commutes with a positive scale), so

    score[i, j] = scale * k_scale[j] * sum_h weights[i, h] * relu(q_fp8[i, h] . k_fp8[j])

:func:`quantize_indexer` makes these inputs from bf16 ones (one scale per row of 128: the whole head).

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

from ._trace import announced
from .fp8 import FP8_DTYPE

__all__ = ["dsa_topk_indices", "id_overlap", "quantize_indexer", "ref_dsa_scores", "ref_dsa_topk_indices"]

# Query rows per chunk are chosen so that one chunk's [C, H, Sk] fp32 score block stays under this many
# elements (64 Mi elements = 256 MiB), which bounds the kernel's memory independently of S.
_CHUNK_ELEMENTS = 1 << 26


# ---------------------------------------------------------------------------------------------- kernel
def _check(q: Tensor, k: Tensor, weights: Tensor, starts: Tensor, ends: Tensor, topk: int,
           k_scale: Tensor | None = None) -> None:
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
    fp8 = (q.dtype == FP8_DTYPE, k.dtype == FP8_DTYPE, k_scale is not None)
    torch._check(all(fp8) or not any(fp8),
                 lambda: f"dsa_topk_indices: FP8 logits take float8_e4m3fn q and k and a k_scale; got q {q.dtype}, "
                         f"k {k.dtype}, k_scale {'given' if k_scale is not None else 'None'} (make them with "
                         f"glm52_model.ops.dsa_topk.quantize_indexer)")
    if k_scale is not None:
        torch._check(k_scale.shape == (k.shape[0],) and k_scale.dtype == torch.float32,
                     lambda: f"dsa_topk_indices: k_scale must be float32 [Sk={k.shape[0]}], got {k_scale.dtype} "
                             f"{tuple(k_scale.shape)}")


def _dsa_topk_kernel(q: Tensor, k: Tensor, weights: Tensor, starts: Tensor, ends: Tensor, topk: int,
                     scale: float, k_scale: Tensor | None = None) -> Tensor:
    """Chunked PyTorch kernel: score a block of queries against every key, mask, then top-k. FP8 inputs are
    widened exactly to fp32 and ``k_scale`` applied to the keys (the same score, up to rounding order)."""
    _check(q, k, weights, starts, ends, topk, k_scale)
    S, H, _ = q.shape
    Sk = k.shape[0]
    out = torch.full((S, topk), -1, dtype=torch.int32, device=q.device)
    if S == 0 or Sk == 0:
        return out
    kk = min(topk, Sk)
    chunk = max(1, min(S, _CHUNK_ELEMENTS // max(1, H * Sk)))
    kf = k.float() if k_scale is None else k.float() * k_scale[:, None]       # [Sk, D]
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
                     scale: float, k_scale: Tensor | None = None) -> Tensor:
    """Top-k key IDs per query, int32 [S, topk], -1 padded. See the module docstring."""
    return _dsa_topk_kernel(q, k, weights, starts, ends, topk, scale, k_scale)


@dsa_topk_indices.register_fake
@announced("glm52::dsa_topk_indices")
def _(q, k, weights, starts, ends, topk, scale, k_scale=None):
    _check(q, k, weights, starts, ends, topk, k_scale)
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


def _no_grad_backward(ctx, grad):
    # The output is integer: nothing flows back. Registered so that calling the op on inputs that
    # require grad is allowed (autograd records no graph for an integer output).
    return None, None, None, None, None, None, None, None


dsa_topk_indices.register_autograd(_no_grad_backward)


@register_flop_formula(torch.ops.glm52.dsa_topk_indices)
def _dsa_topk_flops(q_shape, k_shape, weights_shape, starts_shape, ends_shape, topk, scale, *args,
                    **kwargs) -> int:
    """The logits of every head against every key (half of them masked by causality): S * Sk * H * D."""
    S, H, D = q_shape
    return S * k_shape[0] * H * D

register_must_save(torch.ops.glm52.dsa_topk_indices.default)


def quantize_indexer(q: Tensor, k: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The FP8 logits' inputs from q [S, H, D], k [Sk, D], weights [S, H]: (q_fp8, k_fp8, weights * q's
    per-(token, head) scale, k_scale [Sk]). One e4m3 scale per row of D (DeepSeek-V3.2's indexer: D = 128),
    amax-based as the FP8 linears' tiles (``glm52::fp8_quantize``)."""
    S, H, D = q.shape
    if D != 128:           # a plain raise: Dynamo on torch 2.11 graph-breaks on a torch._check message closure
        raise ValueError(f"quantize_indexer: one FP8 scale per 128-wide head row, got head dim {D}; use "
                         f"index_head_dim=128 or GLM52Config(fp8_indexer=False)")
    q8, qs = torch.ops.glm52.fp8_quantize(q.reshape(S * H, D), "1x128")      # [S*H, D], [S*H, 1]
    k8, ks = torch.ops.glm52.fp8_quantize(k, "1x128")                          # [Sk, D], [Sk, 1]
    return q8.view(S, H, D), k8, weights.float() * qs.view(S, H), ks.view(-1)


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


def id_overlap(a: Tensor, b: Tensor, chunk: int = 4096) -> Tensor:
    """Per row, the share of ``a``'s valid IDs (not -1) that ``b`` also holds (1.0 for a row with none):
    how far two top-k answers agree as sets. Chunked: memory O(chunk x max ID)."""
    n = int(max(a.max(), b.max(), 0)) + 2                                        # slot 0 holds the -1 pads
    out = torch.ones(a.shape[0], dtype=torch.float32, device=a.device)
    for s0 in range(0, a.shape[0], chunk):
        ar, br = a[s0:s0 + chunk].long() + 1, b[s0:s0 + chunk].long() + 1
        held = torch.zeros(ar.shape[0], n, dtype=torch.bool, device=a.device).scatter_(1, br, True)
        hit = held.gather(1, ar) & (ar > 0)
        valid = (ar > 0).sum(1)
        out[s0:s0 + chunk] = torch.where(valid > 0, hit.sum(1) / valid.clamp_min(1), 1.0)
    return out
