"""GLM-5.2 modules: MLA with the DSA indexer and absorbed sparse MLA, MoE, decoder layers, the LM.

Tokens are packed: every activation is [T, ...] over all sequences of the batch, and per-query key
ranges [starts, ends) (causal, within the query's own sequence) come from ``cu_seqlens``.

Parallelism plugs into hooks, attributes holding a callable (defaults here, parallel versions in
``glm52_model.parallel``): ``Indexer.gather_keys`` and ``MLA.gather_kv`` (which rows attention may select:
the local ones, or the sequence-parallel group's) and ``MoE.dispatch`` (where the routed experts run, called
by :meth:`MoE.experts`). Activation checkpointing and compilation: ``glm52_model.compile``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import ops  # noqa: F401  (registers torch.ops.glm52.*)
from .config import GLM52Config
from .loss import head_loss
from .mtp import MTPLayer, mtp_labels, mtp_loss
from .ops.dsa_topk import quantize_indexer
from .ops.fp8 import fp8_linear

__all__ = ["RMSNorm", "Linear", "Indexer", "MLA", "MLP", "MoE", "DecoderLayer", "GLM52ForCausalLM",
           "packed_ranges", "rope_cos_sin", "apply_rope", "local_rows", "local_experts", "expert_rows",
           "combine_experts", "decoder_layers", "init_weights"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Linear(nn.Linear):
    """Bias-free Linear that runs its GEMMs in tile-wise FP8 when ``fp8`` is set."""

    def __init__(self, in_features: int, out_features: int, fp8: bool = False):
        super().__init__(in_features, out_features, bias=False)
        self.fp8 = fp8

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight) if self.fp8 else F.linear(x, self.weight)


def rope_cos_sin(positions: Tensor, dim: int, theta: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    angles = positions.float()[:, None] * inv_freq                               # [T, dim/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate pairs of x [T, ..., dim]: (2i, 2i+1) when interleaved, else (i, i + dim/2)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


def local_rows(rows: Tensor) -> Tensor:
    """Default ``gather_keys`` / ``gather_kv`` hook: a query may select among the rows of this rank only."""
    return rows


def packed_ranges(cu_seqlens: Tensor, num_tokens: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per token: (position in its sequence, key range start, key range end (causal), sequence end)."""
    t = torch.arange(num_tokens, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), t, right=True)              # sequence of each token
    start, seq_end = cu_seqlens[seq].long(), cu_seqlens[seq + 1].long()
    return t - start, start.to(torch.int32), (t + 1).to(torch.int32), seq_end


class Indexer(nn.Module):
    """DSA lightning indexer (GLM flavour); the caller runs it under ``torch.no_grad()``."""

    def __init__(self, cfg: GLM52Config):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk, self.fp8 = cfg.index_topk, cfg.fp8_indexer
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, cfg.fp8)  # query from the MLA q latent
        self.wk = Linear(cfg.hidden_size, self.head_dim, cfg.fp8)                  # one shared key head
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.gather_keys: Callable[[Tensor], Tensor] = local_rows  # hook: the keys a query may select

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x_pe, x_nope = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(x_pe, cos, sin, interleaved=True), x_nope], dim=-1)

    def forward(self, x: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor, starts: Tensor,
                ends: Tensor) -> Tensor:
        T = x.shape[0]
        q = self._rope(self.wq_b(q_latent).view(T, self.n_heads, self.head_dim), cos, sin)  # [T, Hi, Di]
        k = self.gather_keys(self._rope(self.k_norm(self.wk(x)), cos, sin))                 # [Tk, Di]
        w = self.weights_proj(x).float() * self.n_heads ** -0.5                             # [T, Hi]
        k_scale = None
        if self.fp8:                                                         # e4m3 logits, per-row scales
            q, k, w, k_scale = quantize_indexer(q, k, w)
        return torch.ops.glm52.dsa_topk_indices(q, k, w, starts, ends, self.topk, self.head_dim ** -0.5,
                                                k_scale=k_scale)


