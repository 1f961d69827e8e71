"""``sacpass.ModelPlan()`` with no arguments, on the CPU: it counts the step's regions in a first step compiled
without the plan, compiles the plan at the second with its budgets from the host and its cost model measured on
the device, and trains as eager does throughout. Also the cost model's calibration (with injected timings), the measured op
times the planner reads, and the automatic prefetch depth."""
from __future__ import annotations

import pytest
import torch

import sacpass
import sacpass.offload as rt
from sacpass.calibration import BENCHMARKS, CalibrationStore, OpTimer, calibrate, op_signature
from sacpass.offload.runtime import process_runtime
from sacpass.plan import default_host_bytes
from sacpass.testing import OpCounter, no_compile_caches
from tests.support.helpers import assert_steps_match, eager_step
from tests.support.toy import TOY_TOPK_OPS, CompiledStack, stack_step

LAYERS = 4


def _x(rows=24, seed=1):
    return torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed))


def _close(a, b):
    return all(torch.allclose(u, v, atol=1e-5, rtol=1e-5) for u, v in zip(a, b))


@pytest.fixture(autouse=True)
def _clean():
    rt.release_host_memory()
    rt.reset_stats()
    process_runtime().plans.clear()
    yield
    rt.release_host_memory()


@pytest.fixture
def fixed_rates(monkeypatch):
    """The calibration as an injected cost model (this machine's timings would vary the decisions)."""
    calls = []

    def fake(device, op_seconds=None):
        calls.append((torch.device(device), dict(op_seconds or {})))
        return sacpass.CostModel(name="injected", op_seconds=tuple(sorted((op_seconds or {}).items())))
    monkeypatch.setattr("sacpass.calibration.calibrate", fake)
    return calls


def test_the_first_step_runs_the_policy_alone_and_counts_the_regions_then_the_plan_compiles(fixed_rates):
    ref = stack_step(CompiledStack("eager", LAYERS, 0), _x())
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=sacpass.ModelPlan(min_offload_bytes=0))
        model = CompiledStack(be, LAYERS, 0)
        with OpCounter(*TOY_TOPK_OPS) as first:
            grads = [stack_step(model, _x())]
        assert not be.plan.resolved and first.backward == 0  # compiled: the top-k kept, never run again
        (measuring,) = be.reports  # the policy alone: no planner, nothing offloaded or stashed
        assert not measuring.decisions and measuring.host_bytes == 0 and rt.stats().offloaded_bytes == 0
        for _ in range(3):
            rt.reset_stats()
            with OpCounter(*TOY_TOPK_OPS) as later:
                grads.append(stack_step(model, _x()))
            assert later.backward == 0
    assert all(_close(g, ref) for g in grads)
    plan = be.plan
    assert plan.resolved and plan.layers == LAYERS and plan.gpu_bytes == 0 and plan.peak_bytes is None  # the CPU
    assert plan.host_budget() == default_host_bytes() and plan.cost.name == "injected"
    (device, measured), = fixed_rates  # calibrated once, on the device the step ran on, with its op times
    assert device.type == "cpu" and any(sig.startswith("sacpass_toy::topk_ids|") for sig in measured)
    assert any(sig.startswith(("aten::mm|", "aten::addmm|")) for sig in measured), sorted(measured)
    assert len(be.reports) == 2 and be.reports[1].decisions  # then one planned graph for the four layers
    rows = rt.placements(plan)
    assert [r["region"] for r in rows] == list(range(LAYERS)) and all(r["host_bytes"] > 0 for r in rows)
    st = rt.stats()
    assert st.offloaded_bytes == st.reloaded_bytes > 0 and st.bundles_alive == 0 and st.host_bytes_alive == 0


def test_plan_auto_is_the_model_plan_with_no_arguments():
    assert sacpass.backend(plan="auto").plan == sacpass.ModelPlan()


def test_given_layers_compile_at_once_with_the_cost_measured_on_the_device(fixed_rates):
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=sacpass.ModelPlan(layers=LAYERS, min_offload_bytes=0))
        model = CompiledStack(be, LAYERS, 0)
        stack_step(model, _x())
        assert len(be.reports) == 1 and be.plan.cost.name == "injected" and be.plan.layers == LAYERS
    assert fixed_rates == [(torch.device("cpu"), {})]  # no first step to take op times from


