"""The models users bring: transformers architectures with top-k routers and DSA indexers, each trained a step
under sacpass exactly as under plain ``aot_eager``, no decision made again in the backward.

Every row builds its model offline from a tiny config (random weights), turns on transformers' activation
checkpointing, and steps it compiled twice from the same weights: plain ``aot_eager`` (the control) and
``sacpass.backend(inner="aot_eager")``. It checks that the loss and every gradient are bitwise equal, that the
control's backward makes discrete decisions again (checkpointing replays the routers and indexers) and sacpass's
makes none (``OpCounter.decisions()``, counted at run time), and that every decision the backward needs is kept
as integers. The aux-loss rows do the same with ``output_router_logits=True``, where the checkpointed layers run
eagerly and only ``context_fn`` keeps the policy.

What a row measured is pinned in docs/compatibility.json, and docs/compatibility.md is rendered from that file
alone (``test_the_page_is_rendered_from_the_measured_rows``), so the page cannot say what the test did not
measure. A row that changes fails with the difference; ``EXPECTTEST_ACCEPT=1 python -m pytest
tests/test_compat_matrix.py`` rewrites the rows it ran and the page. On a torch or transformers other than the
pinned one the rows are not compared, the checks above still run.
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field

import pytest
import torch

import sacpass
import sacpass.graph_breaks as gb
from sacpass.testing import OpCounter

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = os.path.join(ROOT, "docs", "compatibility.json")
PAGE = os.path.join(ROOT, "docs", "compatibility.md")
ACCEPT = os.environ.get("EXPECTTEST_ACCEPT") == "1"
COMMAND = "EXPECTTEST_ACCEPT=1 python -m pytest tests/test_compat_matrix.py"

# sizes every config below takes (head_dim: hidden_size / num_attention_heads unless a row sets it)
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
            pad_token_id=0)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, head_dim=8,
           v_head_dim=8)
GROUPED = dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
               first_k_dense_replace=0, n_group=4, topk_group=2)  # 4 groups of 2 experts, the best 2 groups
DSA = dict(index_topk=4, index_head_dim=16, index_n_heads=2)  # 4 of 16 keys per query


@dataclass(frozen=True)
class Arch:
    """One architecture of the matrix."""

    name: str  # as the docs name it
    model_type: str  # transformers' model_type
    decides: str  # what makes its discrete decisions
    config: dict = field(default_factory=dict)  # the tiny config's fields beyond TINY
    seq: int = 8  # tokens in the step
    eager: bool = False  # a checkpointed layer runs eagerly (Dynamo cannot trace it): stepped with context_fn
    quick: bool = False  # in the quick subset (-m "not slow")


ARCHS = [
    Arch("Mixtral", "mixtral", "router top-k", dict(num_local_experts=4, num_experts_per_tok=2), quick=True),
    Arch("Qwen2-MoE", "qwen2_moe", "router top-k, shared expert gate",
         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              decoder_sparse_step=1, mlp_only_layers=[])),
    Arch("Qwen3-MoE", "qwen3_moe", "router top-k",
         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
              mlp_only_layers=[])),
    Arch("OLMoE", "olmoe", "router top-k", dict(num_experts=4, num_experts_per_tok=2)),
    Arch("DeepSeek-V2", "deepseek_v2", "group-limited router (max per group, top-k groups, top-k experts)",
         dict(MLA, **GROUPED, topk_method="group_limited_greedy")),
    Arch("DeepSeek-V3", "deepseek_v3", "group-limited router (top-2 sum per group, top-k groups, top-k experts)",
         dict(MLA, **GROUPED)),
    Arch("DeepSeek-V3.2", "deepseek_v32", "DSA indexer top-k, group-limited router", dict(MLA, **GROUPED, **DSA),
         seq=16),
    Arch("DeepSeek-V4", "deepseek_v4", "DSA indexer top-k over compressed keys, router top-k, hash routing",
         dict(layer_types=["compressed_sparse_attention", "sliding_attention"], mlp_layer_types=["hash_moe", "moe"],
              n_routed_experts=4, num_experts_per_tok=2, num_key_value_heads=1, head_dim=8, q_lora_rank=16,
              o_lora_rank=16, o_groups=2, index_topk=2, index_head_dim=16, index_n_heads=2, sliding_window=8),
         seq=16),
    Arch("GLM-4-MoE", "glm4_moe", "group-limited router", dict(GROUPED)),
    Arch("GLM-5 (DSA)", "glm_moe_dsa", "DSA indexer top-k, group-limited router",
         dict(MLA, **GROUPED, **DSA), seq=16),
    Arch("GPT-OSS", "gpt_oss", "router top-k", dict(num_local_experts=4, num_experts_per_tok=2)),
    Arch("Llama-4", "llama4_text", "router top-k", dict(num_local_experts=4, num_experts_per_tok=2)),
    Arch("PhiMoE", "phimoe", "sparsemixer (max along a dim, twice per token)",
         dict(num_local_experts=4, num_experts_per_tok=2)),
    Arch("GraniteMoE", "granitemoe", "router top-k", dict(num_local_experts=4, num_experts_per_tok=2)),
    Arch("ERNIE-4.5-MoE", "ernie4_5_moe", "router top-k",
         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    Arch("MiMo-V2-Flash", "mimo_v2_flash", "router top-k",
         dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    Arch("LongCat-Flash", "longcat_flash", "router top-k with zero experts, an expert loop over the experts hit",
         dict(MLA, n_routed_experts=4, num_experts_per_tok=2, moe_topk=2, moe_intermediate_size=32,
              num_hidden_layers=4), eager=True),  # 2 layers: num_hidden_layers counts their 2 sublayers each
]


# ------------------------------------------------------------------------------------------- a step
@dataclass
class Step:
    """One training step of a compiled copy of the model."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    decisions: OpCounter
    warnings: list[str]


