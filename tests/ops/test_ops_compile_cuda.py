"""The CUDA kernels behind the glm52 ops: opcheck (schema, fake tensors, AOT dispatch) with bf16 inputs (the
TileLang kernels) and fp32 inputs (handed to the PyTorch kernels), outputs of exactly the dtypes and shapes
the fakes promise, the ops' own input errors on CUDA, the one-time warning without TileLang, and a fullgraph
Inductor compile of top-k -> sparse MLA, forward and backward, matching eager."""
import json
import os
import subprocess
import sys

import pytest
import torch

import glm52_model.ops  # noqa: F401
from tests.support.helpers import assert_similar
from sacpass.testing import OpCounter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = torch.ops.glm52


def _inputs(S=256, H=16, topk=64, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qi = torch.randn(S, 32, 128, device="cuda", generator=g).to(dtype)
    ki = torch.randn(S, 128, device="cuda", generator=g).to(dtype)
    w = torch.randn(S, 32, device="cuda", generator=g)
    starts = torch.zeros(S, dtype=torch.int32, device="cuda")
    ends = torch.arange(1, S + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(S, H, 576, device="cuda", generator=g).to(dtype)
    kv = torch.randn(S, 576, device="cuda", generator=g).to(dtype)
    return qi, ki, w, starts, ends, q, kv, topk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck_cuda_kernels(dtype):
    qi, ki, w, starts, ends, q, kv, topk = _inputs(dtype=dtype)
    torch.library.opcheck(OPS.dsa_topk_indices.default, (qi, ki, w, starts, ends, topk, 0.1),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    idx = OPS.dsa_topk_indices(qi, ki, w, starts, ends, topk, 0.1)
    assert idx.dtype == torch.int32 and idx.shape == (q.shape[0], topk)
    torch.library.opcheck(OPS.sparse_mla.default, (q, kv, idx, 0.04, 512),
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = OPS.sparse_mla(q, kv, idx, 0.04, 512)
    assert out.dtype == dtype and out.shape == (*q.shape[:2], 512) and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    torch.library.opcheck(OPS.sparse_mla_bwd.default, (q, kv, out, dout, idx, lse, 0.04, 512),
                          test_utils=("test_schema", "test_faketensor"))
    dq, dkv = OPS.sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.04, 512)
    assert (dq.dtype, dq.shape, dkv.dtype, dkv.shape) == (q.dtype, q.shape, kv.dtype, kv.shape)


def test_cuda_kernels_refuse_bad_inputs_like_the_cpu_path():
    """An int64 index tensor: the op's own check raises, with the same error class on CUDA and CPU."""
    qi, ki, w, starts, ends, q, kv, topk = _inputs()
    idx = OPS.dsa_topk_indices(qi, ki, w, starts, ends, topk, 0.1)
    out, lse = OPS.sparse_mla(q, kv, idx, 0.04, 512)
    calls = {
        "dsa_topk_indices": (OPS.dsa_topk_indices, (qi, ki, w, starts.long(), ends, topk, 0.1)),
        "sparse_mla": (OPS.sparse_mla, (q, kv, idx.long(), 0.04, 512)),
        "sparse_mla_bwd": (OPS.sparse_mla_bwd, (q, kv, out, torch.randn_like(out), idx.long(), lse, 0.04, 512)),
    }
    for name, (op, args) in calls.items():
        with pytest.raises(RuntimeError, match="must be int32") as on_cpu:
            op(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
        with pytest.raises(type(on_cpu.value), match="must be int32"):
            op(*args)


_NO_TILELANG = """
import json, sys, warnings
sys.modules["tilelang"] = None  # as if TileLang were not installed
import torch
import glm52_model.ops
from tests.ops.test_ops_compile_cuda import _inputs
qi, ki, w, starts, ends, q, kv, topk = _inputs()
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    for _ in range(2):
        idx = torch.ops.glm52.dsa_topk_indices(qi, ki, w, starts, ends, topk, 0.1)
        out, lse = torch.ops.glm52.sparse_mla(q, kv, idx, 0.04, 512)
        torch.ops.glm52.sparse_mla_bwd(q, kv, out, torch.randn_like(out), idx, lse, 0.04, 512)
print(json.dumps([str(r.message) for r in rec if issubclass(r.category, UserWarning)]))
"""


def test_without_tilelang_each_op_warns_once():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", _NO_TILELANG], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    messages = json.loads(r.stdout.strip().splitlines()[-1])
    for op in ("glm52::dsa_topk_indices", "glm52::sparse_mla", "glm52::sparse_mla_bwd"):
        mine = [m for m in messages if m.startswith(op + ":")]
        assert len(mine) == 1 and "pip install tilelang==0.1.15" in mine[0], (op, messages)


def test_inductor_fullgraph_topk_then_sparse_mla_matches_eager():
    pytest.importorskip("glm52_model.ops.cuda.sparse_mla_tl", reason="TileLang not installed")
    qi, ki, w, starts, ends, q, kv, topk = _inputs(S=384, H=16, topk=128, seed=1)

    def f(q, kv):
        idx = OPS.dsa_topk_indices(qi, ki, w, starts, ends, topk, 0.1)
        out, _ = OPS.sparse_mla(q * 1.5, kv, idx, 0.04, 512)
        return out.float().square().mean()

    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    f(q1, kv1).backward()
    q2, kv2 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    with OpCounter(OPS.dsa_topk_indices) as topk_runs:
        loss = torch.compile(f, fullgraph=True)(q2, kv2)
        loss.backward()
    assert topk_runs.total == 1
    assert_similar(q2.grad.float(), q1.grad.float(), min_cos=0.9999, max_rel=1e-2, what="dq compiled")
    assert_similar(kv2.grad.float(), kv1.grad.float(), min_cos=0.9999, max_rel=1e-2, what="dkv compiled")
