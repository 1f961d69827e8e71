"""One plan for all layers (sacpass.ModelPlan) on a stack of separately compiled toy layers, on the CPU.

The layers share one compiled graph, so what differs per layer is decided at run time: the decisions pinned
here are where each region's values wait (device or host) under several budgets, what is recomputed at all
(the per-region share), the budgets a step cannot meet (an OffloadError naming the smallest that can), and
that gradients equal eager's whatever the placement. The GPU side (pinned copies, a 2-layer 16K model) is
tests/gpu/test_model_offload_cuda.py.
"""
from __future__ import annotations

import gc
import re
import time
import warnings

import pytest
import torch

import sacpass
import sacpass.offload as rt
from sacpass.offload import clocks, placement, plan_state
from sacpass.offload.placement import Budgets, place_step
from sacpass.offload.clocks import device_key
from sacpass.offload.runtime import process_runtime
from sacpass.testing import no_compile_caches
from tests.support.helpers import assert_steps_match, eager_step, stashed_values_checked
from tests.support.toy import CompiledStack, stack_step

RT = process_runtime()
LAYERS = 4
VALUES = 18816  # bytes a toy layer's planned values take (6 values: 5 of 3072 or 6144 bytes, one of 384)
INPUT = 24 * 32 * 4  # its activation input, placed too (a model plan's default)
REGION = VALUES + INPUT


def _x():
    return torch.randn(24, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _steps_timed_alike(monkeypatch):
    """A step's time on a shared CPU is noise: every larger device budget counts as paying (none is taken back),
    but in the tests of that rule (which script the clock)."""
    monkeypatch.setattr(placement, "PAYS", float("-inf"))


@pytest.fixture(autouse=True)
def _clean():
    rt.release_host_memory()
    RT.plans.clear()  # equal plans share their run-time state (the learned device budget) in a process
    rt.set_prefetch_limit("auto")  # and a peak cap's cut of the prefetch depth
    yield
    rt.release_host_memory()
    rt.set_prefetch_limit("auto")


def _run(plan, steps=3):
    """(grads of each step, stats of the last step, placements of the last step, the backend)."""
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=plan)
        model = CompiledStack(be, LAYERS, 0)
        out = []
        for _ in range(steps):
            rt.reset_stats()
            out.append(stack_step(model, _x()))
        return out, rt.stats(), rt.placements(plan), be


def _eager():
    return stack_step(CompiledStack("eager", LAYERS, 0), _x())


def _plan(gpu, host, **kw):
    kw.setdefault("cost", sacpass.CostModel())  # fixed rates: the decisions pinned here do not follow this machine's
    return sacpass.ModelPlan(layers=LAYERS, gpu_bytes=gpu, host_bytes=host, min_offload_bytes=0, **kw)


@pytest.mark.parametrize("gpu,host,device_by_region", [
    (0, 1 << 20, [0, 0, 0, 0]),                          # all to the host
    (REGION, 1 << 20, [0, 0, 0, REGION]),                # the last layer stays: its backward comes first
    (REGION + 384 * 3, 1 << 20, [384, 384, 384, REGION]),  # then what fits, from the end back
    pytest.param(2 * REGION, 1 << 20, [0, 0, REGION, REGION], marks=pytest.mark.slow),  # tests/test_placement.py
    pytest.param(4 * REGION + 4096, 0, [REGION] * 4, marks=pytest.mark.slow),  # no host: everything on the device
])
def test_placement_by_region_under_several_budgets(gpu, host, device_by_region):
    grads, st, rows, be = _run(_plan(gpu, host))
    assert [r["region"] for r in rows] == list(range(LAYERS))
    assert [r["device_bytes"] for r in rows] == device_by_region
    assert [r["host_bytes"] for r in rows] == [REGION - d for d in device_by_region]
    assert st.kept_bytes == sum(device_by_region)
    assert st.offloaded_bytes == st.reloaded_bytes == LAYERS * REGION - sum(device_by_region)
    assert st.bundles_alive == 0 and st.host_bytes_alive == 0, st.format()
    ref = _eager()
    for g in grads:  # the measuring step and the placed ones
        assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(g, ref))
    assert len(be.reports) == 1  # the layers share one graph: the placement differs, the graph does not


def test_the_backward_reads_each_planned_value_as_the_forward_made_it_bit_for_bit(monkeypatch):
    """What a plan keeps, on the device or through the host, is the forward's own value: the backward reads it
    bit for bit, as without checkpointing (a recompute may round otherwise). The same check fails for a value
    the runtime hands back changed."""
    with stashed_values_checked(monkeypatch) as checked:
        _, st, rows, _ = _run(_plan(REGION, 1 << 20), steps=2)
    assert st.kept_bytes > 0 and st.offloaded_bytes > 0, st.format()
    assert len(checked) == 2 * LAYERS * 7 and all(checked), checked
    unstash = RT.__class__.unstash
    monkeypatch.setattr(RT.__class__, "unstash", lambda self, *a, **k: unstash(self, *a, **k).add(0.0).nextafter(
        torch.tensor(float("inf"))))
    with stashed_values_checked(monkeypatch) as checked:
        _run(_plan(REGION, 1 << 20), steps=1)
    assert len(checked) == LAYERS * 7 and not any(checked), checked


