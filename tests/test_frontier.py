"""The memory-speed frontier on the CPU: the offload action, the memory budget and the planner.

On the CPU the offload copies host to host (there is no device to leave): graphs, numerics and reports are
what they are on a GPU. The runtime's lifecycle is tests/test_offload_runtime.py; the GPU behaviour (pinned memory, side
streams, prefetch) is tests/gpu/test_offload_cuda.py.
"""
from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

import sacpass
import sacpass.offload as offload_runtime
from sacpass.testing import OpCounter, assert_graphs_match, no_compile_caches
from tests.support.toy import ToyLayer, TwoRegions, assert_close_lists, grads_of, unwrap

TOPK = "sacpass_toy::topk_ids"


def _run(be, model, x):
    model = torch.compile(copy.deepcopy(model), backend=be, fullgraph=True)
    x = x.detach().clone().requires_grad_(True)
    with no_compile_caches(), OpCounter("aten::mm", "aten::addmm", TOPK, "sacpass::offload", "sacpass::reload") as calls:
        out = model(x)
        out.square().sum().backward()
    return out.detach(), grads_of(model, x), calls


def _reference(model, x):
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, ToyLayer):
            m.checkpointed = False
    x = x.detach().clone().requires_grad_(True)
    out = ref(x)
    out.square().sum().backward()
    return out.detach(), grads_of(ref, x)


@pytest.fixture
def toy():
    torch.manual_seed(0)
    return ToyLayer(), torch.randn(24, 32)


