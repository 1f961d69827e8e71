"""The 8-bit packing's Triton kernels against the PyTorch reference, and ModelPlan(compress=...) on a 2-layer
GLM-5.2 bench model at 16K tokens.

The kernels, in both formats: the same scales and the same elements as the reference, whatever the length;
unpacking writes what the reference writes. The model: the packing is lossy, so the gradients are held to bounds,
with the loss within 2e-3 of full recompute's (the forward is exact; only the backward reads rebuilt values).
Every value packed (``exact=()``, fp8): per gradient cosine >= 0.97 of full recompute's; its worst gradients are
the query path of the last layer (``attn.wq_a``, ``attn.wq_b``, ``attn.q_norm``: cosine 0.9805-0.9823, relative
error 0.197-0.207 on the H200), whose attention backward takes the row sums of the packed attention output times
its gradient. The default keeps that output exact and is held to every parameter's gradient at cosine >= 0.999
and relative error <= 0.03 of the same plan unpacked and of full recompute, whose own gradients are held to that
bound too; those runs go under torch.use_deterministic_algorithms (sparse MLA's backward and the top-k's select run
their PyTorch kernels there), and the unpacked plan's two steps are asserted equal bit for bit, so the distances
are the packing's alone. Measured on an H100 (docs/offload-and-planning.md): int8 on bf16 matmuls meets the bound
(0.99990 / 0.014); with FP8 matmuls neither format does (the FP8 backward's gradient quantisation turns the
packing's errors into whole e4m3 steps) nor does fp8 on bf16 matmuls: those cases are expected failures.
"""
import contextlib
import copy
import dataclasses
import os

import pytest
import torch

import sacpass
import sacpass.offload as offload_runtime
from glm52_model import GLM52Config, GLM52ForCausalLM
from glm52_model.compile import apply_ac, apply_compile
from tests.support.helpers import cosine_similarity, relative_error
from sacpass.calibration import calibrate
from sacpass.compression import pack, pack_reference, unpack, unpack_reference
from sacpass.report import COPY_BOUND, HOST_BOUND

SEQ = 16384