@pytest.mark.parametrize("gpu", [REGION, 2 * REGION, 3 * REGION + 100])
def test_the_first_step_places_as_the_steps_after_it(gpu):
    """The first step has no sizes from a step before; it estimates the regions to come from those before
    them, so it keeps the last regions on the device as the later steps do, rather than sending the host
    (and so the pinned pool) more than they will ever use."""
    _, first, first_rows, _ = _run(_plan(gpu, 1 << 20), steps=1)
    _, later, rows, _ = _run(_plan(gpu, 1 << 20), steps=3)
    assert [r["device_bytes"] for r in first_rows] == [r["device_bytes"] for r in rows]
    assert first.offloaded_bytes == later.offloaded_bytes == LAYERS * REGION - (gpu // REGION) * REGION


def test_a_region_kept_on_the_device_prefetches_the_one_before():
    _, st, rows, _ = _run(_plan(REGION, 1 << 20))
    assert rows[-1]["host_bytes"] == 0
    assert st.waited_reloads == 0 and st.prefetched_bytes == st.reloaded_bytes > 0, st.format()
    assert [r["reloads_waited"] for r in rows] == [0] * LAYERS
    _, st, rows, _ = _run(_plan(0, 1 << 20))
    assert st.waited_reloads == 1  # all on the host: the step's first reload has nothing before it
    assert [r["reloads_waited"] for r in rows] == [0, 0, 0, 1]  # measured, per region
    rate = sacpass.CostModel().copy_bytes_per_s
    assert all(r["copy_ms_expected"] == pytest.approx(1e3 * r["host_bytes"] / rate) for r in rows)
    text = rt.format_placements(_plan(0, 1 << 20))
    assert "reloads waited (measured)" in text and text.splitlines()[-1].split()[-7] == "1"


def test_the_per_region_share_decides_what_is_recomputed():
    """Each region may keep (host_bytes + gpu_bytes) / layers; below a value's size it is recomputed in
    every layer (the graph is shared), and the step never needs more than the budgets."""
    share = 4 * (INPUT + 6144 + 3072 + 384 + 100)  # the input, the addmm, one mm / bmm and the small bmm
    grads, st, rows, be = _run(_plan(0, share))
    actions = {d.name: d.action for d in be.reports[0].decisions if d.op != "input"}
    assert sorted(a for a in actions.values()) == ["offload"] * 3 + ["recompute"] * 3, actions
    assert st.offloaded_bytes <= share
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(grads[-1], _eager()))


def test_a_step_past_the_budgets_raises_naming_the_smallest_that_hold_it():
    """Compiled for 2 layers, run with 4: the first step finds it has passed host + gpu bytes, the error
    names the fix before the host pool runs out."""
    plan = sacpass.ModelPlan(layers=2, gpu_bytes=0, host_bytes=2 * REGION, min_offload_bytes=0, cost=sacpass.CostModel())
    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=plan), LAYERS, 0)
        with pytest.raises(sacpass.OffloadError, match=r"more regions than layers=2 \(pass the real count\)"):
            stack_step(model, _x())
    assert rt.stats().host_bytes_alive == 0 and not RT.stashes.items


def test_a_placement_the_host_budget_cannot_hold_names_the_smallest_budgets():
    sizes = {(0, 0): 2048, (0, 1): 1024, (1, 0): 1024}
    with pytest.raises(sacpass.OffloadError, match=r"smallest budgets that hold the step are host_bytes=3072 with "
                                                   r"this gpu_bytes, or gpu_bytes=2048 with this host_bytes"):
        place_step(sizes, Budgets(2, 1024, 2048))
    assert place_step(sizes, Budgets(2, 1024, 3072)) == \
        {(1, 0): "device", (0, 1): "host", (0, 0): "host"}


def test_a_step_whose_regions_past_layers_pass_the_host_budget_says_no_device_budget_helps():
    with pytest.raises(sacpass.OffloadError, match=r"or no gpu_bytes with this host_bytes \(values of regions past "
                                                   r"layers=1 always go to the host\)"):
        place_step({(0, 0): 1024, (1, 0): 2048}, Budgets(1, 0, 1024))


def test_a_second_backward_through_a_value_kept_on_the_device_is_refused():
    from torch._functorch import config as functorch_config

    with no_compile_caches(), functorch_config.patch(donated_buffer=False):  # donated buffers refuse it anyway
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=_plan(4 * REGION + 4096, 0)), LAYERS, 0)
        stack_step(model, _x())
        x = _x().requires_grad_(True)
        loss = model(x).square().sum()
        loss.backward(retain_graph=True)
        with pytest.raises(sacpass.OffloadError, match=r"second backward.*retain_graph"):
            loss.backward()


def test_model_plan_checks_its_arguments():
    for bad in (0, -1, True, 2.0, "16"):
        with pytest.raises(sacpass.BackendOptionError, match=r"ModelPlan\(layers="):
            sacpass.ModelPlan(layers=bad)
    with pytest.raises(sacpass.BackendOptionError, match="gpu_bytes"):
        sacpass.ModelPlan(layers=2, gpu_bytes=-1)
    for field, bad in (("host_bytes", 1.5), ("host_bytes", True), ("host_bytes", float("nan")), ("hide", True),
                       ("hide", 0), ("min_offload_bytes", False), ("min_offload_bytes", -1)):
        # the checks it shares with Plan speak of ModelPlan, whose host_bytes is the whole step's
        with pytest.raises(sacpass.BackendOptionError, match=rf"^sacpass: ModelPlan\({field}="
                           + (r".*for the whole step" if field == "host_bytes" else "")):
            sacpass.ModelPlan(layers=2, **{field: bad})
    for field, bad in (("gpu_bytes", True), ("host_bytes", True), ("layers", True), ("hide", float("nan"))):
        with pytest.raises(sacpass.BackendOptionError, match=rf"^sacpass: Plan\({field}="):
            sacpass.Plan(**{field: bad})
    assert sacpass.backend(plan=sacpass.ModelPlan(layers=3)).config.plan == sacpass.ModelPlan(layers=3)
    fixed = dict(layers=3, gpu_bytes=0, cost=sacpass.CostModel())
    assert sacpass.ModelPlan(**{**fixed, "gpu_bytes": 1}).key != sacpass.ModelPlan(**fixed).key
    assert sacpass.ModelPlan(**fixed, inputs=False).key != sacpass.ModelPlan(**fixed).key
    with pytest.raises(sacpass.BackendOptionError, match="inputs"):
        sacpass.ModelPlan(layers=2, inputs=1)
    for bad in (0, -5, 1.5, True, "77G"):
        with pytest.raises(sacpass.BackendOptionError, match=r"ModelPlan\(peak_bytes=.*max_memory_allocated"):
            sacpass.ModelPlan(layers=2, peak_bytes=bad)
    assert sacpass.ModelPlan(**fixed, peak_bytes=1 << 30).key != sacpass.ModelPlan(**fixed).key


