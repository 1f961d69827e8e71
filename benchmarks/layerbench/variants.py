"""The benchmarked layer, its inputs, and the variants: named builders in :data:`VARIANTS`.

A variant gets a private copy of the layer and the inner backend name (``"inductor"`` or ``"aot_eager"``) and
returns a :class:`Built`: the function a step calls and what it was compiled with. Adding one is a decorated
function here; the run order, tables and plot pick it up (add it to :data:`RUN_ORDER` to run it by default).
"""
from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import sacpass
from glm52_model import GLM52Config
from glm52_model.compile import apply_ac, apply_compile, mark_tokens_dynamic
from glm52_model.model import DecoderLayer, init_weights, packed_ranges
from sacpass.passes.checkpoint_regions import always_recompute_context_fn

TOPK_OP = torch.ops.glm52.dsa_topk_indices.default
CONTROL = "full_recompute"


# ------------------------------------------------------------------------------------------ the layer
def build_layer(cfg: GLM52Config, device: torch.device, dtype: torch.dtype, compute_topk: bool = True,
                seed: int = 0) -> DecoderLayer:
    """One MoE decoder layer initialised with ``glm52_model.model.init_weights`` (as the model is)."""
    torch.manual_seed(seed)
    with torch.device(device):
        layer = DecoderLayer(cfg, 0, compute_topk=compute_topk, moe=True)
    init_weights(layer, cfg.init_std)
    return layer.to(dtype)