# cuBLAS repeats its results only with a fixed workspace, set before its first handle (pytest imports this module
# before any test runs): the default's runs go under torch.use_deterministic_algorithms
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextlib.contextmanager
def _deterministic(on: bool):
    """torch.use_deterministic_algorithms(on) inside, the mode before it after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [1, 127, 128 * 4097 + 5, 1 << 22])
def test_the_kernels_pack_and_unpack_as_the_reference(dtype, numel, fmt):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(numel, device="cuda", generator=g) * 10 ** torch.randint(-3, 4, (numel,), device="cuda",
                                                                              generator=g)).to(dtype)
    q, s = pack(x, fmt)
    q_ref, s_ref = pack_reference(x, fmt)
    assert torch.equal(s, s_ref) and q.dtype == q_ref.dtype
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


# the default (sensitive values exact) against the same plan unpacked: what the packing alone moves each gradient by
MIN_COS, MAX_REL = 0.999, 0.03


def _worst(g, ref):
    """Every parameter's (cosine, name, relative error) of gradients ``g`` against ``ref``'s, worst first."""
    return sorted((cosine_similarity(g[n], ref[n]), n, relative_error(g[n], ref[n])) for n in ref)


# the cases the goal's bound does not hold for yet (measured on an H100): the FP8 backward quantises every
# gradient a linear reads to e4m3 in 128-wide tiles, so a packed value anywhere on the gradient's path moves the
# first layer's gradients by whole e4m3 steps (fp8 0.9962 / 0.088, int8 0.9973 / 0.073 at layers.0.attn.wq_a);
# with bf16 matmuls, e4m3's own rounding of the values is too coarse (0.9990 / 0.044 at layers.0.attn.wkv_a)
_BEYOND = pytest.mark.xfail(strict=True, reason="the packing moves some gradient beyond cosine 0.999 / relative "
                                                "error 0.03 (docs/offload-and-planning.md)")


@pytest.mark.parametrize("fmt,exact,fp8", [
    pytest.param("fp8", (), True, id="every value packed"),
    pytest.param("fp8", None, True, id="fp8, sensitive values exact", marks=_BEYOND),
    pytest.param("fp8", None, False, id="fp8, sensitive values exact, bf16 matmuls", marks=_BEYOND),
    pytest.param("int8", None, True, id="int8, sensitive values exact", marks=_BEYOND),
    pytest.param("int8", None, False, id="int8, sensitive values exact, bf16 matmuls")])
def test_a_model_plan_that_packs_its_host_values_stays_close_to_control(fmt, exact, fp8):
    """The 2-layer bench model at 16K, with a host budget that keeps every planned value (so the plan's partition
    is the same packed or not): every floating value the plan sends to the host packed (exact=()), or the
    default, which keeps the values the backward is sensitive to (sparse MLA's output) exact. The loss is
    control's within the forward's rounding. Every value packed: each gradient at cosine >= 0.97 of control's.
    The default: every parameter's gradient at cosine >= 0.999 and relative error <= 0.03 of the same plan's
    unpacked (what the packing alone moves it by), and no further from the gradients of a run without
    checkpointing than full recompute's are. Printed beside: the distances between the references themselves
    (control, the run without checkpointing, the plan unpacked, and the plan unpacked against its own second
    step, which the default's deterministic runs hold to bit for bit)."""
    with _deterministic(exact is None):
        _packed_against_references(fmt, exact, fp8)


def _packed_against_references(fmt, exact, fp8):
    torch.manual_seed(0)
    cfg = GLM52Config.preset("bench", num_layers=2, mtp_layers=0, fp8=fp8, first_k_dense=0)
    with torch.device("cuda"):
        base = GLM52ForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))

    def run(backend, steps=1, checkpoint=True):
        torch._dynamo.reset()
        model = apply_compile(apply_ac(copy.deepcopy(base), checkpoint), backend=backend)
        out = []
        for _ in range(steps):
            offload_runtime.reset_stats()
            out.append(_step(model, ids))
        del model
        return out

    control = sacpass.backend(use_registered=False, save_discrete=False)
    ((l_c, g_c),) = run(control)
    # a host budget that holds every planned value, and copies priced 100x faster than this card's: the copy window
    # (which packing widens) holds every value worth keeping too, so the plan compiles one partition packed or not
    # and "packed vs unpacked" measures the packing alone (at 16K a region's compute hides few of its copies)
    cost = calibrate(torch.device("cuda"))
    cost = dataclasses.replace(cost, copy_bytes_per_s=100 * cost.copy_bytes_per_s)
    budgets = dict(layers=2, gpu_bytes=0, host_bytes=16 << 30, cost=cost)
    be = sacpass.backend(plan=sacpass.ModelPlan(**budgets, compress=fmt, exact=exact))
    (_, (l_p, g_p)) = run(be, steps=2)
    st = offload_runtime.stats()
    assert st.packed_bytes > 0 and st.reloaded_bytes + st.device_copied_bytes == st.offloaded_bytes, st.format()
    assert st.bundles_alive == 0, st.format()
    if exact == ():  # every floating value packed: what went is smaller than those values' own bytes
        assert st.offloaded_bytes < st.packed_bytes, st.format()
    bounded = [d for r in be.reports for d in r.decisions if d.bound in (HOST_BOUND, COPY_BOUND)]
    assert not bounded, bounded  # the budgets keep every value worth a copy, packed or not: one partition
    kept_exact = [d for r in be.reports for d in r.decisions if d.exact and not d.exact.startswith("quantised: ")]
    assert (exact == ()) == (not kept_exact), kept_exact  # quantised forms (FP8 linears' operands) go as they are
    print(st.format())
    rows = {"packed vs control": _worst(g_p, g_c)}
    if exact is None:
        ((_, g_n),) = run(control, checkpoint=False)
        (_, g_x), (_, g_x2) = run(sacpass.backend(plan=sacpass.ModelPlan(**budgets)), steps=3)[1:]
        unpacked = offload_runtime.stats()  # the same values (one partition), none packed: packing shrank what went
        assert unpacked.packed_bytes == 0 and st.offloaded_bytes < unpacked.offloaded_bytes, (st.format(),
                                                                                              unpacked.format())
        rows.update({"packed vs unpacked": _worst(g_p, g_x), "packed vs no checkpoint": _worst(g_p, g_n),
                     "control vs no checkpoint": _worst(g_c, g_n), "unpacked vs no checkpoint": _worst(g_x, g_n),
                     "unpacked vs control": _worst(g_x, g_c),
                     "unpacked vs its next step": _worst(g_x2, g_x)})
    for what, w in rows.items():
        print(f"{fmt} exact={exact} fp8={fp8}: {what}: worst cosine {w[0][:2]}, worst relative error "
              f"{max(w, key=lambda t: t[2])[1:]}")
    print(f"{fmt} exact={exact} fp8={fp8}: loss control {l_c.item()}, packed {l_p.item()}")
    assert abs(l_p.item() - l_c.item()) < 2e-3, (l_p.item(), l_c.item())
    if exact == ():
        assert rows["packed vs control"][0][0] >= 0.97, rows["packed vs control"][:3]
        return
    assert all(torch.equal(g_x[n], g_x2[n]) for n in g_x), rows["unpacked vs its next step"][:3]

    def beyond(what):  # the parameters whose gradients are outside the goal's bound in rows[what]
        return [t for t in rows[what] if t[0] < MIN_COS or t[2] > MAX_REL]
    # the exact plan reads the forward's own values where full recompute recomputes them: the same gradients but
    # for the rounding of what it recomputes
    assert not beyond("unpacked vs control"), beyond("unpacked vs control")
    bad = beyond("packed vs unpacked") + beyond("packed vs control")
    assert not bad, bad
    ctrl = {n: (cos, rel) for cos, n, rel in rows["control vs no checkpoint"]}
    for cos, n, rel in rows["packed vs no checkpoint"]:  # no further from it than full recompute, within the bound
        assert cos >= ctrl[n][0] - (1 - MIN_COS) and rel <= ctrl[n][1] + MAX_REL, (n, cos, rel, ctrl[n])
