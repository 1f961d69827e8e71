"""What CUDA tensors get, checked on the CPU by redispatching the ops to their CUDA kernels with CPU tensors:
without TileLang each op with a TileLang kernel warns once (naming the op and the pip pin) and runs its
PyTorch kernel; with TileLang the launchers check inputs as the op does (same error class) and hand inputs
they do not take (fp32) to the PyTorch kernel, warning once."""
import json
import os
import subprocess
import sys

import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.cuda import REFERENCE_KERNELS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def op_cases(dtype=torch.float32) -> dict:
    """op name -> arguments of one valid call (CPU tensors)."""
    g = torch.Generator().manual_seed(0)
    S, H, D, d_v, T = 16, 2, 128, 64, 4  # latent widths the TileLang kernels take
    qi, ki, w = torch.randn(S, H, 32, generator=g), torch.randn(S, 32, generator=g), torch.randn(S, H, generator=g)
    starts, ends = torch.zeros(S, dtype=torch.int32), torch.arange(1, S + 1, dtype=torch.int32)
    idx = torch.ops.glm52.dsa_topk_indices(qi, ki, w, starts, ends, T, 0.1)
    q, kv = torch.randn(S, H, D, generator=g).to(dtype), torch.randn(S, D, generator=g).to(dtype)
    out, lse = torch.ops.glm52.sparse_mla(q, kv, idx, 0.1, d_v)
    return {"glm52::dsa_topk_indices": (qi.to(dtype), ki.to(dtype), w, starts, ends, T, 0.1),
            "glm52::sparse_mla": (q, kv, idx, 0.1, d_v),
            "glm52::sparse_mla_bwd": (q, kv, out, torch.randn_like(out), idx, lse, 0.1, d_v)}


def _op(name):
    ns, op = name.split("::")
    return getattr(getattr(torch.ops, ns), op).default


def run_on_cuda_kernels_twice() -> dict:
    """Call every op's CUDA kernel twice; op -> (warning messages, results equal to the CPU op's)."""
    import warnings
    report = {}
    for name, args in op_cases().items():
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            got = [_op(name).redispatch(CUDA, *args) for _ in range(2)]
        want = _op(name)(*args)
        want = want if isinstance(want, tuple) else (want,)
        same = all(torch.equal(a, b) for g in got for a, b in zip(g if isinstance(g, tuple) else (g,), want))
        report[name] = ([str(r.message) for r in rec if issubclass(r.category, UserWarning)], same)
    return report


_CHILD = """
import json, sys
sys.modules["tilelang"] = None  # as if TileLang were not installed
from tests.ops.test_cuda_dispatch import run_on_cuda_kernels_twice
print(json.dumps(run_on_cuda_kernels_twice()))
"""


def test_without_tilelang_each_op_warns_once_and_runs_the_reference():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(report) == set(REFERENCE_KERNELS)
    for name, (messages, same) in report.items():
        assert same, f"{name}: the fallback's result differs from the PyTorch kernel's"
        assert len(messages) == 1, (name, messages)
        assert name in messages[0] and "pip install tilelang==0.1.15" in messages[0], messages[0]


@pytest.fixture
def tilelang_launchers(monkeypatch):
    pytest.importorskip("tilelang", reason="TileLang not installed")
    from glm52_model.ops.cuda import _common
    monkeypatch.setattr(_common, "_warned", set())


def test_tilelang_launchers_route_fp32_to_the_reference_once(tilelang_launchers):
    for name, (messages, same) in run_on_cuda_kernels_twice().items():
        assert same, f"{name}: fp32 inputs must run the PyTorch kernel"
        assert len(messages) == 1 and name in messages[0] and "bfloat16" in messages[0], (name, messages)


INT32_ARG = {"glm52::dsa_topk_indices": 3, "glm52::sparse_mla": 2, "glm52::sparse_mla_bwd": 4}  # starts / indices


@pytest.mark.parametrize("name", sorted(REFERENCE_KERNELS))
def test_tilelang_launchers_check_inputs_like_the_op(tilelang_launchers, name):
    """bf16 inputs the kernel would take, but an int64 index tensor: the op's own check refuses it first."""
    args = list(op_cases(torch.bfloat16)[name])
    args[INT32_ARG[name]] = args[INT32_ARG[name]].long()
    with pytest.raises(RuntimeError, match="must be int32") as on_cpu:
        _op(name)(*args)
    with pytest.raises(type(on_cpu.value), match="must be int32"):
        _op(name).redispatch(CUDA, *args)
