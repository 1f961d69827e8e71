"""Bad selectors (docs/bad_inputs.md, "Selectors"): names that do not read or name no op, ops that cannot be
selected, selectors that match in no graph of the compile, and what a selection that is not an error keeps. Each
test asserts the exact error class (or warning) and that the message names the fix."""
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import sacpass
from sacpass.testing import OpCounter
from tests.support.fuzz_ops import Program, compile_program
from tests.support.toy import ToyLayer, compile_and_train, compile_toy, train_counting, unwrap

TOPK = "sacpass_toy::topk_ids"


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
    """One compiled step of ``model`` (two checkpointed top-k layers by default), counting aten::topk."""
    model = model or Model()
    return train_counting(be, model, torch.randn(*shape), "aten::topk")

# ------------------------------------------------------------------------------------------ names and ops

def test_unknown_op_names_closest():
    with pytest.raises(sacpass.UnknownOpError) as info:
        sacpass.backend(save=["sacpass_toy::topk_idz"])
    msg = str(info.value)
    assert "sacpass_toy::topk_ids" in msg and "Import the module" in msg

def test_unknown_overload():
    with pytest.raises(sacpass.UnknownOpError, match="has no overload 'nope'"):
        sacpass.as_selector("aten::topk.nope")

def test_unknown_op_error_quotes_the_module_scope():
    with pytest.raises(sacpass.UnknownOpError, match=r"selector 'Indexer::aten::topkk' names op aten::topkk"):
        sacpass.backend(save=["Indexer::aten::topkk"])

def test_unreadable_selector():
    with pytest.raises(sacpass.SelectorError, match="cannot read"):
        sacpass.as_selector("topk")
    with pytest.raises(sacpass.SelectorError, match="not a selector"):
        sacpass.as_selector(3)

@pytest.mark.parametrize("spelled", ["layers.*.self_attn::topk", "Indexer.x::topk", "a b::topk"])
def test_selector_without_namespace_never_reaches_torch_ops(spelled):
    before = set(vars(torch.ops))
    with pytest.raises(sacpass.UnknownOpError) as info:
        sacpass.backend(save=[spelled])
    assert set(vars(torch.ops)) == before
    ns = spelled.split("::")[0]
    assert f"'{ns}::aten::topk'" in str(info.value)  # the spelling to use instead

def test_packet_matches_every_functional_overload():
    sel = sacpass.as_selector(torch.ops.aten.topk)
    assert torch.ops.aten.topk.default in sel.overloads()
    assert torch.ops.aten.topk.values not in sel.overloads()  # the out= variant mutates

def test_mutating_op_refused():
    with pytest.raises(sacpass.SelectorError, match="returns an input it mutates.*functional variant"):
        sacpass.as_selector(torch.ops.aten.add_.Tensor)

def test_packet_with_only_mutating_overloads():
    with pytest.raises(sacpass.SelectorError) as info:
        sacpass.as_selector(torch.ops.aten.add_)
    assert type(info.value) is sacpass.SelectorError
    assert "aten::add_" in str(info.value) and "select its functional variant" in str(info.value)

def test_op_without_tensor_output_is_refused_naming_the_fix():
    with pytest.raises(sacpass.SelectorError, match="returns no tensor"):
        sacpass.as_selector("aten::is_nonzero")
    with pytest.raises(sacpass.SelectorError) as info:
        sacpass.backend(save=["aten::is_nonzero"])
    assert type(info.value) is sacpass.SelectorError
    assert "returns no tensor" in str(info.value) and "Select the op that produces the tensor" in str(info.value)

def test_higher_order_operator_as_selector():
    with pytest.raises(sacpass.SelectorError) as info:
        sacpass.as_selector(torch.ops.higher_order.tag_activation_checkpoint)
    assert type(info.value) is sacpass.SelectorError and "select the op it wraps" in str(info.value)

def test_view_selected_refused():
    class V(torch.nn.Module):
        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(lambda t: (t.sin().view(-1) * 2).sum(), x, use_reentrant=False)

    _, model = compile_toy(V(), save=["aten::view"])
    with pytest.raises(Exception) as info:
        model(torch.randn(4, 4, requires_grad=True))
    err = unwrap(info)
    assert isinstance(err, sacpass.SelectorError) and "a view" in str(err) and "base" in str(err)

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

# ------------------------------------------------------------------------------------------ matching no graph