def _model(arch: Arch, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(arch.model_type, **{**TINY, **arch.config, **extra})
    return AutoModelForCausalLM.from_config(config).train()


def _step(model, backend, context_fn=None, seq: int = 8) -> Step:
    """Checkpoint every layer as transformers does, compile with ``backend``, run one step."""
    model = copy.deepcopy(model)
    kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn is not None else {})}
    model.activation_checkpointing_enable(kwargs)
    ids = torch.randint(1, TINY["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    gb._REGIONS.clear()
    with warnings.catch_warnings(record=True) as caught, OpCounter.decisions() as decisions:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss
        loss.backward()
    eager = [str(w.message) for w in caught if "eagerly" in str(w.message)]
    return Step(loss.detach(), {n: p.grad for n, p in model.named_parameters()}, decisions, eager)


def _assert_equal_steps(ours: Step, control: Step) -> None:
    assert torch.equal(ours.loss, control.loss), (ours.loss, control.loss)
    assert ours.grads.keys() == control.grads.keys()
    for name, grad in control.grads.items():
        assert (grad is None) == (ours.grads[name] is None), name
        assert grad is None or torch.equal(ours.grads[name], grad), name


def _ops(counter: OpCounter, phase: str) -> str:
    """``topk x2, sort x2``: the decisions made in a phase, by op, in the order first made."""
    made = Counter()
    for (op, ph), n in counter.counts.items():
        if ph == phase:
            made[op.split("::", 1)[1].rsplit(".", 1)[0]] += n
    return ", ".join(f"{op} x{n}" for op, n in made.items()) or "none"


def _kept(backend) -> str:
    """What the backward reads of the decisions, from the reports: ``topk int32 x2, sort int32 x2``."""
    rows = Counter(f"{s.op.split('::', 1)[1].rsplit('.', 1)[0]} {s.dtype}" for r in backend.reports for s in r.saved
                   if s.reason in ("discrete", "decision values"))
    return ", ".join(f"{k} x{n}" for k, n in sorted(rows.items())) or "none"


def _assert_decisions_kept_as_integers(backend) -> None:
    for report in backend.reports:
        for s in report.saved:
            assert not (s.reason == "discrete" and s.dtype.startswith(("float", "bfloat"))), report.format()


# -------------------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("arch", [pytest.param(a, id=a.name, marks=() if a.quick else pytest.mark.slow)
                                  for a in ARCHS])
def test_trains_a_step_under_sacpass_as_under_aot_eager(arch):
    model = _model(arch)
    control = _step(model, "aot_eager", seq=arch.seq)
    be = sacpass.backend(inner="aot_eager")
    ours = _step(model, be, be.context_fn() if arch.eager else None, seq=arch.seq)
    _assert_equal_steps(ours, control)
    assert control.decisions.backward > 0, control.decisions.counts  # checkpointing replays the decisions
    assert ours.decisions.backward == 0, ours.decisions.counts
    _assert_decisions_kept_as_integers(be)
    regions = gb.eager_regions()
    assert all(r.holds for r in regions) and not ours.warnings, ours.warnings
    assert bool(regions) == arch.eager, [r.module for r in regions]
    _check_row("rows", arch.name, {
        "model_class": type(model).__name__, "decides": arch.decides,
        "decisions": _ops(control.decisions, "forward"),
        "made_again_in_backward": {"aot_eager": control.decisions.backward, "sacpass": ours.decisions.backward},
        "kept": _kept(be) + (" in the graphs; in the eager layers, by context_fn" if regions else ""),
        "gradients": "bitwise equal",
        "eager_regions": _regions_text(regions),
    })