# -------------------------------------------------------------------------------------------- offload
def test_inductor_runs_every_offload_after_the_forward_s_work(toy):
    """An offload's async copy still reads its value when the op returns: were it scheduled before other forward
    work, Inductor could hand the value's buffer to a later kernel. Each offload reads the forward's other
    outputs (unread), so the generated forward issues them last; pinned on that code, and on eager's grads.
    (This CPU toy keeps its offloads last even without that argument; the model plan's stash, whose output
    weighs nothing, was moved, and its test in test_model_plan.py fails without the same guard.)"""
    from torch._inductor.utils import run_and_get_code

    layer, x = toy
    be = sacpass.backend(inner="inductor", offload=["aten::addmm", "aten::mm"])
    (out, grads, _), codes = run_and_get_code(lambda: _run(be, layer, x))
    forward = next(c for c in codes if "sacpass.offload.default(" in c)
    body = forward[forward.index("def call("):].splitlines()
    offloads = [i for i, line in enumerate(body) if "sacpass.offload.default(" in line]
    work = [i for i, line in enumerate(body) if "extern_kernels." in line or "cpp_fused" in line]
    assert len(offloads) >= 2 and work and min(offloads) > max(work), "\n".join(body)
    ref_out, ref_grads = _reference(layer, x)
    assert torch.allclose(out, ref_out, atol=1e-4, rtol=1e-4)
    assert_close_lists(grads, ref_grads, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_offload_matches_eager_and_is_never_recomputed(toy, inner):
    model, x = toy
    out_e, grads_e = _reference(model, x)
    be = sacpass.backend(inner=inner, offload=["aten::addmm"])
    out_c, grads_c, calls = _run(be, model, x)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert_close_lists(grads_c, grads_e, rtol=1e-4, atol=1e-5)
    (rep,) = be.reports
    host = [s for s in rep.saved if s.reason == "offload"]
    assert host and all(s.op == "aten::addmm.default" for s in host), rep.format()
    assert rep.host_bytes == sum(s.bytes for s in host) and rep.host_bytes > 0
    assert rep.activation_bytes + rep.input_bytes + rep.host_bytes == rep.total_bytes
    assert "aten::addmm.default" not in rep.recomputed  # never recomputed ...
    assert calls.count("forward", "sacpass::offload") == len(host)  # ... moved out in the forward
    assert calls.count("backward", "sacpass::reload") == len(host)  # ... and back for the backward
    fw, bw = be.results[0].forward, be.results[0].backward
    saved_out = list(fw.graph.find_nodes(op="output")[0].args[0])
    assert all(any(isinstance(o, torch.fx.Node) and o.name == f"{s.name}_offload" for o in saved_out)
               for s in host)  # the forward saves the host copy, not the value
    assert {n.name for n in bw.graph.nodes if n.op == "call_function"} >= {f"{s.name}_reload" for s in host}


def test_offload_topk_ids_keeps_them_out_of_the_backward(toy):
    model, x = toy
    be = sacpass.backend(inner="aot_eager", offload=[TOPK])
    _, _, calls = _run(be, model, x)
    assert calls.count("backward", TOPK) == 0
    (rep,) = be.reports
    assert [(s.op, s.dtype, s.reason) for s in rep.saved if s.reason != "graph input"] == [
        (TOPK + ".default", "int32", "offload")]


def test_offload_stats_count_bytes_both_ways(toy):
    model, x = toy
    offload_runtime.reset_stats()
    _run(sacpass.backend(inner="aot_eager", offload=["aten::addmm"]), model, x)
    st = offload_runtime.stats()
    assert st.offloaded_bytes > 0 and st.reloaded_bytes == st.offloaded_bytes and st.bundles == 1


def test_same_op_in_save_and_offload_is_refused():
    with pytest.raises(sacpass.PolicyConflictError, match="Remove it from one of save= / offload="):
        sacpass.backend(save=[TOPK], offload=[TOPK])
    with pytest.raises(sacpass.PolicyConflictError, match="offload= / recompute="):
        sacpass.backend(offload=["aten::mm"], recompute=["aten::mm"])


def test_offload_selector_must_match(toy):
    model, x = toy
    be = sacpass.backend(inner="aot_eager", offload=["aten::cumsum"])
    with pytest.raises(Exception) as info:
        _run(be, model, x)
    assert isinstance(unwrap(info), sacpass.UnmatchedSelectorError)


def test_offload_report_round_trips_and_the_page_draws_it(toy, tmp_path):
    from sacpass.cli import diff_dumps
    from sacpass.dump import read_report, read_view

    model, x = toy
    saved_dir, off_dir = tmp_path / "save", tmp_path / "offload"
    _run(sacpass.backend(inner="aot_eager", save=["aten::addmm"], dump_dir=saved_dir), model, x)
    torch._dynamo.reset()
    _run(sacpass.backend(inner="aot_eager", offload=["aten::addmm"], dump_dir=off_dir), model, x)
    rep = read_report(off_dir, "g0")
    assert rep.host_bytes > 0 and json.loads(rep.to_json())["host_bytes"] == rep.host_bytes
    view = read_view(off_dir, "g0")
    assert any(n["offload"] for n in view["forward"]) and any(n["reason"] == "offload" for n in view["forward"])
    page = (off_dir / "index.html").read_text()
    assert "badge offload" in page and "kept in host memory" in page
    lines = diff_dumps({"g0": read_report(saved_dir, "g0")}, {"g0": rep})
    assert any("no longer saved" in ln and "must-save" in ln for ln in lines)
    assert any("now saved for backward" in ln and "; offload)" in ln for ln in lines)


# ------------------------------------------------------------------------------------------ the budget
def _saved_set(rep):
    return sorted((s.op, s.dtype, s.shape) for s in rep.saved)


@pytest.mark.slow
def test_memory_budget_numerics_and_bytes():
    """PyTorch's budget solver over the released regions: 0 keeps the regions (recompute all but the
    must-saves), 1 partitions as without checkpointing, and the saved bytes grow with the budget."""
    torch.manual_seed(0)
    model, x = TwoRegions(), torch.randn(24, 32)
    out_e, grads_e = _reference(model, x)
    activations = {}
    for budget in (0.0, 0.5, 1.0):
        torch._dynamo.reset()
        be = sacpass.backend(inner="aot_eager", memory_budget=budget)
        out_c, grads_c, calls = _run(be, model, x)
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
        assert_close_lists(grads_c, grads_e, rtol=1e-4, atol=1e-5)
        assert calls.count("backward", TOPK) == 0  # the must-saves stay fixed under any budget
        (rep,) = be.reports
        activations[budget] = rep.activation_bytes
        assert (budget > 0) == any(s.reason == "budget" for s in rep.saved), rep.format()
    assert activations[0.0] <= activations[0.5] <= activations[1.0] and activations[0.0] < activations[1.0]
    torch._dynamo.reset()
    no_ac = copy.deepcopy(model)
    for layer in no_ac.modules():
        if isinstance(layer, ToyLayer):
            layer.checkpointed = False
    ref = sacpass.backend(inner="aot_eager")
    _run(ref, no_ac, x)
    torch._dynamo.reset()
    full = sacpass.backend(inner="aot_eager", memory_budget=1.0)
    _run(full, model, x)
    assert _saved_set(full.reports[0]) == _saved_set(ref.reports[0])


def _dropout_model(checkpointed: bool, region_budget: float | None = None):
    """amax -> gelu -> dropout -> tanh, in one checkpoint or none (under PyTorch's region budget annotation where
    given): the budget solvers may recompute the amaxes."""
    w = torch.nn.Linear(16, 16)

    def body(x):
        h = w(x)
        h = torch.nn.functional.gelu(h - h.amax(-1, keepdim=True))
        return torch.tanh(torch.nn.functional.dropout(h, 0.3, training=True))

    def model(x):
        annotate = region_budget is not None and torch.compiler.is_compiling()  # eager refuses the annotation
        with (torch.autograd.graph.region_activation_memory_budget(region_budget) if annotate
              else contextlib.nullcontext()):
            return torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False) if checkpointed else body(x)
    return model, w


