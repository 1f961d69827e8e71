"""Copies off the compute stream, and the clocks that time them and the regions around them.

A CUDA device gets two side streams (``d2h`` and ``h2d``); a copy on one waits for the compute stream's work so far
(the source's producer, the destination's allocation) and returns its completion event. A CPU tensor's copies
run synchronously, timed by the host clock. Times are CUDA timing events while on a GPU (read once both have
completed, never waited for) and seconds from ``time.perf_counter`` on the CPU.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from .feeder import FedCopy, Feeder

__all__ = ["device_key", "SideStreams", "timed_copy", "clock", "elapsed_ms", "copy_ms"]


def device_key(device: torch.device) -> tuple[str, int]:
    """A hashable name of ``device`` with its index resolved (the current CUDA device for ``cuda``)."""
    if device.type == "cuda":
        return ("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return (device.type, -1)


class SideStreams:
    """One device's copy streams, made on first use: ``d2h`` (offloads) and ``h2d`` (reloads)."""

    def __init__(self, index: int):
        self.index = index
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._feeders: dict[str, Feeder] = {}

    def get(self, kind: str) -> "torch.cuda.Stream":
        if kind not in self._streams:
            self._streams[kind] = torch.cuda.Stream(device=torch.device("cuda", self.index))
        return self._streams[kind]

    def feed(self, kind: str, dst: Tensor, src: Tensor, timing: "dict[str, list] | None" = None) -> FedCopy:
        """``dst.copy_(src)`` on the ``kind`` stream after the compute stream's work so far, fed to it a few
        chunks at a time from a thread (:mod:`.feeder`: a host read the model makes meanwhile waits for those
        only); returns its completion. ``timing``: the copy goes to ``timing[kind]``."""
        if kind not in self._feeders:
            self._feeders[kind] = Feeder(self.get(kind), self.index)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(torch.device("cuda", self.index)))
        fed = self._feeders[kind].submit(dst, src, ready, timed=timing is not None)
        if timing is not None:
            timing[kind].append(fed)
        return fed

    def flush(self) -> None:
        """Every fed copy queued on its stream (see :meth:`Feeder.flush`)."""
        for feeder in self._feeders.values():
            feeder.flush()

    def copy(self, kind: str, dst: Tensor, src: Tensor, after=None, timing: "dict[str, list] | None" = None
             ) -> "torch.cuda.Event":
        """``dst.copy_(src)`` on the ``kind`` stream, ordered after the compute stream's work so far and after the
        event ``after``; returns its completion. ``timing``: the copy's (start, end) events go to
        ``timing[kind]``."""
        device = torch.device("cuda", self.index)
        stream = self.get(kind)
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


def timed_copy(kind: str, dst: Tensor, src: Tensor, timing: "dict[str, list] | None") -> None:
    """A synchronous copy (a CPU tensor's), its seconds to ``timing[kind]``."""
    t0 = time.perf_counter()
    dst.copy_(src)
    if timing is not None:
        timing[kind].append(time.perf_counter() - t0)


def clock(device: torch.device):
    """A point in ``device``'s compute order: a CUDA timing event recorded on its current stream (the work
    queued so far), or the host clock for the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def elapsed_ms(start, end) -> float | None:
    """Milliseconds between two :func:`clock` marks; None without an end, or while either's work runs."""
    if start is None or end is None:
        return None
    if isinstance(start, float):
        return 1e3 * (end - start)
    return start.elapsed_time(end) if start.query() and end.query() else None


def copy_ms(times: list) -> float | None:
    """The milliseconds of timed copies: CPU seconds, CUDA (start, end) events, or fed copies; None while one is
    running."""
    total = 0.0
    for t in times:
        ms = 1e3 * t if isinstance(t, float) else t.elapsed_ms() if isinstance(t, FedCopy) else elapsed_ms(*t)
        if ms is None:
            return None
        total += ms
    return total
