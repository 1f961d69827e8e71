"""The offload runtime's lifecycle on the CPU: pool, bundles, prefetch order, reload and free.

The CPU path runs the same code as the GPU path (copies done synchronously, an unpinned pool), so what
these tests pin holds there too: a forward whose backward never runs leaves nothing behind, the host limit
counts the bytes really held, threads and interleaved microbatches prefetch their own previous layer, and a
prefetch nobody consumes is freed when its backward ends. The GPU side is tests/gpu/test_offload_cuda.py.
"""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sacpass
import sacpass.offload as rt
from sacpass.offload.runtime import process_runtime
from sacpass.offload.transfers import CopiesOut, ReadOrders
from sacpass.testing import no_compile_caches
from tests.support.toy import CompiledStack, stack_step

RT = process_runtime()
N_LAYERS = 3
OFFLOAD = {"offload": ["aten::addmm"]}


def _stack(seed=0, **options):
    be = sacpass.backend(inner="aot_eager", **(options or OFFLOAD))
    return CompiledStack(be, N_LAYERS, seed), be


def _x(seed=1):
    return torch.randn(24, 32, generator=torch.Generator().manual_seed(seed))


def _counters(st: rt.OffloadStats) -> tuple:
    return st.offloaded_bytes, st.reloaded_bytes, st.prefetched_bytes, st.waited_reloads, st.dropped_prefetch_bytes


def _assert_empty():
    st = rt.stats()
    assert st.bundles_alive == 0 and st.host_bytes_alive == 0, st.format()
    assert not RT.transfers.entries and all(not p.pending and p.in_use == 0 for p in RT.memory.kinds.values())


@pytest.fixture(autouse=True)
def _isolated_pool():
    rt.release_host_memory()
    limit = rt.host_limit()
    yield
    rt.set_host_limit(limit)
    rt.release_host_memory()


@pytest.fixture
def per_layer():
    """Bytes one layer offloads, from the report."""
    def read(be):
        (rep,) = {r.host_bytes for r in be.reports}
        return rep
    return read


def test_a_step_prefetches_every_layer_but_the_last(per_layer):
    with no_compile_caches():
        model, be = _stack()
        stack_step(model, _x())  # compiles
        rt.reset_stats()
        stack_step(model, _x())
    st = rt.stats()
    assert st.offloaded_bytes == N_LAYERS * per_layer(be) == st.reloaded_bytes
    assert st.prefetched_bytes == (N_LAYERS - 1) * per_layer(be), st.format()
    assert st.bundles == N_LAYERS and st.dropped_prefetch_bytes == 0
    _assert_empty()


@pytest.mark.parametrize("junk", ["dropped", "exception"])
def test_forwards_without_backward_leave_nothing_and_change_nothing(junk):
    with no_compile_caches():
        model, _ = _stack()
        stack_step(model, _x())  # compiles
        rt.reset_stats()
        expected = stack_step(model, _x())
        clean = _counters(rt.stats())

        for _ in range(100):  # an eval loop under grad, or a loss that raises: no backward follows
            try:
                out = model(_x(2).requires_grad_(True))
                if junk == "exception":
                    raise ValueError("loss failed")
            except ValueError:
                pass
            del out
        assert rt.stats().bundles_alive == 0, rt.stats().format()
        rt.reset_stats()
        grads = stack_step(model, _x())
    assert _counters(rt.stats()) == clean
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    _assert_empty()


def test_a_live_forward_is_prefetched_then_freed_when_the_backward_ends(per_layer):
    """A forward kept alive (its backward later, or never) sits before the next step's first layer in the
    chain: that layer's backward prefetches it, nothing consumes it, and the copy is freed at the end."""
    with no_compile_caches():
        model, be = _stack()
        stack_step(model, _x())
        kept = model(_x(2).requires_grad_(True))
        rt.reset_stats()
        stack_step(model, _x())
        st = rt.stats()
        assert st.dropped_prefetch_bytes == per_layer(be), st.format()
        assert st.bundles_alive == N_LAYERS  # the kept forward's bundles, nothing else
        assert all(e.reload is None for e in RT.transfers.entries.values())
        kept.square().sum().backward()  # its own backward still works
    del kept
    _assert_empty()


