"""A toy DSA-shaped layer for sacpass tests: indexer projections under no_grad -> a top-k custom op ->
gather-based sparse attention, checkpointed. Tests count its top-k runs with
``sacpass.testing.OpCounter(*TOY_TOPK_OPS)``."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint


# the toy top-k ops, for sacpass.testing.OpCounter
TOY_TOPK_OPS = ("sacpass_toy::topk_ids", "sacpass_toy::topk_pair")
# sacpass.testing.OpCounter cannot yet run around the higher-order ops (auto_functionalized, with_effects)
# that the wrapped variants below become under aot_eager, so those two count their own runs here
WRAPPED_TOPK_CALLS = {"count": 0}


@torch.library.custom_op("sacpass_toy::topk_ids", mutates_args=())
def toy_topk_ids(q: torch.Tensor, k: torch.Tensor, topk: int) -> torch.Tensor:
    """Causal top-k key ids per query, int32, -1 where fewer than topk keys are visible."""
    s = q.shape[0]
    scores = (q.float() @ k.float().T).relu()
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    vals, ids = scores.topk(min(topk, s), dim=-1)
    ids = ids.masked_fill(vals == float("-inf"), -1).to(torch.int32)
    if topk > s:
        ids = F.pad(ids, (0, topk - s), value=-1)
    return ids.contiguous()


@toy_topk_ids.register_fake
def _(q, k, topk):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


@torch.library.custom_op("sacpass_toy::topk_pair", mutates_args=())
def toy_topk_pair(x: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A multi-output op: (values, int32 ids)."""
    v, i = x.topk(topk, dim=-1)
    return v, i.to(torch.int32)


@toy_topk_pair.register_fake
def _(x, topk):
    shape = (*x.shape[:-1], topk)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32)


def _pair_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.shape = inputs[0].shape


def _pair_backward(ctx, grad_vals, grad_ids):
    (ids,) = ctx.saved_tensors
    return grad_vals.new_zeros(ctx.shape).scatter(-1, ids.long(), grad_vals), None


toy_topk_pair.register_autograd(_pair_backward, setup_context=_pair_setup)


def sparse_attend(q, kv, ids):
    """q [S, D], kv [S, D], ids [S, K] (int, -1 masked) -> [S, D]."""
    valid = ids >= 0
    gathered = kv[ids.clamp(min=0).long()]  # [S, K, D]
    scores = torch.einsum("sd,skd->sk", q, gathered) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~valid, float("-inf"))
    return torch.einsum("sk,skd->sd", scores.softmax(-1), gathered)


class ToyIndexer(nn.Module):
    def __init__(self, dim, idx_dim, topk, use_aten_topk=False):
        super().__init__()
        self.wq, self.wk = nn.Linear(dim, idx_dim, bias=False), nn.Linear(dim, idx_dim, bias=False)
        self.topk, self.use_aten_topk = topk, use_aten_topk

    def forward(self, x):
        with torch.no_grad():
            q, k = self.wq(x), self.wk(x)
            if self.use_aten_topk:
                s = x.shape[0]
                scores = (q @ k.T).relu()
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~mask, float("-inf"))
                ids = torch.topk(scores, self.topk, dim=-1).indices
                return ids
            return torch.ops.sacpass_toy.topk_ids(q, k, self.topk)


class ToyLayer(nn.Module):
    """x -> x + sparse_attention(x) ; x -> x + mlp(x), the whole body in checkpoint(use_reentrant=False)."""

    def __init__(self, dim=32, idx_dim=16, topk=4, checkpointed=True, use_aten_topk=False):
        super().__init__()
        self.indexer = ToyIndexer(dim, idx_dim, topk, use_aten_topk)
        self.wq, self.wkv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.checkpointed = checkpointed

    def body(self, x):
        ids = self.indexer(x)
        h = x + self.wo(sparse_attend(self.wq(x), self.wkv(x), ids))
        return h + self.mlp(h)

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class TwoRegions(nn.Module):
    """Two back-to-back checkpointed toy layers."""

    def __init__(self, **kw):
        super().__init__()
        self.a, self.b = ToyLayer(**kw), ToyLayer(**kw)

    def forward(self, x):
        return self.b(self.a(x))


# --------------------------------------------------------------------------- test helpers


class OpCounter(TorchDispatchMode):
    """Counts calls of the given op packets at run time (eager and aot_eager graphs)."""

    def __init__(self, *packets):
        super().__init__()
        self.packets = packets
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.packets:
            self.count += 1
        return func(*args, **(kwargs or {}))


def compile_and_train(be, model: nn.Module, x: torch.Tensor) -> None:
    """One ``torch.compile(model, backend=be, fullgraph=True)`` forward and backward on a fresh copy of ``x``."""
    out = torch.compile(model, backend=be, fullgraph=True)(x.detach().clone().requires_grad_(True))
    out.sum().backward()


def train_counting(be, model: nn.Module, x: torch.Tensor, *ops: str):
    """:func:`compile_and_train`, counting ``ops`` while the backward runs (a ``sacpass.testing.OpCounter``)."""
    from sacpass.testing import OpCounter
    out = torch.compile(model, backend=be, fullgraph=True)(x.detach().clone().requires_grad_(True))
    with OpCounter(*ops) as calls:
        out.sum().backward()
    return calls