class MLA(nn.Module):
    """Multi-head latent attention, absorbed: all heads attend over one shared (kv_lora + rope) latent,
    restricted to the DSA top-k keys. Full layers own an indexer; shared layers take IDs as input."""

    def __init__(self, cfg: GLM52Config, compute_topk: bool):
        super().__init__()
        self.n_heads, self.nope, self.rope, self.v_dim = (cfg.num_heads, cfg.qk_nope_head_dim,
                                                          cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.kv_lora, self.rope_theta = cfg.kv_lora_rank, cfg.rope_theta
        self.softmax_scale = cfg.qk_head_dim ** -0.5
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, cfg.fp8)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, cfg.fp8)
        self.wkv_a = Linear(cfg.hidden_size, cfg.kv_latent_dim, cfg.fp8)
        self.kv_norm = RMSNorm(self.kv_lora, cfg.rms_norm_eps)
        # Used absorbed (its weight enters einsums on q and on the output), hence never FP8.
        self.wkv_b = nn.Linear(self.kv_lora, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = Linear(self.n_heads * self.v_dim, cfg.hidden_size, cfg.fp8)
        self.indexer = Indexer(cfg) if compute_topk else None
        self.gather_kv: Callable[[Tensor], Tensor] = local_rows    # hook: the latent rows attention reads

    def forward(self, x: Tensor, positions: Tensor, starts: Tensor, ends: Tensor,
                topk_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        T, H = x.shape[0], self.n_heads
        q_latent = self.q_norm(self.wq_a(x))                                      # [T, q_lora]
        q_nope, q_pe = self.wq_b(q_latent).view(T, H, -1).split([self.nope, self.rope], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora, self.rope], dim=-1)       # [T, kv_lora], [T, rope]
        cos, sin = rope_cos_sin(positions, self.rope, self.rope_theta)
        q_pe = apply_rope(q_pe, cos, sin, interleaved=False)                     # [T, H, rope]
        k_pe = apply_rope(k_pe, cos, sin, interleaved=False)                     # [T, rope]
        if self.indexer is not None:
            with torch.no_grad():
                topk_ids = self.indexer(x, q_latent, cos, sin, starts, ends)     # [T, topk] int32
        w_kv_b = self.wkv_b.weight.view(H, self.nope + self.v_dim, self.kv_lora)
        q_latent_nope = torch.einsum("thd,hdc->thc", q_nope, w_kv_b[:, :self.nope])  # absorb W_UK: [T, H, kv_lora]
        q_abs = torch.cat([q_latent_nope, q_pe], dim=-1)                         # [T, H, kv_lora + rope]
        kv_abs = self.gather_kv(torch.cat([self.kv_norm(kv), k_pe], dim=-1))     # [Tk, kv_lora + rope]
        o_latent, _ = torch.ops.glm52.sparse_mla(q_abs, kv_abs, topk_ids, self.softmax_scale, self.kv_lora)
        o = torch.einsum("thc,hvc->thv", o_latent, w_kv_b[:, self.nope:])       # absorb W_UV: [T, H, v]
        return self.wo(o.flatten(1)), topk_ids


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, fp8: bool):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(dim, hidden, fp8), Linear(dim, hidden, fp8)
        self.down_proj = Linear(hidden, dim, fp8)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Sigmoid router with bias-corrected top-k selection, normalised and scaled weights (:meth:`route`),
    routed experts as grouped GEMMs over expert-sorted tokens (:meth:`experts`; fixed shapes: no host sync,
    one graph for any routing), plus one shared expert. The ``dispatch`` hook decides where the routed
    experts run (:func:`local_experts`: here); the expert weights are this module's either way."""

    def __init__(self, cfg: GLM52Config):
        super().__init__()
        E, h, Im = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.n_experts, self.top_k, self.route_scale = E, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.gate = nn.Parameter(torch.empty(E, h))
        # Load-balancing bias: shifts which experts are selected, never the weights; updated outside autograd.
        self.register_buffer("e_score_correction_bias", torch.zeros(E), persistent=True)
        self.w_gate = nn.Parameter(torch.empty(E, h, Im))                       # x @ w_gate[e]
        self.w_up = nn.Parameter(torch.empty(E, h, Im))
        self.w_down = nn.Parameter(torch.empty(E, Im, h))
        self.shared_experts = MLP(h, Im * cfg.num_shared_experts, cfg.fp8)
        self.fp8_experts = cfg.fp8_experts                                       # glm52::fp8_grouped_mm
        self.dispatch: Callable[[MoE, Tensor, Tensor, Tensor], Tensor] = local_experts  # hook, see experts()

    def forward(self, x: Tensor) -> Tensor:
        expert, weight = self.route(x)                                           # [T, k], [T, k]
        return self.experts(x, expert, weight) + self.shared_experts(x)         # [T, h]

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's experts [T, k] (int64) and their weights [T, k] (fp32, normalised and scaled)."""
        scores = F.linear(x.float(), self.gate.float()).sigmoid()                 # [T, E]
        expert = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices  # [T, k]
        weight = scores.gather(1, expert)
        return expert, weight / weight.sum(-1, keepdim=True) * self.route_scale

    def experts(self, x: Tensor, expert: Tensor, weight: Tensor) -> Tensor:
        """Routed output [T, h]: every token's weighted sum over its experts, run where ``dispatch`` says."""
        return self.dispatch(self, x, expert, weight)

    def grouped_ffn(self, xs: Tensor, offs: Tensor) -> Tensor:
        """SwiGLU of this module's experts over rows ``xs`` [R, h] sorted by expert; ``offs`` (int32, one
        per expert held here) ends each expert's group. Tile-wise FP8 GEMMs when ``cfg.fp8_experts``."""
        return self._gmm(self.expert_hidden(xs, offs), self.w_down, offs)       # [R, h]

    def expert_hidden(self, x: Tensor, offs: Tensor, rows: Tensor | None = None) -> Tensor:
        """The SwiGLU's hidden rows [R, Im] over ``x`` [R, h], or over ``x[rows]`` read in place: the gate and
        up GEMMs in one op (``grouped_mm_pair``: the rows read, and quantised, once; one dgrad sum)."""
        pair = torch.ops.glm52.fp8_grouped_mm_pair if self.fp8_experts else torch.ops.glm52.grouped_mm_pair
        gate, up = pair(x, self.w_gate, self.w_up, offs, rows)
        return F.silu(gate) * up

    def routed_sum(self, x: Tensor, offs: Tensor, order: Tensor, weight: Tensor) -> Tensor:
        """Every token's weighted sum over its k experts [T, h] when this module holds all the experts: the
        SwiGLU over the assignments ``order`` (sorted by expert), its first GEMMs reading the token rows in
        place, its last GEMM adding each row, weighted, into its token (``grouped_mm_combine``)."""
        hs = self.expert_hidden(x, offs, rows=order // weight.shape[1])          # [T*k, Im]
        combine = (torch.ops.glm52.fp8_grouped_mm_combine if self.fp8_experts
                   else torch.ops.glm52.grouped_mm_combine)
        return combine(hs, self.w_down, offs, order, weight)                     # [T, h]

    def _gmm(self, *args) -> Tensor:
        return (torch.ops.glm52.fp8_grouped_mm if self.fp8_experts else torch.ops.glm52.grouped_mm)(*args)


def local_experts(moe: MoE, x: Tensor, expert: Tensor, weight: Tensor) -> Tensor:
    """Default ``MoE.dispatch``: every expert is here. Sort the T*k assignments by expert, run the grouped
    GEMMs over them, weight and sum them back per token (:meth:`MoE.routed_sum`). Neither the [T*k, h] copy
    of the tokens (:func:`expert_rows`) nor the [T*k, h] expert outputs (:func:`combine_experts`) are made,
    nor their gradients: 6 GiB each at 64K tokens, top-8, width 6144."""
    flat = expert.flatten()                                                      # [T*k]
    order = torch.argsort(flat, stable=True)                                     # assignments by expert
    counts = torch.zeros(moe.n_experts, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)                                      # [E] group ends
    return moe.routed_sum(x, offs, order, weight)


def expert_rows(x: Tensor, order: Tensor) -> Tensor:
    """Each token's row once per assignment, in ``order`` [A = T*k] (assignment ``order[i]`` is token
    ``order[i] // k``'s): [A, h]. Its backward sums each token's k gradients over k, in a fixed order (as a
    gather ``x[order // k]`` would, with atomics: a different sum from run to run)."""
    T, A = x.shape[0], order.shape[0]
    return x.unsqueeze(1).expand(T, A // T, x.shape[1]).flatten(0, 1)[order]


def combine_experts(ys: Tensor, weight: Tensor, order: Tensor) -> Tensor:
    """Expert rows ``ys`` [A, h] (row ``i`` is assignment ``order[i]``) back to each token's weighted sum over its
    k experts [T, h]: the rows read back in assignment order (a gather by the inverse of ``order``, which a
    compiler fuses into the sum), then a sum over k in fp32, in a fixed order (an ``index_add`` of the rows into
    their tokens adds k rows per token with atomics, in a different order from run to run)."""
    T, k = weight.shape
    back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    rows = ys[back].view(T, k, ys.shape[1])                                      # [T, k, h] by assignment
    wide = torch.promote_types(ys.dtype, torch.float32)                          # bf16 rows: summed in fp32
    return (rows.to(wide) * weight.to(wide).unsqueeze(-1)).sum(1).to(ys.dtype)  # [T, h]


class DecoderLayer(nn.Module):
    """Pre-norm MLA + (dense MLP | MoE). Full layers compute top-k IDs; shared layers consume the IDs
    passed in. With ``recompute`` (from ``cfg.recompute``; ``compile.apply_ac`` switches it) the body runs
    under non-reentrant checkpointing inside this forward, so compiling the forward compiles
    checkpoint(body) as one graph (``compile.apply_compile``)."""

    def __init__(self, cfg: GLM52Config, layer_id: int, compute_topk: bool, moe: bool):
        super().__init__()
        self.layer_id, self.compute_topk, self.recompute = layer_id, compute_topk, cfg.recompute
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MLA(cfg, compute_topk)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.fp8)

    def forward(self, x: Tensor, positions: Tensor, starts: Tensor, ends: Tensor,
                topk_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if not self.compute_topk and topk_ids is None:
            raise ValueError(f"DecoderLayer {self.layer_id} shares top-k IDs: pass the last full layer's "
                             f"topk_ids (see GLM52Config.index_topk_freq/index_topk_offset)")
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._body, x, positions, starts, ends, topk_ids, use_reentrant=False)
        return self._body(x, positions, starts, ends, topk_ids)

    def _body(self, x, positions, starts, ends, topk_ids):
        h, topk_ids = self.attn(self.attn_norm(x), positions, starts, ends, topk_ids)
        x = x + h                                                                # [T, hidden]
        x = x + self.mlp(self.ffn_norm(x))
        return x, topk_ids


@torch.no_grad()
def init_weights(root: nn.Module, std: float) -> nn.Module:
    """Normal(0, std) for linear, embedding and expert weights; ones/zeros for norms. Any module tree
    (the model, or one DecoderLayer built alone for a benchmark)."""
    for m in root.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, MoE):
            for p in (m.gate, m.w_gate, m.w_up, m.w_down):
                nn.init.normal_(p, std=std)
        elif isinstance(m, (RMSNorm, nn.LayerNorm)):
            nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    return root


