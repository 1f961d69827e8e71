"""The offload runtime: move saved activations to host memory in the forward, bring them back for the
backward, and prefetch across the per-layer compiled graphs.

Two custom ops, inserted by :mod:`sacpass.passes.offload` into the partitioned graphs:

- ``sacpass::offload(Tensor x, int index, Tensor[] after) -> Tensor``: in the forward, after all of the
  forward's work (``after``, the forward's other outputs, is read by nothing but orders it there: a compiler
  that ran it earlier could reuse ``x``'s memory for a later buffer while the copy still reads it). Copies
  ``x`` into a block of sacpass's host pool on a side stream (the compute stream does not wait) and returns the
  host tensor, which the forward saves instead of ``x``. ``x.record_stream`` lets the allocator reuse ``x``'s
  memory only after the copy. ``index`` is the op's position in its graph; index 0 opens a new *bundle* (one
  execution of one compiled forward).
- ``sacpass::reload(Tensor host, Device device) -> Tensor``: in the backward, before the first use. Each
  reload makes the compute stream wait for its own copy only, and *prefetches*: it issues, on a second side
  stream, the copies that come next in the order the backward reads them (the rest of its bundle, then the
  bundle opened just before it on the same device and thread: the previous layer, whose backward runs
  next), while the copies issued and not yet read stay within :func:`set_prefetch_limit` bytes per device.
  The copies overlap the backward's compute, and a layer's values arrive a few at a time instead of all at
  its first reload (with the previous layer's beside them). The order is the one the backward of the same
  graph read them in last time (learned by the bundle's layout); before that, the reverse of the forward's.

Lifetimes (nothing here is freed by a garbage collection, and nothing outlives what owns it):

- A host tensor's storage is its pool block: the block goes back to the pool when autograd frees the saved
  tensor (after its backward, or with its graph when no backward ever runs), and is handed out again only
  once every copy that reads or writes it has finished (CUDA events).
- A bundle lives exactly as long as one of its host tensors does: a forward whose backward never runs (an
  eval loop under grad, a skipped step, an exception in the loss) leaves nothing behind once its outputs go.
- A reloaded copy the backward read is the backward's: its compute stream waited for the copy before any use,
  so the allocator reuses its memory in that stream's order, at once (not after the copies queued behind it).
  A prefetched copy that no backward consumed is freed when the backward that started it ends (an autograd
  final callback); ``record_stream`` orders the reuse of its device memory after its copy.

The pool: host memory that sacpass owns, in slabs of a power of two bytes (which PyTorch's pinned allocator
holds exactly; pinned when the offloaded tensor is on a GPU), sub-allocated in 512-byte blocks. What it holds
(``host_bytes_held``) is what the machine gives up; what live offloads use (``host_bytes_alive``) is at most
that. :func:`set_host_limit` caps the bytes *held* (default: 80% of physical memory); a slab that would pass
the limit, or more than the host has available, raises :class:`~sacpass.OffloadError` before it is allocated.
:func:`release_host_memory` gives unused slabs back.

State is per device (streams), per thread (the bundle chain a forward appends to) and per graph (a bundle),
under one lock; the backward's copies follow the bundle chain, never a global list. Two models stepping in
two threads, or two microbatches interleaved (F1 F2 B1 B2), each prefetch their own previous layer. Two GPUs
of one process keep apart by construction (streams and chains are keyed by device), which the tests cannot
show here: the test machines have one GPU at most. The runtime's warnings (a reload past the prefetch limit, a
model plan's peak past its cap) are given as its op returns, outside the lock: a filter that makes them errors
stops the forward or backward with the copy issued and the step placed, never halfway through either.

On the CPU (a CPU tensor offloaded) the same code runs: pool, bundles, prefetch order, reload and free, with
the copies done synchronously and an unpinned pool, so the lifecycle is tested without a GPU.
"""
from __future__ import annotations

import collections
import ctypes
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from . import compression
from .errors import OffloadError, SacpassWarning
from .host import available_memory, physical_memory

__all__ = ["set_host_limit", "host_limit", "set_prefetch_limit", "prefetch_limit", "stats", "reset_stats", "OffloadStats", "release_host_memory",
           "placements", "format_placements", "device_budget",
           "pool_bytes", "host_pool_bytes", "ALIGN"]

_lock = threading.RLock()

ALIGN = 512  # bytes: every block of the pool starts and ends on this boundary
_MIN_SLAB = 4 << 20
_MAX_SLAB = 2 << 30
_HOST_MARGIN = 0.05  # share of physical memory a new slab must leave available to everything else

_HOST_LIMIT = int(0.8 * physical_memory())
_PREFETCH_LIMIT: int | None = 4 << 30
_WARNED_LIMITS: set[int] = set()  # prefetch limits a larger reload has been warned of
_SAY: list[str] = []  # warnings found under the lock, given by _say() once the runtime's change is complete


def set_host_limit(nbytes: int) -> None:
    """Cap the host bytes sacpass's pool may hold (its slabs, all devices and graphs together). Unused slabs
    over a lowered limit are given back at once; a later offload that needs more raises OffloadError."""
    global _HOST_LIMIT
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"sacpass.offload.set_host_limit({nbytes!r}): pass a number of bytes, an int >= 0.")
    with _lock:
        _HOST_LIMIT = nbytes
        if _held() > nbytes:
            _trim()


def host_limit() -> int:
    return _HOST_LIMIT


def set_prefetch_limit(nbytes: int | None) -> None:
    """Cap the bytes of reloads issued ahead and not yet read by the backward, per device (default 4 GiB;
    ``None``: no cap, every copy of a layer and of the layer before it issued at the layer's first reload).
    One copy is always in flight, however large (a reload larger than the cap warns once: it is copied alone, when
    nothing else is in flight). A lower cap holds fewer reloaded values on the device at once;
    too low a cap issues the next layer's copies late in this layer's backward, where the compute may no longer
    hide them (each copy waits for the compute issued before it)."""
    global _PREFETCH_LIMIT
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
        raise ValueError(f"sacpass.offload.set_prefetch_limit({nbytes!r}): pass a number of bytes, an int >= 0, "
                         f"or None for no cap.")
    with _lock:
        _PREFETCH_LIMIT = nbytes


def prefetch_limit() -> int | None:
    return _PREFETCH_LIMIT


