"""Rows of the bad-input catalogue (docs/bad_inputs.md) not already covered by tests/test_errors.py or
tests/test_cli.py: each asserts the exact error class (or warning) and that the message names the fix."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import sacpass
from sacpass.compiler import sacpass_backend
from fuzz_ops import FuzzModel, Program
from toy import unwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_program(program, **kw):
    kw.setdefault("inner", "aot_eager")
    kw.setdefault("use_registered", False)
    be = sacpass.backend(**kw)
    return be, torch.compile(FuzzModel(program), backend=be, fullgraph=True)


# ------------------------------------------------------------------------------------------ selectors
def test_packet_with_no_overload_in_graph():
    """An OpOverloadPacket is accepted (every functional overload); none of them in the graph is unmatched."""
    _, model = compile_program(Program(("nograd_ids", "sin"), ((0, 2),)), save=[torch.ops.aten.topk])
    with pytest.raises(Exception) as info:
        model(torch.randn(8, 8, requires_grad=True)).sum().backward()
    err = unwrap(info)
    assert type(err) is sacpass.UnmatchedSelectorError
    assert "aten::topk" in str(err) and "strict=False" in str(err) and "module paths are relative" in str(err)


def test_packet_with_only_mutating_overloads():
    with pytest.raises(sacpass.SelectorError) as info:
        sacpass.as_selector(torch.ops.aten.add_)
    assert type(info.value) is sacpass.SelectorError
    assert "aten::add_" in str(info.value) and "select its functional variant" in str(info.value)


def test_op_without_tensor_output_names_the_fix():
    with pytest.raises(sacpass.SelectorError) as info:
        sacpass.backend(save=["aten::is_nonzero"])
    assert type(info.value) is sacpass.SelectorError
    assert "returns no tensor" in str(info.value) and "Select the op that produces the tensor" in str(info.value)


def test_higher_order_operator_as_selector():
    with pytest.raises(sacpass.SelectorError) as info:
        sacpass.as_selector(torch.ops.higher_order.tag_activation_checkpoint)
    assert type(info.value) is sacpass.SelectorError and "select the op it wraps" in str(info.value)


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


def test_must_recompute_saved_anyway_warns():
    """PyTorch saves a value one checkpoint region hands to the next, whatever its tag: say so."""
    be, model = compile_program(Program(("sin", "gelu"), ((0, 1), (1, 2))), recompute=["aten::sin"])
    with pytest.warns(sacpass.SacpassWarning, match=r"saved for backward anyway: sin \(aten::sin.default.*"
                      r"checkpoint region.*Move the checkpoint boundary"):
        model(torch.randn(8, 8, requires_grad=True)).sum().backward()
    assert "sin" in [s.name for s in be.reports[0].saved]


# ------------------------------------------------------------------------------------------ options, env
def test_unsupported_compile_mode():
    with pytest.raises(sacpass.BackendOptionError) as info:
        sacpass_backend(None, [], mode="max-autotune")
    assert "mode='max-autotune'" in str(info.value) and "torch._inductor.config" in str(info.value)


def test_unwritable_dump_dir_from_env(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("SACPASS_DUMP_DIR", str(blocker / "sub"))
    with pytest.raises(sacpass.DumpError) as info:
        sacpass.backend()
    assert type(info.value) is sacpass.DumpError and "SACPASS_DUMP_DIR" in str(info.value)
    assert "writable directory" in str(info.value)


# ------------------------------------------------------------------------------------------ torch version
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