def test_inductor_runs_every_stash_after_the_forward_s_work_and_grads_match():
    """A stash's output is a tiny handle, so Inductor's scheduler would move it up to its value's producer and
    could then reuse that memory, which the runtime keeps or is still copying; the stash reads the forward's
    other outputs to stay last. Pinned on Inductor's generated forward, and by gradients equal to eager's."""
    from torch._inductor.utils import run_and_get_code

    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="inductor", plan=_plan(REGION, 1 << 20)), LAYERS, 0)
        grads, codes = run_and_get_code(lambda: [stack_step(model, _x()) for _ in range(3)])
    forward = next(c for c in codes if "sacpass.stash.default(" in c)
    body = forward[forward.index("def call("):].splitlines()
    stashes = [i for i, line in enumerate(body) if "sacpass.stash.default(" in line]
    work = [i for i, line in enumerate(body) if "extern_kernels." in line or "cpp_fused" in line]
    assert len(stashes) == 7 and work and min(stashes) > max(work), "\n".join(body)
    ref = _eager()
    for g in grads:
        assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(g, ref))


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_dynamic_shape_compile_places_its_values_and_matches_eager(inner):
    """A batch of another size recompiles the layers for a dynamic batch: the unstash ops' sizes and strides
    are symbolic, and the backward rebuilds them from its own inputs (their names, not a symbol's text); each
    region is placed as under the static compile and the gradients equal eager's at every size."""
    plan = _plan(REGION, 1 << 20)
    with no_compile_caches():
        be = sacpass.backend(inner=inner, plan=plan)
        model = CompiledStack(be, LAYERS, 0)
        eager = CompiledStack("eager", LAYERS, 0)
        for rows in (24, 25, 26, 24):
            x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
            grads, ref = stack_step(model, x), stack_step(eager, x)
            assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(grads, ref)), rows
    dynamic = [r for r in be.results if any(isinstance(n.meta.get("val"), torch.SymInt)
                                            for n in r.backward.graph.find_nodes(op="placeholder"))]
    assert dynamic, "no dynamic-shape compile"
    unstash = [n for r in dynamic for n in r.backward.graph.nodes if n.target is torch.ops.sacpass.unstash.default]
    assert unstash and any(isinstance(a, torch.fx.Node) for n in unstash for a in n.args[1]), unstash
    rows = rt.placements(plan)  # the dynamic graph saves more: the last region keeps the most, within the budget
    assert rows[3]["device_bytes"] > max(r["device_bytes"] for r in rows[:3]), rows
    assert all(r["host_bytes"] > 0 for r in rows) and sum(r["device_bytes"] for r in rows) <= REGION, rows
    assert rt.stats().bundles_alive == 0 and rt.stats().host_bytes_alive == 0


def test_a_symbolic_size_the_backward_cannot_rebuild_goes_to_the_host_and_says_so():
    """The backward's only input that carries the batch symbol is the placed value itself (its handle has no
    shape): the pass cannot give unstash that size, so the value goes through sacpass::offload (to the host at
    every layer) with a warning naming it and the fix. A symbol another input carries is read from it."""
    import operator

    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from sacpass.passes.offload import _SymSizes, offload_pass
    from sacpass.passes.plan import PlanResult

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(6, ConstantSource("rows")), hint=6)
    with FakeTensorMode(shape_env=env):
        x = torch.empty(s, 8)
        z, scalar = x.sin(), x.sin().sum()

    def graph(inputs, body):
        g = torch.fx.Graph()
        phs = {}
        for name, val in inputs:
            phs[name] = g.placeholder(name)
            phs[name].meta["val"] = val
        out = body(g, phs)
        g.output(out)
        return torch.fx.GraphModule(torch.nn.Module(), g), phs

    def fw_body(g, ph):
        sin = g.call_function(torch.ops.aten.sin.default, (ph["x"],), name="sin")
        sin.meta["val"] = z
        total = g.call_function(torch.ops.aten.sum.default, (sin,))
        total.meta["val"] = scalar
        return (total, sin)

    def bw_body(g, ph):
        cos = g.call_function(torch.ops.aten.cos.default, (ph["sin"],))
        cos.meta["val"] = z
        grad = g.call_function(torch.ops.aten.mul.Tensor, (cos, ph["tangents_1"]))
        grad.meta["val"] = z
        return (grad,)

    forward, _ = graph([("x", x)], fw_body)
    backward, bw_ph = graph([("sin", z), ("tangents_1", scalar)], bw_body)
    with pytest.warns(sacpass.SacpassWarning, match=r"sin has size 0 \(s\d+\).*sacpass::offload.*mark_static"):
        done = offload_pass(forward, backward, PlanResult(offload_marks={"sin": "plan"}, model_plan="layers=1",
                                                          cost=sacpass.CostModel()), 1)
    assert done == {"sin": "plan"}
    targets = [n.target for n in forward.graph.nodes] + [n.target for n in backward.graph.nodes]
    assert torch.ops.sacpass.offload.default in targets and torch.ops.sacpass.reload.default in targets
    assert torch.ops.sacpass.stash.default not in targets and torch.ops.sacpass.unstash.default not in targets

    # a SymInt input carries the symbol: sizes and strides (8 * rows for an [8, rows, 8] value) read from it
    backward, ph = graph([("n", s), ("sin", z)], lambda g, ph: (ph["sin"],))
    sym = _SymSizes(backward, [ph["n"]])
    with FakeTensorMode(shape_env=env):
        cube = torch.empty(8, s, 8)
    assert sym.missing(cube.shape, cube.stride()) is None
    first = backward.graph.find_nodes(op="output")[0]
    sizes, strides = sym.ints(cube.shape, first), sym.ints(cube.stride(), first)
    assert sizes == [8, ph["n"], 8] and strides[1:] == [8, 1]
    assert strides[0].target is operator.mul and strides[0].meta["val"] == 8 * s
    assert re.fullmatch(r"stride 0 \(8\*s\d+\)", _SymSizes(backward, []).missing([8, 8, 8], cube.stride()))
    # else a tensor input of that size (a tangent): read once at the graph's start, aten.sym_size.int
    backward, ph = graph([("sin", z), ("tangents_1", z)], lambda g, ph: (ph["sin"],))
    sym = _SymSizes(backward, [ph["tangents_1"]])
    (rows, eight) = sym.ints(z.shape, backward.graph.find_nodes(op="output")[0])
    assert rows.target is torch.ops.aten.sym_size.int and rows.args == (ph["tangents_1"], 0) and eight == 8
    assert rows.prev is ph["tangents_1"] and rows.meta["val"] == z.shape[0]
    backward.graph.lint()


def _forward_keeping_input_refs(model, x):
    """Run the forward; returns (output, weak references to each layer's input)."""
    import weakref

    refs = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: refs.append(weakref.ref(args[0])))
             for layer in model.layers]
    try:
        out = model(x)
    finally:
        for h in hooks:
            h.remove()
    return out, refs


