"""Policy and pass version enter the compile caches; a warm cache hit still yields the report, and a cache hit
is PyTorch's own signal."""
import pytest
import torch

import sacpass
from sacpass.testing import OpCounter
from tests.support.toy import TOY_TOPK_OPS, ToyLayer, compile_and_train

TOPK = "sacpass_toy::topk_ids"


def compile_and_step(model, x, save):
    torch._dynamo.reset()
    be = sacpass.backend(save=save, use_registered=False, save_discrete=False)  # inner="inductor": the caches under test
    out = torch.compile(model, backend=be, fullgraph=True)(x.clone().requires_grad_(True))
    with OpCounter(*TOY_TOPK_OPS) as topk:
        out.sum().backward()
    return be, topk.total


def must_saved(report):
    return [s.op for s in report.saved if s.reason == "must-save"]


@pytest.mark.slow
def test_policy_change_with_warm_caches(fresh_cache):
    from torch._dynamo.utils import counters
    model, x = ToyLayer(), torch.randn(16, 32)
    counters.clear()
    be1, bw1 = compile_and_step(model, x, [TOPK])
    assert bw1 == 0 and not be1.reports[0].from_cache and must_saved(be1.reports[0]) == [TOPK + ".default"]
    assert counters["aot_autograd"]["autograd_cache_saved"] == 1, dict(counters["aot_autograd"])

    be2, bw2 = compile_and_step(model, x, None)  # a different policy must not reuse the first artifact
    assert bw2 == 1 and must_saved(be2.reports[0]) == []
    assert be1.uuid != be2.uuid

    counters.clear()
    be3, bw3 = compile_and_step(model, x, [TOPK])  # warm: no partition runs, the report comes back
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
    assert bw3 == 0
    (rep,) = be3.reports
    assert rep.from_cache and must_saved(rep) == [TOPK + ".default"]
    assert rep.total_bytes == be1.reports[0].total_bytes


@pytest.mark.slow
def test_inference_compile_after_training_gains_no_report(fresh_cache):
    """A cache hit is PyTorch's signal (the AOTAutograd cache-hit counter), never "no report appeared"."""
    model, x = ToyLayer(), torch.randn(16, 32)
    be = sacpass.backend(save=[TOPK], save_discrete=False)
    compile_and_train(be, model, x)
    assert len(be.reports) == 1
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=be, fullgraph=True)(x)
    assert len(be.reports) == 1 and not any(r.from_cache for r in be.reports)
