"""Sequence, expert and fully-sharded data parallelism for the GLM-5.2 layers, traceable whole.

Parallelism plugs into the model's hooks (attributes holding a callable), never into its forwards:
:func:`apply_sp` sets ``Indexer.gather_keys`` and ``MLA.gather_kv`` to an :class:`AllGather`, and
:func:`apply_ep` sets ``MoE.dispatch`` to an :class:`ExpertParallel`. Parameter names do not change.

Every collective inside a decoder layer is a functional collective (``torch.distributed._functional_
collectives``), so ``compile(checkpoint(layer))`` with ``fullgraph=True`` keeps the layer one graph with
the collectives in it, and sacpass partitions that graph like any other.

Layout of ranks (world = dp * sp; ep divides world):

- **SP** groups are ``sp`` consecutive ranks; one group holds one data-parallel block of whole sequences,
  each rank a contiguous slice of the block's packed tokens. Inside the layer the indexer keys [T, 128]
  and the absorbed KV latent [T, 576] are all-gathered over the group; each rank scores its own queries
  against the group's keys with key ranges in block coordinates. The KV gather is differentiable: its
  backward reduce-scatters (sums) the KV gradient back to the rank that owns the rows.
- **EP** groups are ``ep`` consecutive ranks; expert ``e`` lives on group rank ``e // (E / ep)``. Tokens
  are per-rank data in every layout (SP splits them too), so any ``ep`` ranks can form an EP group.
  Routed assignments travel with ``all_to_all_single`` (autograd) and come back the same way. Two
  dispatchers, both one graph for any routing (see :class:`ExpertParallel` and docs/distributed.md):
  ``"padded"`` (static [ep, capacity, hidden] buffers, no host sync) and ``"dynamic"`` (exact split sizes
  exchanged first, read with ``.tolist()`` as unbacked SymInts: needs ``capture_scalar_outputs``).
- **FSDP2**: :func:`apply_fsdp` shards every decoder layer and the root over the whole world. Every
  rank sees distinct tokens, so gradients are summed, not averaged (the loss is already normalised by the
  global token count).

Gradient bookkeeping without FSDP: parameters are replicated over the world (experts over the ranks that
hold the same expert shard); :func:`sync_grads` sums their gradients there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from .model import GLM52ForCausalLM, MoE, combine_experts, decoder_layers, expert_rows, packed_ranges
from .mtp import mtp_labels

__all__ = ["ParallelDims", "ParallelGroups", "Shard", "AllGather", "ExpertParallel", "ParallelCausalLM",
           "apply_sp", "apply_ep", "apply_fsdp", "shard_batch", "sync_grads", "expert_slice", "DISPATCHERS"]

DISPATCHERS = ("padded", "dynamic")
_ROW_ALIGN = 16  # expert rows are padded to a multiple of this


# ---------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class ParallelDims:
    world: int   # number of ranks
    sp: int = 1  # sequence-parallel degree (ranks sharing one block of sequences)
    ep: int = 1  # expert-parallel degree (ranks sharing one set of experts)
    fsdp: bool = False  # fully_shard every decoder layer and the root over the world

    def __post_init__(self) -> None:
        for name in ("sp", "ep"):
            v = getattr(self, name)
            if v < 1 or self.world % v:
                raise ValueError(f"ParallelDims: --{name} {v} must be >= 1 and divide the world size {self.world}")
        if self.fsdp and self.ep > 1:
            raise ValueError("ParallelDims: --fsdp with --ep > 1 is not supported (expert weights need their own "
                             "FSDP mesh over the ranks that hold the same experts); drop --fsdp or use --ep 1")

    @property
    def dp(self) -> int:
        """Data-parallel blocks: groups of sp ranks holding different sequences."""
        return self.world // self.sp


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups, as group names (strings trace cleanly under dynamo)."""

    sp: str | None         # SP group (None when sp == 1)
    sp_rank: int
    ep: str | None         # EP group (None when ep == 1)
    ep_rank: int
    expert_dp: str | None  # ranks holding the same expert shard (None when world == ep)
    world: str

    @classmethod
    def build(cls, dims: ParallelDims) -> "ParallelGroups":
        """Create the groups (collective: every rank calls it, in the same order)."""
        rank, world = dist.get_rank(), dims.world

        def consecutive(size: int) -> str | None:
            if size == 1:
                return None
            mine = None
            for start in range(0, world, size):
                g = dist.new_group(list(range(start, start + size)))
                if start <= rank < start + size:
                    mine = g
            return mine.group_name

        def strided(stride: int) -> str | None:
            if world // stride == 1:
                return None
            mine = None
            for first in range(stride):
                ranks = list(range(first, world, stride))
                g = dist.new_group(ranks)
                if rank in ranks:
                    mine = g
            return mine.group_name

        return cls(sp=consecutive(dims.sp), sp_rank=rank % dims.sp, ep=consecutive(dims.ep),
                   ep_rank=rank % dims.ep,
                   expert_dp=strided(dims.ep) if dims.ep > 1 else None, world=dist.group.WORLD.group_name)


