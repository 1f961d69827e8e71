"""The report of a partitioned graph: immutable, its totals add up, its text groups the recomputed ops, and it
appears in ``TORCH_TRACE`` logs."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import sacpass
from tests.support.toy import ToyLayer, compile_and_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPK = "sacpass_toy::topk_ids"


def test_report_is_immutable_and_totals_add_up():
    be = sacpass.backend(save=[TOPK], inner="aot_eager")
    compile_and_train(be, ToyLayer(), torch.randn(16, 32))
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
    compile_and_train(be, ToyLayer(), torch.randn(16, 32))
    text = be.reports[0].format()
    line = next(ln for ln in text.splitlines() if ln.startswith("recomputed in backward"))
    assert "kinds" in line and "aten (" in text
    assert all(len(ln) <= 110 for ln in text.splitlines() if ln.startswith("  aten"))
    assert "activations:" in text and "graph inputs:" in text


@pytest.mark.slow
def test_reports_appear_under_torch_trace(tmp_path):
    code = ("import torch, sacpass; from tests.support.toy import ToyLayer;"
            "be = sacpass.backend(inner='aot_eager');"
            "torch.compile(ToyLayer(), backend=be, fullgraph=True)(torch.randn(8, 32, requires_grad=True)).sum().backward()")
    env = dict(os.environ, TORCH_TRACE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    logs = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "sacpass_report_g0" in logs