def test_interleaved_microbatches_prefetch_their_own_layers(per_layer):
    """F1 F2 B1 B2: each backward prefetches the layers of its own forward, none of the other's."""
    with no_compile_caches():
        model, be = _stack()
        stack_step(model, _x())
        x1, x2 = _x(3).requires_grad_(True), _x(4).requires_grad_(True)
        ref1, ref2 = stack_step(model, _x(3)), stack_step(model, _x(4))
        model.zero_grad(set_to_none=True)
        rt.reset_stats()
        out1, out2 = model(x1), model(x2)
        out1.square().sum().backward()
        out2.square().sum().backward()
    st = rt.stats()
    assert st.prefetched_bytes == 2 * (N_LAYERS - 1) * per_layer(be), st.format()
    assert st.dropped_prefetch_bytes == 0
    both = [a + b for a, b in zip(ref1[:-1], ref2[:-1])]
    for g, r in zip([p.grad for p in model.parameters() if p.grad is not None], both):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert torch.equal(x1.grad, ref1[-1]) and torch.equal(x2.grad, ref2[-1])
    del out1, out2
    _assert_empty()


def test_two_models_in_two_threads(per_layer):
    steps = 4
    with no_compile_caches():
        models = [_stack(seed)[0] for seed in (0, 1)]
        expected = [stack_step(m, _x(5 + i)) for i, m in enumerate(models)]  # compiles too
        rt.reset_stats()
        results, errors = [None, None], []
        barrier = threading.Barrier(2)

        def train(i):
            try:
                barrier.wait()
                for _ in range(steps):
                    results[i] = stack_step(models[i], _x(5 + i))
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for got, want in zip(results, expected):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    st = rt.stats()
    layer = rt.stats().offloaded_bytes // (2 * steps * N_LAYERS)
    assert st.prefetched_bytes == 2 * steps * (N_LAYERS - 1) * layer, st.format()
    assert st.dropped_prefetch_bytes == 0
    _assert_empty()


# --------------------------------------------------------------------------------------- the prefetch
MANY = {"offload": ["aten::mm", "aten::addmm", "aten::gelu"]}  # several values a layer, read at different times


@pytest.fixture
def issues(monkeypatch):
    """Every host-to-device copy issued: (bytes issued and not yet read right after it, its bytes); the
    reading orders start unlearned and the prefetch limit is restored."""
    seen, issue = [], RT.transfers._issue

    def record(entry, device):
        issue(entry, device)
        seen.append((RT.device(entry.bundle.device).in_flight, entry.nbytes))

    monkeypatch.setattr(RT.transfers, "_issue", record)
    monkeypatch.setattr(RT.transfers, "read_orders", ReadOrders())
    limit = rt.prefetch_limit()
    yield seen
    rt.set_prefetch_limit(limit)


@pytest.mark.parametrize("limit", [1, 16 << 10, None])
def test_the_prefetch_limit_caps_the_copies_issued_and_not_yet_read(issues, limit):
    with no_compile_caches():
        model, be = _stack(**MANY)
        expected = stack_step(model, _x())  # compiles
        rt.set_prefetch_limit(limit)
        rt.reset_stats()
        issues.clear()
        grads = stack_step(model, _x())
    st, layer = rt.stats(), rt.stats().offloaded_bytes // N_LAYERS
    assert len(issues) >= 3 * N_LAYERS and st.reloaded_bytes == st.offloaded_bytes == N_LAYERS * layer
    largest = max(n for _, n in issues)
    assert st.largest_reload_bytes == largest
    if limit is None:  # the old way: a layer's first read issues its other copies and the layer before's
        assert max(f for f, _ in issues) > layer, issues
    else:
        assert all(f <= max(limit, n) for f, n in issues), issues
        assert limit >= largest or max(f for f, _ in issues) == largest  # one copy at a time
    assert st.waited_reloads == 1 and st.prefetched_bytes == st.reloaded_bytes - issues[0][1], st.format()
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    _assert_empty()