_REGION_BUDGET = pytest.mark.skipif(not hasattr(torch.autograd.graph, "region_activation_memory_budget"),
                                    reason="this torch has no torch.autograd.graph.region_activation_memory_budget")


@pytest.mark.parametrize("where", ["sacpass", "pytorch", pytest.param("region", marks=_REGION_BUDGET)])
@pytest.mark.parametrize("checkpointed", [True, False], ids=["in_a_checkpoint", "outside"])
def test_a_memory_budget_never_draws_a_dropout_mask_again(where, checkpointed):
    """Under a budget PyTorch's knapsack may recompute what it likes: a dropout outside a checkpoint (or in a
    region the budget released) is kept, or replayed with its RNG state, never drawn again in the backward."""
    from torch._functorch import config as fc

    model, w = _dropout_model(checkpointed, 0.5 if where == "region" else None)
    x = torch.randn(32, 16)
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(1)
        w.zero_grad(set_to_none=True)
        be = sacpass.backend(inner="aot_eager", memory_budget=0.5 if where == "sacpass" else None)
        fn = torch.compile(model, backend=be, fullgraph=True) if compiled else model
        with fc.patch(activation_memory_budget=0.5 if where == "pytorch" else 1.0), no_compile_caches():
            fn(x).square().sum().backward()
        grads.append(w.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    (rep,) = be.reports
    random_ops = [t for t in rep.tagged if t["op"].startswith("aten::native_dropout")]
    if checkpointed and where != "sacpass":
        assert not random_ops  # the checkpoint replays it: PyTorch saves its RNG state
    elif checkpointed:
        assert not random_ops and any(s.op == "?" for s in rep.saved), rep.format()  # its RNG state, not released
    else:
        assert random_ops and {t["tag"] for t in random_ops} == {"MUST_SAVE"}, rep.format()
        assert any(s.op.startswith("aten::native_dropout") and s.dtype == "bool" for s in rep.saved), rep.format()

def test_memory_budget_zero_recomputes_everything_but_the_must_saves():
    torch.manual_seed(0)
    model, x = ToyLayer(), torch.randn(24, 32)
    plain = sacpass.backend(inner="aot_eager")
    _run(plain, model, x)
    torch._dynamo.reset()
    zero = sacpass.backend(inner="aot_eager", memory_budget=0)
    _run(zero, model, x)
    # inside a checkpoint that is what sacpass already does: the same saved set
    key = lambda r: sorted((s.op, s.dtype, s.shape, s.reason) for s in r.saved)  # noqa: E731
    assert key(zero.reports[0]) == key(plain.reports[0])


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "half", True])
def test_memory_budget_outside_0_1_is_refused(bad):
    with pytest.raises(sacpass.BackendOptionError, match=r"memory_budget=.* must be a number in \[0, 1\]"):
        sacpass.backend(memory_budget=bad)


def test_pytorch_budget_zero_names_sacpass_budget_as_the_fix(toy):
    from torch._functorch import config as fc

    model, x = toy
    with fc.patch(activation_memory_budget=0.0):
        with pytest.raises(Exception) as info:
            _run(sacpass.backend(inner="aot_eager", save=[TOPK]), model, x)
    err = unwrap(info)
    assert "sacpass.backend(memory_budget=0)" in str(err)


# ----------------------------------------------------------------------------------------- the planner
def test_planner_offloads_under_the_host_budget_and_explains_each_choice():
    torch.manual_seed(0)
    model, x = TwoRegions(), torch.randn(24, 32)
    out_e, grads_e = _reference(model, x)
    plan = sacpass.Plan(gpu_bytes=4096, host_bytes=8192, min_offload_bytes=1024)
    be = sacpass.backend(inner="aot_eager", plan=plan)
    out_c, grads_c, calls = _run(be, model, x)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert_close_lists(grads_c, grads_e, rtol=1e-4, atol=1e-5)
    (rep,) = be.reports
    acts = {d.action for d in rep.decisions}
    assert {"save", "offload", "recompute"} <= acts <= {"save", "offload", "recompute", "unneeded"}, rep.format(
        verbose=True)
    assert sum(d.bytes for d in rep.decisions if d.action == "save") <= 4096
    assert sum(d.bytes for d in rep.decisions if d.action == "offload") <= 8192
    assert all(d.action != "offload" or d.bytes >= 1024 for d in rep.decisions)
    assert all(d.recompute_ms > 0 and d.copy_ms > 0 and d.why for d in rep.decisions)
    assert rep.host_bytes == sum(d.bytes for d in rep.decisions if d.action == "offload")
    text = rep.format(verbose=True)
    assert "planned:" in text and "recompute " in text and "copy " in text
    # the budgets hold the most recompute time they can: nothing recomputed fits what either budget left (a value
    # planned that the partition then kept for another reason, "unneeded", took its budget's bytes too)
    saved = sum(d.bytes for d in rep.decisions if d.action == "save")
    unneeded = sum(d.bytes for d in rep.decisions if d.action == "unneeded")
    for d in rep.decisions:
        if d.action == "recompute":
            assert d.bytes > 4096 - saved - unneeded and d.bytes > 8192 - rep.host_bytes - unneeded, rep.format(
                verbose=True)


