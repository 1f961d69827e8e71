"""The runtime's four ops, declared: schemas and fake (meta) kernels, which is all that compile-time code needs.
Their real kernels call this process's runtime (:mod:`sacpass.offload.runtime`), loaded at the first call.

- ``sacpass::offload(Tensor x, int index, Tensor[] after) -> Tensor``: in the forward, after all of the
  forward's work (``after``, the forward's other outputs, is read by nothing but orders it there: a compiler
  that ran it earlier could reuse ``x``'s memory for a later buffer while the copy still reads it). Copies ``x``
  to the host pool on a side stream and returns the host tensor, which the forward saves instead of ``x``.
  ``index`` is the op's position in its graph; index 0 opens a new bundle.
- ``sacpass::reload(Tensor host, Device device) -> Tensor``: in the backward, before the first use: the value
  back on ``device``, its copy waited for by the compute stream alone, the next copies prefetched.
- ``sacpass::stash(Tensor x, int index, str plan, Tensor[] after, bool pack=True, float forward_ms=0.,
  float backward_ms=0.) -> Tensor``: a model plan's value, kept where the plan places it (device or host pool);
  returns its handle. ``pack=False``: never packed, though the plan compresses (``ModelPlan(exact=)``).
  ``forward_ms`` / ``backward_ms`` (on a graph's first stash): what the cost model expects of the graph's forward
  and backward, shown beside what each region took (:func:`sacpass.offload.placements`).
- ``sacpass::unstash(Tensor handle, SymInt[] size, SymInt[] stride, ScalarType dtype, Device device) -> Tensor``:
  the value behind ``handle`` on ``device``: the kept tensor, or the host copy reloaded.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .sizes import dense

__all__ = ["offload", "reload", "stash", "unstash"]


def _runtime():
    from .runtime import process_runtime
    return process_runtime()


@torch.library.custom_op("sacpass::offload", mutates_args=())
def offload(x: Tensor, index: int, after: list[Tensor]) -> Tensor:
    return _runtime().offload(x, index)


@offload.register_fake
def _(x, index, after):
    if dense(x):  # the runtime's host copy keeps a dense value's strides (sacpass.offload.sizes.host_layout)
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("sacpass::reload", mutates_args=())
def reload(host: Tensor, device: torch.device) -> Tensor:
    return _runtime().reload(host, torch.device(device))


@reload.register_fake
def _(host, device):
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


@torch.library.custom_op("sacpass::stash", mutates_args=())
def stash(x: Tensor, index: int, plan: str, after: list[Tensor], pack: bool = True, forward_ms: float = 0.0,
          backward_ms: float = 0.0) -> Tensor:
    return _runtime().stash(x, index, plan, pack, forward_ms, backward_ms)


@stash.register_fake
def _(x, index, plan, after, pack=True, forward_ms=0.0, backward_ms=0.0):
    return torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("sacpass::unstash", mutates_args=())
def unstash(handle: Tensor, size: list[int], stride: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    return _runtime().unstash(handle, size, stride, dtype, torch.device(device))


@unstash.register_fake
def _(handle, size, stride, dtype, device):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)