def test_a_reload_larger_than_the_prefetch_limit_warns_once_per_limit(issues, monkeypatch):
    """A copy larger than the limit goes alone, when nothing else is in flight: said once per limit, with the
    limit that would let two of the largest overlap; a limit that holds every reload says nothing."""
    import re
    import warnings
    monkeypatch.setattr(RT.transfers, "warned_limits", set())
    with no_compile_caches():
        model, be = _stack(**MANY)
        stack_step(model, _x())  # compiles
        largest = max(n for _, n in issues)
        for limit, warns in ((largest, False), (largest - 1, True), (largest - 1, False), (1, True)):
            rt.set_prefetch_limit(limit)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                stack_step(model, _x())
            said = [str(w.message) for w in caught if issubclass(w.category, sacpass.SacpassWarning)
                    and "prefetch limit" in str(w.message)]
            assert len(said) == int(warns), (limit, said)
            if warns:  # names a reload past this limit, and the limit that fits two of it
                suggested = int(re.search(r"set_prefetch_limit\((\d+)\)", said[0]).group(1))
                assert suggested % 2 == 0 and limit < suggested // 2 <= largest, (limit, said[0])
                assert suggested // 2 in {n for _, n in issues} and "None for no limit" in said[0]
    _assert_empty()


def test_a_warning_turned_into_an_error_stops_the_backward_after_the_runtime_is_done(issues, monkeypatch):
    """Under a filter that makes sacpass's warnings errors, the prefetch-limit warning stops the backward only
    once the reload it is about has been issued and handed over (it is said outside the runtime's lock), and
    the next step, warned no more, runs with every copy and block accounted for."""
    import warnings
    monkeypatch.setattr(RT.transfers, "warned_limits", set())
    with no_compile_caches():
        model, be = _stack(**MANY)
        expected = stack_step(model, _x())  # compiles
        largest = max(n for _, n in issues)
        rt.set_prefetch_limit(largest - 1)
        rt.reset_stats()
        issues.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", sacpass.SacpassWarning)
            with pytest.raises(sacpass.SacpassWarning, match="larger than the offload prefetch limit"):
                stack_step(model, _x())
        assert issues and rt.stats().reloaded_bytes == sum(n for _, n in issues) > 0
        assert RT._warnings == []
        rt.reset_stats()
        grads = stack_step(model, _x())
        st = rt.stats()
    assert st.reloaded_bytes == st.offloaded_bytes > 0, st.format()
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    _assert_empty()


def test_the_prefetch_follows_the_order_the_backward_read_in_last(issues):
    """One copy ahead at a time: with the reading order learned, no read but the step's first waits; with a
    wrong order planted (the forward's), reads wait, and the next step has learned the right one again."""
    rt.set_prefetch_limit(1)
    with no_compile_caches():
        model, be = _stack(**MANY)
        stack_step(model, _x())
        rt.reset_stats()
        stack_step(model, _x())
        assert rt.stats().waited_reloads == 1, rt.stats().format()
        ((layout, order),) = RT.transfers.read_orders.orders.items()
        assert sorted(order) == list(range(len(layout))) and order != sorted(order)
        RT.transfers.read_orders.orders[layout] = sorted(order)
        rt.reset_stats()
        stack_step(model, _x())
        assert rt.stats().waited_reloads > 1
        assert RT.transfers.read_orders.orders[layout] == order
        rt.reset_stats()
        stack_step(model, _x())
        assert rt.stats().waited_reloads == 1, rt.stats().format()
    _assert_empty()


def test_the_learned_orders_are_bounded(issues, monkeypatch):
    """One order per layout (compiled graph and shape): a run whose shapes vary keeps only the newest."""
    monkeypatch.setattr(RT.transfers.read_orders, "kept", 2)
    with no_compile_caches():
        model, _ = _stack(**MANY)
        for rows in (24, 25, 26, 27):
            stack_step(model, torch.randn(rows, 32))
    assert len(RT.transfers.read_orders.orders) == 2
    assert {layout[0][0][0] for layout in RT.transfers.read_orders.orders} == {26, 27}  # the rows of the newest two shapes
    _assert_empty()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2GiB"])