@pytest.mark.slow  # the toy stack above covers the counting quickly
def test_the_glm_model_trains_as_eager_under_a_plan_with_no_arguments(fixed_rates):
    """Tiny GLM-5.2 (dense and MoE layers, a shared top-k layer, MTP): the plan counts every decoder layer
    and the MTP layer as regions, and the loss and gradients equal eager's in the counted step and after."""
    import copy

    from glm52_model import GLM52Config, GLM52ForCausalLM
    from glm52_model.compile import apply_compile

    torch.manual_seed(0)
    eager = GLM52ForCausalLM(GLM52Config.tiny(num_layers=3, mtp_layers=1))
    ids = torch.randint(0, eager.cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    reference = eager_step(eager, ids)
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=sacpass.ModelPlan(min_offload_bytes=0))
        model = apply_compile(copy.deepcopy(eager), backend=be, fullgraph=True)
        assert_steps_match(model, ids, reference)
    assert be.plan.layers == 4  # three decoder layers and the MTP layer
    assert [r["region"] for r in rt.placements(be.plan)] == [0, 1, 2, 3]
    (_, measured), = fixed_rates  # the counted step's backward ops timed too, as its forward's
    timed = {sig.split("|")[0] for sig in measured}
    assert {"glm52::sparse_mla", "glm52::sparse_mla_bwd", "glm52::grouped_mm_pair_bwd"} <= timed, sorted(timed)
    assert torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.slow
def test_a_graph_traced_with_dynamic_shapes_compiles_for_them_after_the_counted_step(fixed_rates):
    """compile(dynamic=True): the deferred graph compiles under Dynamo's tracing context, with its symbolic
    sizes, so one compile serves every batch size (no second compile) and gradients equal eager's."""
    eager = CompiledStack("eager", 2, 0)
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=sacpass.ModelPlan(min_offload_bytes=0))
        model = CompiledStack("eager", 2, 0)
        for layer in model.layers:
            layer.forward = torch.compile(type(layer).forward.__get__(layer), backend=be, fullgraph=True,
                                          dynamic=True)
        for rows in (24, 24, 25, 30):
            assert _close(stack_step(model, _x(rows)), stack_step(eager, _x(rows))), rows
    assert len(be.reports) == 2, [r.graph for r in be.reports]  # counted, then planned: once for every size
    unstash = [n for r in be.results for n in r.backward.graph.nodes if n.target is torch.ops.sacpass.unstash.default]
    assert unstash and any(isinstance(a, torch.fx.Node) for n in unstash for a in n.args[1])  # symbolic sizes


# ------------------------------------------------------------------------------------------- calibration
def test_calibration_rates_are_each_benchmark_s_work_over_its_measured_time(tmp_path):
    seconds = {"bf16_mm": 0.5, "fp32_mm": 2.0, "memory": 0.25, "h2d": 0.125, "d2h": 0.0625, "launch": 1e-5}
    asked = []

    def timer(name, fn):
        asked.append(name)
        return seconds[name]
    store = CalibrationStore(str(tmp_path))
    cost = calibrate("cpu", timer=timer, store=store)
    n = 256
    assert sorted(asked) == sorted(b for b in BENCHMARKS if b != "fp8_mm")  # the CPU has no FP8 multiply
    assert cost.bf16_flops == pytest.approx(2 * n ** 3 / 0.5) and cost.fp8_flops == cost.bf16_flops
    assert cost.fp32_flops == pytest.approx(2 * n ** 3 / 2.0)
    assert cost.memory_bytes_per_s == pytest.approx(2 * (32 << 20) / 0.25)
    assert cost.copy_bytes_per_s == pytest.approx((32 << 20) / 0.125)  # the slower way
    assert cost.launch_s == pytest.approx(1e-5) and cost.efficiency == 1.0

    def never(name, fn):
        raise AssertionError("measured again")
    again = calibrate("cpu", timer=never, store=store)  # a restart reads the rates back: the same plan key
    assert again == cost


def test_measured_op_times_already_stored_win_so_a_restart_keys_alike(tmp_path):
    store = CalibrationStore(str(tmp_path))
    timer = lambda name, fn: 0.01  # noqa: E731
    first = calibrate("cpu", timer=timer, store=store, op_seconds={"aten::mm|x": 1.0})
    second = calibrate("cpu", timer=timer, store=store, op_seconds={"aten::mm|x": 2.0, "aten::bmm|y": 3.0})
    assert first.measured("aten::mm|x") == 1.0
    assert second.measured("aten::mm|x") == 1.0 and second.measured("aten::bmm|y") == 3.0
    assert calibrate("cpu", timer=timer, store=None, op_seconds={"a": 4.0}).measured("a") == 4.0


