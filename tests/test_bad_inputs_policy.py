"""Policies the partition cannot honour as written (docs/bad_inputs.md, "Conflicts, discrete decisions and the
audit"): one node selected to save and to recompute, a discrete decision sent back to the backward, a must-save
value the partitioner recomputes, a must-recompute value PyTorch saves anyway. Each test asserts the exact error
class (or warning) and that the message names the fix."""
import copy

import pytest
import torch

import sacpass
from sacpass.testing import OpCounter
from test_discrete import Router
from tests.support.fuzz_ops import Program, compile_program
from tests.support.toy import TOY_TOPK_OPS, compile_toy, train_counting, unwrap

TOPK = "sacpass_toy::topk_ids"


def _step(be, model, shape):
    return train_counting(be, model, torch.randn(*shape), "aten::topk")

# ------------------------------------------------------------------------------------------ conflicts

def test_conflicting_selectors():
    _, model = compile_toy(save=[TOPK], recompute=["indexer::sacpass_toy::topk_ids"])
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 32, requires_grad=True))
    err = unwrap(info)
    assert isinstance(err, sacpass.PolicyConflictError) and "both to save" in str(err)

def test_conflict_message_names_the_fix():
    # the same selector in two lists is refused when the backend is built
    with pytest.raises(sacpass.PolicyConflictError, match=r"aten::sin.*Remove it from one of save= / recompute="):
        compile_program(Program(("mm", "sin"), ((0, 2),)), save=["aten::sin"], recompute=["aten::sin"])
    # two different selectors that meet on one node, when the graph is compiled
    _, model = compile_program(Program(("mm", "sin"), ((0, 2),)), save=["aten::sin"], recompute=["aten::sin.default"])
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 8, requires_grad=True))
    err = unwrap(info)
    assert type(err) is sacpass.PolicyConflictError
    assert "aten::sin" in str(err) and "Remove it from one of save= / recompute=" in str(err)

# ------------------------------------------------------------------------------------------ discrete decisions

def test_save_discrete_false_advises_turning_it_back_on():
    be = sacpass.backend(inner="aot_eager", save_discrete=False)
    calls = _step(be, Router(), (24, 16))
    assert calls.count("backward", "aten::topk") == 1
    (msg,) = [w for w in be.reports[0].warnings if "recomputes discrete decision" in w]
    assert "pass save_discrete=True" in msg and "save=['aten::topk']" in msg
    assert "recompute= selector" not in msg

def test_recompute_selector_warning_names_that_selector():
    be = sacpass.backend(inner="aot_eager", recompute=["aten::topk"])
    with pytest.warns(sacpass.SacpassWarning) as caught:
        _step(be, copy.deepcopy(Router()), (24, 16))
    (msg,) = [str(w.message) for w in caught if "recomputes discrete decision" in str(w.message)]
    assert "drop its recompute= selector aten::topk" in msg and "save_discrete" not in msg

# ------------------------------------------------------------------------------------------ the audit

class OnlyBackwardUse(torch.autograd.Function):
    """A must-save op whose output only the backward reads: the partitioner cannot keep it in the forward."""

    @staticmethod
    def forward(ctx, x):
        ids = torch.ops.sacpass_toy.topk_ids(x.detach(), x.detach(), 2)
        ctx.save_for_backward(ids)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        return g * 2 + ids.float().mean()

class UsesOnlyInBackward(torch.nn.Module):
    def forward(self, x):
        return OnlyBackwardUse.apply(x).sum()

def test_must_save_read_only_by_backward_is_saved():
    be, model = compile_toy(UsesOnlyInBackward(), save=[TOPK])
    x = torch.randn(6, 8, requires_grad=True)
    out = model(x)
    with OpCounter(*TOY_TOPK_OPS) as topk:
        out.backward()
    assert topk.total == 0
    assert [s.reason for s in be.reports[0].saved] == ["must-save"]

@pytest.fixture
def partitioner_ignoring_tags(monkeypatch):
    """Simulate a PyTorch partitioner that drops MUST_SAVE (a regression the audit exists to catch)."""
    from torch.utils.checkpoint import CheckpointPolicy
    import torch._functorch.partitioners as part
    real = part.min_cut_rematerialization_partition

    def ignoring(gm, joint_inputs, **kw):
        for node in gm.graph.nodes:
            if node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE:
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        return real(gm, joint_inputs, **kw)
    monkeypatch.setattr(part, "min_cut_rematerialization_partition", ignoring)

def test_audit_raises_when_partitioner_recomputes_must_save(partitioner_ignoring_tags):
    _, model = compile_toy(save=[TOPK])
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 32, requires_grad=True))
    err = unwrap(info)
    assert isinstance(err, sacpass.MustSaveViolation)
    msg = str(err)
    assert "topk_ids" in msg and TOPK in msg and "module indexer" in msg and "toy.py:" in msg

def test_audit_warns_when_not_strict(partitioner_ignoring_tags):
    be, model = compile_toy(save=[TOPK], strict=False)
    x = torch.randn(8, 32, requires_grad=True)
    with pytest.warns(sacpass.SacpassWarning, match="is computed in the backward graph"):
        out = model(x)
    with OpCounter(*TOY_TOPK_OPS) as topk:
        out.sum().backward()
    assert topk.total == 1  # the violation is real: the top-k ran again
    assert be.reports[0].violations and "VIOLATIONS" in be.reports[0].format()

def test_must_recompute_saved_anyway_warns():
    """PyTorch saves a value one checkpoint region hands to the next, whatever its tag: say so."""
    be, model = compile_program(Program(("sin", "gelu"), ((0, 1), (1, 2))), recompute=["aten::sin"])
    with pytest.warns(sacpass.SacpassWarning, match=r"saved for backward anyway: sin \(aten::sin.default.*"
                      r"checkpoint region.*Move the checkpoint boundary"):
        model(torch.randn(8, 8, requires_grad=True)).sum().backward()
    assert "sin" in [s.name for s in be.reports[0].saved]
