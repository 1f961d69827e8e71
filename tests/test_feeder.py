"""The offload copy feeder: a copy in chunks of at most CHUNK bytes, never more than QUEUED of them ahead of the
copy engine, its completion usable before it is queued, its source let go once queued, its errors raised.

The copy engine here is a clock of fake events: an event completes when something synchronizes on it (the
feeder waiting for room) or the test lets the engine run; the tensors are CPU tensors, so each chunk's bytes
really move."""
from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch

from sacpass import OffloadError
from sacpass.offload.feeder import FedCopy, Feeder, chunks


class Engine:
    """Fake events and stream: records how many chunk events were outstanding (recorded, not complete) at most."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outstanding: list = []
        self.most = 0
        self.waited: list = []

    def event(self, timing):
        engine = self

        class Event:
            done = False

            def record(self, stream):
                with engine.lock:
                    engine.outstanding.append(self)
                    engine.most = max(engine.most, len(engine.outstanding))

            def query(self):
                return self.done

            def synchronize(self):
                with engine.lock:
                    for e in list(engine.outstanding):  # the engine runs in order: everything before it too
                        e.done = True
                        engine.outstanding.remove(e)
                        if e is self:
                            break

            def elapsed_time(self, other):
                return 1.5

        return Event()

    def wait_event(self, event):
        self.waited.append(event)

    def run_all(self):
        with self.lock:
            for e in self.outstanding:
                e.done = True
            self.outstanding.clear()


def _feeder(engine, chunk=64, queued=2):
    return Feeder(engine, None, chunk=chunk, queued=queued, make_event=engine.event,
                  stream_context=lambda s: contextlib.nullcontext())


def test_a_dense_copy_is_cut_into_byte_ranges_and_anything_else_goes_whole():
    src = torch.arange(1000, dtype=torch.float32).reshape(10, 100).t()  # dense, not contiguous
    dst = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype)
    pieces = chunks(dst, src, chunk=1024)
    assert len(pieces) == 4 and [p[0].numel() for p in pieces] == [1024, 1024, 1024, 928]
    for d, s in pieces:
        d.copy_(s)
    assert torch.equal(dst, src)
    gappy = torch.arange(1000.0).reshape(10, 100)[:, :50]  # a slice: not dense, copied as it is
    assert len(chunks(torch.empty(10, 50), gappy, chunk=64)) == 1
    small = torch.arange(8.0)
    assert len(chunks(torch.empty(8), small, chunk=1024)) == 1


def test_copies_are_fed_within_the_queue_bound_and_arrive_whole():
    engine = Engine()
    feeder = _feeder(engine, chunk=64, queued=2)
    srcs = [torch.randn(100 + 37 * i) for i in range(5)]  # 400 to 548 bytes: 7 to 9 chunks each
    dsts = [torch.empty_like(s) for s in srcs]
    ready = engine.event(False)
    fed = [feeder.submit(d, s, ready) for d, s in zip(dsts, srcs)]
    feeder.flush()
    assert engine.most == 2  # never more than QUEUED chunks ahead of the engine
    assert engine.waited == [ready] * 5  # each copy after its source's producer
    engine.run_all()
    assert all(f.query() for f in fed)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)
    whole = torch.empty(4)  # under one chunk: copied whole
    feeder.submit(whole, torch.ones(4), ready).synchronize()
    assert torch.equal(whole, torch.ones(4))
    # the host copy may already be saved for a backward when its chunks land: its version is not bumped
    assert [d._version for d in dsts] == [0] * 5 and whole._version == 0
    timed = feeder.submit(torch.empty(100), torch.ones(100), ready, timed=True)
    timed.synchronize()
    assert timed.elapsed_ms() == 1.5 and fed[0].elapsed_ms() is None  # only a timed copy has a time


def test_a_fed_copy_stands_in_for_its_event_before_it_is_queued():
    engine = Engine()
    feeder = _feeder(engine)
    gate = threading.Event()
    real = feeder._feed
    feeder._feed = lambda *a: (gate.wait(), real(*a))[1]  # the thread is slow to queue it
    fed = feeder.submit(torch.empty(40), torch.ones(40), engine.event(False))  # two chunks: the thread's
    assert not fed.query() and fed.elapsed_ms() is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(fed.event()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # event() waits until the chunks are queued
    gate.set()
    waiter.join(5)
    assert got and got[0] is not None
    fed.synchronize()
    assert fed.query()


def test_the_source_is_let_go_once_its_last_chunk_is_queued():
    engine = Engine()
    feeder = _feeder(engine)
    src = torch.randn(300)
    ref = weakref.ref(src.untyped_storage())
    keep = ref()
    feeder.submit(torch.empty(300), src, engine.event(False))
    del src, keep
    feeder.flush()
    gc.collect()
    assert ref() is None


def test_a_failed_copy_is_raised_where_it_is_waited_on_and_by_the_next_submit():
    engine = Engine()
    feeder = _feeder(engine)
    with pytest.raises(OffloadError, match="offload copy failed"):  # one chunk, queued at once: raised at once
        feeder.submit(torch.empty(3), torch.ones(5), engine.event(False))
    fed = feeder.submit(torch.empty(30), torch.ones(50), engine.event(False))  # the thread's: raised when waited on
    with pytest.raises(OffloadError, match="offload copy failed"):
        fed.event()
    with pytest.raises(OffloadError, match="feeder failed"):
        feeder.submit(torch.empty(3), torch.ones(3), engine.event(False))
    ok = feeder.submit(torch.empty(3), torch.ones(3), engine.event(False))  # the feeder goes on after
    ok.synchronize()
    assert isinstance(ok, FedCopy)


def test_a_small_copy_with_room_is_queued_at_once_and_one_without_room_waits_its_turn():
    engine = Engine()
    feeder = _feeder(engine, chunk=64, queued=2)
    ready = engine.event(False)
    first = feeder.submit(torch.empty(4), torch.ones(4), ready)
    assert first._queued.is_set() and feeder.thread is None  # on the caller's thread, no feeder thread started
    feeder.submit(torch.empty(4), torch.ones(4), ready)
    third = feeder.submit(torch.empty(4), torch.full((4,), 3.0), ready)  # two chunks queued: the thread's turn
    feeder.flush()
    assert feeder.thread is not None and engine.most == 2
    third.synchronize()
    assert third.query()


def test_a_dense_value_is_one_that_fills_its_span_each_element_once():
    """The runtime's dense check (whether a value's copy may go as one flat byte range, keeping its strides) against
    the truth: its elements' offsets are exactly 0..numel-1. Every layout of up to four dims over a few sizes and
    strides, views with a step, permutations; PyTorch's own check misorders a size-1 dim of stride 0 and says no
    to (2, 1, 5, 1) at strides (1, 0, 2, 12), which fills its span."""
    import itertools
    import random

    from sacpass.offload.sizes import dense

    def truth(x):
        if not x.numel():
            return True
        index = torch.arange(x.untyped_storage().nbytes() // x.element_size())
        offsets = index.as_strided(x.shape, x.stride(), x.storage_offset()).flatten() - x.storage_offset()
        return sorted(offsets.tolist()) == list(range(x.numel()))

    rng = random.Random(0)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        nd = rng.randint(0, 4)
        shape = [rng.choice([0, 1, 2, 3, 5]) for _ in range(nd)]
        stride = [rng.choice([0, 1, 2, 3, 5, 6, 15, 30]) for _ in range(nd)]
        for x in (torch.empty(1000).as_strided(shape, stride), torch.empty(shape).permute(list(reversed(range(nd)))),
                  torch.empty(shape)[..., ::2] if nd else torch.empty(())):
            assert dense(x) == truth(x), (tuple(x.shape), x.stride())
            seen[truth(x)] += 1
    assert min(seen.values()) > 1000  # both answers, many times
    odd = torch.empty(10).as_strided((2, 1, 5, 1), (1, 0, 2, 12))
    assert dense(odd) and truth(odd)
    assert all(dense(torch.empty(s).permute(*p)) for s in [(2, 3, 4)] for p in itertools.permutations(range(3)))