def pool_bytes(nbytes: int) -> int:
    """The pool bytes one offloaded tensor of ``nbytes`` takes (its block: rounded up to ``ALIGN``)."""
    return -(-nbytes // ALIGN) * ALIGN


def packs(dtype: torch.dtype, compress: bool) -> bool:
    """Whether a value of ``dtype`` goes to the host FP8-packed under a plan that compresses (floating ones)."""
    return compress and dtype in compression.COMPRESSIBLE


def host_pool_bytes(numel: int, dtype: torch.dtype, compress: bool = False) -> int:
    """The pool bytes a value of ``numel`` elements of ``dtype`` takes on the host: its block, or with
    ``compress`` and a floating dtype the blocks of its FP8 elements and their scales
    (:mod:`sacpass.compression`)."""
    return packed_pool_bytes(numel) if packs(dtype, compress) else pool_bytes(numel * dtype.itemsize)


def packed_pool_bytes(numel: int) -> int:
    """The pool bytes of ``numel`` elements FP8-packed: the blocks of the elements and of their scales."""
    return pool_bytes(numel) + pool_bytes(compression.packed_bytes(numel) - numel)


# ------------------------------------------------------------------------------------------------- stats
@dataclass
class OffloadStats:
    """Counters since the last :func:`reset_stats` (what the benchmarks report), and the state now."""

    offloaded_bytes: int = 0  # device -> host
    reloaded_bytes: int = 0  # host -> device
    prefetched_bytes: int = 0  # reloads issued ahead, before the backward asked for them
    waited_reloads: int = 0  # reloads whose copy was issued only when the backward asked for it
    largest_reload_bytes: int = 0  # the largest single copy back (a prefetch limit below it copies it alone)
    dropped_prefetch_bytes: int = 0  # prefetched, but no backward consumed them: freed when that backward ended
    bundles: int = 0  # bundles opened (forward executions that offloaded)
    host_bytes_alive: int = 0  # pool bytes live offloads use now (their blocks)
    peak_host_bytes: int = 0
    host_bytes_held: int = 0  # pool bytes held now (its slabs): the host memory sacpass really takes
    peak_host_bytes_held: int = 0
    bundles_alive: int = 0  # bundles whose host tensors are still referenced (by an autograd graph)
    kept_bytes: int = 0  # values a model plan kept on the device instead of offloading
    packed_bytes: int = 0  # values a model plan sent to the host FP8-packed (their own bytes; offloaded_bytes
    #                        counts the packed bytes copied)

    def format(self) -> str:
        gib = 2 ** 30
        return (f"offload: {self.offloaded_bytes / gib:.3f} GiB out, {self.reloaded_bytes / gib:.3f} GiB back "
                f"({self.prefetched_bytes / gib:.3f} prefetched, {self.waited_reloads} reloads waited, "
                f"{self.dropped_prefetch_bytes / gib:.3f} GiB prefetched unused); host pool: "
                f"{self.host_bytes_alive / gib:.3f} GiB in use of {self.host_bytes_held / gib:.3f} GiB held "
                f"(peaks {self.peak_host_bytes / gib:.3f} / {self.peak_host_bytes_held / gib:.3f}); "
                f"{self.bundles_alive} bundles alive of {self.bundles} opened"
                + (f"; model plan kept {self.kept_bytes / gib:.3f} GiB on the device" if self.kept_bytes else "")
                + (f"; {self.packed_bytes / gib:.3f} GiB of values went FP8-packed" if self.packed_bytes else ""))


_STATS = OffloadStats()
_LIVE_BUNDLES: "weakref.WeakSet[_Bundle]" = weakref.WeakSet()


def stats() -> OffloadStats:
    with _lock:
        _drain()
        _STATS.bundles_alive = len(_LIVE_BUNDLES)
        _STATS.host_bytes_held = _held()
        return OffloadStats(**vars(_STATS))


def reset_stats() -> None:
    with _lock:
        _drain()
        keep = {"host_bytes_alive", "host_bytes_held", "bundles_alive"}
        for f in fields(OffloadStats):
            if f.name not in keep:
                setattr(_STATS, f.name, 0)
        _STATS.host_bytes_held = _held()
        _STATS.peak_host_bytes = _STATS.host_bytes_alive
        _STATS.peak_host_bytes_held = _STATS.host_bytes_held


def release_host_memory() -> int:
    """Give back the pool's slabs that hold no live offload (and, on CUDA, PyTorch's cached pinned blocks).
    Returns the bytes given back."""
    with _lock:
        _drain()
        freed = _trim()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if freed and empty is not None and torch.cuda.is_available():
        empty()
    return freed


# ------------------------------------------------------------------------------------------------- pool
def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(eq=False)
class _Slab:
    data: Tensor  # uint8, this slab's memory
    size: int
    free: list[list[int]]  # [offset, size] of free runs, by offset
    blocks: int = 0  # blocks handed out or waiting for their copies

    @property
    def ptr(self) -> int:
        return self.data.data_ptr()


@dataclass(eq=False)
class _Block:
    slab: _Slab
    offset: int
    size: int
    events: dict = field(default_factory=dict)  # stream kind -> the last copy on it that touched this block

    @property
    def ptr(self) -> int:
        return self.slab.ptr + self.offset


class _Pool:
    """Slabs of host memory, sub-allocated best fit; freed blocks wait for their copies before reuse."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.slabs: list[_Slab] = []
        self.pending: list[_Block] = []  # freed, some copy still in flight
        self.in_use = 0

    @property
    def held(self) -> int:
        return sum(s.size for s in self.slabs)

    def allocate(self, nbytes: int) -> _Block:
        size = pool_bytes(nbytes)
        block = self._fit(size)
        if block is None and self.pending:
            self._reclaim(wait=True)
            block = self._fit(size)
        if block is None:
            self.slabs.append(_new_slab(self, size))
            block = self._fit(size)
        self.in_use += block.size
        return block

    def release(self, block: _Block) -> None:
        self.in_use -= block.size
        self.pending.append(block)
        self._reclaim()

    def _fit(self, size: int) -> _Block | None:
        best = None
        for slab in self.slabs:
            for run in slab.free:
                if run[1] >= size and (best is None or run[1] < best[1][1]):
                    best = (slab, run)
        if best is None:
            return None
        slab, run = best
        block = _Block(slab, run[0], size)
        run[0] += size
        run[1] -= size
        if run[1] == 0:
            slab.free.remove(run)
        slab.blocks += 1
        return block

    def _reclaim(self, wait: bool = False) -> None:
        keep = []
        for block in self.pending:
            events = list(block.events.values())
            if wait:
                for e in events:
                    e.synchronize()
            elif not all(e.query() for e in events):
                keep.append(block)
                continue
            self._free(block)
        self.pending = keep

    @staticmethod
    def _free(block: _Block) -> None:
        slab = block.slab
        slab.blocks -= 1
        runs = slab.free
        at = next((i for i, r in enumerate(runs) if r[0] > block.offset), len(runs))
        runs.insert(at, [block.offset, block.size])
        if at + 1 < len(runs) and runs[at][0] + runs[at][1] == runs[at + 1][0]:  # merge with the next run
            runs[at][1] += runs.pop(at + 1)[1]
        if at > 0 and runs[at - 1][0] + runs[at - 1][1] == runs[at][0]:  # and with the previous one
            runs[at - 1][1] += runs.pop(at)[1]

    def trim(self) -> int:
        self._reclaim(wait=True)
        empty = [s for s in self.slabs if s.blocks == 0]
        self.slabs = [s for s in self.slabs if s.blocks]
        return sum(s.size for s in empty)


_POOLS = {True: _Pool(pinned=True), False: _Pool(pinned=False)}


def _held() -> int:
    return sum(p.held for p in _POOLS.values())


def _trim() -> int:
    freed = sum(p.trim() for p in _POOLS.values())
    _STATS.host_bytes_held = _held()
    return freed


def _new_slab(pool: _Pool, size: int) -> _Slab:
    """A slab for a block of ``size`` bytes: a power of two, growing with what the pool holds (up to 2 GiB,
    fewer slabs for a large working set), within the host limit and what the host has available."""
    held = _held()
    slab = max(_pow2(size), min(_MAX_SLAB, max(_MIN_SLAB, _pow2(held + 1))))
    if held + slab > _HOST_LIMIT:
        slab = _pow2(size)
    if held + slab > _HOST_LIMIT:
        raise OffloadError(
            f"sacpass: offloading {size} more bytes needs a new host slab of {slab} bytes, which would make "
            f"sacpass's host pool hold {held + slab} bytes ({pool_in_use()} in use by live offloads), past the "
            f"limit of {_HOST_LIMIT} (sacpass.offload.set_host_limit). Offload less (a smaller "
            f"Plan(host_bytes=...) or fewer offload= selectors), drop outputs whose backward will never run, or "
            f"raise the limit.")
    free = available_memory() - int(_HOST_MARGIN * physical_memory())
    if slab > free:
        raise OffloadError(
            f"sacpass: offloading {size} more bytes needs a new host slab of {slab} bytes, but the host has only "
            f"{max(free, 0)} bytes available (beyond a {int(100 * _HOST_MARGIN)}% margin; sacpass's pool holds "
            f"{held}). Offload less (a smaller Plan(host_bytes=...) or fewer offload= selectors), or free host "
            f"memory.")
    data = torch.empty(slab, dtype=torch.uint8, pin_memory=pool.pinned)
    _STATS.host_bytes_held = held + slab
    _STATS.peak_host_bytes_held = max(_STATS.peak_host_bytes_held, held + slab)
    return _Slab(data, slab, [[0, slab]])


def pool_in_use() -> int:
    return sum(p.in_use for p in _POOLS.values())


def _block_tensor(block: _Block, shape, stride, dtype: torch.dtype, on_free=None) -> Tensor:
    """A tensor over ``block``'s memory. With ``on_free``, its storage calls ``on_free`` when it dies: that
    storage *is* the block's life. Without, a second view for a copy (the block outlives it by its events)."""
    buf = (ctypes.c_uint8 * block.size).from_address(block.ptr)
    if on_free is not None:
        weakref.finalize(buf, on_free).atexit = False
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).as_strided(shape, stride)


