"""The same policy when a checkpointed region runs eagerly, and a loud word when it does."""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import sacpass
from sacpass.testing import OpCounter
from tests.support.toy import BreakingLayer, ToyLayer, assert_close_lists, grads_of

TOPK = ("sacpass_toy::topk_ids", "aten::topk", "glm52::dsa_topk_indices")


def _step(fn, model, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    model.zero_grad(set_to_none=True)
    with OpCounter(*TOPK) as calls:
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
    return out.detach(), grads_of(model, inputs[0]), calls


# ---------------------------------------------------------------------------------------------- eager
def test_eager_toy_layer_keeps_the_topk_and_matches_no_checkpoint():
    torch.manual_seed(0)
    layer, x = ToyLayer(checkpointed=False), torch.randn(24, 32)
    out_e, grads_e, _ = _step(layer, layer, x)
    ctx = sacpass.context_fn()  # default policy: the toy top-k is a discrete decision
    out_c, grads_c, calls = _step(lambda t: checkpoint(layer.body, t, use_reentrant=False, context_fn=ctx), layer, x)
    assert calls.backward == 0 and calls.forward == 1, calls.counts
    torch.testing.assert_close(out_c, out_e)
    assert_close_lists(grads_c, grads_e, rtol=0, atol=0)
    assert [(k.op, k.dtype, k.shape, k.reason) for k in ctx.spec.kept] == [
        ("sacpass_toy::topk_ids.default", "int32", (24, 4), "discrete")]
    _, _, plain = _step(lambda t: checkpoint(layer.body, t, use_reentrant=False), layer, x)
    assert plain.backward == 1  # without the context, eager checkpointing replays it


def test_module_scoped_selector_in_eager():
    torch.manual_seed(0)
    layer, x = ToyLayer(checkpointed=False, use_aten_topk=True), torch.randn(24, 32)
    ctx = sacpass.context_fn(save=["indexer::aten::topk"], save_discrete=False)
    _, _, calls = _step(lambda t: checkpoint(layer, t, use_reentrant=False, context_fn=ctx), layer, x)
    assert calls.count("backward", "aten::topk") == 0
    other = sacpass.context_fn(save=["mlp::aten::topk"], save_discrete=False)  # a module holding no top-k
    _, _, calls = _step(lambda t: checkpoint(layer, t, use_reentrant=False, context_fn=other), layer, x)
    assert calls.count("backward", "aten::topk") == 1


def _glm_layer(index):
    from glm52_model import GLM52Config, GLM52ForCausalLM
    from tests.support.golden_cases import _glm_inputs, _shared_ids

    torch.manual_seed(0)
    cfg = GLM52Config.tiny(recompute=False)
    layer = GLM52ForCausalLM(cfg).layers[index]
    x, positions, starts, ends = _glm_inputs(cfg)
    ids = None if layer.compute_topk else _shared_ids(starts, ends, cfg.index_topk)
    return layer, (x, positions, starts, ends, ids)


@pytest.mark.parametrize("index", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_glm_layer_same_saved_set_eager_and_compiled(index):
    """Eager with the context and compiled with the backend keep the same values (by op, dtype and shape),
    run the top-k 0 times in the backward, and both match eager without checkpointing."""
    layer, (x, positions, starts, ends, ids) = _glm_layer(index)
    fn = functools.partial(layer, positions=positions, starts=starts, ends=ends, topk_ids=ids)
    out_e, grads_e, _ = _step(fn, layer, x)

    be = sacpass.backend(inner="aot_eager")
    ctx = be.context_fn()
    out_c, grads_c, eager = _step(lambda t: checkpoint(fn, t, use_reentrant=False, context_fn=ctx), layer, x)
    assert eager.backward == 0, eager.counts
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert_close_lists(grads_c, grads_e, rtol=1e-5, atol=1e-6)

    compiled = torch.compile(lambda t: checkpoint(fn, t, use_reentrant=False), backend=be, fullgraph=True)
    out_g, grads_g, comp = _step(compiled, layer, x)
    assert comp.backward == 0, comp.counts
    assert_close_lists(grads_g, grads_e, rtol=1e-4, atol=1e-5)
    (rep,) = be.reports
    compiled_set = sorted((s.op, s.dtype, tuple(int(d) for d in s.shape)) for s in rep.saved
                          if s.reason in ("must-save", "discrete"))
    eager_set = sorted((k.op, k.dtype, k.shape) for k in ctx.spec.kept)
    assert eager_set == compiled_set, (eager_set, compiled_set)
    assert sum(k.bytes for k in ctx.spec.kept) == sum(
        s.bytes for s in rep.saved if s.reason in ("must-save", "discrete"))


# ----------------------------------------------------------------------------------------- compiled
def test_context_under_compile_partitions_as_the_backend_alone():
    from torch._dynamo.utils import counters

    layer, (x, positions, starts, ends, ids) = _glm_layer(1)
    fn = functools.partial(layer, positions=positions, starts=starts, ends=ends, topk_ids=ids)
    seen = {}
    for mode in ("backend", "context"):
        torch._dynamo.reset()
        counters.clear()
        be = sacpass.backend(inner="aot_eager")
        kw = {"context_fn": be.context_fn()} if mode == "context" else {}
        compiled = torch.compile(lambda t: checkpoint(fn, t, use_reentrant=False, **kw), backend=be, fullgraph=True)
        for length in (1, 2):  # a second call: no recompile
            _step(compiled, layer, x)
        assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
        (rep,) = be.reports
        seen[mode] = ([(s.op, s.dtype, s.shape, s.reason) for s in rep.saved], dict(rep.recomputed))
    assert seen["context"] == seen["backend"]


# -------------------------------------------------------------------------------- regions run eagerly
class BreakingModel(nn.Module):
    def __init__(self, n=2, context_fn=None):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.layers = nn.ModuleList(BreakingLayer(data_dependent=True) for _ in range(n))
        self.context_fn = context_fn

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            kw = {"context_fn": self.context_fn} if self.context_fn is not None else {}
            # transformers' GradientCheckpointingLayer form (modeling_layers.py)
            x = checkpoint(functools.partial(type(layer).forward, layer), x, use_reentrant=False, **kw)
        return x.tanh()


def test_warning_once_per_region_naming_dynamos_reason():
    import sacpass.graph_breaks as gb

    gb._REGIONS.clear()
    torch.manual_seed(0)
    model, x = BreakingModel(), torch.randn(8, 16)
    be = sacpass.backend(inner="aot_eager", strict=False)
    compiled = torch.compile(model, backend=be)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _, _, calls = _step(compiled, model, x)
    eager = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
    assert len(eager) == 1, eager  # one region (one checkpoint call site), warned once in three steps
    assert "test_context.py" in eager[0] and ("data-dependent" in eager[0] or "Dynamic shape" in eager[0]
                                              or "nonzero" in eager[0]), eager[0]
    assert "sacpass.context_fn" in eager[0]
    assert calls.count("backward", "aten::topk") == 2  # the regions ran eagerly: their top-k is replayed
    assert [r.call_site.split(":")[0] for r in gb.eager_regions()] == ["test_context.py"]


def test_context_fixes_the_regions_that_run_eagerly():
    torch.manual_seed(0)
    model, x = BreakingModel(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    ref.forward = lambda t: functools.reduce(lambda h, l: l(h), ref.layers, ref.embed(t)).tanh()
    _, grads_e, _ = _step(ref, ref, x)
    be = sacpass.backend(inner="aot_eager", strict=False)
    model.context_fn = be.context_fn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, grads_c, calls = _step(torch.compile(model, backend=be), model, x)
    assert calls.count("backward", "aten::topk") == 0, calls.counts
    assert_close_lists(grads_c, grads_e, rtol=1e-5, atol=1e-6)


def test_module_scoped_selectors_see_the_models_paths_in_a_region_run_eagerly():
    """A compiled model's layers that run eagerly have the paths they have in the model (``layers.0``), not
    the compile wrapper's (``_orig_mod.layers.0``): a module-scoped selector of context_fn matches there."""
    torch.manual_seed(0)
    model, x = BreakingModel(), torch.randn(8, 16)
    model.context_fn = sacpass.context_fn(save=["layers.*::aten::topk"], save_discrete=False)
    be = sacpass.backend(inner="aot_eager", save=["layers.*::aten::topk"], save_discrete=False, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, calls = _step(torch.compile(model, backend=be), model, x)
    assert calls.count("backward", "aten::topk") == 0, calls.counts


def test_no_warning_for_a_region_that_compiled():
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        be = sacpass.backend(inner="aot_eager")
        _step(torch.compile(ToyLayer(), backend=be), ToyLayer(), torch.randn(8, 32))
    assert not [w for w in caught if "runs eagerly" in str(w.message)]


def test_strict_error_names_the_eager_region():
    import sacpass.graph_breaks as gb

    gb._REGIONS.clear()
    torch.manual_seed(0)
    model, x = BreakingModel(n=1), torch.randn(8, 16)
    model.extra = ToyLayer(dim=16)  # a region that does compile, where the selector is checked

    def forward(t):
        layer = model.layers[0]
        h = checkpoint(functools.partial(type(layer).forward, layer), model.embed(t), use_reentrant=False)
        return model.extra(h)

    be = sacpass.backend(inner="aot_eager", save=["aten::topk"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as info:
            _step(torch.compile(forward, backend=be), model, x)  # raised when the backward starts
    from tests.support.toy import unwrap
    err = unwrap(info)
    assert isinstance(err, sacpass.UnmatchedSelectorError)
    assert "runs eagerly" in str(err) and "test_context.py" in str(err)
