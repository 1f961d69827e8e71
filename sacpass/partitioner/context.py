"""The context of one compile: what the partition needs to know, and what it hands back.

The backend opens a :class:`CompileContext` around each call into torch (``compile_fx`` / ``aot_autograd``);
the partition function, which torch calls from deep inside, finds it with :func:`current` and appends its
:class:`PartitionResult` to it. Nothing calls back into the backend and nothing is stashed on it: when torch
returns, the backend reads the results off the context it opened.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch.fx

from ..policies import Policy
from ..report import Report

__all__ = ["PartitionConfig", "CompileContext", "PartitionResult", "GraphIds", "current", "active"]


@dataclass(frozen=True)
class PartitionConfig:
    """Everything that decides a partition besides the graph. Enters the cache key (``key()``), which is
    computed at each compile: predicate keys follow the globals they read, a Plan's host budget this host."""

    policy: Policy
    strict: bool = True
    memory_budget: float | None = None  # fraction of the candidates' bytes kept on the device (None: off)
    plan: object | None = None  # a sacpass.plan.Plan (save / offload / recompute per candidate), or None

    def key(self) -> str | None:
        """The policy (selectors, predicate keys, registered, defaults), strict, memory_budget and the plan
        (its fields, cost model included, and its host budget as resolved here); None: the caches bypass."""
        policy = self.policy.cache_key()
        if policy is None:
            return None
        plan = "None" if self.plan is None else f"{self.plan!r}:host={self.plan.host_budget()}"
        return hashlib.sha256(f"{policy}-{int(self.strict)}-{self.memory_budget}-{plan}".encode()).hexdigest()[:20]


class GraphIds:
    """Hands out graph ids "g0", "g1", ... for one backend, in partition order (thread-safe)."""

    def __init__(self) -> None:
        self._next = itertools.count()
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            return f"g{next(self._next)}"


@dataclass(frozen=True)
class PartitionResult:
    """Everything one partition produced."""

    report: Report
    joint_text: str  # the joint graph with its tags, before the min-cut
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule


@dataclass
class CompileContext:
    """One compile: the config, where ids come from, the checkpoint bodies routed before AOTAutograd, the
    cache key it compiles under, and the partitions done (filled by the partitioner)."""

    config: PartitionConfig
    ids: GraphIds
    routed_checkpoints: tuple[str, ...] = ()
    results: list[PartitionResult] = field(default_factory=list)
    owner: object = None  # the partitioner this compile is for (a context of another backend is not ours)
    uuid: str | None = None  # the partitioner's cache key for this compile (None: the caches bypass)
    uncached: str = ""  # why the caches bypass (the predicates and what they read), "" when they do not


_CURRENT: contextvars.ContextVar[CompileContext | None] = contextvars.ContextVar("sacpass_compile", default=None)


def current() -> CompileContext | None:
    """The context of the compile in progress on this thread, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def active(ctx: CompileContext) -> Iterator[CompileContext]:
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