def test_set_prefetch_limit_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="pass a number of bytes"):
        rt.set_prefetch_limit(bad)


# ------------------------------------------------------------------------------------------ the pool
ODD = [(1000,), (3, 333), (77, 91), (5,), (4097,)]


def _offload_all(shapes, index0=True):
    return [torch.ops.sacpass.offload(torch.randn(*s), 0 if (index0 and i == 0) else i, []) for i, s in enumerate(shapes)]


def test_the_pool_counts_the_bytes_it_really_holds():
    hosts = _offload_all(ODD)
    st = rt.stats()
    slabs = [s for p in RT.memory.kinds.values() for s in p.slabs]
    real = sum(s.data.untyped_storage().nbytes() for s in slabs)
    assert st.host_bytes_held == real > 0
    assert st.host_bytes_alive == sum(rt.pool_bytes(h.numel() * h.element_size()) for h in hosts) <= real
    for h, s in zip(hosts, ODD):  # every host tensor lives inside a slab
        assert any(sl.ptr <= h.data_ptr() < sl.ptr + sl.size for sl in slabs) and tuple(h.shape) == s
    del hosts, h
    assert rt.stats().host_bytes_alive == 0 and rt.stats().host_bytes_held == real  # kept for reuse
    again = _offload_all(ODD)
    assert rt.stats().host_bytes_held == real  # reused, not grown
    del again
    assert rt.release_host_memory() == real and rt.stats().host_bytes_held == 0


def test_offloaded_values_round_trip_exactly():
    xs = [torch.randn(7, 13), torch.randn(64, 64).t(), torch.randint(0, 9, (33,), dtype=torch.int32),
          torch.randn(10, 10)[:, ::2], torch.rand(5) > 0.5, torch.randn(3, 5).to(torch.bfloat16)]
    hosts = [torch.ops.sacpass.offload(x, i, []) for i, x in enumerate(xs)]
    for x, h in zip(xs, hosts):
        back = torch.ops.sacpass.reload(h, torch.device("cpu"))
        assert back.dtype == x.dtype and back.shape == x.shape and torch.equal(back, x)
    # a host tensor sacpass did not make is copied plainly
    plain = torch.randn(4)
    assert torch.equal(torch.ops.sacpass.reload(plain, torch.device("cpu")), plain)


def test_the_host_limit_caps_the_bytes_held_not_the_tensor_bytes():
    first = _offload_all([(1000,)])  # one slab
    held = rt.stats().host_bytes_held
    rt.set_host_limit(held)
    logical = 0
    kept = []
    with pytest.raises(sacpass.OffloadError, match=r"past the limit of .*set_host_limit.*Offload less"):
        while True:  # tensors whose bytes alone stay under the limit, until the slab is full
            kept += _offload_all([(1000,)], index0=False)
            logical += 4000
            assert logical < 2 * held
    assert rt.stats().host_bytes_held == held  # refused before allocating
    del first, kept
    _assert_empty()


def test_set_host_limit_refuses_bad_values_and_gives_back_unused_slabs():
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(ValueError, match="set_host_limit"):
            rt.set_host_limit(bad)
    hosts = _offload_all([(1000,)])
    del hosts
    assert rt.stats().host_bytes_held > 0
    rt.set_host_limit(0)
    assert rt.stats().host_bytes_held == 0


def test_a_compiled_step_past_the_host_limit_raises_offload_error_and_leaks_nothing():
    with no_compile_caches():
        model, _ = _stack()
        rt.set_host_limit(0)
        with pytest.raises(sacpass.OffloadError, match="set_host_limit"):
            stack_step(model, _x())
    _assert_empty()