@pytest.mark.parametrize("gpu,host,inputs,alive", [
    (0, 1 << 20, True, [False, False, False]),             # every input sent to the host: freed after the forward
    (REGION, 1 << 20, True, [False, False, True]),          # the last layer's stays: its backward comes first
    (0, 1 << 20, False, [True, True, True]),                # inputs=False: kept on the device, as without a plan
])
def test_activation_inputs_are_placed_like_the_planned_values(gpu, host, inputs, alive):
    """A decoder layer's input is what activation checkpointing keeps for every layer; a model plan places it
    (freed on the device once copied to the host) unless inputs=False. The parameters never move."""
    plan = _plan(gpu, host, inputs=inputs)
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=plan)
        model = CompiledStack(be, LAYERS, 0)
        stack_step(model, _x())                                   # the measuring step
        model.zero_grad(set_to_none=True)
        x = _x().requires_grad_(True)
        out, refs = _forward_keeping_input_refs(model, x)
        assert [r() is not None for r in refs[1:]] == alive  # layers 1-3: the inputs only the graphs keep
        out.square().sum().backward()
    report = be.reports[0]
    rows = {s.name: s for s in report.saved}
    placed = [s for s in report.saved if s.op == "input" and s.reason == "offload"]
    assert [s.shape for s in placed] == ([("24", "32")] if inputs else [])
    assert [s.reason for s in report.saved if s.op == "input" and s.shape == ("24", "32")] == ["offload" if inputs else "graph input"]
    params = {tuple(map(str, p.shape)) for p in model.layers[0].parameters()}
    weights = [s for s in rows.values() if s.op == "input" and s.shape != ("24", "32")]
    assert weights and all(s.reason == "graph input" and s.shape in params for s in weights)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5)
               for a, b in zip([p.grad for p in model.parameters() if p.grad is not None] + [x.grad], _eager()))


def test_a_kept_input_written_in_place_before_the_backward_is_refused():
    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=_plan(4 * REGION + 4096, 0)), LAYERS, 0)
        stack_step(model, _x())
        x = _x().requires_grad_(True)
        h = x * 1.0
        loss = model(h).square().sum()
        with torch.no_grad():
            h.add_(1.0)
        with pytest.raises(sacpass.OffloadError, match=r"modified in place after the forward"):
            loss.backward()


def test_activation_inputs_need_aot_autograd_s_static_inputs():
    """Without the list of static inputs (parameters, buffers) nothing tells a weight from an activation:
    no input is placed."""
    from sacpass.passes.plan import activation_inputs

    gm = torch.fx.symbolic_trace(lambda w, x: (x @ w).sum())
    for n in gm.graph.find_nodes(op="placeholder"):
        n.meta["val"] = torch.empty(4, 4)
    assert activation_inputs(gm, None) == []
    assert activation_inputs(gm, [0]) == ["x"]
    assert activation_inputs(gm, [0], min_bytes=65) == []


