"""Offload and reload: copies of saved values to the host pool and back, in bundles, prefetched in reading order.

- An offload copies a value into a block of the pool on the device's ``d2h`` stream (the compute stream does
  not wait; the copy is fed to the stream a few chunks at a time, :mod:`.feeder`) and returns the host tensor,
  whose storage *is* the block's life. ``index`` 0 opens a new *bundle* (one execution of one compiled forward);
  the bundle remembers the one opened before it on the same device and thread (the previous layer, whose
  backward runs next).
- A reload hands the backward its value's device copy, issued now if no prefetch did, and *prefetches*: it
  issues, on the ``h2d`` stream, the copies that come next in the order the backward reads them (the rest of
  its bundle, then the bundle before it), while the copies issued and not yet read stay within the prefetch
  limit per device. The order is the one the backward of the same graph read them in last time (keyed by the
  bundle's layout); before that, the reverse of the forward's. A value the backward asks for while its copy to
  the host is still being fed (the copy engine behind the forward, at its last layers) comes back as the device
  value, copied on the device (:func:`unfinished_source`): no wait for both copies.
- The copies out trail the forward by at most one bundle's bytes (:class:`CopiesOut`): a value whose copy to the
  host has not finished keeps its device memory (the feeder holds it until its last chunk is queued, and the
  allocator hands the memory out again only once the copy has finished); where a forward's copies run longer
  than its compute, that backlog would grow layer by layer and reach the loss, whose large temporaries then take
  new segments beside it, which the caching allocator keeps.

Lifetimes: a bundle lives as long as one of its host tensors does; a reloaded copy the backward read is the
backward's (its compute stream waited for the copy, so its memory is reused in that stream's order at once); a
prefetched copy no backward read is freed when the backward that issued it ends (an autograd final callback),
its memory reused only after its copy.
"""
from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .clocks import device_key, timed_copy
from .feeder import FedCopy
from .pool import Block, HostMemory, block_tensor
from .sizes import format_bytes, host_layout
from .counters import OffloadStats

__all__ = ["Bundle", "CopiesOut", "Entry", "ReadOrders", "Transfers", "unfinished_source"]


def _deref(ref: "weakref.ref | None"):
    return ref() if ref is not None else None


class ReadOrders:
    """The order the last backward of each bundle layout (one compiled graph at one input shape) read its host
    values in: the newest ``kept`` layouts, so a run whose shapes vary keeps a bounded table."""

    def __init__(self, kept: int = 256):
        self.kept = kept
        self.orders: "collections.OrderedDict[tuple, list[int]]" = collections.OrderedDict()

    def get(self, layout: tuple) -> list[int] | None:
        return self.orders.get(layout)

    def learn(self, layout: tuple, order: list[int]) -> None:
        self.orders[layout] = list(order)
        self.orders.move_to_end(layout)
        while len(self.orders) > self.kept:
            self.orders.popitem(last=False)


@dataclass(eq=False)
class Bundle:
    """The host tensors one forward execution offloaded (their keys, in order). Referenced by its entries
    only: it goes when the last of its host tensors does."""

    device: tuple[str, int]
    prev: "weakref.ref[Bundle] | None"  # the bundle opened before it on this device and thread
    owner: "Transfers"
    keys: list[int] = field(default_factory=list)
    nbytes: int = 0  # its values' bytes
    started: bool = False  # its backward has begun (its first reload ran)
    read: list[int] = field(default_factory=list)  # its entries' positions, in the order its backward read them
    shapes: tuple | None = None  # see layout()

    def entries(self) -> list["Entry"]:
        return [e for e in self._by_position() if e is not None]

    def layout(self) -> tuple:
        """Its entries' (shape, dtype), in the forward's order: taken once its forward is over (at its first
        prefetch or read), while all of them live."""
        if self.shapes is None:
            self.shapes = tuple((e.shape, e.dtype) if e is not None else None for e in self._by_position())
        return self.shapes

    def _by_position(self) -> list["Entry | None"]:
        entries = self.owner.entries
        return [e if e is not None and e.bundle is self else None for e in (entries.get(k) for k in self.keys)]

    def pending(self) -> list["Entry"]:
        """Its entries not yet issued nor read, in the order its backward will read them: the order the last
        backward of a bundle of the same layout read them in (the same compiled graph), else the reverse of
        the forward's."""
        order = self.owner.read_orders.get(self.layout()) or range(len(self.keys) - 1, -1, -1)
        entries = self._by_position()
        return [e for e in (entries[i] for i in order) if e is not None and e.reload is None and not e.read]


