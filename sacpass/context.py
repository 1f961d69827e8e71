"""``sacpass.context_fn(...)``: the same policy for ``torch.utils.checkpoint`` when a region runs eagerly.

::

    ctx = sacpass.context_fn()                       # or backend.context_fn(): that backend's own policy
    out = checkpoint(layer, x, use_reentrant=False, context_fn=ctx)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": ctx})

It takes the policy arguments of :func:`sacpass.backend` and returns a ``functools.partial`` (the form Dynamo
accepts for ``context_fn``, with a ``cache_hash`` for the AOTAutograd cache):

- **eager**: two dispatch modes, one for the forward and one for the recompute. The forward keeps the outputs
  of ops the policy saves; a discrete decision keeps only its integer outputs, int64 narrowed to int32, and the
  recompute rebuilds its values as a gather from the recomputed input (as the compiled pass does); an offload
  keeps a host copy. The recompute returns those instead of running the op again. Module-scoped selectors see
  the module path at run time (read off the call stack, relative to the outermost module called). Node predicates
  have no answer for an op at run time and apply under compile only.
- **under torch.compile**: PyTorch's own selective-checkpoint contexts with a policy that marks the selected ops
  ``MUST_SAVE`` (module paths from the traced node's ``nn_module_stack``); the sacpass backend then partitions the
  region exactly as without the context.
"""
from __future__ import annotations

import functools
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .errors import SacpassError, warn
from .modules import running_modules
from .nodes import clean_module_path, dtype_text
from .policies import Policy
from .selectors import (INT32_LIMIT, VALUE_INDEX_OPS, DiscreteSelector, ModuleOpSelector, PredicateSelector,
                        bound_args, is_discrete_op, selection_extent, tensors_in)

__all__ = ["context_fn", "ContextSpec", "KeptValue"]



@dataclass(frozen=True)
class KeptValue:
    """One value the eager forward kept for the recompute (what the compiled report calls saved)."""

    op: str  # "ns::op.overload"
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    reason: str  # must-save | discrete | decision values | offload


@dataclass(eq=False)
class ContextSpec:
    """The policy a context applies, and what its last eager forward kept (``kept``, for tests and reports)."""

    policy: Policy
    kept: list[KeptValue] = field(default_factory=list)

    @property
    def cache_hash(self) -> str:
        return f"sacpass-context-{self.policy.cache_key()}"


_SPECS: dict[str, ContextSpec] = {}


# --------------------------------------------------------------------------------------- module paths
def _eager_modules() -> list[tuple[str, str]]:
    """[(path relative to the outermost module being called, class name)] of the modules running now."""
    return [(path, type(m).__name__) for path, m in running_modules()]


def _traced_modules() -> list[tuple[str, str]]:
    """The module stack of the node being traced (under compile), as the selectors see it in graphs."""
    import torch.fx.traceback as fx_traceback

    stack = (fx_traceback.current_meta or {}).get("nn_module_stack") or {}
    out = []
    for path, cls in stack.values():
        out.append((clean_module_path(str(path)), cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]))
    return out


# --------------------------------------------------------------------------------------------- choice
def _action(policy: Policy, op, args, out, modules_fn) -> tuple[str, str] | None:
    """(action, reason) for one op call, by :meth:`Policy.action`'s precedence; None: recompute it
    (PyTorch's default in a checkpoint). The module stack (``modules_fn()``) is looked up only when a
    module-scoped selector names this op; a discrete decision is told by the op's values (``out``)."""
    stack: list = []

    def modules():
        if not stack:
            stack.append(modules_fn())
        return stack[0]

    def selects(s) -> bool:
        if isinstance(s, ModuleOpSelector):
            return s.op.matches_op(op) and s.matches_module(modules())
        if isinstance(s, DiscreteSelector):
            return out is not None and is_discrete_op(op, args, out)
        return s.matches_op(op)

    def what() -> str:
        path = modules()[-1][0] if modules() else ""
        return f"op call {op} (module {path or '<root>'})"

    chosen = policy.action(selects, what)
    if chosen is None:
        return None
    action, sel = chosen
    if action != "save":
        return action, action
    discrete = isinstance(sel, DiscreteSelector) or (
        op._schema.name in VALUE_INDEX_OPS and out is not None and is_discrete_op(op, args, out))
    # a discrete decision keeps its indices, narrowed, as the compiled pass keeps it
    return ("discrete", "discrete") if discrete else ("save", "must-save")


