"""A model plan's first step: compiled without the plan, counted and timed; the plan compiles at the second.

A :class:`~sacpass.ModelPlan` that is not told ``layers`` cannot partition its first graph: what a region may
keep depends on how many regions share the budgets, and the first compile happens in the first region. So for
each graph that holds a checkpointed region the backend compiles the policy alone (no plan: the partition of
``sacpass.backend()``, whose peak is full recompute's or less) and hands Dynamo a :class:`CountedGraph`: in the
first training step it runs that compiled graph while :class:`FirstStep` counts the regions the step runs before
its first backward and times the heavy ops the compiled forwards and their backwards call (matrix ops, custom
ops); at the first call after that step's backward has begun, it compiles the graph again with the plan resolved,
on the fake inputs and under the tracing context Dynamo traced it with (a graph traced with dynamic shapes
compiles for them), as Dynamo itself compiles a graph again when it specializes it at run time, and runs that
from then on.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
import torch.fx

from .calibration import OpTimer

__all__ = ["FirstStep", "CountedGraph", "checkpoint_regions_in", "trains", "device_of"]


def checkpoint_regions_in(gm: torch.fx.GraphModule) -> int:
    """How many checkpointed regions (``tag_activation_checkpoint`` calls) a Dynamo graph runs."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is hop)


def trains(example_inputs) -> bool:
    """Whether a graph compiled now is a training graph (grad on, and an input that needs it)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def device_of(args) -> torch.device:
    """The device a graph computes on: its first tensor input's off the CPU, else the CPU."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            return a.device
    return torch.device("cpu")


class FirstStep:
    """The first training step of one backend's model plan: the regions it ran before its first backward began,
    the device they ran on and the times of the heavy ops its compiled forwards and backwards ran
    (:class:`~sacpass.calibration.OpTimer`)."""

    def __init__(self):
        self.regions = 0
        self.device: torch.device | None = None
        self.backward_began = False
        self.timer = OpTimer()
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.backward_began

    def run(self, compiled: Callable[..., Any], args, regions: int) -> Any:
        """Run a graph of ``regions`` checkpointed regions (``compiled``: its compile without the plan) on
        ``args``, counting them and timing its heavy ops."""
        from torch.utils._pytree import tree_leaves

        with self.timer:
            out = compiled(*args)
        if torch.is_grad_enabled():
            with self._lock:
                self.regions += regions
                self.device = self.device or device_of(args)
            grads = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if grads:
                torch.autograd.graph.register_multi_grad_hook(grads, self._began, mode="any")
                self.timer.time_backward(grads)
        return out

    def _began(self, *_grads) -> None:
        self.backward_began = True

    def op_seconds(self) -> dict[str, float]:
        return self.timer.seconds()


class CountedGraph:
    """What the backend gives Dynamo for a graph that holds a checkpointed region while the plan counts: the
    graph compiled without the plan (``measuring``), run by :meth:`FirstStep.run` until the first step's
    backward has begun, then ``compile(inputs)`` (the backend's compile, with the plan resolved) once."""

    def __init__(self, gm: torch.fx.GraphModule, measuring: Callable[..., Any], first: FirstStep,
                 compile: Callable[[list], Callable[..., Any]]):
        self.gm, self.measuring, self.first, self._compile = gm, measuring, first, compile
        self.regions = checkpoint_regions_in(gm)
        self.tracing = torch._guards.TracingContext.try_get()
        self.compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def example_inputs(self) -> list:
        """The inputs Dynamo traced the graph with, as its fake tensors (and symbolic sizes): what the compile
        sees, so that it partitions the graph Dynamo traced (real inputs of a later call would be fakified anew,
        their sizes taken as new symbols)."""
        return [n.meta["example_value"] for n in self.gm.graph.find_nodes(op="placeholder")]

    def __call__(self, *args):
        if self.compiled is None:
            if not self.first.done:
                return self.first.run(self.measuring, args, self.regions)
            with self._lock:
                if self.compiled is None:
                    scope = torch._guards.tracing(self.tracing) if self.tracing is not None else contextlib.nullcontext()
                    with scope:
                        self.compiled = self._compile(self.example_inputs())
        return self.compiled(*args)