# ------------------------------------------------------------------------------------------ bookkeeping
@dataclass(eq=False)
class _Bundle:
    """The host tensors one forward execution offloaded (their keys, in order). Referenced by its entries
    only: it goes when the last of its host tensors does."""

    device: tuple[str, int]
    prev: "weakref.ref[_Bundle] | None"  # the bundle opened before it on this device and thread
    keys: list[int] = field(default_factory=list)
    started: bool = False  # its backward has begun (its first reload ran)
    read: list[int] = field(default_factory=list)  # its entries' positions, in the order its backward read them
    shapes: tuple | None = None  # see layout()

    def __post_init__(self) -> None:
        _LIVE_BUNDLES.add(self)

    def entries(self) -> list["_Entry"]:
        return [e for e in self._by_position() if e is not None]

    def layout(self) -> tuple:
        """Its entries' (shape, dtype), in the forward's order: taken once its forward is over (at its first
        prefetch or read), while all of them live."""
        if self.shapes is None:
            self.shapes = tuple((e.shape, e.dtype) if e is not None else None for e in self._by_position())
        return self.shapes

    def _by_position(self) -> list["_Entry | None"]:
        return [e if e is not None and e.bundle is self else None for e in (_ENTRIES.get(k) for k in self.keys)]

    def pending(self) -> list["_Entry"]:
        """Its entries not yet issued nor read, in the order its backward will read them: the order the last
        backward of a bundle of the same layout read them in (the same compiled graph), else the reverse of
        the forward's."""
        order = _READ_ORDERS.get(self.layout()) or range(len(self.keys) - 1, -1, -1)
        entries = self._by_position()
        return [e for e in (entries[i] for i in order) if e is not None and e.reload is None and not e.read]


@dataclass(eq=False)
class _Entry:
    bundle: _Bundle
    pool: _Pool
    block: _Block
    nbytes: int  # the tensor's bytes
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    d2h: "torch.cuda.Event | None"  # completion of the device-to-host copy (None on CPU)
    position: int = 0  # in its bundle
    reload: Tensor | None = None  # the device copy, once issued and until read
    h2d: "torch.cuda.Event | None" = None
    read: bool = False  # a backward has read it
    timing: "dict[str, list] | None" = None  # a model plan's region: its copies' times, each way

    def drop(self, read: bool = False) -> None:
        """Forget its device copy: handed to the backward (``read``), whose compute stream waits for the copy
        before any use, so its memory is reused in the compute stream's order; or freed unread, its memory
        reused only once its copy has finished."""
        if self.reload is not None:
            if not read and self.reload.is_cuda:
                self.reload.record_stream(_stream("h2d", self.reload.device))
            self.reload = None
            _IN_FLIGHT[self.bundle.device] -= self.nbytes


_ENTRIES: dict[int, _Entry] = {}  # host data address -> entry; removed when the host tensor's storage dies
_OPEN: dict[tuple[tuple[str, int], int], "weakref.ref[_Bundle]"] = {}  # (device, thread) -> newest bundle
_STREAMS: dict[tuple[str, int], "torch.cuda.Stream"] = {}
_FREED: collections.deque = collections.deque()  # host addresses whose storage died, to settle under the lock
_BACKWARDS: dict[int, dict] = {}  # autograd graph task -> {id: weak ref} of the bundles its backward read or prefetched
_IN_FLIGHT: collections.Counter = collections.Counter()  # device -> bytes of reloads issued and not yet read
# a bundle's layout -> the order its last backward read its entries; the newest _READ_ORDERS_KEPT layouts (one
# per compiled graph and input shape), so a run whose shapes vary keeps a bounded table
_READ_ORDERS: "collections.OrderedDict[tuple, list[int]]" = collections.OrderedDict()
_READ_ORDERS_KEPT = 256


def _deref(ref: "weakref.ref | None"):
    return ref() if ref is not None else None