# ------------------------------------------------------------------------------------------------- SP
@dataclass(frozen=True)
class AllGather:
    """``gather_keys`` / ``gather_kv`` hook of sequence parallelism: the rows of every rank of the SP group
    (``all_gather_single``; autograd: its backward reduce-scatters the gradient to the rows' owners)."""

    group: str  # SP group name

    def __call__(self, rows: Tensor) -> Tensor:
        return funcol.all_gather_single(rows, 0, self.group)                               # [sp*T, ...]


def apply_sp(model: GLM52ForCausalLM, group: str) -> None:
    """Make every decoder layer's attention sequence-parallel over ``group`` (in place): the indexer scores
    local queries against the group's keys (``starts``/``ends`` in block coordinates) and sparse MLA reads
    the group's KV latent."""
    for layer in decoder_layers(model):
        layer.attn.gather_kv = AllGather(group)
        if layer.attn.indexer is not None:
            layer.attn.indexer.gather_keys = AllGather(group)


# ------------------------------------------------------------------------------------------------- EP
def expert_slice(num_experts: int, ep: int, ep_rank: int) -> slice:
    n = num_experts // ep
    return slice(ep_rank * n, (ep_rank + 1) * n)


@dataclass(frozen=True)
class ExpertParallel:
    """``MoE.dispatch`` hook of expert parallelism: the routed experts are split over an EP group (the
    ``MoE`` keeps only its rank's slice of the expert weights); the router and shared expert are replicated.

    Per rank: sort the T*k assignments of the local tokens by expert (so by destination rank), send each to
    the rank owning its expert, run the local experts with grouped GEMMs over the received rows, send the
    results back, weight and sum them per token.

    ``mode="padded"``: every rank sends a [ep, C, hidden] buffer (C = capacity rows per destination) with
    static sizes, so the all-to-alls have fixed splits [C] * ep and nothing syncs with the host. C = T*k
    (the default, ``capacity_factor=None``) is dropless: no routing can overflow. With a capacity factor f,
    C = ceil(f * T * k / ep); assignments past C for one destination (in expert order, then token order)
    are dropped: they contribute zero to the token's output (the token still gets its shared expert and its
    other assignments), and their routing weights get no gradient. Padding rows are zeros and are grouped
    with the last local expert: zero in, zero out, zero weight gradient.

    ``mode="dynamic"``: the per-destination counts are exchanged first (a [ep] all-to-all), read with
    ``.tolist()`` and used as exact split sizes; dynamo turns them into unbacked SymInts (one graph for any
    routing) when ``torch._dynamo.config.capture_scalar_outputs`` is on. Never drops, no padding, but two
    host syncs per dispatch (and again when the backward recomputes the layer).
    """

    group: str                            # EP group name
    size: int                             # ranks in the group
    n_local: int                          # experts per rank
    mode: str = "padded"                  # one of DISPATCHERS
    capacity_factor: float | None = None  # padded mode: rows per destination = ceil(f * T * k / ep); None: dropless

    def __call__(self, moe: MoE, x: Tensor, expert: Tensor, weight: Tensor) -> Tensor:
        flat = expert.flatten()                                                  # [A = T*k]
        order = torch.argsort(flat, stable=True)                                 # assignments by expert
        fe = flat[order]                                                         # sorted expert IDs
        dst = fe // self.n_local                                                 # destination group rank
        local_e = fe - dst * self.n_local                                        # expert on the destination
        send_counts = torch.zeros(self.size, dtype=torch.long, device=x.device).scatter_add_(
            0, dst, torch.ones_like(dst))                                        # [ep]
        xs = expert_rows(x, order)                                               # [A, h] source rows
        if self.mode == "padded":
            y = self._padded(moe, xs, dst, local_e, send_counts)                 # [A, h], sorted order
        else:
            y = self._dynamic(moe, xs, local_e, send_counts)
        return combine_experts(y, weight, order)                                 # [T, h]

    def _experts(self, moe: MoE, xs: Tensor, e: Tensor) -> Tensor:
        """Run the local experts on rows ``xs`` [R, h] whose local expert is ``e`` [R] (padding rows carry
        ``n_local`` and are zeros); returns the rows in the order given. Rows are padded to a multiple of
        16 (``glm52::grouped_mm``'s backward on CPU needs 16-byte strides over the row dim)."""
        El, R = self.n_local, xs.shape[0]
        pad = (-R) % _ROW_ALIGN
        xs = torch.cat([xs, xs.new_zeros(pad, xs.shape[1])])
        e = torch.cat([e, e.new_full((pad,), El)])
        order = torch.argsort(e, stable=True)
        counts = torch.zeros(El + 1, dtype=torch.long, device=xs.device).scatter_add_(0, e, torch.ones_like(e))
        # padding rows (sorted last) join the last expert's group: zeros in, zeros out, no weight grad
        counts = torch.cat([counts[:El - 1], counts[El - 1:El] + counts[El:]])
        offs = counts[:El].cumsum(0).to(torch.int32)                            # [El] group ends
        ys = moe.grouped_ffn(xs[order], offs)
        return torch.empty_like(ys).index_copy(0, order, ys)[:R]                # back to arrival order

    def _capacity(self, A) -> int:
        if self.capacity_factor is None:
            return A
        pct = int(round(self.capacity_factor * 100))
        return torch.sym_max(1, torch.sym_min(A, (A * pct + self.size * 100 - 1) // (self.size * 100)))

    def _padded(self, moe: MoE, xs: Tensor, dst: Tensor, local_e: Tensor, send_counts: Tensor) -> Tensor:
        ep, (A, h) = self.size, xs.shape
        C = self._capacity(A)
        first = send_counts.cumsum(0) - send_counts                              # [ep] first row per dst
        pos = torch.arange(A, device=xs.device) - first[dst]                     # row within its dst
        slot = torch.where(pos < C, dst * C + pos, ep * C)                       # ep*C = dropped
        send = xs.new_zeros(ep * C + 1, h).index_copy(0, slot, xs)[:ep * C]      # [ep*C, h]
        send_e = torch.full((ep * C + 1,), self.n_local, dtype=torch.long, device=xs.device).index_copy(
            0, slot, local_e)[:ep * C]
        splits = [C] * ep
        recv = funcol.all_to_all_single(send, splits, splits, self.group)        # [ep*C, h]
        recv_e = funcol.all_to_all_single(send_e, splits, splits, self.group)
        out = self._experts(moe, recv, recv_e)
        back = funcol.all_to_all_single(out, splits, splits, self.group)         # [ep*C, h] slot order
        return torch.cat([back, back.new_zeros(1, h)])[slot]                     # [A, h], dropped -> 0

    def _dynamic(self, moe: MoE, xs: Tensor, local_e: Tensor, send_counts: Tensor) -> Tensor:
        A = xs.shape[0]
        recv_counts = funcol.all_to_all_single(send_counts, None, None, self.group)  # [ep]
        in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
        for s in (*in_splits, *out_splits):
            torch._check(s >= 0)
        torch._check(sum(in_splits) == A)
        recv = funcol.all_to_all_single(xs, out_splits, in_splits, self.group)       # [R, h]
        recv_e = funcol.all_to_all_single(local_e, out_splits, in_splits, self.group)
        out = self._experts(moe, recv, recv_e)
        return funcol.all_to_all_single(out, in_splits, out_splits, self.group)      # [A, h]


def apply_ep(model: GLM52ForCausalLM, group: str, ep_size: int, ep_rank: int, dispatch: str = "padded",
             capacity_factor: float | None = None) -> None:
    """Keep only this rank's experts in every MoE layer and dispatch over ``group`` (in place; parameter
    names unchanged, the expert weights sliced to [E / ep_size, ...])."""
    if dispatch not in DISPATCHERS:
        raise ValueError(f"apply_ep: dispatch={dispatch!r} is not one of {DISPATCHERS}")
    E = model.cfg.num_experts
    if E % ep_size:
        raise ValueError(f"apply_ep: num_experts={E} must be divisible by --ep {ep_size}")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"apply_ep: capacity_factor={capacity_factor} must be positive (None = dropless)")
    sl = expert_slice(E, ep_size, ep_rank)
    for layer in decoder_layers(model):
        moe = layer.mlp
        if not isinstance(moe, MoE):
            continue
        for name in ("w_gate", "w_up", "w_down"):
            setattr(moe, name, nn.Parameter(getattr(moe, name).detach()[sl].clone()))
        moe.dispatch = ExpertParallel(group, ep_size, E // ep_size, dispatch, capacity_factor)


# ---------------------------------------------------------------------------------------------- FSDP2
def apply_fsdp(wrapper: "ParallelCausalLM", reshard_after_forward: bool = True) -> None:
    """fully_shard every decoder layer, then the root (embedding, head, norms, MTP projections), over the
    world. Gradients are summed across ranks (divide factor 1): the loss is normalised globally."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(wrapper):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(wrapper, reshard_after_forward=reshard_after_forward)
    for m in wrapper.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


# ---------------------------------------------------------------------------------------------- batch
@dataclass(frozen=True)
class Shard:
    """One rank's tokens of a global batch and what the loss needs to be normalised globally."""

    ids: Tensor          # [T] int64 local tokens
    labels: Tensor       # [T] next-token labels (-100 = ignore)
    mtp_targets: Tensor  # [T] MTP targets (token t+2), computed on whole sequences
    positions: Tensor    # [T] position within the sequence (RoPE)
    starts: Tensor       # [T] int32 key range start, in SP-block coordinates
    ends: Tensor         # [T] int32 key range end (causal), in SP-block coordinates
    n_labels: int        # valid labels in the whole global batch
    n_mtp: int           # valid MTP targets in the whole global batch


def shard_batch(ids: Tensor, labels: Tensor, dims: ParallelDims, rank: int) -> Shard:
    """Split a global batch [B, S] (every rank holds the same one): the dp block ``rank // sp`` gets
    B / dp whole sequences, packed; SP rank ``rank % sp`` gets a contiguous 1/sp of its packed tokens.
    MTP targets are built on whole sequences before slicing (they look one token ahead)."""
    B, S = ids.shape
    if B % dims.dp:
        raise ValueError(f"shard_batch: batch {B} must be divisible by the data-parallel degree {dims.dp}")
    Tb = (B // dims.dp) * S
    if Tb % dims.sp:
        raise ValueError(f"shard_batch: {Tb} tokens per block must be divisible by --sp {dims.sp}")
    n_labels = int((labels != -100).sum())
    cu = torch.arange(B + 1) * S
    _, _, _, seq_end = packed_ranges(cu, B * S)
    all_mtp = mtp_labels(labels.reshape(-1), seq_end)
    d, s = divmod(rank, dims.sp)
    blk = slice(d * Tb, (d + 1) * Tb)
    positions, starts, ends, _ = packed_ranges(torch.arange(B // dims.dp + 1) * S, Tb)
    Tl = Tb // dims.sp
    loc = slice(s * Tl, (s + 1) * Tl)
    take = lambda t: t[blk][loc].contiguous()  # noqa: E731
    return Shard(ids=take(ids.reshape(-1)), labels=take(labels.reshape(-1)), mtp_targets=take(all_mtp),
                 positions=positions[loc], starts=starts[loc], ends=ends[loc], n_labels=n_labels,
                 n_mtp=int((all_mtp != -100).sum()))


# ----------------------------------------------------------------------------------------------- loss
class ParallelCausalLM(nn.Module):
    """FSDP2's root around a (parallelised) :class:`GLM52ForCausalLM`: ``forward(shard)`` returns this rank's
    share of the global loss (sums of token losses over global counts), so the shares add up to the
    single-rank loss of the global batch and summed gradients equal its gradients."""

    def __init__(self, model: GLM52ForCausalLM):
        super().__init__()
        self.model = model

    def forward(self, b: Shard) -> Tensor:
        return self.model(b.ids, b.labels, positions=b.positions, starts=b.starts, ends=b.ends,
                          mtp_targets=b.mtp_targets, num_labels=b.n_labels, num_mtp_targets=b.n_mtp)


def _is_expert_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down") and ".mlp." in name


@torch.no_grad()
def sync_grads(model: nn.Module, groups: ParallelGroups) -> None:
    """Sum gradients of replicated parameters (without FSDP): experts over ``expert_dp``, the rest over
    the world. One flat all-reduce per group."""
    buckets: dict[str, list[Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = groups.expert_dp if (_is_expert_param(name) and groups.ep is not None) else groups.world
        if g is not None:
            buckets.setdefault(g, []).append(p.grad)
    for g, grads in buckets.items():
        flat = torch.cat([t.reshape(-1) for t in grads])
        dist.all_reduce(flat, group=_pg(g))
        off = 0
        for t in grads:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()


def _pg(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)