def test_the_op_timer_times_heavy_ops_by_signature_and_the_planner_reads_them():
    from sacpass.passes.plan import node_seconds

    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with OpTimer() as timer:
        torch.mm(a, b)
        a.add(1.0)  # light: not timed
    times = timer.seconds()
    sig = op_signature(torch.ops.aten.mm.default, (a, b))
    assert list(times) == [sig] == ["aten::mm|float32[8, 16];float32[16, 4]"] and times[sig] > 0
    assert op_signature(torch.ops.aten.mm.out, (a, b), {"out": torch.empty(8, 4)}) == sig  # as compiled code calls it

    gm = torch.fx.symbolic_trace(lambda x, y: torch.mm(x, y))
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    x.meta["val"], y.meta["val"] = a, b
    mm = graph.call_function(torch.ops.aten.mm.default, (x, y))
    mm.meta["val"] = a @ b
    rates = sacpass.CostModel()
    assert node_seconds(mm, rates) == pytest.approx(rates.seconds(2 * 8 * 16 * 4, 4 * (128 + 64 + 32), torch.float32))
    assert node_seconds(mm, sacpass.CostModel(op_seconds=((sig, 0.125),))) == 0.125
    del gm


@torch.library.custom_op("sacpass_test::fails_in_backward", mutates_args=())
def _fails_in_backward(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_fails_in_backward.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("sacpass_test::failing_backward", mutates_args=())
def _failing_backward(g: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the backward failed")


@_failing_backward.register_fake
def _(g):
    return torch.empty_like(g)


_fails_in_backward.register_autograd(lambda ctx, g: torch.ops.sacpass_test.failing_backward(g))


def test_the_op_timer_times_a_compiled_backward_it_is_told_of_and_leaves_no_mode_behind():
    """The backward runs in autograd's thread under the modes of the backward() call: the timer times its heavy
    ops only where told of the compiled graph's outputs, and the thread's mode stack is as before, the backward
    finished or failed."""
    a = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, 4, requires_grad=True)
    from functorch.compile import aot_function, nop

    # AOTAutograd's compiled functions, as a counted graph runs them (Dynamo's frame, not under the timer)
    f = aot_function(lambda x, y: torch.mm(x, y).relu(), fw_compiler=nop, bw_compiler=nop)
    f(a, b)  # compiled (traced) at its first call: outside the timer
    grad_a = op_signature(torch.ops.aten.mm.default, (torch.empty(8, 4), torch.empty(4, 16)))
    grad_b = op_signature(torch.ops.aten.mm.default, (torch.empty(16, 8), torch.empty(8, 4)))
    for told in (False, True):
        timer = OpTimer()
        with timer:
            out = f(a, b)
        if told:
            assert timer.time_backward([out]) == 1  # the one compiled backward node
        out.sum().backward()
        assert torch._C._len_torch_dispatch_stack() == 0
        assert (grad_a in timer.seconds() and grad_b in timer.seconds()) == told, sorted(timer.seconds())

    g = aot_function(lambda x: torch.ops.sacpass_test.fails_in_backward(x @ x.t()), fw_compiler=nop, bw_compiler=nop)
    g(a)
    timer = OpTimer()
    with timer:
        out = g(a)
    assert timer.time_backward([out]) == 1
    with pytest.raises(RuntimeError, match="the backward failed"):
        out.sum().backward()
    assert torch._C._len_torch_dispatch_stack() == 0  # the engine restored the thread's modes
    before = len(timer.marks)
    torch.mm(a, b)
    assert len(timer.marks) == before  # nothing timed after


# -------------------------------------------------------------------------------------------- prefetch
def test_the_prefetch_limit_is_one_layer_ahead_by_default():
    from sacpass.host import process_host_budget
    from sacpass.offload.runtime import Runtime

    assert rt.prefetch_limit() == "auto"
    fresh = Runtime(process_host_budget())
    assert fresh.prefetch_limit(("cpu", -1)) == 4 << 30  # nothing offloaded yet: the default
    hosts = [fresh.offload(torch.randn(n), i) for i, n in enumerate((1000, 3000, 2000))]  # one bundle
    assert fresh.prefetch_limit(("cpu", -1)) == 4 * 6000 + 4 * 3000  # the largest bundle and the largest value
    fresh.prefetch_setting = 1 << 20
    assert fresh.prefetch_limit(("cpu", -1)) == 1 << 20
    for bad in (-1, 1.5, "all"):
        with pytest.raises(ValueError, match="'auto'"):
            rt.set_prefetch_limit(bad)
    del hosts


def test_the_runtime_s_readers_take_the_plan_as_given(fixed_rates):
    """placements(), format_placements() and device_budget() take the plan the user built, before the backend
    resolved it (a clear error) and after (its resolved state)."""
    plan = sacpass.ModelPlan(min_offload_bytes=0, hide=0.75)  # equal plans share their resolution: one of its own
    with pytest.raises(sacpass.OffloadError, match="has not been compiled yet.*run a training step first"):
        rt.placements(plan)
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=plan)
        model = CompiledStack(be, LAYERS, 0)
        for _ in range(3):
            stack_step(model, _x())
    assert rt.placements(plan) == rt.placements(be.plan) and len(rt.placements(plan)) == LAYERS
    assert rt.device_budget(plan) == rt.device_budget(be.plan) and "region" in rt.format_placements(plan)