def _device_key(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return ("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return (device.type, -1)


def _stream(kind: str, device: torch.device) -> "torch.cuda.Stream":
    key = (kind, _device_key(device)[1])
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=torch.device("cuda", key[1]))
    return _STREAMS[key]


def _side_copy(kind: str, device: torch.device, dst: Tensor, src: Tensor, after=None,
               timing: "dict[str, list] | None" = None) -> "torch.cuda.Event":
    """``dst.copy_(src)`` on ``device``'s ``kind`` stream, ordered after the compute stream's work so far (the
    source's producer, the destination's allocation) and after the event ``after``; returns its completion.
    ``timing``: the copy's (start, end) timing events go to ``timing[kind]``."""
    stream = _stream(kind, device)
    stream.wait_stream(torch.cuda.current_stream(device))
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        start = None
        if timing is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event(enable_timing=timing is not None)
        done.record(stream)
    if timing is not None:
        timing[kind].append((start, done))
    return done


def _timed_copy(kind: str, dst: Tensor, src: Tensor, timing: "dict[str, list] | None") -> None:
    """A synchronous copy (a CPU tensor's), its seconds to ``timing[kind]``."""
    t0 = time.perf_counter()
    dst.copy_(src)
    if timing is not None:
        timing[kind].append(time.perf_counter() - t0)


def _copy_ms(times: list) -> float | None:
    """The milliseconds of timed copies: CPU seconds, or CUDA (start, end) events; None while one is running."""
    total = 0.0
    for t in times:
        ms = 1e3 * t if isinstance(t, float) else _elapsed_ms(*t)
        if ms is None:
            return None
        total += ms
    return total


def _clock(device: torch.device):
    """A point in ``device``'s compute order: a CUDA timing event recorded on its current stream (the work
    queued so far), or the host clock for the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def _elapsed_ms(start, end) -> float | None:
    """Milliseconds between two :func:`_clock` marks; None without an end, or while either's work runs."""
    if start is None or end is None:
        return None
    if isinstance(start, float):
        return 1e3 * (end - start)
    return start.elapsed_time(end) if start.query() and end.query() else None


def _drain() -> None:
    """Settle the host tensors that died since the last call: their entries go, their blocks go back to the
    pool (after their copies). Storage finalizers only queue the address, so a collection that runs inside
    the runtime never changes the pool under its feet."""
    _drain_handles()
    while _FREED:
        entry = _ENTRIES.pop(_FREED.popleft(), None)
        if entry is None:
            continue
        entry.drop()
        entry.pool.release(entry.block)
        _STATS.host_bytes_alive -= entry.block.size


def _open_bundle(device: torch.device, index: int) -> _Bundle:
    key = (_device_key(device), threading.get_ident())
    ref = _OPEN.get(key)
    current = _deref(ref)
    if index == 0 or current is None or current.started:
        current = _Bundle(key[0], ref)
        _OPEN[key] = weakref.ref(current)
        _STATS.bundles += 1
    return current


def _host_layout(x: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(sizes, strides, bytes) of ``x``'s host copy: its own strides where they are dense, else contiguous."""
    shape = tuple(x.shape)
    if torch._prims_common.is_non_overlapping_and_dense_or_false(x):
        stride = tuple(x.stride())
    else:
        stride = tuple(torch._prims_common.make_contiguous_strides_for(shape)) if shape else ()
    extent = 0 if x.numel() == 0 else 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    return shape, stride, extent * x.element_size()


def _size(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes} bytes"


def _warn_past_prefetch_limit(nbytes: int) -> None:
    """Once per prefetch limit: a reload larger than the limit is issued only when no other copy is in flight, so
    it neither overlaps the copies before it nor starts early; where such reloads follow each other the backward
    waits for them."""
    limit = _PREFETCH_LIMIT
    if limit is None or nbytes <= limit or limit in _WARNED_LIMITS:
        return
    _WARNED_LIMITS.add(limit)
    _SAY.append(
        f"sacpass: a reload of {_size(nbytes)} is larger than the offload prefetch limit ({_size(limit)}): each "
        f"such copy is issued only when no other is in flight, late, and the backward may wait for it "
        f"(sacpass.offload.stats().waited_reloads). Where the device has the room, raise the limit to at least "
        f"twice the largest reload: sacpass.offload.set_prefetch_limit({2 * nbytes}), or None for no limit.")


def _say() -> None:
    """Give the warnings found under the lock, outside it (at the end of an op): a filter that turns them into
    errors then stops the caller with the runtime's state complete (the copy issued, the next step placed)."""
    with _lock:
        said = list(_SAY)
        _SAY.clear()
    for message in said:
        warnings.warn(message, SacpassWarning, stacklevel=3)


def _issue_reload(entry: _Entry, device: torch.device) -> None:
    _warn_past_prefetch_limit(entry.nbytes)
    src = _block_tensor(entry.block, entry.shape, entry.stride, entry.dtype)
    dev = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=device)
    if device.type == "cuda":
        entry.h2d = _side_copy("h2d", device, dev, src, after=entry.d2h, timing=entry.timing)
        entry.block.events["h2d"] = entry.h2d
    else:
        _timed_copy("h2d", dev, src, entry.timing)
    entry.reload = dev
    _IN_FLIGHT[entry.bundle.device] += entry.nbytes
    _STATS.reloaded_bytes += entry.nbytes
    _STATS.largest_reload_bytes = max(_STATS.largest_reload_bytes, entry.nbytes)


def _prefetch(device: torch.device, bundle: "_Bundle | None", before: "_Bundle | None") -> None:
    """Issue the next copies in reading order: the rest of ``bundle`` (the one being read), then ``before``
    (the one whose backward runs next) unless its backward has begun, while the bytes issued and not yet read
    on ``device`` stay within the prefetch limit; one copy is issued when none is in flight, whatever its size."""
    key = _device_key(device)
    for b in (bundle, before if before is not None and not before.started else None):
        if b is None:
            continue
        for entry in b.pending():
            if _IN_FLIGHT[key] and _PREFETCH_LIMIT is not None and _IN_FLIGHT[key] + entry.nbytes > _PREFETCH_LIMIT:
                return
            _issue_reload(entry, device)
            _STATS.prefetched_bytes += entry.nbytes
            _track(b)


def _track(bundle: _Bundle) -> None:
    """Remember ``bundle`` for the end of the backward running now (its unread copies are freed then)."""
    task = torch._C._current_graph_task_id()
    if task < 0:  # not inside a backward (a graph called by hand): the entries' own lifetimes free them
        return
    if task not in _BACKWARDS:
        _BACKWARDS[task] = {}
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _end_backward(task))
    _BACKWARDS[task].setdefault(id(bundle), weakref.ref(bundle))


def _end_backward(task: int) -> None:
    """The backward ``task`` ended: free the copies it issued that nothing read (a prefetched bundle whose
    backward did not follow, a value its graph never read); such a bundle may be prefetched again later."""
    with _lock:
        _drain()
        for ref in _BACKWARDS.pop(task, {}).values():
            bundle = ref()
            if bundle is None:
                continue
            for entry in bundle.entries():
                if entry.reload is not None:
                    entry.drop()
                    _STATS.dropped_prefetch_bytes += entry.nbytes


def _read(entry: _Entry, device: torch.device) -> tuple[Tensor, "torch.cuda.Event | None"]:
    """Hand ``entry``'s device copy to the backward (issued now if no prefetch did), learn the reading order,
    and prefetch what comes next."""
    bundle = entry.bundle
    if not bundle.started:
        bundle.started = True
        bundle.layout()
    _track(bundle)
    if entry.reload is None:  # not prefetched (or read before: a second backward through the same graph)
        _issue_reload(entry, device)
        _STATS.waited_reloads += 1
    out, event = entry.reload, entry.h2d
    entry.drop(read=True)
    if not entry.read:
        entry.read = True
        bundle.read.append(entry.position)
        if len(bundle.read) == len(bundle.keys):
            _READ_ORDERS[bundle.layout()] = list(bundle.read)
            _READ_ORDERS.move_to_end(bundle.layout())
            while len(_READ_ORDERS) > _READ_ORDERS_KEPT:
                _READ_ORDERS.popitem(last=False)
    _prefetch(device, bundle, _deref(bundle.prev))
    return out, event