def make_inputs(S: int, cfg: GLM52Config, device, dtype, seed: int = 1):
    """(x [S, hidden], positions, starts, ends) of one packed sequence of S tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed + S)
    x = torch.randn(S, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    cu = torch.tensor([0, S], device=device)
    positions, starts, ends, _ = packed_ranges(cu, S)
    return x, positions, starts, ends


# ------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Built:
    fn: Callable                  # (x, positions, starts, ends[, topk_ids]) -> (out, topk_ids)
    backend: object               # what torch.compile was given (a sacpass Backend has .reports)
    label: str                    # the backend as the results name it
    fullgraph: bool = True        # compiled with fullgraph=True


@dataclass(frozen=True)
class VariantSpec:
    name: str
    build: Callable[[DecoderLayer, str], Built]   # (private layer copy, inner backend name) -> Built
    doc: str                                       # one line for --help and the docs
    style: dict = field(default_factory=dict)      # matplotlib line style in the plot


VARIANTS: dict[str, VariantSpec] = {}
RUN_ORDER = ("full_recompute", "sacpass", "pytorch_sac", "island", "no_ac")   # sacpass compiles before SAC


def variant(name: str, **style) -> Callable:
    """Register the decorated builder as variant ``name`` (its docstring is the variant's description)."""
    def register(build: Callable[[DecoderLayer, str], Built]) -> Callable:
        VARIANTS[name] = VariantSpec(name, build, (build.__doc__ or "").strip(), style)
        return build
    return register


class Variant:
    """A registered variant (or ``"eager"``: the model's own checkpoint, not compiled) built over a private
    copy of ``base``. ``dynamic``: mark the token dim dynamic on every call (one compile for every S)."""

    def __init__(self, name: str, base: DecoderLayer, dynamic: bool, backend: str = "inductor"):
        if name != "eager" and name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        self.name, self.dynamic = name, dynamic
        self.layer = copy.deepcopy(base)
        if name == "eager":
            built = Built(apply_ac(self.layer), None, "eager", fullgraph=False)
        else:
            built = VARIANTS[name].build(self.layer, backend)
        self.fn, self.backend, self.backend_name, self.fullgraph = (built.fn, built.backend, built.label,
                                                                    built.fullgraph)

    def __call__(self, x, positions, starts, ends, topk_ids=None):
        if self.dynamic:
            mark_tokens_dynamic(x, positions, starts, ends, topk_ids)
        if topk_ids is None:
            return self.fn(x, positions, starts, ends)
        return self.fn(x, positions, starts, ends, topk_ids)


# ------------------------------------------------------------------------------------------- variants
def save_topk_context():
    return create_selective_checkpoint_contexts([TOPK_OP])


class CheckpointLayer(torch.nn.Module):
    """checkpoint(layer, context_fn=...) placed by hand around a layer whose own checkpoint is off:
    PyTorch SAC (save the top-k op) or the control (recompute every op)."""

    def __init__(self, layer, context_fn):
        super().__init__()
        self.layer, self.context_fn = layer, context_fn

    def forward(self, *args):
        return checkpoint(self.layer, *args, use_reentrant=False, context_fn=self.context_fn)


def _model_checkpoint(layer: DecoderLayer, backend, label: str, recompute: bool) -> Built:
    apply_compile(apply_ac(layer, recompute), backend=backend, fullgraph=True)
    return Built(layer, backend, label)


def _checkpoint_by_hand(layer: DecoderLayer, backend: str, context_fn) -> Built:
    apply_ac(layer, False)
    return Built(torch.compile(CheckpointLayer(layer, context_fn), backend=backend, fullgraph=True), backend,
                 backend)


@variant("no_ac", color="tab:gray")
def _no_ac(layer, backend):
    """no checkpoint, compiled with fullgraph=True (upper bound on speed)"""
    return _model_checkpoint(layer, backend, backend, recompute=False)


@variant("full_recompute", color="tab:blue")
def _full_recompute(layer, backend):
    """the control: checkpoint(..., context_fn=PyTorch SAC contexts, always PREFER_RECOMPUTE) under plain
    torch.compile: the backward replays the whole forward, the DSA top-k included (what torch >= 2.13 runs
    for a plain checkpoint)"""
    return _checkpoint_by_hand(layer, backend, always_recompute_context_fn)


@variant("island", color="tab:red")
def _island(layer, backend):
    """the public workaround: the top-k call in torch._dynamo.disable (graph breaks there), kept by an eager
    selective checkpoint around the compiled layer"""
    # compile(checkpoint(layer)) with a graph break inside the checkpoint body runs the WHOLE body eagerly
    # (measured: 0 compiled graphs), so the island is built the way the workaround is used: an eager
    # selective checkpoint around the compiled layer, whose top-k call is swapped for a disabled one
    apply_ac(layer, False)
    ind = layer.attn.indexer
    ind.forward = types.MethodType(_island_indexer_forward, ind)
    compiled = torch.compile(layer, backend=backend, fullgraph=False)

    def fn(x, positions, starts, ends):
        return checkpoint(compiled, x, positions, starts, ends, use_reentrant=False,
                          context_fn=save_topk_context)
    return Built(fn, backend, backend, fullgraph=False)


@variant("pytorch_sac", color="tab:orange", marker="s")
def _pytorch_sac(layer, backend):
    """checkpoint(..., context_fn=create_selective_checkpoint_contexts([dsa_topk_indices])) under
    torch.compile(fullgraph=True)"""
    return _checkpoint_by_hand(layer, backend, save_topk_context)


@variant("sacpass", color="tab:green", marker="o")
def _sacpass(layer, backend):
    """the model's own checkpoint call, compiled with sacpass.backend() (its inner compiler: --backend)"""
    be = sacpass.backend(inner="inductor" if backend == "inductor" else "aot_eager")
    return _model_checkpoint(layer, be, f"sacpass({be.inner})", recompute=True)


@variant("plain_ac", color="tab:purple", ls=":")
def _plain_ac(layer, backend):
    """(not run by default) the model's own plain checkpoint under plain torch.compile: equal to the control
    on torch >= 2.13; up to 2.12 the ops inside custom autograd.Functions (the FP8 linears) stay untagged,
    so they are saved, not recomputed"""
    return _model_checkpoint(layer, backend, backend, recompute=True)


def _island_indexer_forward(self, x, q_latent, cos, sin, starts, ends):
    """``Indexer.forward`` with the top-k op call moved out of the compiled graph (the eager island).
    Mirrors glm52_model.model.Indexer.forward line for line except for the call."""
    T = x.shape[0]
    q = self._rope(self.wq_b(q_latent).view(T, self.n_heads, self.head_dim), cos, sin)
    k = self.gather_keys(self._rope(self.k_norm(self.wk(x)), cos, sin))
    w = self.weights_proj(x).float() * self.n_heads ** -0.5
    return _island_topk(q, k, w, starts, ends, self.topk, self.head_dim ** -0.5)


@torch._dynamo.disable
def _island_topk(q, k, w, starts, ends, topk, scale):
    return torch.ops.glm52.dsa_topk_indices(q, k, w, starts, ends, topk, scale)


# ------------------------------------------------------------------------ the memory-speed frontier
HOST_GIB = float(__import__("os").environ.get("SACPASS_BENCH_HOST_GIB", "16"))  # planner host budget per layer


def _sacpass_variant(layer, backend, label: str, **options) -> Built:
    be = sacpass.backend(inner="inductor" if backend == "inductor" else "aot_eager", **options)
    return _model_checkpoint(layer, be, f"{label}({be.inner})", recompute=True)


@variant("sacpass_no_discrete", color="tab:olive", ls="--")
def _sacpass_no_discrete(layer, backend):
    """sacpass without its discrete-decision default (save_discrete=False): the routers' top-k recomputed"""
    return _sacpass_variant(layer, backend, "sacpass-no-discrete", save_discrete=False)


# ---------------------------------------------------------------------- precision choices, side by side
# (The layer's CUDA kernels always run the ops' default configs; other kernel configs are timed by
# benchmarks/bench_kernels.py, which passes them to the launchers.)
def _precision(layer: DecoderLayer, experts: bool | None = None, indexer: bool | None = None) -> DecoderLayer:
    """Set this private copy's routed experts / indexer logits to FP8 (True) or the compute dtype (False),
    what ``GLM52Config(fp8_experts=..., fp8_indexer=...)`` builds; None keeps the preset's choice. Same
    weights, so the variants run beside each other in one process."""
    if experts is not None:
        layer.mlp.fp8_experts = experts
    if indexer is not None:
        layer.attn.indexer.fp8 = indexer
    return layer


def add_experts_option(parser) -> None:
    """``--experts {fp8,bf16}``: the routed-expert GEMMs of the benchmarks' models (default: the preset's)."""
    parser.add_argument("--experts", default=None, choices=("fp8", "bf16"),
                        help="routed-expert GEMMs: tile-wise FP8 (glm52::fp8_grouped_mm) or the compute dtype "
                             "(default: the preset's; the bench preset runs them in FP8 with the FP8 linears)")


def experts_overrides(args) -> dict:
    """The ``GLM52Config`` overrides ``--experts`` asks for ({} keeps the preset's choice)."""
    return {} if args.experts is None else {"fp8_experts": args.experts == "fp8"}


@variant("sacpass_bf16_experts", color="tab:orange", ls=":")
def _sacpass_bf16_experts(layer, backend):
    """sacpass with the routed experts in the compute dtype (glm52::grouped_mm), the other kernels current"""
    return _sacpass_variant(_precision(layer, experts=False), backend, "sacpass-bf16-experts")


@variant("sacpass_fp8_experts", color="tab:red", ls=":")
def _sacpass_fp8_experts(layer, backend):
    """sacpass with the routed experts in tile-wise FP8 (glm52::fp8_grouped_mm; the bench preset's default with
    fp8, where this equals sacpass)"""
    return _sacpass_variant(_precision(layer, experts=True), backend, "sacpass-fp8-experts")


@variant("sacpass_fp8_indexer", color="tab:purple", ls=":")
def _sacpass_fp8_indexer(layer, backend):
    """sacpass with the indexer's logits from e4m3 q and k (same top-k op, k_scale given; experts as the preset
    has them: FP8 in the bench preset with fp8)"""
    return _sacpass_variant(_precision(layer, indexer=True), backend, "sacpass-fp8-indexer")


@variant("sacpass_fp8_all", color="black", ls=":")
def _sacpass_fp8_all(layer, backend):
    """sacpass with both: FP8 routed experts and FP8 indexer logits"""
    return _sacpass_variant(_precision(layer, experts=True, indexer=True), backend, "sacpass-fp8-all")


@variant("offload_ids", color="tab:cyan", marker="^")
def _offload_ids(layer, backend):
    """sacpass with the DSA top-k IDs offloaded to pinned host memory instead of kept on the GPU"""
    return _sacpass_variant(layer, backend, "sacpass-offload-ids", offload=["glm52::dsa_topk_indices"])


@variant("offload_mla", color="tab:pink", marker="v")
def _offload_mla(layer, backend):
    """sacpass with sparse MLA's outputs offloaded (its forward is the largest single recompute)"""
    return _sacpass_variant(layer, backend, "sacpass-offload-mla", offload=["glm52::sparse_mla"])


@variant("budget_full", color="tab:brown", ls="-.")
def _budget_full(layer, backend):
    """sacpass with memory_budget=1.0: checkpointed regions keep all the no-AC saves on the device"""
    return _sacpass_variant(layer, backend, "sacpass-budget-1.0", memory_budget=1.0)


@variant("budget_half", color="tab:brown", ls=":")
def _budget_half(layer, backend):
    """sacpass with memory_budget=0.5 (sacpass's solver: densest recompute time per byte first)"""
    return _sacpass_variant(layer, backend, "sacpass-budget-0.5", memory_budget=0.5)


@variant("plan", color="black", marker="*")
def _plan(layer, backend):
    """sacpass's planner: save (GPU budget 0) / offload (SACPASS_BENCH_HOST_GIB per layer) / recompute"""
    plan = sacpass.Plan(host_bytes=int(HOST_GIB * 2 ** 30))
    return _sacpass_variant(layer, backend, "sacpass-plan", plan=plan)


@variant("plan_gpu", color="gray", marker="*", ls=":")
def _plan_gpu(layer, backend):
    """the planner's offloaded set kept on the GPU instead (Plan(gpu_bytes=host budget)): the reference for
    how much of the plan's copy time is hidden"""
    plan = sacpass.Plan(gpu_bytes=int(HOST_GIB * 2 ** 30), host_bytes=0)
    return _sacpass_variant(layer, backend, "sacpass-plan-on-gpu", plan=plan)


@variant("pytorch_budget", color="tab:orange", ls="--")
def _pytorch_budget(layer, backend):
    """PyTorch's own budget alone: no checkpoint, torch._functorch.config.activation_memory_budget=0.5"""
    from torch._functorch import config as functorch_config

    apply_ac(layer, False)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)

    def fn(*args):
        with functorch_config.patch(activation_memory_budget=0.5):
            return compiled(*args)
    return Built(fn, backend, f"{backend}+budget0.5")