def decoder_layers(root: nn.Module) -> list[DecoderLayer]:
    """Every decoder layer in ``root`` (a model: main then MTP layers; or one layer, or a wrapper)."""
    return [m for m in root.modules() if isinstance(m, DecoderLayer)]


def mtp_layer(cfg: GLM52Config, layer_id: int) -> MTPLayer:
    """One MTP layer from this file's pieces; its decoder layer is MoE and reuses the main layers' IDs."""
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    return MTPLayer(enorm=RMSNorm(h, eps), hnorm=RMSNorm(h, eps), eh_proj=Linear(2 * h, h, cfg.fp8),
                    block=DecoderLayer(cfg, layer_id, compute_topk=False, moe=True), norm=RMSNorm(h, eps))


class GLM52ForCausalLM(nn.Module):
    """``loss = model(input_ids, labels=labels)``: main next-token loss + weighted MTP loss.

    ``input_ids`` is [B, S] (B sequences of length S) or [T] packed with ``cu_seqlens`` (int, [n+1]).
    ``labels`` has the same shape and is aligned: labels[t] is the token to predict at position t
    (-100 = ignore). Without labels the logits are returned.

    A rank of a parallel run holds a slice of a packed global batch (``glm52_model.parallel.shard_batch``)
    and passes what it cannot derive from its tokens: ``positions``, ``starts`` and ``ends`` (key ranges in
    the coordinates of the keys its attention reads), ``mtp_targets`` (built on whole sequences) and the
    global counts ``num_labels`` / ``num_mtp_targets`` that the loss sums are divided by, so that the ranks'
    losses add up to the loss of the global batch.
    """

    def __init__(self, cfg: GLM52Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, cfg.is_full_topk_layer(i), cfg.is_moe_layer(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.head.weight = self.embed.weight
        self.mtp = nn.ModuleList(mtp_layer(cfg, cfg.num_layers + i) for i in range(cfg.mtp_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_weights(self, self.cfg.init_std)

    def num_params(self, include_mtp: bool = True) -> int:
        """Parameter count (shared tensors once; the MTP layer reuses the main embedding and head)."""
        return sum(p.numel() for n, p in self.named_parameters() if include_mtp or not n.startswith("mtp."))

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, cu_seqlens: Tensor | None = None, *,
                positions: Tensor | None = None, starts: Tensor | None = None, ends: Tensor | None = None,
                mtp_targets: Tensor | None = None, num_labels: int | None = None,
                num_mtp_targets: int | None = None) -> Tensor:
        ids = input_ids.reshape(-1)                                              # [T]
        positions, starts, ends, seq_end = self._ranges(input_ids, cu_seqlens, positions, starts, ends)
        x = self.embed(ids)                                                      # [T, hidden]
        topk_ids = None
        for layer in self.layers:
            x, topk_ids = layer(x, positions, starts, ends, topk_ids)
        h = self.norm(x)
        if labels is None:
            return self.head(h).float().view(*input_ids.shape, -1)                # [..., vocab]
        labels = labels.reshape(-1)
        loss = head_loss(h, self.head.weight, labels, num_labels)                # head + cross-entropy, by chunks
        if self.mtp:
            if mtp_targets is None and seq_end is None:
                raise ValueError("GLM52ForCausalLM: with positions/starts/ends pass mtp_targets too (they look "
                                 "one token ahead, past a rank's slice; see parallel.shard_batch)")
            if mtp_targets is None:
                mtp_targets = mtp_labels(labels, seq_end)
            loss = loss + self.cfg.mtp_loss_weight * mtp_loss(
                self, x, labels, mtp_targets, positions, starts, ends, topk_ids, num_mtp_targets)
        return loss

    def _ranges(self, input_ids, cu_seqlens, positions, starts, ends):
        """(positions, starts, ends, seq_end): given by a parallel rank, else from ``cu_seqlens``."""
        if positions is not None:
            if starts is None or ends is None:
                raise ValueError("GLM52ForCausalLM: pass positions, starts and ends together")
            if cu_seqlens is not None:
                raise ValueError("GLM52ForCausalLM: pass either cu_seqlens or positions/starts/ends, not both")
            return positions, starts, ends, None
        T = input_ids.numel()
        if cu_seqlens is None:
            B = input_ids.shape[0] if input_ids.dim() == 2 else 1
            cu_seqlens = torch.arange(B + 1, device=input_ids.device) * (T // B)
        return packed_ranges(cu_seqlens, T)