@pytest.mark.slow  # the toy stack's inputs are the quick case
def test_glm_layers_place_their_hidden_states_and_the_shared_top_k_ids_and_match_eager():
    """The GLM-5.2 tiny model: every decoder layer's hidden states, and the top-k IDs a shared-top-k layer
    receives from the layer before, are placed per layer (the last layer's on the device, the rest on the
    host); the loss and gradients equal eager's in the measuring step and in the placed ones."""
    import copy

    from glm52_model import GLM52Config, GLM52ForCausalLM
    from glm52_model.compile import apply_compile

    torch.manual_seed(0)
    eager = GLM52ForCausalLM(GLM52Config.tiny(num_layers=4, mtp_layers=0))
    cfg = eager.cfg
    assert not cfg.is_full_topk_layer(2) and cfg.is_full_topk_layer(1)  # layer 2 reads layer 1's IDs
    plan = sacpass.ModelPlan(layers=4, gpu_bytes=1 << 20, host_bytes=1 << 24, min_offload_bytes=0,
                             cost=sacpass.CostModel())
    ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    reference = eager_step(eager, ids)
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=plan)
        model = apply_compile(copy.deepcopy(eager), backend=be, fullgraph=True)
        # measuring, placed, placed (placements() reads the last complete step)
        assert_steps_match(model, ids, reference, before_step=rt.reset_stats)
    rows = rt.placements(plan)
    assert [r["region"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["host_bytes"] == 0 < rows[3]["device_bytes"] and all(r["host_bytes"] > 0 for r in rows[:3]), rows
    inputs = [(s.dtype, s.reason) for r in be.reports for s in r.saved if s.op == "input" and s.reason == "offload"]
    assert ("int32", "offload") in inputs and ("float32", "offload") in inputs, inputs
    assert rt.stats().bundles_alive == 0 and rt.stats().host_bytes_alive == 0


BASE = 1 << 30  # the device memory the rest of the step takes (weights, gradients, the backward's own buffers)


def _peak_of(plan, per_kept_byte):
    """A device peak like PyTorch's max_memory_allocated (the highest yet): BASE plus ``per_kept_byte`` times
    the bytes the finished step kept on the device."""
    seen = [0]

    def peak(device):
        pl = RT.plans[plan.key]
        kept = sum(n for where, n in pl.placed.values() if where == "device")
        seen[0] = max(seen[0], BASE + per_kept_byte * kept)
        return seen[0]
    return peak


def test_a_peak_cap_raises_the_device_budget_to_what_the_measured_peak_leaves(monkeypatch):
    """peak_bytes: the first step keeps gpu_bytes (none), peaks at BASE; the budget rises by the cap's room
    (two regions), the next steps keep the last two regions and peak at the cap, and the budget holds there."""
    plan = _plan(0, 1 << 20, peak_bytes=BASE + 2 * REGION)
    monkeypatch.setattr(plan_state, "device_peak", _peak_of(plan, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sacpass.SacpassWarning)
        grads, st, rows, _ = _run(plan, steps=4)
    assert [r["device_bytes"] for r in rows] == [0, 0, REGION, REGION]
    assert st.kept_bytes == 2 * REGION and st.offloaded_bytes == 2 * REGION
    budget = rt.device_budget(plan)
    assert {k: budget[k] for k in ("gpu_bytes", "device_budget", "peak_bytes", "peak_read", "held_at")} == {
        "gpu_bytes": 0, "device_budget": 2 * REGION, "peak_bytes": BASE + 2 * REGION, "peak_read": BASE + 2 * REGION,
        "held_at": None}
    assert sorted(budget["step_ms"]) == [0, 2 * REGION]  # the budget in hand measured before it rose
    last = rt.format_placements(plan).splitlines()[-1]
    assert last.startswith(f"device budget {2 * REGION / 2**30:.3f} GiB for the next step (from gpu_bytes 0.000; "
                           f"peak {(BASE + 2 * REGION) / 2**30:.3f} GiB read"), last
    ref = _eager()
    for g in grads:
        assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(g, ref))


def _peaks_by_stretch(monkeypatch, plan, stretches):
    """The device's running peak as the runtime reads it (as each backward begins and as the step's backward
    ends; reset between steps, as bench_model does): the highest so far of ``stretches(kept)``, each stretch's peak
    (before the first backward, then each region's backward, the last region's first) from the bytes the step
    keeps on the device by region. Returns every value read."""
    seen = []

    def peak(device):
        pl = RT.plans[plan.key]
        kept = dict.fromkeys(range(LAYERS), 0)
        for (r, _), (where, n) in pl.placed.items():
            kept[r] += n if where == "device" else 0
        tl = pl.timeline
        at = len(tl.peak_at_backward) if len(tl.backward_began) > len(tl.peak_at_backward) else LAYERS
        seen.append(max(stretches(kept)[:at + 1]))
        return seen[-1]
    monkeypatch.setattr(plan_state, "device_peak", peak)
    return seen


def test_values_gone_before_the_peak_are_kept_by_the_room_under_what_came_before_it(monkeypatch):
    """The step peaks at the cap in the first region's backward (the last to run), where the other regions'
    values are gone: the cap's room at the peak is none, but the device reached only BASE before that backward
    (read as each backward began), so the last two regions, whose backward ended before it, keep their values on
    the device (2 regions of room under the cap there) and the peak stays at the cap."""
    cap = BASE + 2 * REGION
    plan = _plan(0, 1 << 20, peak_bytes=cap)
    # BASE and what the step keeps until the last backward, region 0's, which reaches the cap
    seen = _peaks_by_stretch(monkeypatch, plan, lambda kept: [BASE + sum(kept.values())] * LAYERS + [cap + kept[0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", sacpass.SacpassWarning)
        _, st, rows, _ = _run(plan, steps=5)
    assert [r["device_bytes"] for r in rows] == [0, 0, REGION, REGION], rows
    budget = rt.device_budget(plan)
    assert max(seen) == cap and budget["device_budget"] == 2 * REGION
    assert list(budget["peak_at_backward"]) == [3, 2, 1, 0], budget  # read as each backward began, in their order


def test_each_region_keeps_by_the_room_of_the_stretches_its_values_live_through(monkeypatch):
    """The forward and the loss reach BASE, region 3's backward BASE + one region, the others the cap: region 3's
    values, gone after its backward, fit under the first two stretches and stay on the device; region 2's would
    live through region 3's backward too, which has no room left for them, so they still go to the host."""
    cap = BASE + 2 * REGION
    plan = _plan(0, 1 << 20, peak_bytes=cap)
    seen = _peaks_by_stretch(monkeypatch, plan, lambda kept: [
        BASE + sum(kept.values()), BASE + REGION + kept[2] + kept[1] + kept[0], cap + kept[1] + kept[0],
        cap + kept[0], cap])
    with warnings.catch_warnings():
        warnings.simplefilter("error", sacpass.SacpassWarning)
        _, st, rows, _ = _run(plan, steps=5)
    assert [r["device_bytes"] for r in rows] == [0, 0, 0, REGION], rows
    assert max(seen) == cap and rt.device_budget(plan)["device_budget"] == REGION


def test_the_readout_gives_the_device_s_peak_as_each_backward_began(monkeypatch):
    cap = BASE + 2 * REGION
    plan = _plan(0, 1 << 20, peak_bytes=cap)

    def peak(device):
        tl = RT.plans[plan.key].timeline
        return BASE + len(tl.peak_at_backward) * REGION if len(tl.backward_began) > len(tl.peak_at_backward) else cap
    monkeypatch.setattr(plan_state, "device_peak", peak)
    _run(plan, steps=2)  # the second step is placed from the first's peak
    budget = rt.device_budget(plan)
    assert budget["peak_at_backward"] == {3: BASE, 2: BASE + REGION, 1: BASE + 2 * REGION, 0: BASE + 3 * REGION}
    line = f"the device's peak as each region's backward began (GiB): 3 {BASE / 2**30:.3f}, 2 {(BASE + REGION) / 2**30:.3f}"
    assert line in rt.format_placements(plan), rt.format_placements(plan)


def test_a_peak_cap_grows_the_budget_no_further_than_every_value():
    plan = _plan(0, 1 << 20, peak_bytes=BASE + 100 * REGION)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_state, "device_peak", _peak_of(plan, 1))
        _, st, rows, _ = _run(plan, steps=4)
    assert [r["device_bytes"] for r in rows] == [REGION] * LAYERS and st.offloaded_bytes == 0
    assert rt.device_budget(plan)["device_budget"] == LAYERS * REGION


def test_a_step_past_the_peak_cap_lowers_the_budget_and_warns_at_gpu_bytes(monkeypatch):
    """Kept values that cost twice their bytes at the peak: the third step (the first at a raised budget, once
    gpu_bytes was measured) passes the cap, the budget goes back by the excess (to gpu_bytes), and the peak, the
    highest yet, moving no more, it stays there (the prefetch depth untouched: the budget gave the excess back).
    A step past the cap with the budget already at gpu_bytes and a prefetch limit set by hand warns, naming the
    fix."""
    plan = _plan(0, 1 << 20, peak_bytes=BASE + 2 * REGION)
    monkeypatch.setattr(plan_state, "device_peak", _peak_of(plan, 2))
    _, _, rows, _ = _run(plan, steps=5)
    assert [r["device_bytes"] for r in rows] == [0] * LAYERS
    assert rt.device_budget(plan)["device_budget"] == 0 and rt.device_budget(plan)["prefetch_cut"] is None
    plan = _plan(REGION, 1 << 20, peak_bytes=BASE)
    monkeypatch.setattr(plan_state, "device_peak", lambda device: BASE + 10 * REGION)
    rt.set_prefetch_limit(4 * REGION)
    with pytest.warns(sacpass.SacpassWarning, match=r"peak_bytes=.*peaked at .* gpu_bytes=\d+, the least it keeps"):
        _, _, rows, _ = _run(plan, steps=3)
    assert [r["device_bytes"] for r in rows] == [0, 0, 0, REGION]
    assert rt.prefetch_limit("cpu") == 4 * REGION and rt.device_budget(plan)["prefetch_cut"] is None


def test_a_step_past_the_peak_cap_at_gpu_bytes_prefetches_less_down_to_one_value(monkeypatch):
    """Nothing kept to give back: each step that peaks past the cap (a fresh peak: reset between steps, as
    bench_model does) lowers the automatic prefetch limit by its excess, down to one value ahead; only then does
    the plan warn. The reloads still bring every value back: the gradients are eager's."""
    plan = _plan(0, 1 << 20, peak_bytes=BASE)
    excess, steps = iter([VALUES // 2, VALUES // 2 + 1, 1 << 40, (1 << 40) + 1, (1 << 40) + 2]), []

    def peak(device):  # one peak a step, whenever it is read
        timeline = RT.plans[plan.key].timeline
        if not steps or steps[-1][0] is not timeline:
            steps.append((timeline, BASE + next(excess)))
        return steps[-1][1]
    monkeypatch.setattr(plan_state, "device_peak", peak)
    grads, _, rows, _ = _run(plan, steps=3)  # the first two steps' peaks read as the next steps begin
    assert [r["device_bytes"] for r in rows] == [0] * LAYERS
    device = RT.device(device_key(torch.device("cpu")))  # its largest bundle and value: the most in this process yet
    whole = device.largest_bundle + device.largest_value
    assert rt.device_budget(plan)["prefetch_cut"] == whole - VALUES - 1 == rt.prefetch_limit("cpu") > device.largest_value
    assert "prefetch limit lowered to" in rt.format_placements(plan)
    grads += _run(plan, steps=1)[0]
    assert rt.device_budget(plan)["prefetch_cut"] == device.largest_value == rt.prefetch_limit("cpu")
    with pytest.warns(sacpass.SacpassWarning, match=r"prefetch limit at one value ahead or set by hand"):
        grads += _run(plan, steps=1)[0]
    ref = _eager()
    for g in grads:
        assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(g, ref))
    rt.set_prefetch_limit("auto")
    assert rt.prefetch_limit("cpu") == whole and rt.device_budget(plan)["prefetch_cut"] is None


def test_the_peak_warning_as_an_error_stops_the_forward_with_the_next_step_placed(monkeypatch):
    """The warning that the step peaked past the cap at gpu_bytes comes from the first stash of the next step;
    made an error, it stops that forward only after the step was placed (the budget lowered, the table made);
    the aborted forward (one value stashed, no backward) is no step to place from, so the next step is placed
    as if it had not run."""
    plan = _plan(REGION, 1 << 20, peak_bytes=BASE)
    monkeypatch.setattr(plan_state, "device_peak", lambda device: BASE + 10 * REGION)
    rt.set_prefetch_limit(4 * REGION)  # by hand: the peak cap cannot lower it
    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=plan), LAYERS, 0)
        stack_step(model, _x())
        with warnings.catch_warnings():
            warnings.simplefilter("error", sacpass.SacpassWarning)
            with pytest.raises(sacpass.SacpassWarning, match="the least it keeps"):
                stack_step(model, _x())
        gc.collect()  # the traceback's frames held the aborted forward's handles (a new step starts once they go)
        assert rt.device_budget(plan)["peak_read"] == BASE + 10 * REGION
        grads = stack_step(model, _x())
    rows = rt.placements(plan)
    assert [r["region"] for r in rows] == list(range(LAYERS))
    assert [r["device_bytes"] for r in rows] == [0, 0, 0, REGION], rows
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(grads, _eager()))


def test_a_forward_whose_backward_never_ran_does_not_place_the_next_step():
    """An evaluation under grad on a batch twice the size between two training steps: its values would not fit
    the device budget, but no backward ran, so the next step is placed from the training step before it."""
    plan = _plan(REGION, 1 << 20)
    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=plan), LAYERS, 0)
        stack_step(model, torch.randn(25, 32))  # the second size compiles one graph for every batch size (dynamic)
        for _ in range(3):  # compiled, then placed from a step of that graph
            stack_step(model, _x())
        placed = [(r["device_bytes"], r["host_bytes"]) for r in rt.placements(plan)]
        model(torch.cat([_x(), _x()])).sum()  # its graph goes at once; its values with it
        grads = stack_step(model, _x())
    rows = rt.placements(plan)
    assert [(r["device_bytes"], r["host_bytes"]) for r in rows] == placed, rows
    assert placed[3][1] == 0 and all(host > 0 for _, host in placed[:3]), placed
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(grads, _eager()))
    assert rt.stats().bundles_alive == 0 and rt.stats().host_bytes_alive == 0


