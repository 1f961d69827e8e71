"""The FP8 packing's Triton kernels against the PyTorch reference, and ModelPlan(compress="fp8") on a 2-layer
GLM-5.2 bench model at 16K tokens.

The kernels: the same scales and the same float8 elements as the reference (rounding to nearest both ways),
whatever the length; unpacking writes what the reference writes. The model: the packing is lossy, so the
gradients are held to bounds against control (the same compile, full recompute), with the loss within 2e-3 (the
forward is exact; only the backward reads rebuilt values). Every value packed (``exact=()``): per gradient
cosine >= 0.97; its worst gradients are the query path of the last layer (``attn.wq_a``, ``attn.wq_b``,
``attn.q_norm``: cosine 0.9805-0.9823, relative error 0.197-0.207 on the H200), whose attention backward takes
the row sums of the packed attention output times its gradient. The default keeps that output exact and is held
to every parameter's gradient at cosine >= 0.999 and relative error <= 0.03. The test prints the worst
gradients with each run.
"""
import copy

import pytest
import torch

import sacpass
import sacpass.offload as offload_runtime
from glm52_model import GLM52Config, GLM52ForCausalLM
from glm52_model.compile import apply_compile
from tests.support.helpers import cosine_similarity, relative_error
from sacpass.compression import pack, pack_reference, unpack, unpack_reference

SEQ = 16384


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [1, 127, 128 * 4097 + 5, 1 << 22])
def test_the_kernels_pack_and_unpack_as_the_reference(dtype, numel):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(numel, device="cuda", generator=g) * 10 ** torch.randint(-3, 4, (numel,), device="cuda",
                                                                              generator=g)).to(dtype)
    q, s = pack(x)
    q_ref, s_ref = pack_reference(x)
    assert torch.equal(s, s_ref)
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same == 1.0, same
    out, ref = unpack(q, s, torch.empty_like(x)), unpack_reference(q, s, torch.empty_like(x))
    assert torch.equal(out, ref)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids)
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


# the goal of the default (sensitive values exact): every parameter's gradient against control's
MIN_COS, MAX_REL = 0.999, 0.03


@pytest.mark.parametrize("exact", [(), None], ids=["every value packed", "sensitive values exact"])
def test_a_model_plan_that_packs_its_host_values_stays_close_to_control(exact):
    """The 2-layer bench model at 16K: every floating value the plan sends to the host packed (exact=()), or the
    default, which keeps the values the backward is sensitive to (sparse MLA's output) exact. The loss is
    control's within the forward's rounding. Every value packed: each gradient at cosine >= 0.97 of control's.
    The default: every parameter's gradient at cosine >= 0.999 and relative error <= 0.03 of control's; the same
    plan without compression (every value exact) is measured beside it, to show what of the distance is the
    packing's and what the partition's own rounding."""
    torch.manual_seed(0)
    cfg = GLM52Config.preset("bench", num_layers=2, mtp_layers=0, fp8=True, first_k_dense=0)
    with torch.device("cuda"):
        base = GLM52ForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    torch._dynamo.reset()
    control = apply_compile(copy.deepcopy(base), backend=sacpass.backend(use_registered=False, save_discrete=False))
    l_c, g_c = _step(control, ids)
    del control

    def worst(g):
        return sorted((cosine_similarity(g[n], g_c[n]), n, relative_error(g[n], g_c[n])) for n in g_c)

    budgets = dict(layers=2, gpu_bytes=0, host_bytes=8 << 30)
    if exact is None:  # the plan as exact: what its partition alone moves the gradients by
        torch._dynamo.reset()
        model = apply_compile(copy.deepcopy(base), backend=sacpass.backend(plan=sacpass.ModelPlan(**budgets)))
        for _ in range(2):
            _, g_x = _step(model, ids)
        del model
        print("exact plan: worst grads (cos, name, rel):", worst(g_x)[:3])

    torch._dynamo.reset()
    plan = sacpass.ModelPlan(**budgets, compress="fp8", exact=exact)
    be = sacpass.backend(plan=plan)
    model = apply_compile(copy.deepcopy(base), backend=be)
    for _ in range(2):
        offload_runtime.reset_stats()
        l_p, g_p = _step(model, ids)
        st = offload_runtime.stats()
        assert st.packed_bytes > 0 and st.reloaded_bytes == st.offloaded_bytes and st.bundles_alive == 0, st.format()
        if exact == ():
            assert st.offloaded_bytes < 0.53 * st.packed_bytes, st.format()
    kept_exact = [d for r in be.reports for d in r.decisions if d.exact]
    assert (exact == ()) == (not kept_exact), kept_exact
    print(st.format())
    w = worst(g_p)
    print(f"exact={exact}: loss control", l_c.item(), "packed", l_p.item(), "; worst grads (cos, name, rel):", w[:3],
          "; worst rel:", max(w, key=lambda t: t[2]))
    assert abs(l_p.item() - l_c.item()) < 2e-3, (l_p.item(), l_c.item())
    if exact == ():
        assert w[0][0] >= 0.97, w[:3]
    else:
        bad = [t for t in w if t[0] < MIN_COS or t[2] > MAX_REL]
        assert not bad, bad
