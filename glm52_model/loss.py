"""The token loss: the output head and the cross-entropy in one pass over row chunks.

``cross_entropy(head(h).float(), targets)`` holds the whole [tokens, vocab] logits in bf16, their fp32 copy and
the log-probabilities it saves for the backward: at 64K tokens and a 32K vocabulary about 19 GiB at once, the
largest blocks of the step (16 GiB ones at 128K), allocated after every layer's forward has left its values on
the device. :func:`head_loss` computes the same loss a chunk of rows at a time and, in the same pass, the
gradients of the hidden states and of the head's weight (the softmax less the one-hot target, times the loss's
scale, through the head's two matrix products), so that nothing of the vocabulary's width outlives a chunk: what
the backward keeps is the hidden states' gradient ([tokens, hidden]) and the weight's (fp32, [vocab, hidden]).
Each chunk's logits are the head's own bf16 product, cast to fp32 as before; the gradients go back through the
head in bf16 as autograd's would. The weight's gradient is summed over the chunks in fp32 (one bf16 product a
chunk), so it differs from a single product over all rows in its last bits.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["head_loss", "CHUNK_BYTES"]

CHUNK_BYTES = 512 << 20  # fp32 logits of one chunk of rows: its temporaries are a few of these


def _rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, count: Tensor | None, grads: bool):
        rows = _rows(weight.shape[0])
        valid_all = targets != -100
        denominator = (valid_all.sum() if count is None else count).to(torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grads else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
        for start in range(0, hidden.shape[0], rows):
            h, t = hidden[start:start + rows], targets[start:start + rows]
            valid = valid_all[start:start + rows]
            logits = (h @ weight.t()).float()                                    # [rows, vocab], as head(h).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1)
            total = total + torch.where(valid, lse - picked, 0.0).sum()
            if grads:
                g = logits.sub_(lse.unsqueeze(1)).exp_()                        # softmax, in place of the logits
                g.scatter_add_(1, t.clamp_min(0).unsqueeze(1), -valid.to(g.dtype).unsqueeze(1))
                g.mul_(torch.where(valid, 1.0 / denominator, 0.0).unsqueeze(1))  # ignored rows: no gradient
                g = g.to(hidden.dtype)
                grad_hidden[start:start + rows] = g @ weight
                grad_weight += (g.t() @ h).float()
        if grads:
            ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / denominator

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        return ((grad_hidden * scale).to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype),
                None, None, None)


def head_loss(hidden: Tensor, weight: Tensor, targets: Tensor, count: int | None = None) -> Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=-100)``: the mean over the valid
    targets, or their sum divided by ``count`` (the valid targets of a whole parallel batch, so that the ranks'
    shares add up to its mean), without the whole logits at once (see the module docstring). ``hidden`` is
    [tokens, hidden], ``weight`` the head's [vocab, hidden], ``targets`` [tokens] (-100: ignored)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"head_loss: hidden [tokens, hidden] {tuple(hidden.shape)}, weight [vocab, hidden] "
                         f"{tuple(weight.shape)} and targets [tokens] {tuple(targets.shape)} do not fit together")
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    denominator = None if count is None else torch.tensor(float(count), device=hidden.device)
    return _HeadLoss.apply(hidden, weight, targets, denominator, grads)