def test_a_peak_cap_without_a_device_peak_keeps_gpu_bytes():
    """On the CPU there is no allocator peak to read: the plan keeps gpu_bytes and says it read none."""
    plan = _plan(REGION, 1 << 20, peak_bytes=BASE)
    _, _, rows, _ = _run(plan)
    assert [r["device_bytes"] for r in rows] == [0, 0, 0, REGION]
    budget = rt.device_budget(plan)
    assert {k: budget[k] for k in ("gpu_bytes", "device_budget", "peak_bytes", "peak_read", "held_at")} == {
        "gpu_bytes": REGION, "device_budget": REGION, "peak_bytes": BASE, "peak_read": None, "held_at": None}
    with pytest.raises(sacpass.OffloadError, match="not registered"):
        rt.device_budget(_plan(3 * REGION, 1 << 20, peak_bytes=BASE))


def test_the_peak_is_read_as_each_backward_ends_so_a_reset_between_steps_does_not_hide_it(monkeypatch):
    """A training loop that resets the peak statistics between steps: read at the next step's start, the peak
    would be the reset's (BASE) and the budget would grow past the cap; read as the backward ends, it is the
    step's own."""
    plan = _plan(0, 1 << 20, peak_bytes=BASE + 2 * REGION)
    highest = [BASE]
    monkeypatch.setattr(plan_state, "device_peak", lambda device: highest[0])
    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=plan), LAYERS, 0)
        for _ in range(4):
            rt.reset_stats()
            model.zero_grad(set_to_none=True)
            loss = model(_x().requires_grad_(True)).square().sum()
            highest[0] = max(highest[0], BASE + rt.stats().kept_bytes)  # what the forward kept raised the peak
            loss.backward()
            highest[0] = BASE  # torch.cuda.reset_peak_memory_stats(): the peak is what is allocated now
    assert [r["device_bytes"] for r in rt.placements(plan)] == [0, 0, REGION, REGION]
    assert rt.device_budget(plan)["device_budget"] == 2 * REGION


