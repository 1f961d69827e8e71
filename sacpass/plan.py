"""The planner's inputs: a :class:`Plan` or a :class:`ModelPlan` (budgets), and a
:class:`~sacpass.calibration.CostModel` (how long an op takes, measured by :mod:`sacpass.calibration`).

``sacpass.backend(plan=sacpass.Plan(...))`` (or ``plan="auto"``) makes sacpass choose, in every checkpointed
region, for each value the backward needs: keep it on the device (``save``), move it to pinned host memory
and back (``offload``), or ``recompute`` it, to minimise the step time under the budgets. The choice itself is
:mod:`sacpass.passes.plan`. All budgets are per execution of one compiled graph: one decoder layer.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from . import calibration
from .calibration import CostModel
from .compression import BF16_RATIO, FORMATS
from .errors import BackendOptionError
from .offload.plans import declare

__all__ = ["CostModel", "Plan", "ModelPlan", "as_plan"]


PLAN_SHARE = 0.9  # of the host pool's limit: what a plan's values may take, the rest room for the slabs' rounding
DEVICE_SHARE = 0.85  # of the GPU's memory: a ModelPlan's default peak cap (the rest: the allocator's fragmentation)


def default_host_bytes() -> int:
    """The host bytes a plan spends by default, all its layers together: ``PLAN_SHARE`` of the host pool's limit,
    which is this process's share of the host (:mod:`sacpass.host`) unless ``sacpass.offload.set_host_limit`` set
    another."""
    from .offload import host_limit
    return int(PLAN_SHARE * host_limit())


def _count(value, least: int) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_shared(owner: str, host_unit: str, host_bytes, hide, min_offload_bytes) -> None:
    """The checks :class:`Plan` and :class:`ModelPlan` share, in the words of the one given."""
    if host_bytes is not None and not _count(host_bytes, 0):
        raise BackendOptionError(f"sacpass: {owner}(host_bytes={host_bytes!r}) is invalid; host_bytes must be None "
                                 f"(automatic) or an int >= 0 (host bytes {host_unit}).")
    if isinstance(hide, bool) or not (isinstance(hide, (int, float)) and 0 < hide <= 1):  # NaN fails the range too
        raise BackendOptionError(f"sacpass: {owner}(hide={hide!r}) is invalid; hide must be in (0, 1] (the share of a "
                                 f"region's compute its copies may take).")
    if not _count(min_offload_bytes, 0):
        raise BackendOptionError(f"sacpass: {owner}(min_offload_bytes={min_offload_bytes!r}) is invalid; "
                                 f"min_offload_bytes must be an int >= 0.")


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
        if not _count(self.gpu_bytes, 0):
            raise BackendOptionError(f"sacpass: Plan(gpu_bytes={self.gpu_bytes!r}) is invalid; gpu_bytes must be an "
                                     f"int >= 0 (device bytes per layer).")
        if not _count(self.layers, 1):
            raise BackendOptionError(f"sacpass: Plan(layers={self.layers!r}) is invalid; layers must be an int >= 1.")
        _check_shared("Plan", "per layer", self.host_bytes, self.hide, self.min_offload_bytes)
        if not isinstance(self.cost, CostModel):
            raise BackendOptionError(f"sacpass: Plan(cost={self.cost!r}) is invalid; cost must be a sacpass.CostModel.")

    def host_budget(self) -> int:
        if self.host_bytes is not None:
            return self.host_bytes
        return default_host_bytes() // self.layers


@dataclass(frozen=True)
class ModelPlan:
    """One plan for every checkpointed region of a step (all layers), whatever graphs they share.

    ``sacpass.ModelPlan()`` needs no arguments: it counts the step's regions, takes its budgets from the device
    and the host, and measures its cost model on the device it runs on. Every field below overrides one of
    those.

    Layers of one kind share one compiled graph, so a per-graph :class:`Plan` gives the first layer and the
    last the same decisions, though the last layer's backward runs first and has no time to hide its reloads.
    A ModelPlan decides in two places:

    - at compile time, per graph: what is worth keeping at all (the rest is recomputed), the values that hold the
      most recompute time while ``layers`` regions' worth fits ``host_bytes + gpu_bytes`` and the copy window
      (``hide`` x the region's estimated forward at the copy rate, less the copies of the activation inputs it
      places, see ``inputs``); these values go through
      ``sacpass::stash`` / ``sacpass::unstash``;
    - at run time, per value and region: keep it on the device or copy it to the host pool. The regions are
      numbered by their order in the step (the n-th forward since the last backward). From the last region
      backwards, values stay on the device while the device budget lasts (their backward comes first, their
      reloads would have nothing to hide behind); the rest goes to the host, within ``host_bytes``. Every step
      is placed from the sizes the step before it recorded (:func:`sacpass.offload.placements`); the first,
      which has none, places the same way with each region still to come as large as the largest before it,
      so its host pool grows no larger than the later steps need.

    layers:    checkpointed regions (decoder layers) one step runs; regions past it go to the host. None (the
               default): counted in the first training step, whose graphs are compiled without the plan (the
               policy alone, as ``sacpass.backend()`` partitions them) while the plan counts the regions and times
               the heavy ops (matrix ops, custom ops) at their shapes; the graphs compile with the plan at the
               second step.
    gpu_bytes: device bytes the step keeps beyond the must-saves, all regions together. None (the default): it
               starts at 0 and follows the measured peak (see ``peak_bytes``) up to ``DEVICE_SHARE`` of the GPU's
               memory (none on the CPU).
    host_bytes: host bytes the step may offload, all regions together; None: :func:`default_host_bytes`, this
               process's share of the host (physical memory, the cgroup limit and what is available, over the
               launcher's local ranks: :mod:`sacpass.host`).
    inputs:    also place each region's activation inputs (a decoder layer's hidden states, which activation
               checkpointing otherwise keeps on the device for every layer) like its planned values: kept on
               the device for the last regions, offloaded for the rest. Parameters and buffers (the graph's
               static inputs) never move. Their bytes come out of the region's share first.
    hide, min_offload_bytes: as in :class:`Plan`, per region.
    cost:      the cost model; None (the default): measured on the device (:func:`sacpass.calibration.calibrate`:
               copy rates each way, matrix rates, memory bandwidth, kept in the compile cache's directory so a
               restart reuses them) with the first step's op times where it counted the regions (the heavy ops
               of its compiled forwards and backwards).
    compress:  None (default): values go to the host as they are, and come back bit for bit. ``"fp8"`` or
               ``"int8"``: the floating values sent to the host go packed, one byte an element and one fp32 scale
               per 128 (0.52 of a bf16 value's bytes, :mod:`sacpass.compression`), and come back rebuilt in their
               dtype. Lossy: ``"fp8"`` (float8 e4m3) brings each element back within 1/16 of its own magnitude,
               ``"int8"`` within 1/254 of the largest in its 128 (closer on Gaussian-like values, coarser on small
               elements beside an outlier), so the backward reads values close to, not equal to, the forward's;
               the planner counts the packed bytes against ``host_bytes`` and the copy window, so about twice as
               much fits. Values kept on the device, and integer and bool values (indices, masks: discrete
               decisions), are never packed.
    exact:     with ``compress``, the values sent to the host as they are, bit for bit, while the rest go packed.
               None (the default): the values the backward is sensitive to, those it sums times their own
               gradient (attention's ``rowsum(out * dout)``, softmax's ``sum(y * dy)``: differences of near-equal
               terms that packing disturbs most), seen in the joint graph as a custom op or a softmax backward
               reading the value with a gradient of its shape, a custom op reading it with any gradient and
               returning one value per row of it (a routing weight's gradient), or a ``mul`` of the value and its
               gradient reduced by a ``sum``; e.g. the attention output of ``glm52::sparse_mla``. Selectors (op names, ``"module::op"`` strings,
               OpOverloads, as the policy's) name them instead; ``()`` packs every floating value. The planner
               counts their full bytes. Under any of them, a quantised form (float8 elements with their fp32
               scales, e.g. an FP8 linear's weight-gradient operand) goes as it is: packing would round scales
               that each multiply a tile, to save 1/128 of its bytes. A selector that names no value the plan
               considers is reported like an unmatched policy selector.
    peak_bytes: the device memory the step may peak at (``torch.cuda.max_memory_allocated``; e.g. full
               recompute's peak, measured). After each step the run time reads that peak and raises the device
               budget by what it left under ``peak_bytes``, so the next step keeps more of the last regions'
               values on the device instead of copying them (``gpu_bytes`` is where it starts). The device's peak
               is also read as each region's backward begins: a region's values, kept instead of copied, are
               there only from its forward through its own backward, so they count only against the stretches
               of the step they live through (the last region's against the forwards, the loss and its own
               backward). A value kept
               instead of copied adds its bytes at most to any moment of the step, so the peak stays within
               ``peak_bytes``; a step that passes it anyway (the peak rose past it) lowers the budget by the
               excess, never below ``gpu_bytes``, and one whose budget is already there warns. The peak read is
               the highest since the last ``torch.cuda.reset_peak_memory_stats()``: reset it after the compiling
               step if that one peaks higher. None: ``DEVICE_SHARE`` of the GPU's memory where ``gpu_bytes`` is
               None too, else no cap (the step keeps ``gpu_bytes``). The budget, the cap and the peak read:
               :func:`sacpass.offload.device_budget`. Device memory is spent only where it buys time: the budget
               rises only once a step at the budget in hand was timed (its regions' forwards and backwards, on
               the device), and where steps at the larger budget then measure no faster than at a smaller one by
               1% (two steps), the plan goes back to the smaller budget and holds there.

    A step whose values fit neither budget raises :class:`~sacpass.OffloadError` naming the smallest budgets
    that hold it, before the host pool runs out.
    """

    layers: int | None = None
    gpu_bytes: int | None = None
    host_bytes: int | None = None
    inputs: bool = True
    hide: float = 0.8
    min_offload_bytes: int = 1 << 20
    cost: CostModel | None = None
    compress: str | None = None
    peak_bytes: int | None = None
    exact: tuple | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "exact", _exact_selectors(self.exact, self.compress))
        if self.peak_bytes is not None and not _count(self.peak_bytes, 1):
            raise BackendOptionError(f"sacpass: ModelPlan(peak_bytes={self.peak_bytes!r}) must be None (the GPU's "
                                     f"memory less a margin, or no cap with gpu_bytes given) or an int > 0: the "
                                     f"device memory the step may peak at, e.g. full recompute's "
                                     f"torch.cuda.max_memory_allocated().")
        if self.compress is not None and self.compress not in FORMATS:
            raise BackendOptionError(f"sacpass: ModelPlan(compress={self.compress!r}) is not a compression; pass None "
                                     f"(values go to the host as they are, the default), 'fp8' or 'int8' (floating "
                                     f"values go packed in that format, lossy).")
        if not isinstance(self.inputs, bool):
            raise BackendOptionError(f"sacpass: ModelPlan(inputs={self.inputs!r}) must be True (place the regions' "
                                     f"activation inputs too) or False (keep them on the device).")
        if self.layers is not None and not _count(self.layers, 1):
            raise BackendOptionError(f"sacpass: ModelPlan(layers={self.layers!r}) is invalid; pass the number of "
                                     f"checkpointed regions one step runs (e.g. len(model.layers)), an int >= 1, or "
                                     f"None to have the plan count them in the first step.")
        if self.gpu_bytes is not None and not _count(self.gpu_bytes, 0):
            raise BackendOptionError(f"sacpass: ModelPlan(gpu_bytes={self.gpu_bytes!r}) is invalid; gpu_bytes must be "
                                     f"an int >= 0 (device bytes, all regions together), or None to follow the "
                                     f"measured peak.")
        if self.cost is not None and not isinstance(self.cost, CostModel):
            raise BackendOptionError(f"sacpass: ModelPlan(cost={self.cost!r}) is invalid; cost must be a "
                                     f"sacpass.CostModel, or None to measure it on the device.")
        _check_shared("ModelPlan", "for the whole step", self.host_bytes, self.hide, self.min_offload_bytes)

    @property
    def counts_regions(self) -> bool:
        """Whether the plan counts the step's regions in a first step compiled without it (``layers`` not given)."""
        return self.layers is None

    @property
    def resolved(self) -> bool:
        """Whether every budget and the cost model are set: what a compile partitions with."""
        return self.layers is not None and self.gpu_bytes is not None and self.cost is not None

    def resolve(self, device, regions: int | None = None, op_seconds: dict | None = None) -> "ModelPlan":
        """This plan with nothing left to decide, for ``device``: ``layers`` from ``regions`` (counted), the cost
        model measured there (:func:`sacpass.calibration.calibrate`, with the counted step's op times), the device
        budget from 0 under ``DEVICE_SHARE`` of its memory."""
        import torch

        if self.resolved:
            return self
        layers = self.layers if self.layers is not None else regions
        if layers is None:
            raise BackendOptionError("sacpass: ModelPlan() counts the step's regions in its first training step; "
                                     "resolve it with the count (regions=...), or pass layers=.")
        cost = self.cost
        if cost is None:
            cost = calibration.calibrate(device, op_seconds=op_seconds)
        peak = self.peak_bytes
        device = torch.device(device)
        if self.gpu_bytes is None and peak is None and device.type == "cuda":
            peak = int(DEVICE_SHARE * torch.cuda.get_device_properties(device).total_memory)
        return dataclasses.replace(self, layers=layers, gpu_bytes=self.gpu_bytes or 0, cost=cost, peak_bytes=peak)

    def host_budget(self) -> int:
        return self.host_bytes if self.host_bytes is not None else default_host_bytes()

    def _require_resolved(self, what: str) -> None:
        if not self.resolved:
            raise BackendOptionError(f"sacpass: {self!r} has {what} only once resolved (ModelPlan.resolve): the backend "
                                     f"does that at the compile, after counting the regions where layers is None.")

    @property
    def key(self) -> str:
        """What the compiled graphs name this plan by (its stash ops' argument): its budgets."""
        self._require_resolved("a key")
        return (f"layers={self.layers},gpu={self.gpu_bytes},host={self.host_budget()},inputs={int(self.inputs)}"
                + (f",compress={self.compress}" if self.compress else "")
                + (f",peak={self.peak_bytes}" if self.peak_bytes is not None else ""))

    def region_share(self) -> int:
        """The bytes one region may keep, on the device or the host, if every region of the step ran its graph.
        With ``compress``, in packed bytes: the device's part, which stays unpacked, counts at the packing ratio
        of bf16, so that the regions the device cannot hold fit ``host_bytes`` packed."""
        self._require_resolved("a region share")
        gpu = int(self.gpu_bytes * BF16_RATIO) if self.compress else self.gpu_bytes
        return (self.host_budget() + gpu) // self.layers

    def region_plan(self, placed_inputs: int = 0) -> Plan:
        """The per-graph part: the region's share less ``placed_inputs`` (the bytes of its activation inputs,
        which are placed whatever the planner decides), for the values the planner chooses."""
        return Plan(gpu_bytes=0, host_bytes=max(0, self.region_share() - placed_inputs), layers=self.layers,
                    hide=self.hide, min_offload_bytes=self.min_offload_bytes, cost=self.cost)


def _exact_selectors(exact, compress) -> tuple:
    """ModelPlan(exact=): None (the sensitive values), or op and module-op selectors only (they print and hash as
    they read), with compress."""
    from .selectors import ModuleOpSelector, OpSelector, as_selectors

    if exact is None:
        return None
    if exact == ():
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
                                 f"where compress='fp8' or 'int8' packs the others; without compress every value goes "
                                 f"to the host exact. Pass compress='fp8' (or 'int8'), or drop exact=.")
    return sels


def as_plan(plan) -> Plan | ModelPlan | None:
    """``None``, ``"auto"`` (a :class:`ModelPlan` with no arguments), a Plan or a ModelPlan; anything else is
    refused."""
    if isinstance(plan, ModelPlan):
        return declare(plan) if plan.resolved else plan
    if plan is None or isinstance(plan, Plan):
        return plan
    if plan == "auto":
        return ModelPlan()
    raise BackendOptionError(f"sacpass: plan={plan!r} is not a plan; pass plan='auto' (sacpass.ModelPlan(), which "
                             f"needs no arguments), a sacpass.ModelPlan(...) with overrides, a sacpass.Plan(...) with "
                             f"per-graph budgets, or None (no planner).")


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
