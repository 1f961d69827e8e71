"""The TileLang CUDA kernels behind the glm52 ops: opcheck (schema, fake tensors, AOT dispatch) and a
fullgraph Inductor compile of top-k -> sparse MLA, forward and backward, matching eager."""
import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.dsa_topk import topk_calls
from helpers import assert_similar

pytest.importorskip("glm52_model.ops.cuda.sparse_mla_tl", reason="TileLang not installed")


def _inputs(S=256, H=16, topk=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qi = torch.randn(S, 32, 128, device="cuda", generator=g).bfloat16()
    ki = torch.randn(S, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(S, 32, device="cuda", generator=g)
    starts = torch.zeros(S, dtype=torch.int32, device="cuda")
    ends = torch.arange(1, S + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(S, H, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=g).bfloat16()
    return qi, ki, w, starts, ends, q, kv, topk


def test_opcheck_cuda_kernels():
    qi, ki, w, starts, ends, q, kv, topk = _inputs()
    torch.library.opcheck(torch.ops.glm52.dsa_topk_indices.default, (qi, ki, w, starts, ends, topk, 0.1),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    idx = torch.ops.glm52.dsa_topk_indices(qi, ki, w, starts, ends, topk, 0.1)
    torch.library.opcheck(torch.ops.glm52.sparse_mla.default, (q, kv, idx, 0.04, 512),
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.glm52.sparse_mla(q, kv, idx, 0.04, 512)
    torch.library.opcheck(torch.ops.glm52.sparse_mla_bwd.default,
                          (q, kv, out, torch.randn_like(out), idx, lse, 0.04, 512),
                          test_utils=("test_schema", "test_faketensor"))


def test_inductor_fullgraph_topk_then_sparse_mla_matches_eager():
    qi, ki, w, starts, ends, q, kv, topk = _inputs(S=384, H=16, topk=128, seed=1)

    def f(q, kv):
        idx = torch.ops.glm52.dsa_topk_indices(qi, ki, w, starts, ends, topk, 0.1)
        out, _ = torch.ops.glm52.sparse_mla(q * 1.5, kv, idx, 0.04, 512)
        return out.float().square().mean()

    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    f(q1, kv1).backward()
    q2, kv2 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    topk_calls().reset()
    loss = torch.compile(f, fullgraph=True)(q2, kv2)
    loss.backward()
    assert topk_calls().count == 1
    assert_similar(q2.grad.float(), q1.grad.float(), min_cos=0.9999, max_rel=1e-2, what="dq compiled")
    assert_similar(kv2.grad.float(), kv1.grad.float(), min_cos=0.9999, max_rel=1e-2, what="dkv compiled")
