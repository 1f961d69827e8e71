"""The layer benchmark's harness (benchmarks/layerbench): kernel settings a variant pins hold for its whole
step, backward included, and ``--experts`` maps to the config override."""
import torch

from layerbench import variants as lv  # benchmarks/ (pytest.ini's pythonpath)
from layerbench.measure import step

KERNEL_CHOICE = "default"            # patched by the variant below; read by the backward


class _ReadsChoice(torch.autograd.Function):
    """Identity; records KERNEL_CHOICE as the forward and the backward each see it."""
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        _ReadsChoice.seen.append(("forward", KERNEL_CHOICE))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _ReadsChoice.seen.append(("backward", KERNEL_CHOICE))
        return g


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))


def test_kernel_settings_hold_in_the_backward_too(monkeypatch):
    """A kernel constant the CUDA kernels read per call must be patched while the backward runs, which is
    after the variant's function has returned."""
    def build(layer, backend):
        def fn(x, positions, starts, ends):
            return _ReadsChoice.apply(x * layer.w), None
        return lv._with_kernel_settings(lv.Built(fn, None, "test"), [(__name__, "KERNEL_CHOICE", "previous")])

    monkeypatch.setitem(lv.VARIANTS, "_test_settings", lv.VariantSpec("_test_settings", build, "test"))
    v = lv.Variant("_test_settings", _Tiny(), dynamic=False)
    _ReadsChoice.seen.clear()
    step(v, torch.randn(3, 4), None, None, None)
    assert _ReadsChoice.seen == [("forward", "previous"), ("backward", "previous")]
    assert KERNEL_CHOICE == "default", "the setting must not outlive the step"
    assert v.layer.w.grad is not None


def test_experts_option_maps_to_the_config_override():
    import argparse
    p = argparse.ArgumentParser()
    lv.add_experts_option(p)
    assert lv.experts_overrides(p.parse_args([])) == {}
    assert lv.experts_overrides(p.parse_args(["--experts", "fp8"])) == {"fp8_experts": True}
    assert lv.experts_overrides(p.parse_args(["--experts", "bf16"])) == {"fp8_experts": False}
