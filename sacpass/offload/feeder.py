"""Offload copies fed to their copy stream a few chunks at a time, from a thread.

A GPU's copy engine runs the device-to-host copies queued on it in order, whatever stream queued them. A host
read the model makes while a region's offloads are queued (``tensor.tolist()``, ``.item()``, ``.cpu()``: an MoE
reading its per-expert row counts, a loss read for logging) is itself such a copy, and waits behind all of them:
on an H100, 72 ms behind one 4 GiB offload, and as long behind the same bytes queued as many small copies at once
(``benchmarks/host_read_beside_copies.py``). The compute stream idles that long, each such read.

So offloads are not queued whole. :class:`Feeder` takes each copy (a destination, a source, the compute
stream's point where the source is ready) and queues it on its stream in chunks of :data:`CHUNK` bytes from its
own thread, never more than :data:`QUEUED` chunks ahead of the copy engine: a host read waits for those at
most, while the copies still run at the link's rate (the thread waits for a chunk's event without the GIL). A
copy of one chunk or less, submitted while the queue has room and no copy waits before it, is queued at once on
the caller's thread.

Each copy's completion is a :class:`FedCopy`, which stands in for a CUDA event (``query``, ``synchronize``)
before its chunks are even queued: ``event()`` waits until they are and returns the real one, for a stream to
wait on. The feeder holds the source until its last chunk is queued (the caller records the source's use on the
copy stream, so its memory is reused only after the copy). An error in the thread is raised by the next call
that waits on the copy, or submits another.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable

import torch
from torch import Tensor

from ..errors import OffloadError
from .sizes import dense

__all__ = ["CHUNK", "QUEUED", "FedCopy", "Feeder", "chunks"]

CHUNK = 64 << 20  # bytes queued on the copy engine at a time: ~1.2 ms at the 55 GB/s of an H100's link
QUEUED = 6  # chunks queued ahead of the copy engine: what a host read may wait behind (~7 ms on an H100)


class FedCopy:
    """A copy handed to a :class:`Feeder`: its completion, usable as a CUDA event's stand-in from the moment it
    is submitted. ``event()`` is the real one (its last chunk's), once every chunk is queued."""

    def __init__(self) -> None:
        self._queued = threading.Event()
        self._start = None
        self._done = None
        self._error: BaseException | None = None

    def _finish(self, start, done, error: BaseException | None = None) -> None:
        self._start, self._done, self._error = start, done, error
        self._queued.set()

    def _wait_queued(self):
        self._queued.wait()
        if self._error is not None:
            raise OffloadError(f"sacpass: an offload copy failed on its copy stream: {self._error!r}. The offloaded "
                               f"value is lost; the backward that needs it cannot run.") from self._error
        return self._done

    def event(self):
        """The copy's completion event, once its chunks are all queued (waits for the feeder until then)."""
        return self._wait_queued()

    def query(self) -> bool:
        """Whether the copy has finished (False while its chunks are still being fed)."""
        return self._queued.is_set() and self._error is None and self._done.query()

    def synchronize(self) -> None:
        self._wait_queued().synchronize()

    def elapsed_ms(self) -> float | None:
        """The copy's time on its stream, first chunk to last (timed copies only); None until it has finished."""
        if not self.query() or self._start is None:
            return None
        return self._start.elapsed_time(self._done)


def _alias(t: Tensor, dtype: torch.dtype, offset: int, size, stride) -> Tensor:
    """A tensor over ``t``'s memory with a version counter of its own: writing it leaves ``t``'s version alone
    (the destination may already be saved for a backward, which checks that version)."""
    return torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage(), offset, size, stride)


def chunks(dst: Tensor, src: Tensor, chunk: int = CHUNK) -> list[tuple[Tensor, Tensor]]:
    """``dst.copy_(src)`` as pieces of at most ``chunk`` bytes: flat byte ranges of both where they share one
    dense layout (the offload's host layout is the source's own where that is dense); else the copy whole. The
    pieces are aliases (:func:`_alias`): the copy does not count as a write of ``dst`` for autograd."""
    if (dst.shape != src.shape or dst.stride() != src.stride() or dst.dtype != src.dtype or not dense(src)
            or src.numel() * src.element_size() <= chunk):
        return [tuple(_alias(t, t.dtype, t.storage_offset(), t.shape, t.stride()) for t in (dst, src))]
    nbytes = src.numel() * src.element_size()
    d, s = (_alias(t, torch.uint8, t.storage_offset() * t.element_size(), (nbytes,), (1,)) for t in (dst, src))
    return [(d[i:i + chunk], s[i:i + chunk]) for i in range(0, nbytes, chunk)]