@dataclass(eq=False)
class Entry:
    bundle: Bundle
    pinned: bool  # which slabs its block came from
    block: Block
    nbytes: int  # the tensor's bytes
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    d2h: "FedCopy | None"  # completion of the device-to-host copy (None on CPU)
    position: int = 0  # in its bundle
    reload: Tensor | None = None  # the device copy, once issued and until read
    h2d: "torch.cuda.Event | None" = None
    source: "weakref.ref[Tensor] | None" = None  # the device value, while its copy is still being fed (a GPU's)
    version: int = 0  # the device value's version counter when it was offloaded
    read: bool = False  # a backward has read it
    timing: "dict[str, list] | None" = None  # a model plan's region: its copies' times, each way


def unfinished_source(entry: Entry, device: torch.device) -> Tensor | None:
    """The device value ``entry`` was offloaded from, where the backward asks for it before its copy to the host
    has finished (the copy engine still behind: the last regions of a forward whose copies run longer than its
    compute): while the feeder still holds it, it is alive, and a copy of it on the device (left untouched for the
    copy to the host) saves waiting for both copies. None where it is gone (its last chunk queued), its copy
    finished, it was written since, or it lives elsewhere or in another layout than the host copy's."""
    if entry.source is None or entry.d2h is None:
        return None
    x = entry.source()
    if (x is None or entry.d2h.query() or x._version != entry.version or device_key(x.device) != device_key(device)
            or tuple(x.shape) != entry.shape or tuple(x.stride()) != entry.stride or x.dtype != entry.dtype):
        return None
    return x


class CopiesOut:
    """One device's copies to the host not known to have finished, oldest first, and their bytes.

    Their sources' memory is not free: the feeder holds a value until its copy's last chunk is queued, and the
    allocator hands its memory out again only once the copy has finished. :meth:`due` keeps those bytes within
    a limit by naming the oldest copies for the offloading thread to wait for, on the host: the allocator then
    sees them finished and reuses their memory, and the forward goes on at the copy engine's pace."""

    def __init__(self) -> None:
        self.copies: collections.deque = collections.deque()  # (completion, bytes)
        self.nbytes = 0

    def add(self, done, nbytes: int) -> None:
        self.copies.append((done, nbytes))
        self.nbytes += nbytes

    def due(self, nbytes: int, limit: int) -> list:
        """Let the finished copies go, then take the oldest ones off until ``nbytes`` more fit within ``limit``
        (a value larger than the limit takes every copy before it, then goes alone): the copies to wait for,
        oldest first. The caller waits for them outside the runtime's lock (:meth:`Transfers.wait_copies_out`)."""
        self.copies = collections.deque((done, n) for done, n in self.copies if not done.query())
        self.nbytes = sum(n for _, n in self.copies)
        due = []
        while self.copies and self.nbytes + nbytes > limit:
            done, n = self.copies.popleft()
            self.nbytes -= n
            due.append(done)
        return due


