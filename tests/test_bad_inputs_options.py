"""Bad backend options and environment (docs/bad_inputs.md, "Backend options, dumps, the checkpoint's place and
the torch version"): unknown options and values, an unwritable dump directory, a report JSON sacpass cannot read,
a checkpoint around the compile instead of inside it, PyTorch's budget at 0, a torch outside the supported range.
Each test asserts the exact error class (or warning) and that the message names the fix."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import sacpass
from sacpass._version import check_torch_version
from sacpass.compiler import sacpass_backend
from tests.support.toy import ToyLayer, compile_toy, unwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPK = "sacpass_toy::topk_ids"

# ------------------------------------------------------------------------------------------ options

def test_unknown_inner_and_strict_type():
    with pytest.raises(sacpass.BackendOptionError, match="inductor"):
        sacpass.backend(inner="eager")
    with pytest.raises(sacpass.BackendOptionError, match="True or False"):
        sacpass.backend(strict="yes")

def test_unknown_named_option_lists_valid_keys():
    with pytest.raises(sacpass.BackendOptionError) as info:
        sacpass.named_backend({"sav": [TOPK]})
    assert "'sav'" in str(info.value) and "save" in str(info.value) and "recompute" in str(info.value)

def test_named_backend_rejects_unknown_option():
    model = torch.compile(ToyLayer(), backend="sacpass", options={"sav": [TOPK]})
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 32))
    assert "unknown backend option" in str(info.value) and "save" in str(info.value)

def test_unsupported_compile_mode():
    with pytest.raises(sacpass.BackendOptionError) as info:
        sacpass_backend(None, [], mode="max-autotune")
    assert "mode='max-autotune'" in str(info.value) and "torch._inductor.config" in str(info.value)

# ------------------------------------------------------------------------------------------ dumps

def test_unwritable_dump_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(sacpass.DumpError, match="cannot be written.*writable directory"):
        sacpass.backend(dump_dir=blocker / "sub")

def test_unwritable_dump_dir_from_env(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("SACPASS_DUMP_DIR", str(blocker / "sub"))
    with pytest.raises(sacpass.DumpError) as info:
        sacpass.backend()
    assert type(info.value) is sacpass.DumpError and "SACPASS_DUMP_DIR" in str(info.value)
    assert "writable directory" in str(info.value)

def test_report_json_rejects_foreign_and_newer():
    with pytest.raises(sacpass.DumpError, match="not a sacpass report"):
        sacpass.Report.from_json('{"a": 1}')
    with pytest.raises(sacpass.DumpError, match="version 99.*Upgrade"):
        sacpass.Report.from_json('{"kind": "sacpass.report", "version": 99}')
    with pytest.raises(sacpass.DumpError, match="not valid JSON"):
        sacpass.Report.from_json("{")

# ------------------------------------------------------------------------------------------ the checkpoint's place

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

# the quick run checks the reentrant form (found from its frames); torch's non-reentrant function is
# test_checkpoint_outside_compile_warns's case, and checkpoint_wrapper runs it (found from its hooks)
@pytest.mark.parametrize("form", [pytest.param("function", marks=pytest.mark.slow), "function_reentrant",
                                  pytest.param("checkpoint_wrapper", marks=pytest.mark.slow)])
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
        be = sacpass.backend(save=[TOPK], inner="aot_eager", use_registered=False, save_discrete=False)
        torch.compile(ToyLayer(checkpointed=False), backend=be, fullgraph=True)(x).sum().backward()

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

needs_region_budget = pytest.mark.skipif(not hasattr(torch.autograd.graph, "region_activation_memory_budget"),
                                         reason="this torch has no torch.autograd.graph.region_activation_memory_budget")


class _RegionBudget(torch.nn.Module):
    """The toy layer with its whole forward under PyTorch's region budget annotation."""

    def __init__(self, budget: float):
        super().__init__()
        self.layer, self.budget = ToyLayer(), budget

    def forward(self, x):
        with torch.autograd.graph.region_activation_memory_budget(self.budget):
            return self.layer(x)


@needs_region_budget
@pytest.mark.parametrize("option", ["memory_budget", "plan"])
def test_region_memory_budget_with_sacpass_budget_or_plan_is_refused(option):
    kw = {"memory_budget": 0.5} if option == "memory_budget" else {"plan": sacpass.Plan()}
    _, model = compile_toy(_RegionBudget(0.5), **kw)
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 32, requires_grad=True))
    err = unwrap(info)
    assert isinstance(err, sacpass.SacpassError), err
    assert "region_activation_memory_budget(0.5)" in str(err) and option in str(err)
    assert "drop the annotation, or the backend's option" in str(err)


@needs_region_budget
def test_region_memory_budget_zero_with_must_save_names_the_annotation():
    _, model = compile_toy(_RegionBudget(0.0), save=[TOPK])
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 32, requires_grad=True))
    err = unwrap(info)
    assert isinstance(err, sacpass.SacpassError), err
    assert "region_activation_memory_budget(0) annotates this graph" in str(err) and "memory_budget=0" in str(err)

# ------------------------------------------------------------------------------------------ torch version

def test_torch_version_range():
    with pytest.raises(sacpass.UnsupportedTorchVersion, match="2.10.0.*>= 2.11"):
        check_torch_version("2.10.0")
    with pytest.warns(sacpass.SacpassWarning, match="2.16.0.*newer than the newest tested version 2.15"):
        check_torch_version("2.16.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for v in ("2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"):
            check_torch_version(v)

def test_torch_outside_range_at_import():
    """`import sacpass` itself refuses torch < 2.11 and warns on torch newer than the newest tested."""
    script = textwrap.dedent("""
        import sys, warnings
        import torch
        torch.__version__ = "2.10.0"
        try:
            import sacpass
        except ImportError as e:
            print("REFUSED", type(e).__name__, e)
        for name in [m for m in sys.modules if m == "sacpass" or m.startswith("sacpass.")]:
            del sys.modules[name]
        torch.__version__ = "2.99.0"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import sacpass
        print("WARNED", [str(w.message) for w in caught if w.category.__name__ == "SacpassWarning"])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    refused, warned = r.stdout.splitlines()[-2:]
    assert refused.startswith("REFUSED UnsupportedTorchVersion") and "pip install 'torch>=2.11'" in refused
    assert "2.99.0 is newer than the newest tested" in warned and "Run the sacpass test suite" in warned