def test_unmatched_selector_strict_and_not():
    _, model = compile_toy(save=["aten::topk"])
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    err = unwrap(info)
    assert isinstance(err, sacpass.UnmatchedSelectorError) and "aten::topk" in str(err) and "strict=False" in str(err)

    torch._dynamo.reset()
    be, model = compile_toy(save=["aten::topk"], strict=False)
    with pytest.warns(sacpass.SacpassWarning, match="matched no forward node"):
        model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert be.reports[0].unmatched == ("aten::topk",)

def test_non_strict_warning_does_not_advise_strict_false():
    be = sacpass.backend(save=["aten::cumsum"], inner="aot_eager", strict=False)
    with pytest.warns(sacpass.SacpassWarning) as caught:
        compile_and_train(be, ToyLayer(), torch.randn(16, 32))
    msgs = [str(w.message) for w in caught if "matched no forward node" in str(w.message)]
    assert msgs and not any("strict=False" in m for m in msgs)

def test_packet_with_no_overload_in_graph():
    """An OpOverloadPacket is accepted (every functional overload); none of them in the graph is unmatched."""
    _, model = compile_program(Program(("nograd_ids", "sin"), ((0, 2),)), save=[torch.ops.aten.topk])
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 8, requires_grad=True)).sum().backward()
    err = unwrap(info)
    assert type(err) is sacpass.UnmatchedSelectorError
    assert "aten::topk" in str(err) and "strict=False" in str(err) and "module paths are relative" in str(err)

def test_module_selector_does_not_match_other_modules():
    be = sacpass.backend(save=["mlp::aten::topk"], inner="aot_eager", use_registered=False, save_discrete=False)
    model = torch.compile(ToyLayer(use_aten_topk=True), backend=be, fullgraph=True)
    with pytest.raises(sacpass.UnmatchedSelectorError, match="matched no forward node"):
        model(torch.randn(8, 32, requires_grad=True)).sum().backward()

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

class LoggingModel(nn.Module):
    """Graph-breaks outside its layers (a logging call before them)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(32, 32)
        self.layers = nn.ModuleList([ToyLayer(), ToyLayer()])

    def forward(self, x):
        x = self.embed(x)
        print("step")  # noqa: T201 - the graph break
        for layer in self.layers:
            x = layer(x)
        return x

def test_strict_selector_survives_a_graph_break_outside_the_layers(capsys):
    torch.manual_seed(0)
    be = sacpass.backend(save=[TOPK, "layers.*.indexer::aten::mm"], inner="aot_eager")
    model = torch.compile(LoggingModel(), backend=be)
    with OpCounter(TOPK) as calls:
        model(torch.randn(16, 32, requires_grad=True)).sum().backward()
    assert calls.backward == 0
    assert len(be.reports) >= 2  # the graph before the break holds no region: not an error there
    assert not be.unmatched()

# the quick run checks a module path that misses; an op in no graph at all is the same check (and
# test_unmatched_selector_strict_and_not's case)
@pytest.mark.parametrize("selector", [pytest.param("aten::cumsum", marks=pytest.mark.slow), "indexer::aten::mm",
                                      pytest.param("mlp::aten::topk", marks=pytest.mark.slow)])
def test_a_selector_matching_in_no_graph_of_the_compile_is_an_error(selector):
    """Checked when the first backward starts (every graph of the step has been compiled by then)."""
    torch.manual_seed(0)
    be = sacpass.backend(save=[TOPK, selector], inner="aot_eager")
    model = torch.compile(LoggingModel(), backend=be)
    out = model(torch.randn(16, 32, requires_grad=True))  # the forward compiles and runs
    with pytest.raises(sacpass.UnmatchedSelectorError, match=rf"{selector}.*matched no forward node in any graph"):
        out.sum().backward()
    assert be.unmatched() == [selector]

# ------------------------------------------------------------------------------------------ not an error

def test_explicit_save_of_a_selection_keeps_its_indices_narrowed():
    be = sacpass.backend(save=["aten::topk"], inner="aot_eager", save_discrete=False)
    calls = _step(be)
    assert calls.count("backward", "aten::topk") == 0
    kept = [(s.op, s.dtype) for r in be.reports for s in r.saved if s.op.startswith("aten::topk")]
    assert kept == [("aten::topk.default", "int32")] * 2, kept  # no float values, no int64 indices
