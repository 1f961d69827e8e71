"""Multi-token prediction (depth 1): predict token t+2 at position t from the main model's hidden state
and the embedding of token t+1, through one more decoder layer that reuses the last main layer's IDs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import GLM52Config
from .model import DecoderLayer, Linear, RMSNorm, _token_dynamic

__all__ = ["MTPLayer", "mtp_labels", "mtp_loss"]


class MTPLayer(nn.Module):
    """enorm/hnorm -> eh_proj -> decoder layer (MoE, shared top-k) -> norm; the embedding and output
    head are the main model's."""

    def __init__(self, cfg: GLM52Config, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, cfg.fp8)
        self.block = DecoderLayer(cfg, layer_id, compute_topk=False, moe=True)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: Tensor, next_embeds: Tensor, positions: Tensor, starts: Tensor, ends: Tensor,
                topk_ids: Tensor) -> Tensor:
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))  # [T, hidden]
        x, _ = self.block(*_token_dynamic(self.block, x, positions, starts, ends, topk_ids))
        return self.norm(x)


def mtp_labels(labels: Tensor, seq_end: Tensor) -> Tensor:
    """Targets two ahead: labels[t + 1] within the same sequence, -100 past its end or after an ignored
    input token."""
    t = torch.arange(labels.shape[0], device=labels.device)
    shifted = torch.cat([labels[1:], labels.new_full((1,), -100)])
    keep = (t + 1 < seq_end) & (labels != -100)
    return torch.where(keep, shifted, -100)


def mtp_loss(model, hidden: Tensor, labels: Tensor, positions: Tensor, starts: Tensor, ends: Tensor,
             seq_end: Tensor, topk_ids: Tensor) -> Tensor:
    """Mean over MTP depths of the cross-entropy of each MTP layer's prediction."""
    next_embeds = model.embed(labels.clamp_min(0))                               # token t+1 at position t
    targets = mtp_labels(labels, seq_end)
    losses = []
    for layer in model.mtp:
        h = layer(hidden, next_embeds, positions, starts, ends, topk_ids)
        losses.append(F.cross_entropy(model.head(h).float(), targets, ignore_index=-100))
    return torch.stack(losses).mean()
