"""Issue 17: the bugs and rough edges a code review and a new user found, each pinned by a test."""
from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import sacpass
from sacpass.testing import OpCounter
from toy import ToyLayer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPK = "sacpass_toy::topk_ids"


def _train(be, model, x):
    out = torch.compile(model, backend=be, fullgraph=True)(x.detach().clone().requires_grad_(True))
    out.sum().backward()


# ------------------------------------------------------------------------------------------- bugs
def test_inference_compile_after_training_gains_no_report(fresh_cache):
    """A cache hit is PyTorch's signal (the AOTAutograd cache-hit counter), never "no report appeared"."""
    model, x = ToyLayer(), torch.randn(16, 32)
    be = sacpass.backend(save=[TOPK], save_discrete=False)
    _train(be, model, x)
    assert len(be.reports) == 1
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=be, fullgraph=True)(x)
    assert len(be.reports) == 1 and not any(r.from_cache for r in be.reports)


def test_policies_star_import():
    namespace: dict = {}
    exec("from sacpass.policies import *", namespace)  # noqa: S102
    assert {"Policy", "register_must_save", "registered_must_save", "clear_registry"} <= set(namespace)


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


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).cos()


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.w = Inner(), nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        return self.w(x).sin() * scale + self.inner(x)


class Stack(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.layers, self.how = nn.ModuleList([Layer(), Layer()]), how

    def forward(self, x):
        for layer in self.layers:
            if self.how == "transformers":  # what GradientCheckpointingLayer does
                x = checkpoint(functools.partial(layer.__call__, scale=2.0), x, use_reentrant=False)
            else:
                x = checkpoint(layer, x, 2.0, use_reentrant=False)
        return x


@pytest.mark.parametrize("how", ["transformers", "module"])
@pytest.mark.parametrize("selector, tagged", [("Layer::aten::sin", 2), ("layers.*::aten::sin", 2),
                                              ("layers.1::aten::sin", 1), ("Layer::aten::cos", 2),
                                              ("layers.0.inner::aten::cos", 1)])
def test_module_scoping_does_not_depend_on_how_checkpoint_was_called(how, selector, tagged):
    torch.manual_seed(0)
    be = sacpass.backend(save=[selector], inner="aot_eager", save_discrete=False)
    _train(be, Stack(how), torch.randn(4, 8))
    (rep,) = be.reports
    hits = [t for t in be.reports[0].tagged if t["selector"] == selector]
    assert len(hits) == tagged, rep.format(verbose=True)
    op = selector.rsplit("::", 1)[1]
    assert all(t["op"] == f"aten::{op}.default" and t["module"].startswith("layers.") for t in hits)


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


def test_golden_helper_refuses_graphs_from_the_cache(fresh_cache, tmp_path):
    from sacpass.testing import GoldenFromCacheError, assert_graphs_match, no_compile_caches

    model, x = ToyLayer(), torch.randn(16, 32)
    _train(sacpass.backend(save=[TOPK]), model, x)
    torch._dynamo.reset()
    warm = sacpass.backend(save=[TOPK])
    _train(warm, model, x)
    assert warm.reports[0].from_cache
    os.environ["EXPECTTEST_ACCEPT"] = "1"
    try:
        with pytest.raises(GoldenFromCacheError, match="no_compile_caches"):
            assert_graphs_match("warm", warm, directory=tmp_path)
    finally:
        del os.environ["EXPECTTEST_ACCEPT"]
    assert not (tmp_path / "warm.txt").exists()  # nothing useless written
    torch._dynamo.reset()
    fresh = sacpass.backend(save=[TOPK])
    with no_compile_caches():
        _train(fresh, model, x)
    assert not fresh.reports[0].from_cache and fresh.results


# ------------------------------------------------------------------------------------------- design
def test_report_is_immutable_and_totals_add_up():
    be = sacpass.backend(save=[TOPK], inner="aot_eager")
    _train(be, ToyLayer(), torch.randn(16, 32))
    (rep,) = be.reports
    with pytest.raises(dataclasses.FrozenInstanceError):
        rep.graph = "g9"
    with pytest.raises(TypeError):
        rep.recomputed["aten::mm.default"] = 0
    assert isinstance(rep.saved, tuple) and isinstance(rep.tagged, tuple)
    assert rep.total_bytes == sum(s.bytes for s in rep.saved)
    assert rep.activation_bytes + rep.input_bytes + rep.host_bytes == rep.total_bytes
    assert sacpass.Report.from_json(rep.to_json()).to_json() == rep.to_json()


def test_report_groups_the_recomputed_ops():
    be = sacpass.backend(inner="aot_eager")
    _train(be, ToyLayer(), torch.randn(16, 32))
    text = be.reports[0].format()
    line = next(ln for ln in text.splitlines() if ln.startswith("recomputed in backward"))
    assert "kinds" in line and "aten (" in text
    assert all(len(ln) <= 110 for ln in text.splitlines() if ln.startswith("  aten"))
    assert "activations:" in text and "graph inputs:" in text


def test_import_and_cli_do_not_import_dynamo_or_inductor(tmp_path):
    from dumps import toy_dump

    directory = tmp_path / "d"
    toy_dump(directory)
    code = ("import sys, sacpass, sacpass.cli;"
            f"rc = sacpass.cli.main(['report', {str(directory)!r}], out=open(__import__('os').devnull, 'w'));"
            "bad = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules];"
            "print('RC', rc, 'BAD', bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "RC 0 BAD []" in out.stdout, out.stdout + out.stderr


def test_reports_appear_under_torch_trace(tmp_path):
    code = ("import torch, sacpass, sys; sys.path.insert(0, 'tests'); from toy import ToyLayer;"
            "be = sacpass.backend(inner='aot_eager');"
            "torch.compile(ToyLayer(), backend=be, fullgraph=True)(torch.randn(8, 32, requires_grad=True)).sum().backward()")
    env = dict(os.environ, TORCH_TRACE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    logs = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "sacpass_report_g0" in logs


def test_cli_diff_prints_each_graphs_bytes_once(tmp_path):
    from dumps import toy_dump
    from sacpass.cli import main

    a, b = tmp_path / "a", tmp_path / "b"
    toy_dump(a, policy=False)
    toy_dump(b, policy=True)
    import io
    buf = io.StringIO()
    assert main(["diff", str(a), str(b)], out=buf) == 1
    assert buf.getvalue().count("g0: saved bytes") == 1, buf.getvalue()


def test_non_strict_warning_does_not_advise_strict_false():
    be = sacpass.backend(save=["aten::cumsum"], inner="aot_eager", strict=False)
    with pytest.warns(sacpass.SacpassWarning) as caught:
        _train(be, ToyLayer(), torch.randn(16, 32))
    msgs = [str(w.message) for w in caught if "matched no forward node" in str(w.message)]
    assert msgs and not any("strict=False" in m for m in msgs)


def test_lambda_warning_points_at_the_users_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sacpass.backend(save=[lambda n: False])
    (w,) = [w for w in caught if "no stable cache key" in str(w.message)]
    assert w.filename == __file__


def test_op_counter_sees_ops_inside_functionalized_wrappers():
    from toy import WrappedTopkLayer

    be = sacpass.backend(save=["sacpass_toy::topk_ids_counting"], inner="aot_eager", save_discrete=False)
    model = torch.compile(WrappedTopkLayer("mutating"), backend=be, fullgraph=True)
    with OpCounter("sacpass_toy::topk_ids_counting") as calls:
        model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert calls.forward == 1 and calls.backward == 0


def test_setup_keeps_the_lower_bound_only_and_depends_on_numpy():
    text = open(os.path.join(ROOT, "setup.py")).read()
    assert '"torch>=2.11"' in text and "<2.15" not in text and '"numpy"' in text


def test_readme_documents_every_backend_option():
    readme = open(os.path.join(ROOT, "README.md")).read()
    from sacpass.backend import VALID_OPTIONS
    for option in VALID_OPTIONS:
        assert f"| `{option}` |" in readme, option
