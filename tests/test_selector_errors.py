"""Selector mistakes: what an unmatched selector is told, ops that never reach a joint graph, what an explicit
save of a selection keeps, and the advice for a discrete decision the backward recomputes."""
import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import sacpass
from sacpass.testing import OpCounter
from test_discrete import Router
from toy import unwrap


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        picked = torch.sin(self.lin(x)).topk(3, dim=-1)
        return picked.values.sum(-1, keepdim=True) * x + picked.indices.float().mean()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


def _step(be, model=None, shape=(4, 8)):
    model = model or Model()
    out = torch.compile(model, backend=be, fullgraph=True)(torch.randn(*shape, requires_grad=True))
    with OpCounter("aten::topk") as calls:
        out.sum().backward()
    return calls


def test_unmatched_selector_lists_what_is_present_nearest_first():
    be = sacpass.backend(save=["Layr::aten::sinh"], inner="aot_eager")
    with pytest.raises(sacpass.UnmatchedSelectorError) as info:
        _step(be)
    msg = str(info.value)
    ops = msg.split("Ops present, nearest first: ", 1)[1].split(".", 1)[0].split(", ")
    modules = msg.split("Module paths present, nearest first: ", 1)[1].split(". ", 1)[0].split(", ")
    assert ops[0] == "aten::sin" and "aten::topk" in ops, ops
    assert modules[:2] == ["layers.0 (Layer)", "layers.1 (Layer)"] and "layers.0.lin (Linear)" in modules, modules
    assert "strict=False" in msg


def test_decomposed_ops_are_spelled_as_the_op_they_become():
    assert str(sacpass.as_selector("aten::argsort")) == "aten::sort"
    assert str(sacpass.as_selector("layers.*::aten::argsort")) == "layers.*::aten::sort"
    assert str(sacpass.as_selector(torch.ops.aten.argsort)) == "aten::sort"
    assert str(sacpass.as_selector("aten::softmax")) == "aten::_softmax"
    assert str(sacpass.as_selector("aten::layer_norm")) == "aten::native_layer_norm"


def test_decomposing_op_without_a_single_replacement_is_refused():
    with pytest.raises(sacpass.SelectorError) as info:
        sacpass.backend(save=["aten::linear"])
    assert type(info.value) is sacpass.SelectorError
    assert "decomposes" in str(info.value) and "Select aten::addmm or aten::mm instead" in str(info.value)
    with pytest.raises(sacpass.SelectorError, match="CompositeImplicitAutograd"):
        sacpass.as_selector(torch.ops.aten.matmul)


def test_argsort_selector_matches_the_sort_in_the_graph():
    class Sorter(nn.Module):
        def forward(self, x):
            return checkpoint(lambda t: t.gather(-1, t.sin().argsort(-1)).cos(), x, use_reentrant=False)

    be = sacpass.backend(save=["aten::argsort"], inner="aot_eager", save_discrete=False)
    _step(be, Sorter())
    assert [t["op"] for t in be.reports[0].tagged if t["selector"] == "aten::sort"], be.reports[0].tagged


def test_explicit_save_of_a_selection_keeps_its_indices_narrowed():
    be = sacpass.backend(save=["aten::topk"], inner="aot_eager", save_discrete=False)
    calls = _step(be)
    assert calls.count("backward", "aten::topk") == 0
    kept = [(s.op, s.dtype) for r in be.reports for s in r.saved if s.op.startswith("aten::topk")]
    assert kept == [("aten::topk.default", "int32")] * 2, kept  # no float values, no int64 indices


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