# ------------------------------------------------------------------------------------------------ ops
@torch.library.custom_op("sacpass::offload", mutates_args=())
def offload(x: Tensor, index: int, after: list[Tensor]) -> Tensor:
    """Copy ``x`` to sacpass's host pool without making the compute stream wait; see the module docstring.
    ``after`` is not read: it orders the op after the forward's other outputs."""
    return _to_host(x, index)


def _to_host(x: Tensor, index: int, timing: "dict[str, list] | None" = None) -> Tensor:
    """offload's work; ``timing``: where the copies of the host tensor, each way, are timed (a model plan's
    region)."""
    shape, stride, nbytes = _host_layout(x)
    if nbytes == 0:
        return torch.empty_strided(shape, stride, dtype=x.dtype, device="cpu")
    on_cuda = x.device.type == "cuda"
    with _lock:
        _drain()
        pool = _POOLS[on_cuda]
        block = pool.allocate(nbytes)
        bundle = _open_bundle(x.device, index)
        host = _block_tensor(block, shape, stride, x.dtype, on_free=lambda key=block.ptr: _FREED.append(key))
        entry = _Entry(bundle, pool, block, nbytes, shape, stride, x.dtype, None, position=len(bundle.keys),
                       timing=timing)
        _ENTRIES[block.ptr] = entry
        bundle.keys.append(block.ptr)
        _STATS.host_bytes_alive += block.size
        _STATS.peak_host_bytes = max(_STATS.peak_host_bytes, _STATS.host_bytes_alive)
        _STATS.offloaded_bytes += nbytes
        if on_cuda:
            entry.d2h = _side_copy("d2h", x.device, host, x, timing=timing)
            block.events["d2h"] = entry.d2h
            # x's memory is handed out again only after the copy: free as soon as the forward drops x
            x.record_stream(_stream("d2h", x.device))
    if not on_cuda:
        _timed_copy("d2h", host, x, timing)
    return host


