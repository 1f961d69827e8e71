"""The offload runtime: move saved activations to pinned host memory in the forward, bring them back for the
backward, and prefetch across the per-layer compiled graphs.

Two custom ops, inserted by :mod:`sacpass.passes.offload` into the partitioned graphs:

- ``sacpass::offload(Tensor x, int index) -> Tensor``: in the forward, right after ``x`` is produced. Copies
  ``x`` into a pinned host buffer on a side stream (the compute stream does not wait) and returns the host
  tensor, which the forward saves instead of ``x``. ``x.record_stream`` makes the allocator reuse its memory
  only after the copy, so it is free as soon as the forward drops it and the copy is done. ``index`` is the op's
  position in its graph; index 0 opens a new *bundle* (one execution of one compiled forward).
- ``sacpass::reload(Tensor host, Device device) -> Tensor``: in the backward, before the first use. The first
  reload of a bundle issues the host-to-device copies of the whole bundle on a second side stream, then
  starts the copies of the bundle before it (the previous layer, in forward order), so that layer's reloads
  overlap this layer's backward; each reload makes the compute stream wait for its own copy only.

On a CPU tensor both ops copy (host to host): the graphs, the numerics and the report are what they are on
a GPU, nothing is saved and nothing is prefetched. Pinned bytes alive at once are capped by
:func:`set_host_limit` (default: 80% of physical memory); going past it raises :class:`OffloadError`.
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .errors import OffloadError

__all__ = ["set_host_limit", "host_limit", "stats", "reset_stats", "OffloadStats"]

_lock = threading.Lock()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


_HOST_LIMIT = int(0.8 * _physical_memory())


def set_host_limit(nbytes: int) -> None:
    """Cap the pinned host bytes that offloaded activations may hold at once (all graphs together)."""
    global _HOST_LIMIT
    if nbytes < 0:
        raise ValueError(f"sacpass.offload.set_host_limit: {nbytes} must be >= 0")
    _HOST_LIMIT = int(nbytes)


def host_limit() -> int:
    return _HOST_LIMIT


@dataclass
class OffloadStats:
    """Counters since the last :func:`reset_stats` (what the benchmarks report)."""

    offloaded_bytes: int = 0  # device -> host
    reloaded_bytes: int = 0  # host -> device
    prefetched_bytes: int = 0  # reloads started ahead, before their bundle's backward
    waited_reloads: int = 0  # reloads whose copy was not started before the backward needed it
    host_bytes_alive: int = 0  # pinned bytes referenced now
    peak_host_bytes: int = 0
    bundles: int = 0


_STATS = OffloadStats()


def stats() -> OffloadStats:
    return OffloadStats(**vars(_STATS))


def reset_stats() -> None:
    alive = _STATS.host_bytes_alive
    for k in vars(_STATS):
        setattr(_STATS, k, 0)
    _STATS.host_bytes_alive = _STATS.peak_host_bytes = alive


# ------------------------------------------------------------------------------------------ bookkeeping
@dataclass(eq=False)  # identity: bundles are found in a list by who they are, not what they hold
class _Bundle:
    """The host tensors one forward execution offloaded, in order (weak references)."""

    hosts: list[weakref.ref] = field(default_factory=list)
    started: bool = False  # its backward has begun (its first reload ran)
    issued: bool = False  # its host-to-device copies have been issued


@dataclass(eq=False)
class _Entry:
    bundle: _Bundle
    d2h: "torch.cuda.Event | None"  # completion of the device-to-host copy (None on CPU)
    nbytes: int
    reload: Tensor | None = None  # the device copy, once issued
    h2d: "torch.cuda.Event | None" = None


_ENTRIES: dict[int, _Entry] = {}  # host storage address -> entry; removed when the host tensor dies
_BUNDLES: list[_Bundle] = []  # forward order; a bundle leaves when its backward begins
_STREAMS: dict[tuple[str, int], "torch.cuda.Stream"] = {}


def _key(host: Tensor) -> int:
    return host.untyped_storage().data_ptr()


def _stream(kind: str, device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (kind, index) not in _STREAMS:
        _STREAMS[(kind, index)] = torch.cuda.Stream(device=torch.device("cuda", index))
    return _STREAMS[(kind, index)]


def _forget(key: int, nbytes: int) -> None:
    with _lock:
        entry = _ENTRIES.pop(key, None)
        _STATS.host_bytes_alive -= nbytes
    if entry is not None and entry.reload is not None and entry.h2d is not None:
        # an unused prefetch: order the allocator's reuse of its memory after the copy
        torch.cuda.current_stream(entry.reload.device).wait_event(entry.h2d)


def _host_like(x: Tensor) -> Tensor:
    """A host tensor with ``x``'s sizes, and its strides where they are dense (pinned when ``x`` is on a GPU)."""
    pin = x.device.type == "cuda"
    if torch._prims_common.is_non_overlapping_and_dense_or_false(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu", pin_memory=pin)
    return torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=pin)


