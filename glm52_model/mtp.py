"""Multi-token prediction (depth 1): predict token t+2 at position t from the main model's hidden state
and the embedding of token t+1, through one more decoder layer that reuses the last main layer's IDs.

The MTP layer is built by ``GLM52ForCausalLM`` from the model's own pieces (``model.mtp_layer``), so this
module needs nothing from ``model.py``.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .loss import head_loss

__all__ = ["MTPLayer", "mtp_labels", "mtp_loss"]


class MTPLayer(nn.Module):
    """enorm/hnorm -> eh_proj -> decoder layer (MoE, shared top-k) -> norm; the embedding and output
    head are the main model's."""

    def __init__(self, enorm: nn.Module, hnorm: nn.Module, eh_proj: nn.Module, block: nn.Module, norm: nn.Module):
        super().__init__()
        self.enorm, self.hnorm, self.eh_proj, self.block, self.norm = enorm, hnorm, eh_proj, block, norm

    def forward(self, hidden: Tensor, next_embeds: Tensor, positions: Tensor, starts: Tensor, ends: Tensor,
                topk_ids: Tensor) -> Tensor:
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))  # [T, hidden]
        x, _ = self.block(x, positions, starts, ends, topk_ids)
        return self.norm(x)


def mtp_labels(labels: Tensor, seq_end: Tensor) -> Tensor:
    """Targets two ahead: labels[t + 1] within the same sequence, -100 past its end or after an ignored
    input token."""
    t = torch.arange(labels.shape[0], device=labels.device)
    shifted = torch.cat([labels[1:], labels.new_full((1,), -100)])
    keep = (t + 1 < seq_end) & (labels != -100)
    return torch.where(keep, shifted, -100)


def mtp_loss(model, hidden: Tensor, labels: Tensor, targets: Tensor, positions: Tensor, starts: Tensor,
             ends: Tensor, topk_ids: Tensor, count: int | None = None) -> Tensor:
    """Mean over MTP depths of the cross-entropy of each MTP layer's prediction (``targets``: mtp_labels)."""
    next_embeds = model.embed(labels.clamp_min(0))                               # token t+1 at position t
    losses = [head_loss(layer(hidden, next_embeds, positions, starts, ends, topk_ids), model.head.weight, targets,
                        count) for layer in model.mtp]
    return torch.stack(losses).mean()