def compile_toy(model: nn.Module | None = None, **kw):
    """A sacpass backend (``inner="aot_eager"``, no registered ops unless given) and ``model`` (a
    :class:`ToyLayer` by default) compiled with it, ``fullgraph=True``."""
    import sacpass
    kw.setdefault("inner", "aot_eager")
    kw.setdefault("use_registered", False)
    be = sacpass.backend(**kw)
    return be, torch.compile(model or ToyLayer(), backend=be, fullgraph=True)


def grads_of(module: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters() if p.grad is not None] + \
        [x.grad.detach().clone() for x in inputs if x.grad is not None]


def assert_close_lists(a, b, **tol):
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **tol)


@torch.library.custom_op("sacpass_toy::topk_ids_counting", mutates_args=("seen",))
def toy_topk_ids_counting(q: torch.Tensor, k: torch.Tensor, seen: torch.Tensor, topk: int) -> torch.Tensor:
    """Like topk_ids, and adds 1 to ``seen`` per call: a mutating op returning a fresh tensor
    (auto_functionalized in the joint graph)."""
    seen.add_(1)
    WRAPPED_TOPK_CALLS["count"] += 1
    return toy_topk_ids(q, k, topk)


@toy_topk_ids_counting.register_fake
def _(q, k, seen, topk):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


@torch.library.custom_op("sacpass_toy::topk_ids_effectful", mutates_args=())
def toy_topk_ids_effectful(q: torch.Tensor, k: torch.Tensor, topk: int) -> torch.Tensor:
    """Like topk_ids, registered as an ordered side-effecting op (with_effects in the joint graph)."""
    WRAPPED_TOPK_CALLS["count"] += 1
    return toy_topk_ids(q, k, topk)


@toy_topk_ids_effectful.register_fake
def _(q, k, topk):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


def _register_effectful():
    from torch._higher_order_ops import effects
    op = torch.ops.sacpass_toy.topk_ids_effectful.default
    if hasattr(effects, "_register_effectful_op"):
        effects._register_effectful_op(op, effects._EffectType.ORDERED)
    else:  # pragma: no cover - older spelling
        effects.SIDE_EFFECTS[op] = effects._EffectType.ORDERED


_register_effectful()


class WrappedTopkLayer(ToyLayer):
    """The toy layer with its top-k replaced by a mutating or an effectful variant."""

    def __init__(self, variant: str, **kw):
        super().__init__(**kw)
        self.variant = variant
        self.register_buffer("seen", torch.zeros(()))

    def body(self, x):
        with torch.no_grad():
            q, k = self.indexer.wq(x), self.indexer.wk(x)
            if self.variant == "mutating":
                ids = torch.ops.sacpass_toy.topk_ids_counting(q, k, self.seen, self.indexer.topk)
            else:
                ids = torch.ops.sacpass_toy.topk_ids_effectful(q, k, self.indexer.topk)
        h = x + self.wo(sparse_attend(self.wq(x), self.wkv(x), ids))
        return h + self.mlp(h)


def unwrap(excinfo):
    """Dynamo wraps backend errors in BackendCompilerFailed; return the sacpass error inside."""
    import sacpass
    err = excinfo.value
    while err is not None and not isinstance(err, sacpass.SacpassError):
        err = err.__cause__ or getattr(err, "inner_exception", None)
    assert err is not None, f"no SacpassError in {excinfo.value!r}"
    return err


class CompiledStack(nn.Module):
    """Toy layers, each compiled on its own with ``backend``: one compiled graph execution per layer, as the
    model's decoder layers run (the offload runtime's unit: one bundle per layer and step)."""

    def __init__(self, backend, n_layers: int = 3, seed: int = 0, **layer_kw):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(ToyLayer(**layer_kw) for _ in range(n_layers))
        for layer in self.layers:
            layer.forward = torch.compile(layer.forward, backend=backend, fullgraph=True)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stack_step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """One training step of a toy stack on a fresh copy of ``x`` (loss: the output's squares summed): every
    parameter's gradient and the input's (:func:`grads_of`)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    model(x).square().sum().backward()
    return grads_of(model, x)


class BreakingLayer(nn.Module):
    """A layer whose body Dynamo cannot trace, so a checkpoint around it runs eagerly: an explicit
    ``torch._dynamo.graph_break()``, or (``data_dependent=True``) boolean indexing, a data-dependent shape, in
    its indexer."""

    def __init__(self, dim=16, topk=4, data_dependent=False):
        super().__init__()
        self.wq, self.wv, self.topk, self.data_dependent = nn.Linear(dim, dim), nn.Linear(dim, dim), topk, data_dependent

    def forward(self, x):
        with torch.no_grad():
            scores = self.wq(x) @ x.T
            if self.data_dependent:
                scores = scores + scores[scores > 0].mean()              # graph break in the body
            else:
                torch._dynamo.graph_break()
            ids = torch.topk(scores, self.topk, dim=-1).indices
        return x + self.wv(x)[ids].mean(1)