def _scripted_steps(monkeypatch, plan, region_ms_by_kept):
    """Clock marks that make each step's regions take ``region_ms_by_kept(bytes the step keeps on the device)``
    milliseconds each, forward and backward: a step's measured time follows its placement."""
    now = [0.0]

    def clock(device):
        pl = RT.plans[plan.key]
        kept = sum(n for where, n in pl.placed.values() if where == "device")
        now[0] += region_ms_by_kept(kept) / 1e3
        return now[0]
    monkeypatch.setattr(clocks, "clock", clock)


def test_a_larger_device_budget_that_measures_slower_is_given_back_and_held(monkeypatch):
    """The peak leaves room for two regions on the device, but steps that keep them measure slower (scripted: 10
    ms a region at no bytes kept, 12 ms with any kept): after two steps at the larger budget (one could be
    noise) the plan goes back to gpu_bytes and holds there, though the peak would let it rise again; the readouts
    say so."""
    monkeypatch.setattr(placement, "PAYS", 0.01)
    plan = _plan(0, 1 << 20, peak_bytes=BASE + 2 * REGION)
    monkeypatch.setattr(plan_state, "device_peak", _peak_of(plan, 0))  # the peak never nears the cap
    _scripted_steps(monkeypatch, plan, lambda kept: 12.0 if kept else 10.0)
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=plan)
        model = CompiledStack(be, LAYERS, 0)
        kept = []
        for _ in range(6):
            rt.reset_stats()
            stack_step(model, _x())
            kept.append(rt.stats().kept_bytes)
    # step 1 placed as values came, 2 measured at gpu_bytes, 3 raised by the cap's room, 4 confirms it slower,
    # 5-6 held back
    assert kept == [0, 0, 2 * REGION, 2 * REGION, 0, 0], kept
    budget = rt.device_budget(plan)
    assert budget["held_at"] == 0 == budget["device_budget"], budget
    assert set(budget["step_ms"]) == {0, 2 * REGION} and budget["step_ms"][2 * REGION] > budget["step_ms"][0]
    last = rt.format_placements(plan).splitlines()[-1]
    assert last.startswith("held at 0.000 GiB: a larger device budget measured no faster (by 1%") and "(2 steps)" in last, last
    assert budget["step_samples"][2 * REGION] == 2 and budget["doubt"] is None


def test_one_slow_step_at_a_larger_budget_is_measured_again_before_it_is_given_back(monkeypatch):
    """The first step that keeps regions on the device is slow (scripted: 12 ms a region, once; a pool growing, a
    neighbour on the host), every later one fast (8 ms): the plan runs the budget again instead of holding at
    gpu_bytes for good, and keeps it."""
    monkeypatch.setattr(placement, "PAYS", 0.01)
    plan = _plan(0, 1 << 20, peak_bytes=BASE + 2 * REGION)
    monkeypatch.setattr(plan_state, "device_peak", _peak_of(plan, 0))
    slow_marks = [2 * LAYERS]  # the clock marks of one step (a forward and a backward mark a region)

    def ms(kept):
        if kept and slow_marks[0] > 0:
            slow_marks[0] -= 1
            return 12.0
        return 8.0 if kept else 10.0
    _scripted_steps(monkeypatch, plan, ms)
    _, st, _, _ = _run(plan, steps=6)
    budget = rt.device_budget(plan)
    assert budget["held_at"] is None and st.kept_bytes > 0, budget
    assert RT.plans[plan.key].step_samples[2 * REGION] >= 2


def test_a_loop_that_runs_ahead_of_its_device_is_timed_a_step_late(monkeypatch):
    """A training loop ahead of its GPU: a step's timing events are still running when the next step begins, so
    each step is read one step later. The budget still rises once gpu_bytes is timed (a step later than with the
    events done), and a larger budget that measured slower is still given back and held."""
    from sacpass.offload.timeline import Timeline

    monkeypatch.setattr(placement, "PAYS", 0.01)
    regions_ms = Timeline.regions_ms

    def read_late(self):  # the first read of each step finds its work running
        if not getattr(self, "read_once", False):
            self.read_once = True
            return None
        return regions_ms(self)
    monkeypatch.setattr(Timeline, "regions_ms", read_late)
    plan = _plan(0, 1 << 20, peak_bytes=BASE + 2 * REGION)
    monkeypatch.setattr(plan_state, "device_peak", _peak_of(plan, 0))
    _scripted_steps(monkeypatch, plan, lambda kept: 12.0 if kept else 10.0)
    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=plan), LAYERS, 0)
        kept = []
        for _ in range(7):
            rt.reset_stats()
            stack_step(model, _x())
            kept.append(rt.stats().kept_bytes)
    # 1 placed as values came; 2 at gpu_bytes, read at the start of 4; 4 raised, read at the start of 6; 5 read
    # at the start of 7, the second slower step: held
    assert kept == [0, 0, 0, 2 * REGION, 2 * REGION, 2 * REGION, 0], kept
    assert rt.device_budget(plan)["held_at"] == 0


def test_a_larger_device_budget_that_buys_no_time_is_given_back_and_held(monkeypatch):
    """Steps that keep regions on the device measure as fast as those that copy them (scripted: 10 ms a region
    either way; the copies hid behind compute): the memory buys nothing, so after two steps at the larger budget
    the plan goes back to gpu_bytes and holds there, its peak and reserve no higher than they need be."""
    monkeypatch.setattr(placement, "PAYS", 0.01)
    plan = _plan(0, 1 << 20, peak_bytes=BASE + 2 * REGION)
    monkeypatch.setattr(plan_state, "device_peak", _peak_of(plan, 0))
    _scripted_steps(monkeypatch, plan, lambda kept: 10.0)
    _, st, rows, _ = _run(plan, steps=6)
    budget = rt.device_budget(plan)
    assert budget["held_at"] == 0 == budget["device_budget"] and st.kept_bytes == 0, budget
    assert budget["step_samples"][2 * REGION] == 2