def _compile_policy(spec: ContextSpec, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if not isinstance(op, torch._ops.OpOverload):
        return CheckpointPolicy.PREFER_RECOMPUTE
    chosen = _action(spec.policy, op, args, getattr(ctx, "op_output", None), _traced_modules)
    if chosen is None:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_RECOMPUTE if chosen[0] == "recompute" else CheckpointPolicy.MUST_SAVE


# ---------------------------------------------------------------------------------------------- eager
@dataclass
class _Entry:
    action: str  # "recompute" | "save" | "discrete" | "offload"
    value: Any = None
    dtype: torch.dtype | None = None  # a narrowed index: the dtype the op returned


def _keep(spec: ContextSpec, op, entry_value, reason: str) -> None:
    for t in tensors_in(entry_value):
        # a decision kept whole (a custom op's): its floating outputs are values no index rebuilds
        why = "decision values" if reason == "discrete" and t.dtype.is_floating_point else reason
        spec.kept.append(KeptValue(f"{op._schema.name}.{op._overloadname or 'default'}", dtype_text(t.dtype),
                                   tuple(t.shape), t.numel() * t.element_size(), why))


def _index_as_int32(idx: torch.Tensor, limit: int) -> torch.Tensor:
    """An int64 index over fewer than 2**31 positions, kept as int32 (as the compiled pass keeps it)."""
    return idx.to(torch.int32) if idx.dtype == torch.int64 and limit <= INT32_LIMIT else idx


class _PolicyMode(TorchDispatchMode):
    """A dispatch mode over one checkpoint call's storage (per op, in call order); never active in tracing."""

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __init__(self, spec: ContextSpec, storage) -> None:
        super().__init__()
        self.spec, self.storage = spec, storage


class _ForwardMode(_PolicyMode):
    """The checkpointed forward: run every op, keep what the policy says, in per-op order."""

    def __enter__(self):
        self.spec.kept.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.checkpoint import SAC_IGNORED_OPS

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS or not isinstance(func, torch._ops.OpOverload):
            return out
        chosen = _action(self.spec.policy, func, args, out, _eager_modules)
        entry = _Entry("recompute")
        if chosen is not None and chosen[0] != "recompute":
            action, reason = chosen
            kind = VALUE_INDEX_OPS.get(func._schema.name)
            if action == "discrete" and kind is not None and isinstance(out, tuple):
                extent = selection_extent(func, args, kwargs)
                entry = _Entry("discrete", _index_as_int32(out[1].detach(), extent), out[1].dtype)
            elif action == "discrete" and isinstance(out, torch.Tensor):
                extent = selection_extent(func, args, kwargs)
                entry = _Entry("discrete", _index_as_int32(out.detach(), extent), out.dtype)
            elif action == "discrete":  # several outputs, values among them: keep them all
                entry = _Entry("save", tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out))
            elif action == "offload":
                entry = _Entry("offload", tree_map(
                    lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t, out))
            else:
                entry = _Entry("save", tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out))
            _keep(self.spec, func, entry.value, reason)
        self.storage[func].append(entry)
        return out


class _RecomputeMode(_PolicyMode):
    """The recompute in the backward: hand back what the forward kept, rebuild decisions, run the rest."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.checkpoint import SAC_IGNORED_OPS

        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS or not isinstance(func, torch._ops.OpOverload):
            return func(*args, **kwargs)
        queue = self.storage.get(func)
        if not queue:
            raise SacpassError(
                f"sacpass.context_fn: the recompute ran {func} more often than the forward did; the checkpointed "
                f"function must run the same ops each time (no data-dependent control flow, no global state).")
        entry = queue.popleft()
        if entry.action == "recompute":
            return func(*args, **kwargs)
        if entry.action == "save":
            return entry.value
        device = next((t.device for t in tensors_in(args)), torch.device("cpu"))
        if entry.action == "offload":
            return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, entry.value)
        # a discrete decision: the forward's indices; values gathered from the recomputed input
        idx = entry.value.to(entry.dtype)
        kind = VALUE_INDEX_OPS.get(func._schema.name)
        if kind is None:
            return idx
        src = args[0]
        bound = bound_args(func, args, kwargs)
        dim = bound.get("dim", -1)
        if kind == "same" or bound.get("keepdim", False):
            values = torch.gather(src, dim, idx)
        else:
            values = torch.gather(src, dim, idx.unsqueeze(dim)).squeeze(dim)
        return values, idx


def _context(key: str):
    """``context_fn`` body: picks the eager modes or, under compile, PyTorch's SAC contexts."""
    spec = _SPECS[key]
    if torch.compiler.is_compiling():
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        return create_selective_checkpoint_contexts(functools.partial(_compile_policy, spec))
    storage: dict = defaultdict(deque)
    return _ForwardMode(spec, storage), _RecomputeMode(spec, storage)


def context_fn(save=None, recompute=None, offload=None, *, use_registered: bool = True,
               save_collectives: bool = True, save_discrete: bool = True):
    """A ``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False)`` applying the sacpass policy
    (same arguments as :func:`sacpass.backend`; see the module docstring)."""
    policy = Policy.build(save, recompute, offload, use_registered=use_registered,
                          save_collectives=save_collectives, save_discrete=save_discrete)
    return _from_policy(policy)


def _from_policy(policy: Policy):
    predicates = [str(s) for s in policy.explicit if isinstance(s, PredicateSelector)]
    if predicates:
        warn(f"sacpass.context_fn: predicate selector(s) {', '.join(predicates)} read FX nodes and apply under "
             f"torch.compile only; in eager they select nothing. Use op or module-scoped selectors to cover both.")
    spec = ContextSpec(policy)
    key = spec.cache_hash if policy.cache_key() is not None else f"{spec.cache_hash}-{id(spec)}"
    spec = _SPECS.setdefault(key, spec)  # one spec per policy: Dynamo guards on the key, not the object
    fn = functools.partial(_context, key)
    fn.cache_hash = spec.cache_hash  # the AOTAutograd cache keys on it (no bypass)
    fn.spec = spec
    return fn