def _regions_text(regions) -> str:
    if not regions:
        return ""
    first = regions[0]
    return f"{', '.join(r.module for r in regions)}: {first.reason.split(' Hint:')[0]} ({first.break_site})"


# ------------------------------------------------------------------------------- the aux-loss setting
AUX = [a for a in ARCHS if a.name in ("Mixtral", "Qwen3-MoE")]


@pytest.mark.slow
@pytest.mark.parametrize("arch", AUX, ids=[a.name for a in AUX])
def test_the_aux_loss_setting_keeps_the_policy_with_context_fn(arch):
    """``output_router_logits=True`` (the load-balancing loss) records each layer's router logits from inside
    the checkpoint, which Dynamo cannot trace: every layer runs eagerly. Without ``context_fn`` sacpass says so
    and the backward routes again; with ``backend.context_fn()`` the policy holds there, silently."""
    model = _model(arch, output_router_logits=True)
    control = _step(model, "aot_eager")
    be = sacpass.backend(inner="aot_eager")
    plain = _step(model, be)
    assert all(f"model.layers.{i} " in " ".join(plain.warnings) for i in range(2)), plain.warnings
    assert plain.decisions.backward > 0
    unheld = gb.eager_regions()
    be = sacpass.backend(inner="aot_eager")
    ours = _step(model, be, be.context_fn())
    assert ours.warnings == [] and ours.decisions.backward == 0, (ours.warnings, ours.decisions.counts)
    held = gb.eager_regions()
    assert [r.module for r in held] == [r.module for r in unheld] and all(r.holds for r in held)
    _assert_equal_steps(ours, control)
    _check_row("aux_loss", arch.name, {
        "model_class": type(model).__name__, "eager_regions": _regions_text(held),
        "without_context_fn": {"warnings": len(plain.warnings), "made_again_in_backward": plain.decisions.backward},
        "with_context_fn": {"warnings": len(ours.warnings), "made_again_in_backward": ours.decisions.backward},
        "gradients": "bitwise equal",
    })


