"""Every refused input gets a sacpass error (or warning) that names the thing and the fix."""
import warnings

import pytest
import torch
import torch.nn as nn

import sacpass
from sacpass._version import check_torch_version
from sacpass.testing import OpCounter
from toy import TOY_TOPK_OPS, ToyLayer, compile_and_train, unwrap

TOPK = "sacpass_toy::topk_ids"


def compile_toy(model=None, **kw):
    kw.setdefault("inner", "aot_eager")
    kw.setdefault("use_registered", False)
    be = sacpass.backend(**kw)
    return be, torch.compile(model or ToyLayer(), backend=be, fullgraph=True)


def test_unknown_op_names_closest():
    with pytest.raises(sacpass.UnknownOpError) as info:
        sacpass.backend(save=["sacpass_toy::topk_idz"])
    msg = str(info.value)
    assert "sacpass_toy::topk_ids" in msg and "Import the module" in msg


def test_unknown_overload():
    with pytest.raises(sacpass.UnknownOpError, match="has no overload 'nope'"):
        sacpass.as_selector("aten::topk.nope")


def test_unreadable_selector():
    with pytest.raises(sacpass.SelectorError, match="cannot read"):
        sacpass.as_selector("topk")
    with pytest.raises(sacpass.SelectorError, match="not a selector"):
        sacpass.as_selector(3)


def test_mutating_op_refused():
    with pytest.raises(sacpass.SelectorError, match="returns an input it mutates.*functional variant"):
        sacpass.as_selector(torch.ops.aten.add_.Tensor)


def test_op_without_tensor_output_refused():
    with pytest.raises(sacpass.SelectorError, match="returns no tensor"):
        sacpass.as_selector("aten::is_nonzero")


def test_packet_matches_every_functional_overload():
    sel = sacpass.as_selector(torch.ops.aten.topk)
    assert torch.ops.aten.topk.default in sel.overloads()
    assert torch.ops.aten.topk.values not in sel.overloads()  # the out= variant mutates


def test_view_selected_refused():
    class V(torch.nn.Module):
        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(lambda t: (t.sin().view(-1) * 2).sum(), x, use_reentrant=False)

    _, model = compile_toy(V(), save=["aten::view"])
    with pytest.raises(Exception) as info:
        model(torch.randn(4, 4, requires_grad=True))
    err = unwrap(info)
    assert isinstance(err, sacpass.SelectorError) and "a view" in str(err) and "base" in str(err)


def test_conflicting_selectors():
    _, model = compile_toy(save=[TOPK], recompute=["indexer::sacpass_toy::topk_ids"])
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 32, requires_grad=True))
    err = unwrap(info)
    assert isinstance(err, sacpass.PolicyConflictError) and "both to save" in str(err)


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


def test_unknown_inner_and_strict_type():
    with pytest.raises(sacpass.BackendOptionError, match="inductor"):
        sacpass.backend(inner="eager")
    with pytest.raises(sacpass.BackendOptionError, match="True or False"):
        sacpass.backend(strict="yes")


def test_unknown_named_option_lists_valid_keys():
    with pytest.raises(sacpass.BackendOptionError) as info:
        sacpass.named_backend({"sav": [TOPK]})
    assert "'sav'" in str(info.value) and "save" in str(info.value) and "recompute" in str(info.value)