@offload.register_fake
def _(x, index, after):
    if torch._prims_common.is_non_overlapping_and_dense_or_false(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


def _plain_copy(host: Tensor, device: torch.device) -> Tensor:
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    out.copy_(host)
    with _lock:
        _STATS.reloaded_bytes += host.numel() * host.element_size()
    return out


@torch.library.custom_op("sacpass::reload", mutates_args=())
def reload(host: Tensor, device: torch.device) -> Tensor:
    """Bring an offloaded activation back to ``device``; see the module docstring."""
    device = torch.device(device)
    with _lock:
        _drain()
        entry = _ENTRIES.get(host.data_ptr()) if host.numel() else None
        if entry is None or entry.shape != tuple(host.shape) or entry.dtype != host.dtype:
            entry = None  # a host tensor sacpass did not make (or an empty one): copied plainly below
        else:
            out, event = _read(entry, device)
    if entry is None:
        return _plain_copy(host, device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).wait_event(event)
    _say()
    return out


@reload.register_fake
def _(host, device):
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


# ------------------------------------------------------------------------------ placement by a model plan
# sacpass::stash(Tensor x, int index, str plan, Tensor[] after, bool pack=True, float forward_ms=0., float
# backward_ms=0.) -> Tensor and sacpass::unstash(Tensor handle,
# SymInt[] size, SymInt[] stride, ScalarType dtype, Device device) -> Tensor: the ops of a sacpass.ModelPlan.
# stash returns a handle (a one-element int64 host tensor) and decides per call where the value waits for its
# backward: on the device (kept as it is) or in the host pool (offload's copy, bundle and prefetch). The handle's
# life is the value's: when autograd frees the saved handle, the kept value or host copy goes with it. The
# decision is the plan's _Placement, by the region's position in the step and the value's index in its graph,
# so the layers that share one compiled graph place their values differently.


@dataclass(eq=False)
class _Mark:
    """Whether a backward has begun on the values of one region (a bundle's, or one kept on the device)."""

    started: bool = False
    bundled: bool = False  # its first value for the host has opened a bundle
    before: "weakref.ref[_Bundle] | None" = None  # the newest bundle when the region began: its backward is next


@dataclass(eq=False)
class _Chain:
    position: int = -1  # the region now running its forward, by its order in the step
    mark: "weakref.ref[_Mark] | None" = None  # that region's (it dies with the region's values)


@dataclass(eq=False)
class _Stashed:
    value: Tensor | None  # the device tensor kept, or the host tensor of the pool (offload's)
    mark: _Mark
    on_host: bool
    placement: "_Placement"  # the plan that placed it
    position: int  # its region's, in the step
    source: "weakref.ref[Tensor]"  # the value stashed, while something else keeps it (a graph input's caller)
    version: int  # its version then: an in-place write before the backward is refused, as autograd does
    consumed: bool = False
    scales: Tensor | None = None  # FP8-packed on the host: value holds its elements, this their tile scales

    def check_unchanged(self) -> None:
        x = self.source()
        if x is not None and x._version != self.version:
            raise OffloadError(
                f"sacpass: a value a model plan keeps for the backward ({tuple(x.shape)} {x.dtype}) was modified in "
                f"place after the forward (version {self.version} -> {x._version}); its backward would read other "
                f"values. Do not write into a layer's input or output before the backward (clone it first), as "
                f"autograd requires for every saved tensor.")


_CHAINS: dict[tuple[tuple[str, int], int], _Chain] = {}  # (device, thread) -> the step its forwards are in
_STASHED: dict[int, _Stashed] = {}  # handle key -> what it stands for
_DEAD_HANDLES: collections.deque = collections.deque()
_HANDLE_IDS = iter(range(1, 1 << 62))


@dataclass(eq=False)
class _Timeline:
    """One step of a model plan as it ran and as its graphs' cost model expected it, by region: the reloads that
    waited, the copies' times, the :func:`_clock` marks of its forwards and backwards, the expected times."""

    waited: dict[int, int] = field(default_factory=dict)  # region -> reloads not prefetched
    copies: dict[int, dict[str, list]] = field(default_factory=dict)  # region -> its copies' times, each way
    forward_done: dict[int, object] = field(default_factory=dict)  # region -> its forward's work done (first stash)
    backward_began: dict[int, object] = field(default_factory=dict)  # region -> its first unstash
    backward_ended: object = None  # the backward's end (its final callback)
    expected: dict[int, tuple[float, float]] = field(default_factory=dict)  # region -> (forward ms, backward ms)

    def forward_ms(self) -> dict[int, float | None]:
        """Each region's forward (ms) from the region before's first stash to its own (so it carries the region
        before's stashes: their FP8 packing, with compress); the first region's has no start mark (None)."""
        order = sorted(self.forward_done)
        return {p: None if q is None else _elapsed_ms(self.forward_done[q], self.forward_done[p])
                for q, p in zip([None] + order[:-1], order)}

    def backward_ms(self) -> dict[int, float | None]:
        """Each region's backward (ms): from its first unstash to that of the region whose backward came next (the
        one before it in the step), the last to the backward's end; None while one is running, or without an
        end mark."""
        began = self.backward_began
        order = sorted(began, reverse=True)  # backward order
        return {p: _elapsed_ms(began[p], began[q] if q is not None else self.backward_ended)
                for p, q in zip(order, order[1:] + [None])}


@dataclass(eq=False)
class _Placement:
    """Where one model plan puts each value: {(position, index): "device" | "host"}, from the step before."""

    layers: int
    gpu_bytes: int
    host_bytes: int
    compress: bool = False  # floating values go to the host FP8-packed (ModelPlan(compress="fp8"))
    table: dict[tuple[int, int], str] = field(default_factory=dict)
    recording: dict[tuple[int, int], int] = field(default_factory=dict)  # this step: (position, index) -> bytes
    host_sizes: dict[tuple[int, int], int] = field(default_factory=dict)  # this step: pool bytes on the host
    placed: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)  # this step: where, bytes
    last: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)  # the step before: where, bytes
    host_used: int = 0  # this step
    device_used: int = 0
    region_bytes: dict[int, int] = field(default_factory=dict)  # this step: position -> its values' bytes so far
    copy_bytes_per_s: float = 0.0  # the plan's cost model: a region's expected copy time, beside the measured
    timeline: _Timeline = field(default_factory=_Timeline)  # this step's
    last_timeline: _Timeline = field(default_factory=_Timeline)  # the step before's
    peak_bytes: int | None = None  # ModelPlan(peak_bytes=): the device budget follows the measured peak
    device_budget: int = -1  # the device bytes the next step keeps: gpu_bytes, raised toward peak_bytes
    device: tuple[str, int] | None = None  # where the planned values live (whose peak is read)
    peak_read: int | None = None  # the device's peak as the last step's backward ended
    step_peak: int | None = None  # this step's: read at the end of each backward that unstashed its values
    task: int = -1  # the backward whose end is awaited (its final callback queued)
    warned: bool = False

    def __post_init__(self) -> None:
        if self.device_budget < 0:
            self.device_budget = self.gpu_bytes

    def new_step(self) -> None:
        """The step before is over: where a backward ran in it, its sizes and measured peak place the next one. A
        forward whose backward never ran (an exception part way, an evaluation under grad) is not a step to
        place from: the next step is placed as it would have been without it."""
        if self.recording and self.timeline.backward_began:
            self._follow_peak()
            self.table = self.solve(self.recording, self.host_sizes)
            self.last = dict(self.placed)
            self.last_timeline = self.timeline
        self.recording, self.host_sizes, self.placed, self.region_bytes = {}, {}, {}, {}
        self.host_used, self.device_used, self.timeline = 0, 0, _Timeline()

    def timing(self, position: int) -> dict[str, list]:
        """Where region ``position``'s copies of this step are timed, each way."""
        return self.timeline.copies.setdefault(position, {"d2h": [], "h2d": []})

    def note_forward(self, position: int, device: torch.device, forward_ms: float, backward_ms: float) -> None:
        """At a region's first stash (its forward's work all issued): mark when it is done, and keep what its
        graph's cost model expects of its forward and backward."""
        self.timeline.forward_done[position] = _clock(device)
        self.timeline.expected[position] = (forward_ms, backward_ms)

    def note_backward(self, position: int, device: torch.device) -> None:
        """At each unstash, inside a backward: the first of region ``position`` marks when its backward began; the
        backward's end (an autograd final callback, queued once per backward) marks when it ended and, with
        peak_bytes, reads the device's peak then, so a reset_peak_memory_stats between steps leaves the step's
        own peak to read."""
        timeline = self.timeline
        if position not in timeline.backward_began:
            timeline.backward_began[position] = _clock(device)
        task = torch._C._current_graph_task_id()
        if task < 0 or task == self.task:
            return
        self.task = task

        def ended() -> None:
            mark = _clock(device)
            peak = _device_peak(self.device) if self.peak_bytes is not None and self.device is not None else None
            with _lock:
                timeline.backward_ended = mark
                if peak is not None:
                    self.step_peak = max(self.step_peak or 0, peak)
        torch.autograd.Variable._execution_engine.queue_callback(ended)

    def _follow_peak(self) -> None:
        """With peak_bytes: move the device budget by the step's measured peak (see ModelPlan.peak_bytes)."""
        peak, self.step_peak = self.step_peak, None
        if peak is None:
            return
        if peak < self.peak_bytes:  # at most every value of the step (the budget stops growing there)
            everything = sum(self.recording.values())
            self.device_budget = max(self.device_budget, min(self.device_budget + self.peak_bytes - peak, everything))
        elif peak > self.peak_bytes and (self.peak_read is None or peak > self.peak_read):  # rose past the cap
            lowered = max(self.gpu_bytes, self.device_budget - (peak - self.peak_bytes))
            if lowered == self.device_budget and not self.warned:
                self.warned = True
                _SAY.append(
                    f"sacpass: ModelPlan(peak_bytes={self.peak_bytes}): the step peaked at {peak} bytes on the device "
                    f"with the device budget at gpu_bytes={self.gpu_bytes}, the least it keeps. Lower gpu_bytes, or "
                    f"raise peak_bytes to what the step needs; the plan goes on at gpu_bytes. (The peak read is "
                    f"torch.cuda.max_memory_allocated(): if the compiling step set it, call "
                    f"torch.cuda.reset_peak_memory_stats() after that step.)")
            self.device_budget = lowered
        self.peak_read = peak

    def solve(self, sizes: dict[tuple[int, int], int], host_sizes: dict[tuple[int, int], int] | None = None
              ) -> dict[tuple[int, int], str]:
        """From the last region back, keep values on the device while the device budget (``gpu_bytes``, or as
        the measured peak moved it) lasts; the rest to the host (each taking its ``host_sizes`` pool bytes
        there; by default its block). Raises OffloadError when the host part passes ``host_bytes``."""
        on_host = lambda k: (host_sizes or {}).get(k, pool_bytes(sizes[k]))  # noqa: E731
        table, device = {}, 0
        for key in sorted(sizes, reverse=True):
            if key[0] < self.layers and device + sizes[key] <= self.device_budget:
                table[key] = "device"
                device += sizes[key]
            else:
                table[key] = "host"
        host = sum(on_host(k) for k, where in table.items() if where == "host")
        if host <= self.host_bytes:
            return table
        total = sum(map(on_host, sizes))
        gpu, left = 0, total  # the smallest device budget that holds the step: kept from the last region back
        for key in sorted(sizes, reverse=True):
            if left <= self.host_bytes:
                break
            if key[0] < self.layers:
                gpu, left = gpu + sizes[key], left - on_host(key)
        by_gpu = f"gpu_bytes={gpu} with this host_bytes" if left <= self.host_bytes else \
            f"no gpu_bytes with this host_bytes (values of regions past layers={self.layers} always go to the host)"
        raise OffloadError(
            f"sacpass: ModelPlan(layers={self.layers}, gpu_bytes={self.gpu_bytes}, host_bytes={self.host_bytes}) "
            f"cannot place this step: its planned values take {sum(sizes.values())} bytes ({total} in the host "
            f"pool), of which {host} would go to the host, past host_bytes. The smallest budgets that hold the step "
            f"are host_bytes={host} with this gpu_bytes, or {by_gpu}; or recompile with a smaller "
            f"plan (its per-region share, (host_bytes + gpu_bytes) / layers, picks what is kept at all).")

    def _later_device_bytes(self, position: int) -> int:
        """In the first step, the device bytes the regions after ``position`` will keep, estimated as solve()
        keeps them: each as large as the largest region before it this step (layers share graphs); with none
        before it, the whole device budget."""
        if position >= self.layers - 1:
            return 0
        seen = max((b for p, b in self.region_bytes.items() if p < position), default=0)
        return min(self.device_budget, (self.layers - 1 - position) * seen) if seen else self.device_budget

    def place(self, position: int, index: int, nbytes: int, packed: int | None = None) -> str:
        """Where value ``index`` of region ``position`` waits: the table (from the step before), or in the first
        step as the table would place it, the regions still to come estimated from those before: the device
        if the device budget, less what the later regions are expected to keep there, holds it; else the host
        while host_bytes lasts; else the device while gpu_bytes lasts. So the first step takes about the host
        memory of the steps after it, and the pool holds no more than they need. ``packed``: the value's
        elements when it would go to the host FP8-packed (its host bytes are then those of the packed form)."""
        key = (position, index)
        size = pool_bytes(nbytes) if packed is None else packed_pool_bytes(packed)
        self.recording[key] = nbytes
        self.host_sizes[key] = size
        where = self.table.get(key) if self.table else None
        if where is None:
            room = self.device_budget - self.device_used - self._later_device_bytes(position)
            self.region_bytes[position] = self.region_bytes.get(position, 0) + nbytes
            if position < self.layers and nbytes <= room:
                where = "device"
            elif self.host_used + size <= self.host_bytes:
                where = "host"
            elif position < self.layers and self.device_used + nbytes <= self.device_budget:
                where = "device"
            else:
                raise OffloadError(
                    f"sacpass: ModelPlan(layers={self.layers}, gpu_bytes={self.gpu_bytes}, host_bytes="
                    f"{self.host_bytes}): by region {position} this step's planned values take "
                    f"{self.host_used + self.device_used + nbytes} bytes, past host_bytes + gpu_bytes. Each region "
                    f"was compiled to keep at most (host_bytes + gpu_bytes) / layers, so the step runs more regions "
                    f"than layers={self.layers} (pass the real count) or larger ones than at compile time; or raise "
                    f"the budgets.")
        if where == "host":
            self.host_used += size
        else:
            self.device_used += nbytes
        self.placed[key] = (where, nbytes if where == "device" or packed is None else compression.packed_bytes(packed))
        return where


