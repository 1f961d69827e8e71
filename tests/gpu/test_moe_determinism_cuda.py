"""The GLM-5.2 MoE on a GPU, compiled with Inductor: two runs of the same forward and backward give the same bits
(its rows go out to the experts and come back by gathers, each token's k rows summed in a fixed order: no
atomics whose order changes the sum), in bf16 with the tile-wise FP8 experts and the bf16 ones."""
import pytest
import torch

from glm52_model import GLM52Config
from glm52_model.model import MoE, init_weights

TOKENS = 8192


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_experts", "bf16_experts"])
def test_the_moe_s_forward_and_backward_repeat_bit_for_bit(fp8):
    torch.manual_seed(0)
    cfg = GLM52Config.preset("bench", fp8=fp8)
    with torch.device("cuda"):
        moe = init_weights(MoE(cfg), cfg.init_std).to(torch.bfloat16)
    x = torch.randn(TOKENS, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    run = torch.compile(moe)

    def step():
        xi = x.clone().requires_grad_()
        moe.zero_grad(set_to_none=True)
        y = run(xi)
        y.backward(dy)
        torch.cuda.synchronize()
        return [y.detach(), xi.grad] + [p.grad for p in moe.parameters()]

    first, second = step(), step()
    assert all(a is not None for a in first)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