# ------------------------------------------------------------------------------- the pinned rows
def _versions() -> dict:
    return {"torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]), "transformers": transformers.__version__}


def _load() -> dict:
    with open(ROWS) as f:
        return json.load(f)


def _check_row(table: str, name: str, row: dict) -> None:
    """Compare a measured row with the pinned one (same torch and transformers only); rewrite it on accept."""
    data = _load() if os.path.exists(ROWS) else {**_versions(), "rows": {}, "aux_loss": {}}
    if ACCEPT:
        data.update(_versions())
        data[table][name] = row
        order = [a.name for a in (ARCHS if table == "rows" else AUX)]
        data[table] = dict(sorted(data[table].items(), key=lambda kv: order.index(kv[0])))
        with open(ROWS, "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        with open(PAGE, "w") as f:
            f.write(render_page(data))
        return
    if {k: data.get(k) for k in _versions()} != _versions():
        return  # pinned on another release: the checks above are what holds here
    assert data[table].get(name) == row, (
        f"{name}: the matrix measured\n{json.dumps(row, indent=1)}\nbut docs/compatibility.json pins\n"
        f"{json.dumps(data[table].get(name), indent=1)}\nIf the change is intended: {COMMAND} -k '{name}'")


# ------------------------------------------------------------------------------------------ the page
def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else "-"


def render_page(data: dict) -> str:
    """docs/compatibility.md, from the pinned rows alone."""
    lines = [
        "# Compatibility: transformers models under sacpass",
        "",
        f"Generated from `docs/compatibility.json`, what `tests/test_compat_matrix.py` measured (it runs in CI; "
        f"`{COMMAND}` rewrites both): transformers {data['transformers']}, torch {data['torch']}, CPU.",
        "",
        "Each architecture is built offline from a tiny config (hidden size 32, 2 layers, a few experts, random "
        "weights), checkpointed per layer by transformers itself (`activation_checkpointing_enable({\"use_reentrant\": "
        "False})`: each layer calls `checkpoint(partial(forward, layer, **kw), ...)`), and trained one step "
        "compiled twice from the same weights: plain `aot_eager`, and `sacpass.backend(inner=\"aot_eager\")` with "
        "no option. The test checks that the loss and every gradient are bitwise equal; it counts every discrete "
        "decision at run time (`sacpass.testing.OpCounter.decisions()`: top-k, sort, max along a dim, ...) and "
        "checks that plain `aot_eager`'s backward makes them again (the checkpoint replays the routers and "
        "indexers) while sacpass's makes none, each decision the backward needs kept as int32 indices, its "
        "values rebuilt from them.",
        "",
        "| model | transformers class | what decides | decisions per step | made again in the backward: "
        "`aot_eager` / sacpass | kept for the backward | gradients |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in data["rows"].items():
        again = r["made_again_in_backward"]
        lines.append(f"| {name} | `{r['model_class']}` | {_cell(r['decides'])} | {_cell(r['decisions'])} | "
                     f"{again['aot_eager']} / {again['sacpass']} | {_cell(r['kept'])} | {r['gradients']} |")
    eager = [(name, r) for name, r in data["rows"].items() if r["eager_regions"]]
    if eager:
        lines += ["", "Layers Dynamo cannot trace run eagerly, outside the graphs sacpass partitions; these rows are "
                  "stepped with `context_fn=backend.context_fn()`, which applies the same policy there:", ""]
        lines += [f"- {name}: {r['eager_regions']}" for name, r in eager]
    lines += [
        "",
        "## The aux-loss setting",
        "",
        "With `output_router_logits=True` (the load-balancing loss) each layer's router logits are recorded from "
        "inside the checkpoint, which Dynamo cannot trace: every checkpointed layer runs eagerly. sacpass warns, "
        "naming the layers (once per graph break Dynamo reports: the model's frame, then the layers' own); with "
        "the backend's own policy given to the checkpoint, `model.activation_checkpointing_enable("
        "{\"use_reentrant\": False, \"context_fn\": be.context_fn()})`, the decisions are kept there too and "
        "the warnings are gone.",
        "",
        "| model | eager regions | without `context_fn`: warnings, made again in the backward | with "
        "`context_fn`: warnings, made again | gradients (with, against plain `aot_eager`) |",
        "|---|---|---|---|---|",
    ]
    for name, r in data["aux_loss"].items():
        without, with_ = r["without_context_fn"], r["with_context_fn"]
        lines.append(f"| {name} | {_cell(r['eager_regions'])} | {without['warnings']}, "
                     f"{without['made_again_in_backward']} | {with_['warnings']}, {with_['made_again_in_backward']} "
                     f"| {r['gradients']} |")
    lines += [
        "",
        "## Checking a model of your own",
        "",
        "The same checks, on your model and data:",
        "",
        "```python",
        "import sacpass, sacpass.graph_breaks, torch",
        "from sacpass.testing import OpCounter",
        "",
        "be = sacpass.backend()",
        "model.activation_checkpointing_enable({\"use_reentrant\": False, \"context_fn\": be.context_fn()})",
        "with OpCounter.decisions() as decisions:",
        "    torch.compile(model, backend=be)(**batch).loss.backward()",
        "assert decisions.backward == 0, decisions.counts     # no decision made again in the backward",
        "print([r.module for r in sacpass.graph_breaks.eager_regions()])  # layers Dynamo ran eagerly, if any",
        "print(be.reports[0])                                 # what each graph keeps, and why",
        "```",
        "",
        "A layer Dynamo runs eagerly is named by its full path in the model (`model.layers.3`), whichever way it "
        "was checkpointed: transformers' `partial(forward, layer, **kw)` or its older `partial(layer.__call__)`, a "
        "bound method, a lambda over the layer, `checkpoint_wrapper` (torchtitan, FSDP), the layer itself; and "
        "one by one when each layer is compiled on its own (`layer.compile()`). A report row with the reason "
        "`decision values` is a custom op's floating output that its integer outputs cannot rebuild, kept beside "
        "them.",
    ]
    return "\n".join(lines) + "\n"


def test_the_page_is_rendered_from_the_measured_rows():
    data = _load()
    assert list(data["rows"]) == [a.name for a in ARCHS], "a row of the matrix is not pinned: run " + COMMAND
    assert list(data["aux_loss"]) == [a.name for a in AUX], "an aux-loss row is not pinned: run " + COMMAND
    with open(PAGE) as f:
        assert f.read() == render_page(data), f"docs/compatibility.md is not what the rows give: run {COMMAND}"
