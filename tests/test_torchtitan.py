"""sacpass in torchtitan through its config (sacpass.integrations.torchtitan, docs/torchtitan.md).

torchtitan 0.3.0's DeepSeek-V3 debug model, built from its model registry with MoE and one MTP layer; the
activation-checkpointing policy is built from a config tree carrying ``override.imports``, applied with
torchtitan's own ``apply_overrides``, then the policy's ``apply`` and torchtitan's ``apply_compile`` run as in
``parallelize_deepseekv3`` (no Trainer, tokenizer or data set). FlexAttention has no backward on CPU, so the
training checks swap it for torchtitan's causal ``ScaledDotProductAttention`` and run the graphs with
``inner="aot_eager"``; the FlexAttention model itself is compiled forward-only, with Inductor, through the
integration, where torchtitan refuses a backend named "sacpass".
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("torchtitan", reason="pip install --no-deps torchtitan==0.3.0 (see .ci/run)")
pytest.importorskip("triton", reason="torchtitan's MoE imports triton: pip install --no-deps triton==3.9.0")

import sacpass  # noqa: E402
import sacpass.integrations.torchtitan as titan  # noqa: E402
from sacpass.testing import OpCounter  # noqa: E402
from torchtitan.config import CompileConfig, Configurable  # noqa: E402
from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC  # noqa: E402
from torchtitan.distributed.compile import apply_compile  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402
from torchtitan.models.deepseek_v3 import model_registry  # noqa: E402
from torchtitan.models.deepseek_v3.mtp import MTPLoss  # noqa: E402

B, S = 2, 32          # training checks (causal SDPA)
FLEX_S = 128          # FlexAttention's default block size: the shortest sequence its block mask takes
pytestmark = [  # torchtitan's router and RoPE ask CPU autocast for float32, which CPU autocast declines
    pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning"),
    pytest.mark.filterwarnings("ignore:CPU Autocast only supports:UserWarning"),
    pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex:UserWarning"),
]
PARALLEL_DIMS = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)


@dataclass(kw_only=True, slots=True)
class Job(Configurable.Config):
    """The two sections of torchtitan's Trainer.Config the override reads and the compile uses."""
    activation_checkpoint: Any = None
    compile: Any = None


@pytest.fixture(autouse=True)
def _torchtitan_globals():
    """apply_compile sets Dynamo flags, torchtitan's memory-budget mode sets PyTorch's activation_memory_budget
    and the policies turn Dynamo's LRU cache off, process-wide: each comes back as it was."""
    from torch._functorch import config as functorch_config

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch._dynamo.config.patch(capture_scalar_outputs=False,
                                    skip_fwd_side_effects_in_bwd_under_checkpoint=False), \
            functorch_config.patch(activation_memory_budget=functorch_config.activation_memory_budget):
        yield
    torch._C._dynamo.eval_frame._set_lru_cache(True)
    torch.set_num_threads(before)


def _model(flex: bool):
    spec = model_registry("debugmodel", num_mtp_layers=1)
    if not flex:
        for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
            if isinstance(parent, list):
                parent[attr] = ScaledDotProductAttention.Config()
            else:
                setattr(parent, attr, ScaledDotProductAttention.Config())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return spec, model.train()


