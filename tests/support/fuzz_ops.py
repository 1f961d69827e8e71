"""The vocabulary of the sacpass fuzzer (tests/test_fuzz.py): small programs as plain data, a module that
runs them, and a dispatch mode that counts ops per packet at run time.

A program is a tuple of step names applied one after another to a [S, D] float32 activation ``h``; some
steps read the program's input too (a residual). Checkpoint regions are spans of steps. Everything here is
plain, printable data so that hypothesis can shrink a failure to a short program and a failure can be
pasted into ``@example`` as a regression test.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import sacpass
from tests.support import toy  # noqa: F401  registers sacpass_toy::topk_ids and sacpass_toy::topk_pair

S, D, K = 8, 8, 3  # tokens, width, top-k


def _mm(m, i, h, x):
    return h @ m.weights[i]


def _sin(m, i, h, x):
    return h.sin()


def _gelu(m, i, h, x):
    return F.gelu(h)


def _tanh(m, i, h, x):
    return torch.tanh(h) + x  # a residual to the program input


def _rmsnorm(m, i, h, x):  # a mean reduction
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)


def _amax(m, i, h, x):  # a max reduction
    return h - h.amax(-1, keepdim=True)


def _view(m, i, h, x):  # views and a copy-making reshape
    return h.view(S, D // 2, 2).transpose(1, 2).reshape(S, D) * 0.5 + h


def _cast(m, i, h, x):  # a widening cast and back
    return (h.double() * 1.25).float()


def _topk(m, i, h, x):  # aten.topk: values carry gradient, indices gather
    vals, ids = torch.topk(h, K, dim=-1)
    return h + vals.mean(-1, keepdim=True) + 0.1 * torch.gather(h, -1, ids).sum(-1, keepdim=True)


def _argsort(m, i, h, x):  # aten.sort through argsort: a permutation the backward reads (gather)
    order = torch.argsort(h, dim=-1)
    return torch.gather(h, -1, order) * 0.5 + h


def _maxdim(m, i, h, x):  # aten.max.dim: values carry gradient to the argmax
    vals, _ = h.max(-1, keepdim=True)
    return h + vals


def _pair(m, i, h, x):  # the multi-output custom op: (values, int32 ids)
    vals, ids = torch.ops.sacpass_toy.topk_pair(h, K)
    return h * vals.mean(-1, keepdim=True).sigmoid() + 0.01 * ids.float().mean()


def _nograd_ids(m, i, h, x):  # a custom op under no_grad whose int32 output indexes the activation
    with torch.no_grad():
        ids = torch.ops.sacpass_toy.topk_ids(h, h, K)
    valid = (ids >= 0).unsqueeze(-1).to(h.dtype)  # [S, K, 1]
    return h + (h[ids.clamp(min=0).long()] * valid).mean(1)


def _dropout(m, i, h, x):  # RNG: a checkpoint must replay the same mask
    return F.dropout(h, p=0.25, training=True)


def _inplace(m, i, h, x):  # in-place ops on an intermediate
    t = h.mul(0.5)
    t.add_(1.0)
    t.tanh_()
    return t * h


STEPS = {
    "mm": _mm, "sin": _sin, "gelu": _gelu, "tanh": _tanh, "rmsnorm": _rmsnorm, "amax": _amax, "view": _view,
    "cast": _cast, "topk": _topk, "argsort": _argsort, "maxdim": _maxdim, "pair": _pair, "nograd_ids": _nograd_ids, "dropout": _dropout,
    "inplace": _inplace,
}
RANDOM_STEPS = frozenset({"dropout"})

# Selectors a step is known to put in the forward joint graph (a taggable, non-view op).
STEP_OPS = {
    "mm": ("aten::mm",), "sin": ("aten::sin",), "gelu": ("aten::gelu",), "tanh": ("aten::tanh",),
    "rmsnorm": ("aten::rsqrt", "aten::mean"), "amax": ("aten::amax",), "view": ("aten::clone",),
    "cast": ("aten::_to_copy",), "topk": ("aten::topk", "aten::gather"), "argsort": ("aten::sort", "aten::gather"),
    "maxdim": ("aten::max",), "pair": ("sacpass_toy::topk_pair",),
    "nograd_ids": ("sacpass_toy::topk_ids", "aten::index"), "dropout": ("aten::native_dropout",),
    "inplace": ("aten::add",),
}
# Selectors a step puts in the graph that must be refused when selected to save (views).
STEP_VIEWS = {"view": ("aten::transpose",)}
# Ops no program here runs: selecting one is an unmatched selector.
ABSENT_OPS = ("aten::cumsum", "aten::kthvalue")
# Discrete decisions among them: saved by sacpass's default (save_discrete=True) unless a recompute= names them.
DISCRETE_OPS = frozenset({"aten::topk", "aten::sort", "aten::max", "sacpass_toy::topk_pair", "sacpass_toy::topk_ids"})

# Ops whose backward formulas never call the op itself: any run of one during backward is a recomputation,
# so their run-time count in backward must be 0 once they are must-save.
COUNTABLE = frozenset({
    "aten::sin", "aten::gelu", "aten::tanh", "aten::rsqrt", "aten::mean", "aten::amax", "aten::topk",
    "aten::sort", "aten::max", "sacpass_toy::topk_pair", "sacpass_toy::topk_ids", "aten::native_dropout",
})


def packet(qualname: str) -> torch._ops.OpOverloadPacket:
    ns, name = qualname.split("::")
    return getattr(getattr(torch.ops, ns), name)


@dataclass(frozen=True)
class Program:
    """steps: step names; regions: checkpoint spans (start, end) over step indices, outermost first.

    Spans are either disjoint (one region, back-to-back regions) or nested (an inner span inside an outer).
    """

    steps: tuple[str, ...]
    regions: tuple[tuple[int, int], ...] = ()

    def ops(self) -> set[str]:
        return {op for s in self.steps for op in STEP_OPS[s]}


class FuzzModel(nn.Module):
    """Runs a Program. One [D, D] weight per step (used by "mm"), so every step can be a separate matmul."""

    def __init__(self, program: Program, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.program = program
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(D, D, generator=g) * D ** -0.5) for _ in program.steps)
        self.checkpointed = True

    def _run(self, lo: int, hi: int, regions: tuple[tuple[int, int], ...], h, x):
        i = lo
        while i < hi:
            span = next((r for r in regions if r[0] == i and r[1] <= hi), None)
            if span is not None and self.checkpointed:
                inner = tuple(r for r in regions if r != span)
                # bind the span now: eager checkpoint calls the function again during backward
                h = checkpoint(functools.partial(self._run, *span, inner), h, x, use_reentrant=False)
                i = span[1]
            else:
                h = STEPS[self.program.steps[i]](self, i, h, x)
                i += 1
        return h

    def forward(self, x):
        return self._run(0, len(self.program.steps), self.program.regions, x, x)


def compile_program(program: Program, **kw):
    """A sacpass backend (``inner="aot_eager"``, no registered ops unless given) and a :class:`FuzzModel` of
    ``program`` compiled with it, ``fullgraph=True``."""
    kw.setdefault("inner", "aot_eager")
    kw.setdefault("use_registered", False)
    be = sacpass.backend(**kw)
    return be, torch.compile(FuzzModel(program), backend=be, fullgraph=True)


class PacketCounter(TorchDispatchMode):
    """Counts run-time calls per op packet (aot_eager graphs and eager code run through the dispatcher)."""

    def __init__(self, packets):
        super().__init__()
        self.packets = {p: str(p) for p in packets}
        self.counts: Counter = Counter()

    supports_higher_order_operators = True  # run_with_rng_state(rng_state, op, ...) replays a random op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ops = [func] if isinstance(func, torch._ops.OpOverload) else \
            [a for a in args if isinstance(a, torch._ops.OpOverload)]
        for op in ops:
            if op.overloadpacket in self.packets:
                self.counts[self.packets[op.overloadpacket]] += 1
        return func(*args, **(kwargs or {}))


def qualname_of(p: torch._ops.OpOverloadPacket) -> str:
    return p._qualified_op_name