def test_the_report_gives_tensor_and_pool_bytes(per_layer):
    with no_compile_caches():
        model, be = _stack()
        stack_step(model, _x())
    rep = be.reports[0]
    assert rep.host_pool_bytes == sum(rt.pool_bytes(s.bytes) for s in rep.saved if s.on_host) >= rep.host_bytes > 0
    assert f"{rep.host_pool_bytes} bytes of sacpass's host pool" in rep.format()


def test_a_plan_past_the_host_limit_warns_when_it_is_made():
    rt.set_host_limit(1 << 20)
    with no_compile_caches(), pytest.warns(sacpass.SacpassWarning, match=r"may offload 4194304 bytes a step.*"
                                                                            r"Lower Plan\(host_bytes"):
        model, _ = _stack(plan=sacpass.Plan(host_bytes=1 << 20, layers=4, min_offload_bytes=0))
        stack_step(model, _x())


def test_an_offload_the_host_has_no_memory_for_raises_before_allocating(monkeypatch):
    monkeypatch.setattr(RT.memory, "available", lambda: 0)
    with pytest.raises(sacpass.OffloadError, match=r"the host has only 0 bytes available.*free host memory"):
        _offload_all([(1000,)])
    assert rt.stats().host_bytes_held == 0
    _assert_empty()


class _CopyStillRunning:
    """A copy to the host the copy engine has not finished (a GPU's, behind the copies queued before it)."""

    def __init__(self, done=False):
        self.done = done

    def query(self) -> bool:
        return self.done


@pytest.mark.parametrize("case", ["running", "finished", "written since", "gone", "other layout"])
def test_a_value_asked_for_while_its_copy_out_still_runs_is_copied_on_the_device(case):
    """The backward of the last layers can ask for a value before its copy to the host has finished (a forward
    whose copies run longer than its compute): while the feeder still holds the device value, the reload copies
    it on the device (no wait for the copy out and the copy back), leaving it to its copy out; a finished copy, a
    value written since, one already let go or one whose host copy has another layout come back from the host as
    before. Either way a fresh tensor with the offloaded bits, and a second read gives them again."""
    x = torch.randn(64, 48)
    want, nbytes = x.clone(), x.numel() * x.element_size()
    host = torch.ops.sacpass.offload(x, 0, [])
    entry = RT.transfers.entry_for(host)
    entry.d2h = _CopyStillRunning(done=case == "finished")
    entry.source, entry.version = weakref.ref(x), x._version
    if case == "written since":
        x.add_(0)  # the same numbers, a new version: the host copy might not have seen a write
    if case == "gone":
        del x
        gc.collect()
    if case == "other layout":
        entry.stride = (1, 64)  # as the host copy of a value that was not dense
    rt.reset_stats()
    back = torch.ops.sacpass.reload(host, torch.device("cpu"))
    st = rt.stats()
    on_device = case == "running"
    assert entry.source() is None or back.data_ptr() != entry.source().data_ptr()  # the backward's own tensor
    if case != "other layout":
        assert torch.equal(back, want)
    assert st.device_copied_bytes == (nbytes if on_device else 0), st.format()
    assert st.reloaded_bytes == (0 if on_device else nbytes) and st.waited_reloads == (0 if on_device else 1)
    assert ("copied on the device, their copy out unfinished" in st.format()) is on_device
    assert torch.equal(torch.ops.sacpass.reload(host, torch.device("cpu")), back)  # a second backward's read


class _Copy:
    """A copy to the host that finishes when waited for (or has already)."""

    def __init__(self, name: str, waits: list, done: bool = False):
        self.name, self.waits, self.done = name, waits, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits.append(self.name)
        self.done = True


def _make_room(out: CopiesOut, nbytes: int, limit: int) -> int:
    due = out.due(nbytes, limit)
    for done in due:
        done.synchronize()
    return len(due)