def test_a_larger_device_budget_that_measures_faster_is_kept(monkeypatch):
    monkeypatch.setattr(placement, "PAYS", 0.01)
    plan = _plan(0, 1 << 20, peak_bytes=BASE + 2 * REGION)
    monkeypatch.setattr(plan_state, "device_peak", _peak_of(plan, 0))
    _scripted_steps(monkeypatch, plan, lambda kept: 8.0 if kept else 10.0)
    _, st, rows, _ = _run(plan, steps=5)  # each raise measured faster: it goes on rising, to every value
    assert st.kept_bytes == LAYERS * REGION and rt.device_budget(plan)["held_at"] is None


def test_each_region_s_copies_are_measured_beside_the_expected_time():
    """placements(): per region, the copies' own time each way (the host clock for CPU tensors, CUDA timing
    events on a GPU) beside the cost model's expectation; one timed copy per value sent each way, none for a
    region kept on the device."""
    plan = _plan(REGION, 1 << 20)
    _, _, rows, _ = _run(plan)
    host_rows, kept = rows[:-1], rows[-1]
    assert all(r["d2h_ms_measured"] > 0 and r["h2d_ms_measured"] > 0 and r["copy_ms_expected"] > 0 for r in host_rows)
    assert kept["d2h_ms_measured"] == kept["h2d_ms_measured"] == 0.0 and kept["host_bytes"] == 0
    timed = RT.plans[plan.key].last_timeline.copies
    assert sorted(timed) == [r["region"] for r in host_rows]
    assert all(len(timed[r["region"]]["d2h"]) == len(timed[r["region"]]["h2d"]) == r["values"] for r in host_rows)
    assert "measured D2H / H2D" in rt.format_placements(plan).splitlines()[0]


def test_each_region_s_forward_and_backward_are_timed_beside_what_the_cost_model_expects(monkeypatch):
    """forward_ms_measured: from the region before's first stash (its forward's work done) to the region's own,
    none for the first region; backward_ms_measured: from the region's first unstash to region p-1's (whose
    backward is next), region 0's to the backward's end. Clock marks of a step at 0, 5, 12, 21 ms (the
    forwards of regions 0-3) then 100, 110, 130, 160, 200 (the backwards of regions 3, 2, 1, 0, the end) give
    forwards -, 5, 7, 9 and backwards 40, 30, 20, 10 to regions 0-3. The expected times are the cost model's
    over the compiled forward's and backward's ops (the stash ops aside), the same for every region of the
    shared graph. With the host clock, each time is > 0 and the backwards take no longer than the step's."""
    from sacpass.passes.plan import node_seconds

    marks = iter(k + d for k in range(0, 100, 10)
                 for d in (0.0, 0.005, 0.012, 0.021, 0.100, 0.110, 0.130, 0.160, 0.200))
    monkeypatch.setattr(clocks, "clock", lambda device: next(marks))
    plan = _plan(0, 1 << 20)
    _, _, rows, be = _run(plan)
    assert rows[0]["forward_ms_measured"] is None
    assert [r["forward_ms_measured"] for r in rows[1:]] == pytest.approx([5.0, 7.0, 9.0])
    assert [r["backward_ms_measured"] for r in rows] == pytest.approx([40.0, 30.0, 20.0, 10.0])
    (result,) = be.results
    for way, gm in (("forward", result.forward), ("backward", result.backward)):
        want = 1e3 * sum(node_seconds(n, plan.cost) for n in gm.graph.nodes
                         if n.op == "call_function" and "sacpass." not in str(n.target))
        assert want > 0 and all(r[f"{way}_ms_expected"] == pytest.approx(want) for r in rows), way
    last = rt.format_placements(plan).splitlines()[1].split()
    assert last[-1] == "40.00" and last[-4] == "-"  # region 0: backward measured, no forward measured
    monkeypatch.undo()
    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=plan), LAYERS, 0)
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss = model(_x().requires_grad_(True)).square().sum()
            t0 = time.perf_counter()
            loss.backward()
            took = 1e3 * (time.perf_counter() - t0)
    timeline = RT.plans[plan.key].timeline  # the step just run
    timed, forwards = timeline.backward_ms(), timeline.forward_ms()
    assert sorted(timed) == sorted(forwards) == list(range(LAYERS)) and all(ms > 0 for ms in timed.values())
    assert sum(timed.values()) <= took and forwards[0] is None and all(forwards[p] > 0 for p in range(1, LAYERS))


def test_copy_time_sums_seconds_and_finished_events_and_waits_for_running_ones():
    class Event:
        def __init__(self, done, ms=0.0):
            self.done, self.ms = done, ms

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return end.ms

    assert clocks.copy_ms([0.001, 0.0025]) == pytest.approx(3.5)
    assert clocks.copy_ms([0.001, (Event(True), Event(True, 4.0))]) == pytest.approx(5.0)
    assert clocks.copy_ms([(Event(True), Event(False))]) is None
    assert clocks.copy_ms([]) == 0.0
    assert clocks.elapsed_ms(1.0, 1.25) == pytest.approx(250.0)  # a region's backward: two clock marks
    assert clocks.elapsed_ms(Event(True), Event(True, 7.0)) == 7.0
    assert clocks.elapsed_ms(Event(True), Event(False)) is None and clocks.elapsed_ms(1.0, None) is None


def test_the_placed_inputs_share_the_copy_window():
    """A region's activation inputs go to the host in the same window as its planned values (hide x its
    estimated forward at the copy rate), so they come out of that window: over copy rates from one where nothing
    fits to one where everything does, a plan that places its inputs offloads no more of its values than one that
    keeps them on the device, and where the window is tight, less."""
    def offloaded(rate, inputs):
        cost = sacpass.CostModel(copy_bytes_per_s=rate)
        torch._dynamo.reset()  # a compile per plan
        with no_compile_caches():
            be = sacpass.backend(inner="aot_eager", plan=_plan(0, 1 << 30, cost=cost, inputs=inputs))
            stack_step(CompiledStack(be, LAYERS, 0), _x())
        return sum(d.bytes for d in be.reports[0].decisions if d.op != "input" and d.action == "offload")

    rates = [2.0 ** k for k in range(4, 34, 3)]
    pairs = [(offloaded(r, True), offloaded(r, False)) for r in rates]
    assert pairs[0] == (0, 0) and pairs[-1][0] == pairs[-1][1] > 0, pairs  # nothing fits / everything does
    assert all(placed <= kept for placed, kept in pairs), pairs
    assert any(placed < kept for placed, kept in pairs), pairs
