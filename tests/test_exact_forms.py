"""Smaller exact forms: what a checkpointed region keeps or offloads is the narrowest value the backward needs,
never a lossy one. A planned value the backward reads only through cheap one-input ops (a float mask made by a
comparison, a cast) is kept as the narrowest value of that chain (the mask's bool); an offloaded selection's
int64 indices leave as int32. Each form: its dtype and bytes in the report, the candidate no longer kept, and
gradients equal to eager's (the forms are exact, so the tolerance is float rounding's)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sacpass
import sacpass.offload as rt
from sacpass.testing import OpCounter, no_compile_caches

S, D = 256, 64


class Masked(torch.nn.Module):
    """A region with a top-k (int64 indices the backward gathers with), a float mask made from a linear's output
    (the backward reads only the mask), and a cast of a linear's output (read only in fp16)."""

    def __init__(self, direct: bool = False, half: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.w, self.v, self.u = (torch.nn.Linear(D, D) for _ in range(3))
        self.direct = direct  # the backward also reads the linear's output itself: no smaller form
        self.half = half  # the fp16 cast (Inductor rounds a fused fp16 product once, eager at every op)

    def body(self, x):
        idx = (self.w(x) @ x.T).topk(8, dim=-1).indices                 # int64 [S, 8]
        pre = self.v(x)
        mask = (pre > 0).float()                                         # float [S, D], from a bool
        y = x[idx].sum(1) * mask
        if self.direct:
            y = y * pre
        if not self.half:
            return y + self.u(x)
        half = self.u(x).to(torch.float16)                              # read in fp16 only
        return y + (half * half).float()

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


def _run(model, be, x):
    x = x.clone().requires_grad_(True)
    compiled = torch.compile(model, backend=be, fullgraph=True) if be is not None else model
    with OpCounter("sacpass::offload") as calls:
        compiled(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    return grads, calls


def _x():
    return torch.randn(S, D, generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _clean():
    rt.release_host_memory()
    yield
    rt.release_host_memory()


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_planned_mask_is_offloaded_as_its_bool_and_a_cast_as_its_narrow_dtype(inner):
    half = inner == "aot_eager"  # Inductor's fused fp16 rounding differs from eager's whatever is saved
    model = Masked(half=half)
    ref, _ = _run(model, None, _x())
    with no_compile_caches():
        be = sacpass.backend(inner=inner, plan=sacpass.Plan(host_bytes=1 << 30, min_offload_bytes=0))
        grads, _ = _run(model, be, _x())
    report = be.reports[0]
    offloaded = {s.dtype: s.bytes for s in report.saved if s.reason == "offload"}
    assert offloaded == ({"bool": S * D, "float16": 2 * S * D} if half else {"bool": S * D}), report.format()
    forms = [d for d in report.decisions if d.form]
    assert len(forms) == (2 if half else 1) and all(d.action == "offload" for d in forms), report.decisions
    assert sorted(d.bytes for d in forms) == sorted(offloaded.values())   # not 4 * S * D, the linears' outputs
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-5 if half else 1e-4, atol=1e-5 if half else 1e-3)


def test_a_value_the_backward_also_reads_itself_keeps_its_own_form():
    model = Masked(direct=True)
    ref, _ = _run(model, None, _x())
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=sacpass.Plan(host_bytes=1 << 30, min_offload_bytes=0))
        grads, _ = _run(model, be, _x())
    offloaded = sorted(s.dtype for s in be.reports[0].saved if s.reason == "offload")
    assert "bool" not in offloaded and offloaded.count("float32") >= 1, be.reports[0].format()
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_an_offloaded_selection_leaves_as_int32_indices():
    model = Masked()
    ref, _ = _run(model, None, _x())
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", offload=["aten::topk"])
        rt.reset_stats()
        grads, calls = _run(model, be, _x())
    rows = [s for s in be.reports[0].saved if s.reason == "offload"]
    assert [(s.dtype, s.bytes) for s in rows] == [("int32", 4 * S * 8)], be.reports[0].format()
    assert calls.count("forward", "sacpass::offload") == 1 and rt.stats().offloaded_bytes == 4 * S * 8
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_a_model_plan_stashes_the_bool_form():
    model = Masked()
    ref, _ = _run(model, None, _x())
    plan = sacpass.ModelPlan(layers=1, gpu_bytes=0, host_bytes=1 << 30, min_offload_bytes=0, cost=sacpass.CostModel())
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=plan)
        for _ in range(2):
            grads, _ = _run(model, be, _x())
            for g, r in zip(grads, ref):
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert "bool" in {s.dtype for s in be.reports[0].saved if s.reason == "offload"}