def test_torch_version_range():
    with pytest.raises(sacpass.UnsupportedTorchVersion, match="2.10.0.*>= 2.11"):
        check_torch_version("2.10.0")
    with pytest.warns(sacpass.SacpassWarning, match="2.16.0.*newer than the newest tested version 2.15"):
        check_torch_version("2.16.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for v in ("2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"):
            check_torch_version(v)


def test_checkpoint_outside_compile_warns():
    layer = ToyLayer(checkpointed=False)
    be = sacpass.backend(save=[TOPK], inner="aot_eager", use_registered=False, save_discrete=False)
    compiled = torch.compile(layer, backend=be, fullgraph=True)
    x = torch.randn(8, 32, requires_grad=True)
    with pytest.warns(sacpass.SacpassWarning, match=r"checkpoint\(compile\(f\)\).*compile\(checkpoint\(f\)\)"):
        torch.utils.checkpoint.checkpoint(compiled, x, use_reentrant=False).sum().backward()


def test_checkpoint_decorator_outside_compile_warns():
    """The decorator form (torch 2.14+) runs the function through torch's checkpoint without a frame named
    ``checkpoint``: still checkpoint(compile(f))."""
    try:
        decorator = torch.utils.checkpoint.checkpoint(use_reentrant=False)
    except TypeError:
        pytest.skip(f"torch {torch.__version__}'s checkpoint has no decorator form")
    layer = ToyLayer(checkpointed=False)
    be = sacpass.backend(save=[TOPK], inner="aot_eager", use_registered=False, save_discrete=False)
    compiled = torch.compile(layer, backend=be, fullgraph=True)

    @decorator
    def run(x):
        return compiled(x)

    x = torch.randn(8, 32, requires_grad=True)
    with pytest.warns(sacpass.SacpassWarning, match=r"checkpoint\(compile\(f\)\).*compile\(checkpoint\(f\)\)"):
        run(x).sum().backward()


def _checkpoint_forms():
    """Ways users run a compiled module under an eager checkpoint, by name: each is checkpoint(compile(f))."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    cp = torch.utils.checkpoint.checkpoint
    return {
        "function": lambda compiled: lambda x: cp(compiled, x, use_reentrant=False),
        "function_reentrant": lambda compiled: lambda x: cp(compiled, x, use_reentrant=True),
        "checkpoint_wrapper": lambda compiled: checkpoint_wrapper(compiled),
    }


@pytest.mark.parametrize("form", ["function", "function_reentrant", "checkpoint_wrapper"])
def test_every_eager_checkpoint_form_around_a_compile_warns(form):
    """checkpoint(compile(f)) is found from torch's checkpoint itself (its saved-tensor hooks, or its frames for
    the reentrant form), whatever calls it: torch's function, torch.distributed's checkpoint_wrapper. Compiling
    the same layer with no checkpoint around it does not warn."""
    layer = ToyLayer(checkpointed=False)
    be = sacpass.backend(save=[TOPK], inner="aot_eager", use_registered=False, save_discrete=False)
    compiled = torch.compile(layer, backend=be, fullgraph=True)
    run = _checkpoint_forms()[form](compiled)
    x = torch.randn(8, 32, requires_grad=True)
    with pytest.warns(sacpass.SacpassWarning, match=r"checkpoint\(compile\(f\)\).*compile\(checkpoint\(f\)\)"):
        run(x).sum().backward()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sacpass.SacpassWarning)
        torch.compile(ToyLayer(checkpointed=False), backend=sacpass.backend(
            save=[TOPK], inner="aot_eager", use_registered=False, save_discrete=False), fullgraph=True)(x).sum().backward()


@pytest.mark.slow
def test_transformers_gradient_checkpointing_inside_compiled_layers_does_not_warn():
    """Hugging Face's ``gradient_checkpointing_enable`` checkpoints each decoder layer's ``forward`` (its module
    hooks stay outside), so layers compiled one by one (``layer.compile(backend=...)``) trace the checkpoint:
    compile(checkpoint(f)), the composition sacpass wants. No warning, and the backward recomputes inside the
    compiled graphs."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    be = sacpass.backend(inner="aot_eager", use_registered=False)
    for layer in model.model.layers:
        layer.compile(backend=be)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)      # transformers' own deprecation of the name
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (1, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sacpass.SacpassWarning)
        model(ids, labels=ids).loss.backward()
    assert be.reports and all(r.recomputed for r in be.reports)


def test_activation_memory_budget_zero_with_must_save():
    from torch._functorch import config as fc
    _, model = compile_toy(save=[TOPK])
    with fc.patch(activation_memory_budget=0.0):
        with pytest.raises(Exception) as info:
            model(torch.randn(8, 32, requires_grad=True))
    err = unwrap(info)
    assert "activation_memory_budget" in str(err) and "above 0" in str(err)


