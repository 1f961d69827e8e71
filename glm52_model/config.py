"""GLM-5.2 model configuration: one typed dataclass and three presets (``tiny``, ``bench``, ``glm52``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["GLM52Config", "PRESETS"]

PRESETS = ("tiny", "bench", "glm52")  # classmethods of GLM52Config, smallest first


@dataclass(kw_only=True)
class GLM52Config:
    # -- sizes
    vocab_size: int = 154880                 # tokenizer vocabulary
    hidden_size: int = 6144                  # model width
    num_layers: int = 78                     # main decoder layers (MTP layers not included)
    first_k_dense: int = 3                   # the first k layers use a dense SwiGLU MLP, the rest MoE
    intermediate_size: int = 12288           # dense MLP hidden width
    # -- MLA attention
    num_heads: int = 64                      # attention heads
    q_lora_rank: int = 2048                  # query latent width (wq_a -> q_norm -> wq_b)
    kv_lora_rank: int = 512                  # shared key/value latent width (also the value latent)
    qk_nope_head_dim: int = 192              # per-head query/key width without RoPE
    qk_rope_head_dim: int = 64               # per-head (and shared key) RoPE width
    v_head_dim: int = 256                    # per-head value width after un-absorbing wkv_b
    # -- DSA lightning indexer
    index_n_heads: int = 32                  # indexer query heads
    index_head_dim: int = 128                # indexer head width; RoPE on its first qk_rope_head_dim dims
    index_topk: int = 2048                   # keys kept per query
    index_topk_freq: int = 4                 # layers >= offset compute top-k every freq-th layer ...
    index_topk_offset: int = 3               # ... layers < offset always do: full = 0,1,2,6,10,...
    # -- MoE
    num_experts: int = 256                   # routed experts
    num_experts_per_tok: int = 8             # routed experts per token (top-k)
    num_shared_experts: int = 1              # always-on shared experts (fused into one MLP)
    moe_intermediate_size: int = 2048        # expert hidden width (shared expert: times num_shared)
    routed_scaling_factor: float = 2.5       # scale applied to the normalised routing weights
    # -- misc
    rope_theta: float = 8e6                  # RoPE base
    rms_norm_eps: float = 1e-5               # RMSNorm epsilon
    tie_word_embeddings: bool = False        # GLM-5.2 keeps the output head separate
    mtp_layers: int = 1                      # multi-token-prediction depth (0 or 1)
    mtp_loss_weight: float = 0.3             # weight of the MTP loss in the training loss
    # -- training options
    fp8: bool = False                        # tile-wise FP8 GEMMs in the projection Linears
    fp8_experts: bool = False                # tile-wise FP8 grouped GEMMs in the routed experts
    fp8_indexer: bool = False                # the indexer's logits from e4m3 q and k (needs index_head_dim 128)
    recompute: bool = True                   # activation checkpointing around every decoder layer
    init_std: float = 0.02                   # normal init std of weights

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"GLM52Config: {msg}")

        need(self.mtp_layers in (0, 1), f"mtp_layers={self.mtp_layers} is not supported; use 0 or 1")
        need(0 <= self.first_k_dense <= self.num_layers,
             f"first_k_dense={self.first_k_dense} must be in [0, num_layers={self.num_layers}]")
        need(self.index_topk_freq >= 1, f"index_topk_freq={self.index_topk_freq} must be >= 1")
        need(self.index_topk_offset >= 1,
             f"index_topk_offset={self.index_topk_offset} must be >= 1 (layer 0 has no IDs to reuse)")
        need(self.num_experts_per_tok <= self.num_experts,
             f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        need(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.index_head_dim,
             f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= index_head_dim")
        need(not self.fp8_indexer or self.index_head_dim == 128,
             f"fp8_indexer needs index_head_dim=128 (one e4m3 scale per head row), got {self.index_head_dim}")
        for name in ("num_layers", "hidden_size", "num_heads", "kv_lora_rank", "index_topk", "num_experts"):
            need(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be positive")

    # -- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Width of the absorbed key latent shared by all heads (kv_lora + rope; 576 in GLM-5.2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_full_topk_layer(self, layer_id: int) -> bool:
        """Whether main layer ``layer_id`` computes its own top-k (else it reuses the last full layer's)."""
        if layer_id < self.index_topk_offset:
            return True
        return (layer_id - self.index_topk_offset) % self.index_topk_freq == self.index_topk_freq - 1

    def full_topk_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_full_topk_layer(i)]

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense

    def expected_num_params(self, include_mtp: bool = True) -> int:
        """Analytic parameter count of :class:`GLM52ForCausalLM` (the e_score_correction_bias buffers
        are not parameters). Shared-top-k layers own no indexer: they never compute top-k."""
        h, H, V = self.hidden_size, self.num_heads, self.vocab_size
        ql, kl, r = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim
        Hi, Di = self.index_n_heads, self.index_head_dim
        attn = (h * ql + ql + ql * H * self.qk_head_dim + h * (kl + r) + kl
                + kl * H * (self.qk_nope_head_dim + self.v_head_dim) + H * self.v_head_dim * h)
        indexer = ql * Hi * Di + h * Di + 2 * Di + h * Hi
        dense = 3 * h * self.intermediate_size
        Im = self.moe_intermediate_size
        moe = self.num_experts * h + 3 * self.num_experts * h * Im + 3 * h * Im * self.num_shared_experts

        def layer(i: int, full: bool, is_moe: bool) -> int:
            return 2 * h + attn + (indexer if full else 0) + (moe if is_moe else dense)

        total = sum(layer(i, self.is_full_topk_layer(i), self.is_moe_layer(i)) for i in range(self.num_layers))
        total += V * h + h + (0 if self.tie_word_embeddings else V * h)          # embedding, norm, head
        if include_mtp:
            total += self.mtp_layers * (2 * h + 2 * h * h + layer(-1, False, True) + h)
        return total

    # -- presets
    @classmethod
    def preset(cls, name: str, **overrides) -> "GLM52Config":
        """The preset called ``name`` (one of :data:`PRESETS`) with ``overrides`` applied."""
        if name not in PRESETS:
            raise ValueError(f"GLM52Config.preset: unknown preset {name!r}; valid presets are {', '.join(PRESETS)}")
        return getattr(cls, name)(**overrides)

    @classmethod
    def _preset(cls, base: dict, overrides: dict) -> "GLM52Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"GLM52Config: unknown option(s) {unknown}; valid options are {sorted(known)}")
        return cls(**{**base, **overrides})

    @classmethod
    def glm52(cls, **overrides) -> "GLM52Config":
        """The public GLM-5.2 sizes (shape checks, meta-device construction; not for running on CPU)."""
        return cls._preset({}, overrides)

    @classmethod
    def bench(cls, **overrides) -> "GLM52Config":
        """GLM-5.2 widths for ONE MoE decoder layer that computes top-k, 8 experts, no MTP and a 32K
        vocabulary: one H200 holds it (with its logits) at 16K-64K packed tokens. With ``fp8=True`` the
        routed experts join the FP8 recipe too (``fp8_experts`` follows ``fp8`` unless given), as in
        DeepSeek-V3's FP8 training (the step time and loss against bf16 experts: docs/results.md)."""
        base = dict(num_layers=1, first_k_dense=0, mtp_layers=0, num_experts=8, vocab_size=32768,
                    fp8_experts=bool(overrides.get("fp8", False)))
        return cls._preset(base, overrides)

    @classmethod
    def tiny(cls, **overrides) -> "GLM52Config":
        """CPU-test size with every feature on: layer 0 dense + full top-k, layer 1 MoE + full top-k,
        layer 2 MoE + shared top-k (reuses layer 1's IDs), one MTP layer (shares layer 2's IDs)."""
        base = dict(
            vocab_size=512, hidden_size=256, num_layers=3, first_k_dense=1, intermediate_size=512,
            num_heads=2, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=64,
            v_head_dim=64, index_n_heads=2, index_head_dim=128, index_topk=32, index_topk_freq=2,
            index_topk_offset=2, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
            moe_intermediate_size=128, rope_theta=10000.0, mtp_layers=1,
        )
        return cls._preset(base, overrides)