class Feeder:
    """Feeds one copy stream (see the module docstring). ``make_event(timing)`` and ``stream_context`` are the
    CUDA ones by default; ``chunk`` and ``queued`` bound what a host read waits behind."""

    def __init__(self, stream, device_index: int | None = None, chunk: int = CHUNK, queued: int = QUEUED,
                 make_event: Callable[[bool], object] | None = None, stream_context=None) -> None:
        self.stream = stream
        self.device_index = device_index
        self.chunk, self.queued = chunk, queued
        self.make_event = make_event or (lambda timing: torch.cuda.Event(enable_timing=timing))
        self.stream_context = stream_context or torch.cuda.stream
        self.jobs: collections.deque = collections.deque()
        self.in_flight: collections.deque = collections.deque()  # chunks' events, oldest first
        self.cv = threading.Condition()
        self.busy = 0  # jobs submitted and not yet queued whole
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, dst: Tensor, src: Tensor, ready, timed: bool = False) -> FedCopy:
        """Queue ``dst.copy_(src)`` after ``ready`` (an event on the producer's stream); returns its completion."""
        fed = FedCopy()
        with self.cv:
            if self.error is not None:
                error, self.error = self.error, None
                raise OffloadError(f"sacpass: the offload copy feeder failed: {error!r}") from error
            if self.busy == 0 and src.numel() * src.element_size() <= self.chunk and self._room():
                # one chunk, the queue has room and nothing waits before it: queued at once, on this thread
                try:
                    fed._finish(*self._feed(dst, src, ready, timed))
                except Exception as e:
                    raise OffloadError(f"sacpass: an offload copy failed on its copy stream: {e!r}.") from e
                return fed
            self.jobs.append((dst, src, ready, timed, fed))
            self.busy += 1
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="sacpass-offload-feeder", daemon=True)
                self.thread.start()
            self.cv.notify()
        return fed

    def _room(self) -> bool:
        """Whether another chunk may be queued now (the chunks the copy engine has finished are let go)."""
        while self.in_flight and self.in_flight[0].query():
            self.in_flight.popleft()
        return len(self.in_flight) < self.queued

    def flush(self) -> None:
        """Wait until every copy submitted so far is queued on the stream (not finished)."""
        with self.cv:
            self.cv.wait_for(lambda: self.busy == 0)

    def _run(self) -> None:
        if self.device_index is not None:
            torch.cuda.set_device(self.device_index)
        while True:
            with self.cv:
                self.cv.wait_for(lambda: bool(self.jobs))
                dst, src, ready, timed, fed = self.jobs.popleft()
            try:
                start, done = self._feed(dst, src, ready, timed)
                fed._finish(start, done)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on this copy, or submits next
                fed._finish(None, None, e)
                with self.cv:
                    self.error = e
            del dst, src  # the source's memory goes back to its allocator once its last chunk is queued
            with self.cv:
                self.busy -= 1
                self.cv.notify_all()

    def _feed(self, dst: Tensor, src: Tensor, ready, timed: bool):
        self.stream.wait_event(ready)
        start = None
        with self.stream_context(self.stream):
            if timed:
                start = self.make_event(True)
                start.record(self.stream)
            pieces = chunks(dst, src, self.chunk)
            for i, (d, s) in enumerate(pieces):
                while len(self.in_flight) >= self.queued:
                    self.in_flight.popleft().synchronize()  # without the GIL: the copy engine's pace
                d.copy_(s, non_blocking=True)
                mark = self.make_event(timed and i == len(pieces) - 1)
                mark.record(self.stream)
                self.in_flight.append(mark)
        return start, self.in_flight[-1]
