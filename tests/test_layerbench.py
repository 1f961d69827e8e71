"""The layer benchmark's harness (benchmarks/layerbench): a step runs the variant's forward and backward and
returns the loss, and ``--experts`` maps to the config override."""
import torch

from layerbench import variants as lv  # benchmarks/ (pytest.ini's pythonpath)
from layerbench.measure import step


class _Records(torch.autograd.Function):
    """Identity; records that the forward and the backward ran."""
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        _Records.seen.append("forward")
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Records.seen.append("backward")
        return g


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))


def test_step_runs_the_forward_and_the_backward(monkeypatch):
    """One step of a registered variant: its function's forward, then the backward of the loss, which fills the
    private layer copy's gradients; the loss is mean(out^2)."""
    def build(layer, backend):
        def fn(x, positions, starts, ends):
            return _Records.apply(x * layer.w), None
        return lv.Built(fn, None, "test")

    monkeypatch.setitem(lv.VARIANTS, "_test_step", lv.VariantSpec("_test_step", build, "test"))
    v = lv.Variant("_test_step", _Tiny(), dynamic=False)
    _Records.seen.clear()
    x = torch.randn(3, 4)
    loss = step(v, x, None, None, None)
    assert _Records.seen == ["forward", "backward"]
    assert torch.equal(loss, x.square().mean())
    torch.testing.assert_close(v.layer.w.grad, (2 * x.square() / x.numel()).sum(0))


def test_experts_option_maps_to_the_config_override():
    import argparse
    p = argparse.ArgumentParser()
    lv.add_experts_option(p)
    assert lv.experts_overrides(p.parse_args([])) == {}
    assert lv.experts_overrides(p.parse_args(["--experts", "fp8"])) == {"fp8_experts": True}
    assert lv.experts_overrides(p.parse_args(["--experts", "bf16"])) == {"fp8_experts": False}