def test_the_copies_out_wait_for_the_oldest_until_the_new_bytes_fit():
    """A forward that runs ahead of its copies to the host waits for the oldest, in order and no more than it
    must, so that the bytes still to copy stay within the limit; copies already finished go without a wait; a
    value larger than the limit waits for every copy before it and then goes alone."""
    waits: list = []
    out = CopiesOut()
    assert _make_room(out, 10, 4) == 0 and out.nbytes == 0  # nothing queued: a large value goes at once
    for name, n, done in [("a", 3, True), ("b", 3, False), ("c", 3, False), ("d", 3, False)]:
        out.add(_Copy(name, waits, done), n)
    assert _make_room(out, 3, 9) == 1 and waits == ["b"] and out.nbytes == 6  # a finished; b waited; c, d left
    assert _make_room(out, 3, 9) == 0 and out.nbytes == 6  # 6 + 3 fits
    out.add(_Copy("e", waits, False), 3)
    assert _make_room(out, 5, 9) == 2 and waits == ["b", "c", "d"] and out.nbytes == 3  # 3 + 5 fits only now
    assert _make_room(out, 20, 9) == 1 and waits == ["b", "c", "d", "e"] and out.nbytes == 0


def test_the_copies_out_are_waited_for_with_the_runtime_s_lock_released(monkeypatch):
    """An offload that must wait for copies out queues its own first and waits after its op, outside the
    runtime's lock: another thread's op goes on meanwhile (a pipeline schedule's stages in threads); the wait is
    counted, and a copy that failed raises to the offloading thread with the count right."""
    other_ran = threading.Event()

    def other_op():  # another thread's op: it takes the runtime's lock
        if RT.lock.acquire(timeout=5):
            RT.lock.release()
            other_ran.set()

    class _Blocking(_Copy):
        def synchronize(self) -> None:
            helper = threading.Thread(target=other_op)
            helper.start()
            helper.join(10)
            super().synchronize()

    original = RT.transfers.to_host

    def to_host(x, index, timing=None):  # a CPU offload found one copy out due, as a CUDA one past the bound does
        host = original(x, index, timing)
        RT.transfers.copies_due.setdefault(threading.get_ident(), []).append(_Blocking("a", waits))
        return host

    waits: list = []
    rt.reset_stats()
    monkeypatch.setattr(RT.transfers, "to_host", to_host)
    host = RT.offload(torch.ones(4), 0)
    assert waits == ["a"] and other_ran.is_set()
    assert rt.stats().copy_out_waits == 1 and not RT.transfers.copies_due

    class _Failed(_Copy):
        def synchronize(self) -> None:
            raise sacpass.OffloadError("sacpass: an offload copy failed on its copy stream")

    RT.transfers.copies_due[threading.get_ident()] = [_Failed("f", waits)]
    with pytest.raises(sacpass.OffloadError, match="copy failed"):  # the copy's error reaches the forward
        RT.transfers.wait_copies_out()
    assert rt.stats().copy_out_waits == 2 and not RT.transfers.copies_due
    del host


class _Checked(_Copy):
    """A copy that fails the test if it is waited for once finished."""

    def synchronize(self) -> None:
        assert not self.done, f"copy {self.name} waited for after it had finished"
        super().synchronize()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.booleans()), max_size=30), st.integers(1, 120))
def test_the_copies_out_stay_within_the_limit_waiting_for_the_oldest_and_no_more(offloads, limit):
    """Over any run of offloads (its bytes, whether its copy finishes before the next offload): after each
    wait the bytes still to copy and the new value's fit the limit, or nothing is left to wait for; the copies
    waited for are unfinished ones, oldest first, each once; and the wait stops as soon as the value fits (the
    last copy waited for, had it not been, would not have left room)."""
    waits: list = []
    out = CopiesOut()
    for i, (nbytes, finishes) in enumerate(offloads):
        sizes = {c.name: n for c, n in out.copies}
        before = len(waits)
        _make_room(out, nbytes, limit)
        assert out.nbytes == sum(n for _, n in out.copies)
        assert out.nbytes + nbytes <= limit or not out.copies
        if len(waits) > before:
            assert out.nbytes + sizes[waits[-1]] + nbytes > limit  # no more than it had to
        copy = _Checked(str(i), waits)
        out.add(copy, nbytes)
        copy.done = finishes
    assert [int(w) for w in waits] == sorted(int(w) for w in set(waits))  # oldest first, each once