def _issue_reload(host: Tensor, entry: _Entry, device: torch.device) -> None:
    stream = _stream("h2d", device)
    dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the allocation is ordered before the copy
    if entry.d2h is not None:
        stream.wait_event(entry.d2h)
    with torch.cuda.stream(stream):
        dev.copy_(host, non_blocking=True)
        entry.h2d = torch.cuda.Event()
        entry.h2d.record(stream)
    entry.reload = dev
    _STATS.reloaded_bytes += entry.nbytes


def _issue_bundle(bundle: _Bundle, device: torch.device, *, prefetch: bool) -> None:
    bundle.issued = True
    for ref in bundle.hosts:
        host = ref()
        entry = _ENTRIES.get(_key(host)) if host is not None else None
        if entry is not None and entry.reload is None:
            _issue_reload(host, entry, device)
            if prefetch:
                _STATS.prefetched_bytes += entry.nbytes
            else:
                _STATS.waited_reloads += 1


def _begin_backward(bundle: _Bundle, device: torch.device) -> None:
    """The first reload of ``bundle``: issue its copies if no one did, and prefetch the bundle before it."""
    bundle.started = True
    if not bundle.issued:
        _issue_bundle(bundle, device, prefetch=False)
    at = _BUNDLES.index(bundle) if bundle in _BUNDLES else len(_BUNDLES)
    earlier = [b for b in _BUNDLES[:at] if not b.started and not b.issued]
    if earlier:  # in a plain backward, the layer before this one runs its backward next
        _issue_bundle(earlier[-1], device, prefetch=True)
    if bundle in _BUNDLES:
        _BUNDLES.remove(bundle)


# ------------------------------------------------------------------------------------------------ ops
@torch.library.custom_op("sacpass::offload", mutates_args=())
def offload(x: Tensor, index: int) -> Tensor:
    """Copy ``x`` to (pinned) host memory without making the compute stream wait; see the module docstring."""
    host = _host_like(x)
    nbytes = host.untyped_storage().nbytes()
    with _lock:
        if _STATS.host_bytes_alive + nbytes > _HOST_LIMIT:
            raise OffloadError(
                f"sacpass: offloading {nbytes} more bytes would hold {_STATS.host_bytes_alive + nbytes} pinned host "
                f"bytes, past the limit of {_HOST_LIMIT} (sacpass.offload.set_host_limit). Offload less (a "
                f"smaller Plan(host_bytes=...) or fewer offload= selectors) or raise the limit.")
        if index == 0 or not _BUNDLES:
            _BUNDLES.append(_Bundle())
            _STATS.bundles += 1
        bundle = _BUNDLES[-1]
        _STATS.host_bytes_alive += nbytes
        _STATS.peak_host_bytes = max(_STATS.peak_host_bytes, _STATS.host_bytes_alive)
        _STATS.offloaded_bytes += nbytes
    d2h = None
    if x.device.type == "cuda":
        stream = _stream("d2h", x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            host.copy_(x, non_blocking=True)
            d2h = torch.cuda.Event()
            d2h.record(stream)
        # the allocator may hand x's memory out again only after the copy: freed as soon as the forward
        # drops x and the copy is done, without a reference kept here until the next sacpass op runs
        x.record_stream(stream)
    else:
        host.copy_(x)
    key = _key(host)
    _ENTRIES[key] = _Entry(bundle, d2h, nbytes)
    bundle.hosts.append(weakref.ref(host, lambda _, k=key, n=nbytes: _forget(k, n)))
    return host


@offload.register_fake
def _(x, index):
    if torch._prims_common.is_non_overlapping_and_dense_or_false(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("sacpass::reload", mutates_args=())
def reload(host: Tensor, device: torch.device) -> Tensor:
    """Bring an offloaded activation back to ``device``; see the module docstring."""
    device = torch.device(device)
    entry = _ENTRIES.get(_key(host))
    if device.type != "cuda" or entry is None:  # CPU, or a host tensor sacpass did not make: copy plainly
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        out.copy_(host)
        _STATS.reloaded_bytes += host.untyped_storage().nbytes()
        return out
    if not entry.bundle.started:
        _begin_backward(entry.bundle, device)
    if entry.reload is None:  # reloaded before (a second backward through the same graph): again
        _issue_reload(host, entry, device)
        _STATS.waited_reloads += 1
    torch.cuda.current_stream(device).wait_event(entry.h2d)
    out, entry.reload = entry.reload, None
    return out


@reload.register_fake
def _(host, device):
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