_PLACEMENTS: dict[str, _Placement] = {}


def register_placement(plan) -> str:
    """The runtime side of a :class:`~sacpass.ModelPlan` (one per budget set; equal plans share it)."""
    with _lock:
        if plan.key not in _PLACEMENTS:
            _PLACEMENTS[plan.key] = _Placement(plan.layers, plan.gpu_bytes, plan.host_budget(),
                                               compress=plan.compress == "fp8",
                                               copy_bytes_per_s=plan.cost.copy_bytes_per_s,
                                               peak_bytes=plan.peak_bytes)
    return plan.key


def placements(plan=None) -> list[dict]:
    """Where the last complete step put each planned value: one row per region, in step order, with the bytes
    kept on the device and sent to the host, the expected copy time of those host bytes each way (the plan's
    cost model) beside the measured one (``d2h_ms_measured``, ``h2d_ms_measured``: the copies' own time, from
    CUDA timing events on their streams, or the host clock for a CPU tensor's; None while one is still
    running), how many of the region's reloads had no prefetch to hide behind (its backward waited for them),
    and the region's forward and backward as its graph's cost model expected them (``*_ms_expected``: the
    compiled forward's and backward's ops, recomputation included) beside what they took
    (``*_ms_measured``: timing events on the compute stream, or the host clock; a forward from the region
    before's end to its own, so the first region's is None; a backward from its first unstash to the next
    region's; None where not measured). A region's reloads are issued while the region after it runs its
    backward: they hide when their H2D time is well under that region's backward (the plan's, or every
    registered plan's)."""
    with _lock:
        chosen = [_PLACEMENTS[plan.key]] if plan is not None and plan.key in _PLACEMENTS else \
            list(_PLACEMENTS.values())
        rows: dict[int, dict] = {}
        for pl in chosen:
            complete = bool(pl.last)
            for (pos, _), (where, nbytes) in sorted((pl.last or pl.placed).items()):
                row = rows.setdefault(pos, {"region": pos, "device_bytes": 0, "host_bytes": 0, "values": 0,
                                            "copy_ms_expected": 0.0, "d2h_ms_measured": 0.0,
                                            "h2d_ms_measured": 0.0, "reloads_waited": 0,
                                            "forward_ms_expected": None, "forward_ms_measured": None,
                                            "backward_ms_expected": None, "backward_ms_measured": None})
                row[f"{where}_bytes"] += nbytes
                row["values"] += 1
                if where == "host" and pl.copy_bytes_per_s:
                    row["copy_ms_expected"] += 1e3 * nbytes / pl.copy_bytes_per_s
            timeline = pl.last_timeline if complete else pl.timeline
            for pos, n in timeline.waited.items():
                if pos in rows:
                    rows[pos]["reloads_waited"] += n
            for pos, times in timeline.copies.items():
                for way in ("d2h", "h2d"):
                    ms = _copy_ms(times[way])
                    if pos in rows:
                        got = rows[pos][f"{way}_ms_measured"]
                        rows[pos][f"{way}_ms_measured"] = None if ms is None or got is None else got + ms
            for pos, (fwd, bwd) in timeline.expected.items():
                if pos in rows:
                    rows[pos]["forward_ms_expected"], rows[pos]["backward_ms_expected"] = fwd, bwd
            for way, measured in (("forward", timeline.forward_ms()), ("backward", timeline.backward_ms())):
                for pos, ms in measured.items():
                    if pos in rows and ms is not None:
                        rows[pos][f"{way}_ms_measured"] = ms
        return [rows[p] for p in sorted(rows)]


def device_budget(plan) -> dict:
    """A model plan's device budget: ``gpu_bytes`` (where it started), ``device_budget`` (what the next step
    keeps on the device), ``peak_bytes`` (the cap, or None) and ``peak_read`` (the device's peak allocated
    memory as the last step's backward ended, or None before one has, or where there is none to read)."""
    with _lock:
        pl = _PLACEMENTS.get(plan.key)
        if pl is None:
            raise OffloadError(f"sacpass: {plan!r} is not registered: build a backend with it (sacpass.backend(plan="
                               f"...)) before asking for its device budget.")
        return {"gpu_bytes": pl.gpu_bytes, "device_budget": pl.device_budget, "peak_bytes": pl.peak_bytes,
                "peak_read": pl.peak_read}


def _device_peak(device: tuple[str, int]) -> int | None:
    """The device's peak allocated memory (since the process began or the last reset_peak_memory_stats), where
    there is one (a GPU)."""
    return torch.cuda.max_memory_allocated(device[1]) if device[0] == "cuda" else None