class Transfers:
    """Every offloaded value of the process (by its host address), the bundles, the copies in flight per device,
    the reading orders learned, and the backwards that prefetched. Called under the runtime's lock.

    ``devices(key)`` gives a device's state (its copy streams and in-flight bytes); ``prefetch_limit(key)`` the
    bytes of reloads that may be in flight on that device (None: no cap); ``say`` collects warnings the runtime
    gives once its op is done; ``lock`` is the runtime's (the end of a backward takes it)."""

    def __init__(self, memory: HostMemory, stats: OffloadStats, devices: Callable, prefetch_limit: Callable,
                 say: Callable[[str], None], lock: "threading.RLock"):
        self.memory, self.stats, self.devices, self.prefetch_limit = memory, stats, devices, prefetch_limit
        self.say, self.lock = say, lock
        self.settle_all: Callable[[], None] = self.settle  # the runtime's, which settles dead handles first
        self.entries: dict[int, Entry] = {}  # host data address -> entry; removed when the host tensor dies
        self.freed: collections.deque = collections.deque()  # addresses whose storage died, settled under the lock
        self.backwards: dict[int, dict] = {}  # autograd graph task -> {id: weak ref} of the bundles it touched
        self.read_orders = ReadOrders()
        self.live: "weakref.WeakSet[Bundle]" = weakref.WeakSet()
        self.warned_limits: set[int] = set()  # prefetch limits a larger reload has been warned of
        self.copies_due: dict[int, list] = {}  # thread -> copies out its last offload must wait for, unlocked

    # ------------------------------------------------------------------------------------------ forward
    def to_host(self, x: Tensor, index: int, timing: "dict[str, list] | None" = None) -> Tensor:
        """Copy ``x`` into the pool (see the module docstring); ``timing``: where the copies of the host tensor,
        each way, are timed (a model plan's region)."""
        shape, stride, nbytes = host_layout(x)
        if nbytes == 0:
            return torch.empty_strided(shape, stride, dtype=x.dtype, device="cpu")
        on_cuda = x.device.type == "cuda"
        block = self.memory.allocate(nbytes, pinned=on_cuda)
        bundle = self._open_bundle(x.device, index)
        host = block_tensor(block, shape, stride, x.dtype, on_free=lambda key=block.ptr: self.freed.append(key))
        entry = Entry(bundle, on_cuda, block, nbytes, shape, stride, x.dtype, None, position=len(bundle.keys),
                      timing=timing)
        self.entries[block.ptr] = entry
        bundle.keys.append(block.ptr)
        st = self.stats
        st.host_bytes_alive += block.size
        st.peak_host_bytes = max(st.peak_host_bytes, st.host_bytes_alive)
        st.offloaded_bytes += nbytes
        state = self.devices(device_key(x.device))
        bundle.nbytes += nbytes
        state.largest_bundle = max(state.largest_bundle, bundle.nbytes)
        state.largest_value = max(state.largest_value, nbytes)
        if on_cuda:
            # at most one bundle's bytes (one layer's offloads, the largest yet) still to copy out: the copies of
            # the layer before may run under this one's forward, no further
            due = state.copies_out.due(nbytes, state.largest_bundle)
            if due:
                self.copies_due.setdefault(threading.get_ident(), []).extend(due)
            streams = state.streams
            # x's memory is handed out again only after the copy: free once the forward drops x and the feeder
            # has queued the copy's last chunk
            x.record_stream(streams.get("d2h"))
            entry.d2h = streams.feed("d2h", host, x, timing=timing)
            state.copies_out.add(entry.d2h, nbytes)
            entry.source, entry.version = weakref.ref(x), x._version
            block.events["d2h"] = entry.d2h
        else:
            timed_copy("d2h", host, x, timing)
        return host

    def wait_copies_out(self) -> None:
        """Wait for the copies out that this thread's offloads found due (:meth:`CopiesOut.due`), with the
        runtime's lock released: other threads' offloads and reloads go on meanwhile. Called after the op that
        queued its own copy; a copy that failed raises here (its value is lost)."""
        due = self.copies_due.pop(threading.get_ident(), None)
        if not due:
            return
        began, waited = time.perf_counter(), 0
        try:
            for done in due:
                waited += 1
                done.synchronize()
        finally:
            with self.lock:
                self.stats.copy_out_waits += waited
                self.stats.copy_out_wait_ms += (time.perf_counter() - began) * 1e3

    def _open_bundle(self, device: torch.device, index: int) -> Bundle:
        state = self.devices(device_key(device))
        thread = threading.get_ident()
        ref = state.open_bundles.get(thread)
        current = _deref(ref)
        if index == 0 or current is None or current.started:
            current = Bundle(state.key, ref, self)
            self.live.add(current)
            state.open_bundles[thread] = weakref.ref(current)
            self.stats.bundles += 1
        return current

    def newest_bundle(self, device: torch.device) -> "weakref.ref[Bundle] | None":
        """The bundle opened last on ``device`` by this thread (the one whose backward runs after the next)."""
        return self.devices(device_key(device)).open_bundles.get(threading.get_ident())

    # ----------------------------------------------------------------------------------------- backward
    def entry_for(self, host: Tensor) -> Entry | None:
        """The entry of a host tensor sacpass made (None for an empty one, or one it did not make)."""
        entry = self.entries.get(host.data_ptr()) if host.numel() else None
        if entry is None or entry.shape != tuple(host.shape) or entry.dtype != host.dtype:
            return None
        return entry

    def read(self, entry: Entry, device: torch.device) -> tuple[Tensor, "torch.cuda.Event | None"]:
        """Hand ``entry``'s device copy to the backward (issued now if no prefetch did), learn the reading order,
        and prefetch what comes next."""
        bundle = entry.bundle
        if not bundle.started:
            bundle.started = True
            bundle.layout()
        self._track(bundle)
        if entry.reload is None and not self._issue(entry, device):  # not prefetched (or read before: a second
            self.stats.waited_reloads += 1  # backward through the same graph), and a copy was needed
        out, event = entry.reload, entry.h2d
        self._drop(entry, read=True)
        if not entry.read:
            entry.read = True
            bundle.read.append(entry.position)
            if len(bundle.read) == len(bundle.keys):
                self.read_orders.learn(bundle.layout(), bundle.read)
        self.prefetch(device, bundle, _deref(bundle.prev))
        return out, event

    def prefetch(self, device: torch.device, bundle: Bundle | None, before: Bundle | None) -> None:
        """Issue the next copies in reading order: the rest of ``bundle`` (the one being read), then ``before``
        (the one whose backward runs next) unless its backward has begun, while the bytes issued and not yet
        read on ``device`` stay within the prefetch limit; one copy is issued when none is in flight, whatever
        its size."""
        state = self.devices(device_key(device))
        limit = self.prefetch_limit(state.key)
        for b in (bundle, before if before is not None and not before.started else None):
            if b is None:
                continue
            for entry in b.pending():
                if state.in_flight and limit is not None and state.in_flight + entry.nbytes > limit:
                    return
                if not self._issue(entry, device):  # a copy from the host issued ahead
                    self.stats.prefetched_bytes += entry.nbytes
                self._track(b)

    def _issue(self, entry: Entry, device: torch.device) -> bool:
        """Give ``entry`` its device copy: where its copy to the host is still going (:func:`unfinished_source`), a
        copy of the device value on the ``h2d`` stream (returns True: no copy through the host, no wait for it);
        else a copy from the host on that stream after the copy to the host (False)."""
        source = unfinished_source(entry, device)
        on_device = source is not None
        if not on_device:
            self._warn_past_prefetch_limit(entry.nbytes, self.prefetch_limit(device_key(device)))
            source = block_tensor(entry.block, entry.shape, entry.stride, entry.dtype)
        dev = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=device)
        if device.type == "cuda":
            streams = self.devices(device_key(device)).streams
            # after the compute stream's work so far; from the host, after the copy there too
            entry.h2d = streams.copy("h2d", dev, source, after=None if on_device else entry.d2h.event(),
                                     timing=None if on_device else entry.timing)
            if on_device:
                source.record_stream(streams.get("h2d"))
            else:
                entry.block.events["h2d"] = entry.h2d
        elif on_device:
            dev.copy_(source)
        else:
            timed_copy("h2d", dev, source, entry.timing)
        entry.reload = dev
        self.devices(entry.bundle.device).in_flight += entry.nbytes
        if on_device:
            self.stats.device_copied_bytes += entry.nbytes
        else:
            self.stats.reloaded_bytes += entry.nbytes
            self.stats.largest_reload_bytes = max(self.stats.largest_reload_bytes, entry.nbytes)
        return on_device

    def _drop(self, entry: Entry, read: bool = False) -> None:
        """Forget ``entry``'s device copy: handed to the backward (``read``), whose compute stream waits for the
        copy before any use, so its memory is reused in the compute stream's order; or freed unread, its memory
        reused only once its copy has finished."""
        if entry.reload is not None:
            state = self.devices(entry.bundle.device)
            if not read and entry.reload.is_cuda:
                entry.reload.record_stream(state.streams.get("h2d"))
            entry.reload = None
            state.in_flight -= entry.nbytes

    def _warn_past_prefetch_limit(self, nbytes: int, limit: int | None) -> None:
        """Once per prefetch limit: a reload larger than the limit is issued only when no other copy is in
        flight, so it neither overlaps the copies before it nor starts early; where such reloads follow each
        other the backward waits for them."""
        if limit is None or nbytes <= limit or limit in self.warned_limits:
            return
        self.warned_limits.add(limit)
        self.say(
            f"sacpass: a reload of {format_bytes(nbytes)} is larger than the offload prefetch limit "
            f"({format_bytes(limit)}): each such copy is issued only when no other is in flight, late, and the "
            f"backward may wait for it (sacpass.offload.stats().waited_reloads). Where the device has the room, "
            f"raise the limit to at least twice the largest reload: sacpass.offload.set_prefetch_limit("
            f"{2 * nbytes}), or None for no limit.")

    def _track(self, bundle: Bundle) -> None:
        """Remember ``bundle`` for the end of the backward running now (its unread copies are freed then)."""
        task = torch._C._current_graph_task_id()
        if task < 0:  # not inside a backward (a graph called by hand): the entries' own lifetimes free them
            return
        if task not in self.backwards:
            self.backwards[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_backward(task))
        self.backwards[task].setdefault(id(bundle), weakref.ref(bundle))

    def _end_backward(self, task: int) -> None:
        """The backward ``task`` ended: free the copies it issued that nothing read (a prefetched bundle whose
        backward did not follow, a value its graph never read); such a bundle may be prefetched again later."""
        with self.lock:
            self._free_unread(task)

    def _free_unread(self, task: int) -> None:
        self.settle_all()
        for ref in self.backwards.pop(task, {}).values():
            bundle = ref()
            if bundle is None:
                continue
            for entry in bundle.entries():
                if entry.reload is not None:
                    self._drop(entry)
                    self.stats.dropped_prefetch_bytes += entry.nbytes

    # ------------------------------------------------------------------------------------------ upkeep
    def settle(self) -> None:
        """Settle the host tensors that died since the last call: their entries go, their blocks go back to the
        pool (after their copies). Storage finalizers only queue the address, so a collection that runs inside
        the runtime never changes the pool under its feet."""
        while self.freed:
            entry = self.entries.pop(self.freed.popleft(), None)
            if entry is None:
                continue
            self._drop(entry)
            self.memory.release(entry.block, entry.pinned)
            self.stats.host_bytes_alive -= entry.block.size

    def plain_copy(self, host: Tensor, device: torch.device) -> Tensor:
        """A host tensor sacpass did not make (or an empty one), copied to ``device`` as it is."""
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        out.copy_(host)  # outside the runtime's lock: only the counter is shared
        with self.lock:
            self.stats.reloaded_bytes += host.numel() * host.element_size()
        return out