def test_each_recompute_names_the_budget_that_left_no_room_for_it():
    """A recomputed value says which budget would have kept it, and the report sums them: with no host budget,
    the host; with a copy window too small for any copy, the window; with min_offload_bytes above every value,
    that floor. The bounds' estimated times are the recomputed values' own."""
    from sacpass.report import COPY_BOUND, HOST_BOUND, SIZE_BOUND

    torch.manual_seed(0)
    model, x = TwoRegions(), torch.randn(24, 32)
    slow_copies = sacpass.CostModel(copy_bytes_per_s=1.0)
    for plan, bound in ((sacpass.Plan(host_bytes=0, min_offload_bytes=0), HOST_BOUND),
                        (sacpass.Plan(host_bytes=1 << 30, min_offload_bytes=0, cost=slow_copies), COPY_BOUND),
                        (sacpass.Plan(host_bytes=1 << 30, min_offload_bytes=1 << 30), SIZE_BOUND)):
        be = sacpass.backend(inner="aot_eager", plan=plan)
        _run(be, model, x)
        (rep,) = be.reports
        recomputed = [d for d in rep.decisions if d.action == "recompute"]
        assert recomputed and {d.bound for d in recomputed} == {bound}, rep.format(verbose=True)
        assert all(d.bound == "" for d in rep.decisions if d.action != "recompute")
        n, ms = rep.recompute_bounds()[bound]
        assert n == len(recomputed) and ms == pytest.approx(sum(d.recompute_ms for d in recomputed))
        assert f"recomputed for want of: {bound} ({n} values" in rep.format()
        assert sacpass.Report.from_json(rep.to_json()).recompute_bounds() == rep.recompute_bounds()


def test_plan_auto_and_bad_plans():
    assert sacpass.backend(plan="auto").config.plan == sacpass.ModelPlan()
    with pytest.raises(sacpass.BackendOptionError, match="plan='auto'"):
        sacpass.backend(plan="fast")
    with pytest.raises(sacpass.BackendOptionError, match="gpu_bytes must be an int >= 0"):
        sacpass.Plan(gpu_bytes=-1)
    with pytest.raises(sacpass.BackendOptionError, match="hide must be in"):
        sacpass.Plan(hide=0)
    assert sacpass.Plan(host_bytes=None, layers=4).host_budget() < sacpass.Plan(host_bytes=None).host_budget()


def test_plan_without_a_checkpoint_region_warns(toy):
    model, x = toy
    model.checkpointed = False
    with pytest.warns(sacpass.SacpassWarning, match="no checkpointed region"):
        _run(sacpass.backend(inner="aot_eager", plan=sacpass.Plan()), model, x)


def test_policy_enters_the_cache_key():
    a, b, c = (sacpass.backend(memory_budget=0.5), sacpass.backend(memory_budget=0.25),
               sacpass.backend(plan=sacpass.Plan(host_bytes=1 << 20)))
    d = sacpass.backend(offload=["aten::mm"])
    assert len({a.uuid, b.uuid, c.uuid, d.uuid, sacpass.backend().uuid}) == 5


# ------------------------------------------------------------------------------------------ goldens
@pytest.mark.golden
@pytest.mark.parametrize("case", ["offload", pytest.param("budget", marks=pytest.mark.slow),
                                  pytest.param("plan", marks=pytest.mark.slow)])
def test_frontier_goldens(case):
    torch.manual_seed(0)
    model, x = ToyLayer(), torch.randn(24, 32)
    kw = {"offload": {"offload": ["aten::addmm"]}, "budget": {"memory_budget": 0.5},
          "plan": {"plan": sacpass.Plan(gpu_bytes=4096, host_bytes=8192, min_offload_bytes=1024)}}[case]
    be = sacpass.backend(inner="aot_eager", use_registered=False, **kw)  # the same policy line in any process
    _run(be, model, x)
    assert_graphs_match(f"toy_{case}", be)
