"""glm52::grouped_mm on CUDA (bf16) with uneven expert groups, forward and backward, against the loop reference."""
import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.grouped_mm import ref_grouped_mm


@pytest.mark.parametrize("offs", [[5, 12, 12, 31], [0, 7, 20, 29]])
def test_grouped_mm_uneven_groups_cuda(offs):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(31, 128, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    w = (torch.randn(4, 128, 64, generator=g) * 0.1).to("cuda", torch.bfloat16).requires_grad_(True)
    offs = torch.tensor(offs, dtype=torch.int32, device="cuda")
    y = torch.ops.glm52.grouped_mm(x, w, offs)
    y.float().square().sum().backward()
    x2, w2 = (t.detach().float().requires_grad_(True) for t in (x, w))
    y2 = ref_grouped_mm(x2, w2, offs)
    y2.square().sum().backward()
    # bf16 inputs and outputs against an fp32 loop: compare by relative L2 error (bf16 eps is 7.8e-3)
    for got, ref in ((y, y2), (x.grad, x2.grad), (w.grad, w2.grad)):
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert rel <= 1e-2, rel