def _parallelize(model, ac, *, imports=(), backend="aot_eager"):
    """What parallelize_deepseekv3 does on one device: the AC policy from the config, then apply_compile."""
    job = Job(activation_checkpoint=ac, compile=CompileConfig(enable=True, backend=backend))
    apply_overrides(OverrideConfig(imports=list(imports)), job)
    job.activation_checkpoint.build(dump_folder="").apply(model)
    apply_compile(model, compile_config=job.compile, parallel_dims=PARALLEL_DIMS)
    return job


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (B, S + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(S).expand(B, S)


def _step(model, loss_fn):
    inputs, labels, positions = _batch()
    loss, _ = loss_fn(model(inputs, positions), labels, positions=positions)
    loss.backward()
    return loss.detach()


def _grads(model):
    strip = ("._checkpoint_wrapped_module", "._orig_mod")
    out = {}
    for name, p in model.named_parameters():
        for s in strip:
            name = name.replace(s, "")
        out[name] = p.grad
    return out


def _moe_blocks(model) -> int:
    return sum(1 for block in model.layers.values() if getattr(block, "moe_enabled", False))


def _train_case(ac, imports=(), backend="aot_eager"):
    """(eager loss and grads, compiled loss and grads, the top-k counter, graph breaks, model, job)."""
    spec, model = _model(flex=False)
    eager = copy.deepcopy(model)
    loss_fn = MTPLoss.Config(global_vocab_size=decoder_vocab_size(spec)).build()
    eager_loss = _step(eager, loss_fn)
    job = _parallelize(model, ac, imports=imports, backend=backend)
    counters.clear()
    with OpCounter("aten::topk") as topk:
        loss = _step(model, loss_fn)
    breaks = sum(counters["graph_break"].values())
    return (eager_loss, _grads(eager)), (loss, _grads(model)), topk, breaks, model, job


def _assert_equal_to_eager(eager, compiled):
    (eager_loss, eager_grads), (loss, grads) = eager, compiled
    assert torch.equal(loss, eager_loss), (loss.item(), eager_loss.item())
    assert grads.keys() == eager_grads.keys()
    for name, g in eager_grads.items():
        assert g is not None and grads[name] is not None, name
        assert torch.equal(grads[name], g), name


SACPASS = (titan.OVERRIDE, {"inner": "aot_eager"})


@pytest.mark.slow
def test_plain_full_ac_replays_every_moe_blocks_topk():
    """The control of the test below: torchtitan's FullAC and per-block compile with plain min-cut replay every
    MoE block's top-k in the backward."""
    _, _, plain, breaks, model, _ = _train_case(FullAC.Config())
    moe = _moe_blocks(model)
    assert moe == 5 and breaks == 0
    assert plain.backward == moe


def test_full_ac_router_topk_never_runs_in_the_backward():
    eager, compiled, topk, breaks, model, job = _train_case(FullAC.Config(), imports=[SACPASS])
    moe = _moe_blocks(model)
    assert moe == 5
    assert type(job.activation_checkpoint) is titan.SacpassFullAC.Config
    assert job.activation_checkpoint.sacpass == {"inner": "aot_eager"}
    assert topk.backward == 0
    assert topk.forward == moe + 1  # the MoE blocks (compiled) and the MTP block (eager, not checkpointed)
    assert breaks == 0
    _assert_equal_to_eager(eager, compiled)
    be = titan.backend_of(model)
    assert isinstance(be, sacpass.Backend) and be.inner == "aot_eager"
    assert be.reports and all(not r.violations for r in be.reports)
    assert all("aten::topk.default" not in r.recomputed for r in be.reports)
    discrete = [s for r in be.reports for s in r.saved if s.op == "aten::topk.default"]
    assert discrete and {s.reason for s in discrete} == {"discrete"}


@pytest.mark.slow
@pytest.mark.parametrize("ac", [SelectiveAC.Config, MemoryBudgetAC.Config], ids=["selective", "memory_budget"])
def test_composes_with_selective_and_memory_budget_ac(ac):
    eager, compiled, topk, breaks, model, job = _train_case(ac(), imports=[SACPASS])
    assert type(job.activation_checkpoint) is titan.sacpass_variant(ac._owner).Config
    assert topk.backward == 0 and topk.forward == _moe_blocks(model) + 1 and breaks == 0
    _assert_equal_to_eager(eager, compiled)
    assert titan.backend_of(model).reports
    if ac is MemoryBudgetAC.Config:
        assert job.activation_checkpoint.memory_budget == 0.5  # the policy's own fields are kept


@pytest.mark.slow
def test_flex_attention_model_compiles_through_the_integration(monkeypatch):
    """Forward-only (FlexAttention has no backward on CPU), with Inductor: the path torchtitan refuses by name."""
    _, refused = _model(flex=True)
    with pytest.raises(ValueError, match="neither 'inductor' nor 'aot_eager'"):
        _parallelize(refused, FullAC.Config(), backend="sacpass")

    graphs = []
    call = sacpass.Backend.__call__

    def spy(self, gm, example_inputs):
        graphs.append(gm)
        return call(self, gm, example_inputs)

    monkeypatch.setattr(sacpass.Backend, "__call__", spy)
    _, model = _model(flex=True)
    _parallelize(model, FullAC.Config(), imports=[(titan.OVERRIDE, {})], backend="inductor")
    assert titan.backend_of(model).inner == "inductor"
    tokens = torch.randint(0, 2048, (1, FLEX_S), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(FLEX_S).expand(1, FLEX_S)
    counters.clear()
    with torch.no_grad():
        out = model(tokens, positions, model.get_attention_masks(positions))
    assert sum(counters["graph_break"].values()) == 0
    assert len(graphs) >= 2  # the dense block and the MoE block, each one graph given to sacpass
    assert all(_calls_flex_attention(gm) for gm in graphs)
    assert [o.shape for o in out] == [torch.Size([1, FLEX_S, 2048])] * 2  # main logits, MTP logits
    assert all(torch.isfinite(o).all() for o in out)


def _calls_flex_attention(gm: torch.fx.GraphModule) -> bool:
    """FlexAttention's compiled call sits in a wrapped sub-graph (wrap_inductor_compiled_regions)."""
    return any("flex_attention" in str(node.target) for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
               for node in sub.graph.nodes)


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(sacpass.BackendOptionError, match="unknown backend option.*'budget'.*memory_budget"):
        _parallelize(torch.nn.Module(), FullAC.Config(), imports=[(titan.OVERRIDE, {"budget": 0.5})])
    with pytest.raises(sacpass.BackendOptionError, match="inner="):
        _parallelize(torch.nn.Module(), FullAC.Config(), imports=[(titan.OVERRIDE, {"inner": "eager"})])


def test_compile_off_is_an_error_naming_the_fix():
    spec, model = _model(flex=False)
    job = Job(activation_checkpoint=FullAC.Config(), compile=CompileConfig(enable=False))
    apply_overrides(OverrideConfig(imports=[SACPASS]), job)
    job.activation_checkpoint.build().apply(model)  # compile off: parallelize never calls apply_compile
    inputs, _, positions = _batch()
    with pytest.raises(sacpass.SacpassError, match="--compile.enable"):
        model(inputs, positions)
