"""The planner's inputs: a :class:`Plan` (budgets) and a :class:`CostModel` (how long an op takes).

``sacpass.backend(plan=sacpass.Plan(...))`` (or ``plan="auto"``) makes sacpass choose, in every checkpointed
region, for each value the backward needs: keep it on the device (``save``), move it to pinned host memory
and back (``offload``), or ``recompute`` it, to minimise the step time under the budgets. The choice itself is
:mod:`sacpass.passes.plan`. All budgets are per execution of one compiled graph: one decoder layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .compression import BF16_RATIO
from .errors import BackendOptionError

__all__ = ["CostModel", "Plan", "ModelPlan", "as_plan"]


@dataclass(frozen=True)
class CostModel:
    """Seconds an op takes: max(FLOPs / matrix rate, bytes moved / memory bandwidth) + a launch overhead.

    FLOPs come from ``torch.utils.flop_counter``'s formulas (ATen matmuls, attention, ``_scaled_mm``, and
    whatever a model registers for its custom ops with ``register_flop_formula``); bytes are the op's input
    and output tensor bytes. The defaults are the H200 as measured on it: dense bf16
    GEMMs at 790 TFLOP/s, blockwise FP8 at 1170, device copies at 4.3 TB/s, pinned host copies at 51.5 GiB/s
    each way; ``efficiency`` scales the rates to what whole kernels reach.
    """

    name: str = "h200"
    bf16_flops: float = 790e12  # dense bf16/fp16 matrix FLOP/s
    fp8_flops: float = 1170e12  # blockwise-scaled e4m3 matrix FLOP/s
    fp32_flops: float = 60e12  # fp32 (no TF32) matrix FLOP/s
    memory_bytes_per_s: float = 4.3e12  # device memory, read + write
    copy_bytes_per_s: float = 51.5 * 2**30  # pinned host <-> device, each way
    efficiency: float = 0.7  # share of the peak rates real kernels reach
    launch_s: float = 4e-6  # per kernel

    def flop_rate(self, dtype: torch.dtype) -> float:
        if dtype in (torch.float32, torch.float64):
            return self.fp32_flops * self.efficiency
        if dtype.itemsize == 1:
            return self.fp8_flops * self.efficiency
        return self.bf16_flops * self.efficiency

    def seconds(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        return max(flops / self.flop_rate(dtype), nbytes / (self.memory_bytes_per_s * self.efficiency)) + self.launch_s

    def copy_seconds(self, nbytes: float) -> float:
        return nbytes / self.copy_bytes_per_s


PLAN_SHARE = 0.9  # of the host pool's limit: what a plan's values may take, the rest room for the slabs' rounding


def default_host_bytes() -> int:
    """The host bytes a plan spends by default, all its layers together: ``PLAN_SHARE`` of the host pool's limit,
    which is this process's share of the host (:mod:`sacpass.host`) unless ``sacpass.offload.set_host_limit`` set
    another."""
    from .offload import host_limit
    return int(PLAN_SHARE * host_limit())


@dataclass(frozen=True)
class Plan:
    """What the planner may spend, per execution of one compiled graph (one layer).

    gpu_bytes:  device bytes the planner may keep beyond the must-saves (0: no more than full recompute keeps).
                With ``memory_budget=f`` given too, f times the candidates' bytes instead.
    host_bytes: pinned host bytes it may offload per layer; None: :func:`default_host_bytes` / ``layers``.
    layers:     how many layer executions share the host memory per step (only for host_bytes=None).
    hide:       share of the layer's estimated forward (and backward) time its copies may take, so that they
                stay hidden under compute (copies run on their own streams).
    min_offload_bytes: smaller values are not worth a copy; they are saved or recomputed.
    cost:       the cost model (defaults: the H200).
    """

    gpu_bytes: int = 0
    host_bytes: int | None = None
    layers: int = 1
    hide: float = 0.8
    min_offload_bytes: int = 1 << 20
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        def bad(what: str) -> BackendOptionError:
            return BackendOptionError(f"sacpass: Plan({what}) is invalid; " + {
                "gpu_bytes": "gpu_bytes must be an int >= 0 (device bytes per layer).",
                "host_bytes": "host_bytes must be None (automatic) or an int >= 0 (host bytes per layer).",
                "layers": "layers must be an int >= 1.",
                "hide": "hide must be in (0, 1].",
                "min_offload_bytes": "min_offload_bytes must be an int >= 0.",
                "cost": "cost must be a sacpass.CostModel.",
            }[what.split("=")[0]])
        if not isinstance(self.gpu_bytes, int) or self.gpu_bytes < 0:
            raise bad(f"gpu_bytes={self.gpu_bytes!r}")
        if self.host_bytes is not None and (not isinstance(self.host_bytes, int) or self.host_bytes < 0):
            raise bad(f"host_bytes={self.host_bytes!r}")
        if not isinstance(self.layers, int) or self.layers < 1:
            raise bad(f"layers={self.layers!r}")
        if not (isinstance(self.hide, (int, float)) and 0 < self.hide <= 1) or math.isnan(self.hide):
            raise bad(f"hide={self.hide!r}")
        if not isinstance(self.min_offload_bytes, int) or self.min_offload_bytes < 0:
            raise bad(f"min_offload_bytes={self.min_offload_bytes!r}")
        if not isinstance(self.cost, CostModel):
            raise bad(f"cost={self.cost!r}")

    def host_budget(self) -> int:
        if self.host_bytes is not None:
            return self.host_bytes
        return default_host_bytes() // self.layers


@dataclass(frozen=True)
class ModelPlan:
    """One plan for every checkpointed region of a step (all layers), whatever graphs they share.

    Layers of one kind share one compiled graph, so a per-graph :class:`Plan` gives the first layer and the
    last the same decisions, though the last layer's backward runs first and has no time to hide its reloads.
    A ModelPlan decides in two places:

    - at compile time, per graph: what is worth keeping at all (the rest is recomputed), greedily by recompute
      time per byte while ``layers`` regions' worth fits ``host_bytes + gpu_bytes`` and the copy window
      (``hide`` x the region's estimated forward at the copy rate); these values go through
      ``sacpass::stash`` / ``sacpass::unstash``;
    - at run time, per value and region: keep it on the device or copy it to the host pool. The regions are
      numbered by their order in the step (the n-th forward since the last backward). From the last region
      backwards, values stay on the device while ``gpu_bytes`` lasts (their backward comes first, their
      reloads would have nothing to hide behind); the rest goes to the host, within ``host_bytes``. Every step
      is placed from the sizes the step before it recorded (:func:`sacpass.offload.placements`); the first,
      which has none, places the same way with each region still to come as large as the largest before it,
      so its host pool grows no larger than the later steps need.

    layers:    checkpointed regions (decoder layers) one step runs; regions past it go to the host.
    gpu_bytes: device bytes the step may keep beyond the must-saves, all regions together.
    host_bytes: host bytes the step may offload, all regions together; None: :func:`default_host_bytes`.
    inputs:    also place each region's activation inputs (a decoder layer's hidden states, which activation
               checkpointing otherwise keeps on the device for every layer) like its planned values: kept on
               the device for the last regions, offloaded for the rest. Parameters and buffers (the graph's
               static inputs) never move. Their bytes come out of the region's share first.
    hide, min_offload_bytes, cost: as in :class:`Plan`, per region.
    compress:  None (default): values go to the host as they are, and come back bit for bit. ``"fp8"``: the
               floating values sent to the host go FP8-packed (float8 e4m3, one fp32 scale per 128 elements:
               0.52 of a bf16 value's bytes, :mod:`sacpass.compression`) and come back rebuilt in their dtype.
               Lossy: each element within 1/16 of its magnitude, so the backward reads values close to, not
               equal to, the forward's; the planner counts the packed bytes against ``host_bytes`` and the copy
               window, so about twice as much fits. Values kept on the device, and integer and bool values
               (indices, masks: discrete decisions), are never packed.
    exact:     with ``compress``: selectors (op names, ``"module::op"`` strings, OpOverloads, as the policy's) of
               values sent to the host as they are, bit for bit, while the rest go packed; e.g.
               ``exact="glm52::sparse_mla"`` keeps the attention output exact, whose backward takes row sums of
               it times its gradient (a difference of near-equal terms that packing disturbs most). The planner
               counts their full bytes. A selector that names no value the plan considers is reported like an
               unmatched policy selector.
    peak_bytes: None (default): the step keeps ``gpu_bytes`` on the device. An int: the device memory the step
               may peak at (``torch.cuda.max_memory_allocated``; e.g. full recompute's peak, measured, or the
               GPU's memory less a margin). After each step the run time reads that peak and raises the device
               budget by what it left under ``peak_bytes``, so the next step keeps more of the last regions'
               values on the device instead of copying them (``gpu_bytes`` is where it starts). A value kept
               instead of copied adds its bytes at most to any moment of the step, so the peak stays within
               ``peak_bytes``; a step that passes it anyway (the peak rose past it) lowers the budget by the
               excess, never below ``gpu_bytes``, and one whose budget is already there warns. The peak read is
               the highest since the last ``torch.cuda.reset_peak_memory_stats()``: reset it after the compiling
               step if that one peaks higher. The budget, the cap and the peak read:
               :func:`sacpass.offload.device_budget`.

    A step whose values fit neither budget raises :class:`~sacpass.OffloadError` naming the smallest budgets
    that hold it, before the host pool runs out.
    """

    layers: int
    gpu_bytes: int = 0
    host_bytes: int | None = None
    inputs: bool = True
    hide: float = 0.8
    min_offload_bytes: int = 1 << 20
    cost: CostModel = field(default_factory=CostModel)
    compress: str | None = None
    peak_bytes: int | None = None
    exact: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "exact", _exact_selectors(self.exact, self.compress))
        if self.peak_bytes is not None and (isinstance(self.peak_bytes, bool) or not isinstance(self.peak_bytes, int)
                                            or self.peak_bytes <= 0):
            raise BackendOptionError(f"sacpass: ModelPlan(peak_bytes={self.peak_bytes!r}) must be None (keep gpu_bytes "
                                     f"on the device) or an int > 0: the device memory the step may peak at, e.g. "
                                     f"full recompute's torch.cuda.max_memory_allocated().")
        if self.compress not in (None, "fp8"):
            raise BackendOptionError(f"sacpass: ModelPlan(compress={self.compress!r}) is not a compression; pass None "
                                     f"(values go to the host as they are, the default) or 'fp8' (floating values "
                                     f"go FP8-packed, lossy).")
        if not isinstance(self.inputs, bool):
            raise BackendOptionError(f"sacpass: ModelPlan(inputs={self.inputs!r}) must be True (place the regions' "
                                     f"activation inputs too) or False (keep them on the device).")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise BackendOptionError(f"sacpass: ModelPlan(layers={self.layers!r}) is invalid; pass the number of "
                                     f"checkpointed regions one step runs (e.g. len(model.layers)), an int >= 1.")
        Plan(gpu_bytes=self.gpu_bytes, host_bytes=self.host_bytes, hide=self.hide,  # the shared checks
             min_offload_bytes=self.min_offload_bytes, cost=self.cost)

    def host_budget(self) -> int:
        return self.host_bytes if self.host_bytes is not None else default_host_bytes()

    @property
    def key(self) -> str:
        """What the compiled graphs name this plan by (its stash ops' argument): its budgets."""
        return (f"layers={self.layers},gpu={self.gpu_bytes},host={self.host_budget()},inputs={int(self.inputs)}"
                + (f",compress={self.compress}" if self.compress else "")
                + (f",peak={self.peak_bytes}" if self.peak_bytes is not None else ""))

    def region_share(self) -> int:
        """The bytes one region may keep, on the device or the host, if every region of the step ran its graph.
        With ``compress``, in packed bytes: the device's part, which stays unpacked, counts at the packing ratio
        of bf16, so that the regions the device cannot hold fit ``host_bytes`` packed."""
        gpu = int(self.gpu_bytes * BF16_RATIO) if self.compress else self.gpu_bytes
        return (self.host_budget() + gpu) // self.layers

    def region_plan(self, placed_inputs: int = 0) -> Plan:
        """The per-graph part: the region's share less ``placed_inputs`` (the bytes of its activation inputs,
        which are placed whatever the planner decides), for the values the planner chooses."""
        return Plan(gpu_bytes=0, host_bytes=max(0, self.region_share() - placed_inputs), layers=self.layers,
                    hide=self.hide,
                    min_offload_bytes=self.min_offload_bytes, cost=self.cost)


def _exact_selectors(exact, compress) -> tuple:
    """ModelPlan(exact=): op and module-op selectors only (they print and hash as they read), with compress."""
    from .selectors import ModuleOpSelector, OpSelector, as_selectors

    if exact is None or exact == ():
        return ()
    spelled = (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket, OpSelector, ModuleOpSelector)
    items = [exact] if isinstance(exact, spelled) or not isinstance(exact, (list, tuple)) else list(exact)
    for item in items:
        if not isinstance(item, spelled):
            raise BackendOptionError(f"sacpass: ModelPlan(exact=...): {item!r} is not an op name, 'module::op' string, "
                                     f"OpOverload or op selector; pass those (e.g. exact='glm52::sparse_mla').")
    sels = as_selectors(items)  # names and ops read as op or module-op selectors only
    if compress is None:
        raise BackendOptionError(f"sacpass: ModelPlan(exact={', '.join(map(str, sels))}) names values kept bit for bit "
                                 f"where compress='fp8' packs the others; without compress every value goes to the "
                                 f"host exact. Pass compress='fp8', or drop exact=.")
    return sels


_DECLARED: dict[str, ModelPlan] = {}  # plan key -> the plan a backend of this process was built with


def declared_plan(key: str) -> "ModelPlan | None":
    """The model plan a backend of this process was built with, by its key (what its compiled graphs' stash ops
    name): the runtime makes the plan's state from it at its first stash, cached graphs' included."""
    return _DECLARED.get(key)


def as_plan(plan) -> Plan | ModelPlan | None:
    """``None``, ``"auto"`` (the default :class:`Plan`), a Plan or a ModelPlan; anything else is refused."""
    if isinstance(plan, ModelPlan):
        _DECLARED.setdefault(plan.key, plan)  # before any graph runs, cached ones included
        return plan
    if plan is None or isinstance(plan, Plan):
        return plan
    if plan == "auto":
        return Plan()
    raise BackendOptionError(f"sacpass: plan={plan!r} is not a plan; pass plan='auto', a sacpass.Plan(...) with "
                             f"budgets, a sacpass.ModelPlan(layers=...) for the whole step, or None (no planner).")


def check_memory_budget(memory_budget) -> float | None:
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or \
            math.isnan(memory_budget) or not 0 <= memory_budget <= 1:
        raise BackendOptionError(
            f"sacpass: memory_budget={memory_budget!r} must be a number in [0, 1]: the share of the bytes no "
            f"activation checkpointing would keep that checkpointed regions may keep on the device (0: "
            f"recompute everything but the must-saves; 1: keep all).")
    return float(memory_budget)