def format_placements(plan=None) -> str:
    gib = 2 ** 30
    lines = ["region  values  device GiB  host GiB  copy ms (expected, each way)  measured D2H / H2D  "
             "reloads waited (measured)  forward ms expected / measured  backward ms expected / measured"]
    shown = lambda ms: "-" if ms is None else f"{ms:.2f}"  # noqa: E731
    for r in placements(plan):
        measured = f"{shown(r['d2h_ms_measured'])} / {shown(r['h2d_ms_measured'])}"
        lines.append(f"{r['region']:>6}  {r['values']:>6}  {r['device_bytes'] / gib:>10.3f}  {r['host_bytes'] / gib:>8.3f}"
                     f"  {r['copy_ms_expected']:>28.2f}  {measured:>18}  {r['reloads_waited']:>25}"
                     f"  {shown(r['forward_ms_expected']) + ' / ' + shown(r['forward_ms_measured']):>31}"
                     f"  {shown(r['backward_ms_expected']) + ' / ' + shown(r['backward_ms_measured']):>32}")
    if plan is not None and getattr(plan, "peak_bytes", None) is not None and plan.key in _PLACEMENTS:
        b = device_budget(plan)
        read = "none read yet" if b["peak_read"] is None else f"{b['peak_read'] / gib:.3f} GiB read"
        lines.append(f"device budget {b['device_budget'] / gib:.3f} GiB for the next step (from gpu_bytes "
                     f"{b['gpu_bytes'] / gib:.3f}; peak {read}, cap {b['peak_bytes'] / gib:.3f})")
    return "\n".join(lines)


def _region(device: torch.device, index: int, placement: _Placement) -> tuple[int, _Mark]:
    """The position in the step of the forward this call belongs to (index 0 starts a region; a region whose
    values' backward has begun ends the step) and that region's mark."""
    chain = _CHAINS.setdefault((_device_key(device), threading.get_ident()), _Chain())
    last = _deref(chain.mark)
    if index == 0 or last is None or last.started:
        # a new step when the region before has begun its backward, or its values are gone (a forward whose
        # backward never ran, an exception in the middle of a step)
        new_step = last is None or last.started
        chain.position = 0 if new_step else chain.position + 1
        last = _Mark(before=_OPEN.get((_device_key(device), threading.get_ident())))
        chain.mark = weakref.ref(last)
        if new_step:
            placement.new_step()
    return chain.position, last


def _handle(key: int) -> Tensor:
    buf = (ctypes.c_int64 * 1)(key)
    weakref.finalize(buf, _DEAD_HANDLES.append, key).atexit = False
    return torch.frombuffer(buf, dtype=torch.int64)


def _drain_handles() -> None:
    while _DEAD_HANDLES:
        _STASHED.pop(_DEAD_HANDLES.popleft(), None)  # the kept value, or the host tensor (then its block), goes


@torch.library.custom_op("sacpass::stash", mutates_args=())
def stash(x: Tensor, index: int, plan: str, after: list[Tensor], pack: bool = True, forward_ms: float = 0.0,
          backward_ms: float = 0.0) -> Tensor:
    """Keep ``x`` for the backward where ``plan`` places it (device or host pool); returns its handle. ``after``
    (the forward's other outputs, unread) orders it after all of the forward's work: a compiler sees a tiny
    output and would otherwise move it up to ``x``'s producer, then reuse ``x``'s memory that it keeps.
    ``pack=False``: never FP8-packed, though the plan compresses (ModelPlan(exact=)). ``forward_ms`` /
    ``backward_ms`` (on a graph's first stash): what the cost model expects of the graph's forward and backward,
    shown beside what each region took (:func:`placements`)."""
    with _lock:
        _drain_handles()
        placement = _PLACEMENTS.get(plan)
        if placement is None:
            raise OffloadError(f"sacpass: a compiled graph stashes values for the model plan {plan!r}, which no "
                               f"sacpass.ModelPlan in this process declares; build the backend with that plan "
                               f"before running graphs compiled (or cached) with it.")
        placement.device = _device_key(x.device)
        position, mark = _region(x.device, index, placement)
        if index == 0:
            placement.note_forward(position, x.device, forward_ms, backward_ms)
        nbytes = _host_layout(x)[2]
        packed = x.numel() if pack and packs(x.dtype, placement.compress) else None
        where = placement.place(position, index, nbytes, packed)
        key = next(_HANDLE_IDS)
        if where == "device":
            _STATS.kept_bytes += nbytes
            _STASHED[key] = _Stashed(x, mark, on_host=False, placement=placement, position=position, source=weakref.ref(x),
                                     version=x._version)
        else:
            first, mark.bundled = not mark.bundled, True
            sent, scales = (x, None) if packed is None else compression.pack(x)  # packed on the compute stream
            timing = placement.timing(position)
            host = _to_host(sent, 0 if first else 1, timing)  # index 0: the region's first host value opens its bundle
            if scales is not None:
                scales = _to_host(scales, 1, timing)
                _STATS.packed_bytes += nbytes
            _STASHED[key] = _Stashed(host, mark, on_host=True, placement=placement, position=position,
                                     source=weakref.ref(x), version=x._version, scales=scales)
        handle = _handle(key)
    _say()  # after the handle: an error raised here drops it, and the stashed value with it
    return handle


@stash.register_fake
def _(x, index, plan, after, pack=True, forward_ms=0.0, backward_ms=0.0):
    return torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("sacpass::unstash", mutates_args=())
def unstash(handle: Tensor, size: list[int], stride: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The value behind ``handle`` on ``device``: the kept tensor, or the host copy reloaded."""
    with _lock:
        _drain_handles()
        item = _STASHED.get(int(handle[0]))
        if item is None:
            raise OffloadError("sacpass: a backward asked for a stashed value whose handle sacpass does not know "
                               "(its forward ran in another process, or the handle was copied); run the "
                               "forward and the backward of a compiled graph in one process.")
        if not item.on_host:  # a value kept on the device: prefetch the region before (its backward is next)
            _prefetch(torch.device(device), None, _deref(item.mark.before))
        item.mark.started = True
        item.placement.note_backward(item.position, torch.device(device))
        item.check_unchanged()
        if not item.on_host:
            if item.consumed:
                raise OffloadError("sacpass: a second backward through a graph whose planned value the model plan "
                                   "kept on the device: the first backward owned it. Use a sacpass.Plan (per graph) "
                                   "for graphs that are differentiated twice (retain_graph=True).")
            item.consumed = True
            out, item.value = item.value, None
            # handed to the backward, which may write into it once it is dead there: only if nothing else
            # (a view kept by the forward's caller, another saved view) shares its memory
            if torch._C._storage_Use_Count(out.untyped_storage()._cdata) > 2:
                out = out.clone()
        else:
            host, scales = item.value, item.scales
            entry = _ENTRIES.get(host.data_ptr()) if host.numel() else None
            if entry is not None and entry.reload is None:  # no prefetch issued its copy: the backward waits for it
                waited = item.placement.timeline.waited
                waited[item.position] = waited.get(item.position, 0) + 1
    if not item.on_host:
        _say()  # the prefetch's warnings (the reload's own are said by reload)
        return out
    if scales is None:
        return reload(host, device)
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    return compression.unpack(reload(host, device), reload(scales, device), out)


@unstash.register_fake
def _(handle, size, stride, dtype, device):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)