def test_unwritable_dump_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(sacpass.DumpError, match="cannot be written.*writable directory"):
        sacpass.backend(dump_dir=blocker / "sub")


def test_lambda_predicate_bypasses_cache_explicitly():
    with pytest.warns(sacpass.SacpassWarning, match="caches are bypassed"):
        be = sacpass.backend(save=[lambda n: n.name == "topk_ids"], inner="aot_eager", use_registered=False, save_discrete=False)
    assert be.uuid is None

    def named(node):
        return node.name == "topk_ids"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        be = sacpass.backend(save=[named], inner="aot_eager", use_registered=False, save_discrete=False)
    assert be.uuid is not None
    model = torch.compile(ToyLayer(), backend=be, fullgraph=True)
    out = model(torch.randn(8, 32, requires_grad=True))
    with OpCounter(*TOY_TOPK_OPS) as topk:
        out.sum().backward()
    assert topk.total == 0


def test_dump_written(tmp_path):
    be, model = compile_toy(save=[TOPK], dump_dir=tmp_path / "dump")
    model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    folder = tmp_path / "dump" / "g0"
    assert {p.name for p in folder.iterdir()} >= {"joint.txt", "forward.txt", "backward.txt", "report.json"}
    assert "MUST_SAVE" in (folder / "joint.txt").read_text()
    back = sacpass.Report.from_json((folder / "report.json").read_text())
    assert back.to_json() == be.reports[0].to_json()


def test_report_json_rejects_foreign_and_newer():
    with pytest.raises(sacpass.DumpError, match="not a sacpass report"):
        sacpass.Report.from_json('{"a": 1}')
    with pytest.raises(sacpass.DumpError, match="version 99.*Upgrade"):
        sacpass.Report.from_json('{"kind": "sacpass.report", "version": 99}')
    with pytest.raises(sacpass.DumpError, match="not valid JSON"):
        sacpass.Report.from_json("{")


@pytest.mark.parametrize("spelled", ["layers.*.self_attn::topk", "Indexer.x::topk", "a b::topk"])
def test_selector_without_namespace_never_reaches_torch_ops(spelled):
    before = set(vars(torch.ops))
    with pytest.raises(sacpass.UnknownOpError) as info:
        sacpass.backend(save=[spelled])
    assert set(vars(torch.ops)) == before
    ns = spelled.split("::")[0]
    assert f"'{ns}::aten::topk'" in str(info.value)  # the spelling to use instead


def test_unknown_op_error_quotes_the_module_scope():
    with pytest.raises(sacpass.UnknownOpError, match=r"selector 'Indexer::aten::topkk' names op aten::topkk"):
        sacpass.backend(save=["Indexer::aten::topkk"])


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


@pytest.mark.parametrize("selector", ["aten::cumsum", "indexer::aten::mm", "mlp::aten::topk"])
def test_a_selector_matching_in_no_graph_of_the_compile_is_an_error(selector):
    """Checked when the first backward starts (every graph of the step has been compiled by then)."""
    torch.manual_seed(0)
    be = sacpass.backend(save=[TOPK, selector], inner="aot_eager")
    model = torch.compile(LoggingModel(), backend=be)
    out = model(torch.randn(16, 32, requires_grad=True))  # the forward compiles and runs
    with pytest.raises(sacpass.UnmatchedSelectorError, match=rf"{selector}.*matched no forward node in any graph"):
        out.sum().backward()
    assert be.unmatched() == [selector]


def test_non_strict_warning_does_not_advise_strict_false():
    be = sacpass.backend(save=["aten::cumsum"], inner="aot_eager", strict=False)
    with pytest.warns(sacpass.SacpassWarning) as caught:
        compile_and_train(be, ToyLayer(), torch.randn(16, 32))
    msgs = [str(w.message) for w in caught if "matched no forward node" in str(w.message)]
    assert msgs and not any("strict=False" in m for m in msgs)


def test_lambda_warning_points_at_the_users_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sacpass.backend(save=[lambda n: False])
    (w,) = [w for w in caught if "no stable cache key" in str(w.message)]
    assert w.filename == __file__
