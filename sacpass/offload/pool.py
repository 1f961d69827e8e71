"""The host pool: host memory that sacpass owns, in slabs of a power of two bytes (which PyTorch's pinned
allocator holds exactly; pinned when the offloaded tensor is on a GPU), sub-allocated best fit in blocks of
``ALIGN`` bytes. A freed block is handed out again only once every copy that touched it has finished (its CUDA
events). What the slabs hold (``held``) is what the machine gives up; the blocks handed out (``in_use``) are at
most that.

The pool's limit caps the bytes *held*: by default this process's share of the host (:mod:`sacpass.host`), so
that the local ranks of one host never hold more together than the node budget. A slab that would pass the
limit, or take more than the host has available, raises :class:`~sacpass.OffloadError` before it is allocated.
"""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..errors import OffloadError
from ..host import HostBudget, available_memory, physical_memory
from .sizes import pool_bytes

__all__ = ["Slab", "Block", "HostMemory", "block_tensor"]

_MIN_SLAB = 4 << 20
_MAX_SLAB = 2 << 30
_HOST_MARGIN = 0.05  # share of physical memory a new slab must leave available to everything else


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(eq=False)
class Slab:
    data: Tensor  # uint8, this slab's memory
    size: int
    free: list[list[int]]  # [offset, size] of free runs, by offset
    blocks: int = 0  # blocks handed out or waiting for their copies

    @property
    def ptr(self) -> int:
        return self.data.data_ptr()


@dataclass(eq=False)
class Block:
    slab: Slab
    offset: int
    size: int
    events: dict = field(default_factory=dict)  # stream kind -> the last copy on it that touched this block

    @property
    def ptr(self) -> int:
        return self.slab.ptr + self.offset


class _Slabs:
    """The slabs of one kind (pinned or not), sub-allocated best fit; freed blocks wait for their copies."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.slabs: list[Slab] = []
        self.pending: list[Block] = []  # freed, some copy still in flight
        self.in_use = 0

    @property
    def held(self) -> int:
        return sum(s.size for s in self.slabs)

    def fit(self, size: int) -> Block | None:
        best = None
        for slab in self.slabs:
            for run in slab.free:
                if run[1] >= size and (best is None or run[1] < best[1][1]):
                    best = (slab, run)
        if best is None:
            return None
        slab, run = best
        block = Block(slab, run[0], size)
        run[0] += size
        run[1] -= size
        if run[1] == 0:
            slab.free.remove(run)
        slab.blocks += 1
        return block

    def reclaim(self, wait: bool = False) -> None:
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

    def release(self, block: Block) -> None:
        """``block`` freed: at once where no copy touched it, else once its copies have finished, which the next
        allocation that needs the room asks (a release never queries the copies of every block freed before it:
        a step frees hundreds, one at a time)."""
        self.in_use -= block.size
        if block.events:
            self.pending.append(block)
        else:
            self._free(block)

    @staticmethod
    def _free(block: Block) -> None:
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
        """Give back the slabs that hold no block; returns their bytes."""
        self.reclaim(wait=True)
        empty = [s for s in self.slabs if s.blocks == 0]
        self.slabs = [s for s in self.slabs if s.blocks]
        return sum(s.size for s in empty)


class HostMemory:
    """The pinned and the plain slabs of one process, under one limit on the bytes they hold.

    ``budget`` is the host's share for this process (:func:`sacpass.host.process_host_budget`): the limit's
    default, and what an error names. ``available``: the memory the host has available now (a function, so
    tests can give another)."""

    def __init__(self, budget: HostBudget, available: Callable[[], int] = available_memory):
        self.budget = budget
        self.limit = budget.rank_bytes
        self.limit_set = False  # set_host_limit() replaced the rank's share
        self.available = available
        self.kinds = {True: _Slabs(pinned=True), False: _Slabs(pinned=False)}
        self.peak_held = 0

    @property
    def held(self) -> int:
        return sum(k.held for k in self.kinds.values())

    @property
    def in_use(self) -> int:
        return sum(k.in_use for k in self.kinds.values())

    def allocate(self, nbytes: int, pinned: bool) -> Block:
        kind = self.kinds[pinned]
        size = pool_bytes(nbytes)
        block = kind.fit(size)
        if block is None and kind.pending:  # the blocks freed since, whose copies have finished; else wait for them
            kind.reclaim()
            block = kind.fit(size)
        if block is None and kind.pending:
            kind.reclaim(wait=True)
            block = kind.fit(size)
        if block is None:
            kind.slabs.append(self._new_slab(kind, size))
            block = kind.fit(size)
        kind.in_use += block.size
        return block

    def release(self, block: Block, pinned: bool) -> None:
        self.kinds[pinned].release(block)

    def trim(self) -> int:
        return sum(k.trim() for k in self.kinds.values())

    def set_limit(self, nbytes: int) -> None:
        self.limit, self.limit_set = nbytes, True
        if self.held > nbytes:
            self.trim()

    def _whose_limit(self) -> str:
        if self.limit_set:
            return f"the limit of {self.limit} bytes (sacpass.offload.set_host_limit)"
        b = self.budget
        return (f"local rank {b.local_rank}'s share of this host, {self.limit} bytes ({b.describe()}; "
                f"sacpass.offload.host_limit())")

    def _new_slab(self, kind: _Slabs, size: int) -> Slab:
        """A slab for a block of ``size`` bytes: a power of two, growing with what the pool holds (up to 2 GiB,
        fewer slabs for a large working set), within the limit and what the host has available."""
        held = self.held
        slab = max(_pow2(size), min(_MAX_SLAB, max(_MIN_SLAB, _pow2(held + 1))))
        if held + slab > self.limit:
            slab = _pow2(size)
        if held + slab > self.limit:
            raise OffloadError(
                f"sacpass: offloading {size} more bytes needs a new host slab of {slab} bytes, which would make "
                f"sacpass's host pool hold {held + slab} bytes ({self.in_use} in use by live offloads), past "
                f"{self._whose_limit()}. Offload less (a smaller ModelPlan(host_bytes=...) or Plan(host_bytes=...), "
                f"fewer offload= selectors), drop outputs whose backward will never run, or raise the limit "
                f"(sacpass.offload.set_host_limit) where the host has the memory.")
        free = self.available() - int(_HOST_MARGIN * physical_memory())
        if slab > free:
            raise OffloadError(
                f"sacpass: offloading {size} more bytes needs a new host slab of {slab} bytes, but the host has only "
                f"{max(free, 0)} bytes available (beyond a {int(100 * _HOST_MARGIN)}% margin; sacpass's pool holds "
                f"{held}). Offload less (a smaller Plan(host_bytes=...) or fewer offload= selectors), or free host "
                f"memory.")
        data = torch.empty(slab, dtype=torch.uint8, pin_memory=kind.pinned)
        self.peak_held = max(self.peak_held, held + slab)
        return Slab(data, slab, [[0, slab]])


def block_tensor(block: Block, shape, stride, dtype: torch.dtype, on_free=None) -> Tensor:
    """A tensor over ``block``'s memory. With ``on_free``, its storage calls ``on_free`` when it dies: that
    storage *is* the block's life. Without, a second view for a copy (the block outlives it by its events)."""
    buf = (ctypes.c_uint8 * block.size).from_address(block.ptr)
    if on_free is not None:
        weakref.finalize(buf, on_free).atexit = False
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).as_strided(shape, stride)
