"""The kernel benchmark's sweeps (benchmarks/bench_kernels.py) are configs the kernels take: each entry names only
fields of the config it overrides, times something other than the op's default, and passes the builders' checks;
an unknown --op-configs name is refused before any GPU work."""
import dataclasses

import pytest


@pytest.fixture(scope="module")
def modules():
    pytest.importorskip("tilelang", reason="TileLang not installed (pip install '.[cuda]')")
    import bench_kernels as bk
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    return bk, tl


def test_overrides_replace_named_fields_and_refuse_unknown_ones(modules):
    bk, tl = modules
    config = bk.with_overrides(tl.TopkConfig(), {"buffers": 2, "logits": {"min_blocks": 3}})
    assert config.buffers == 2 and config.logits.min_blocks == 3
    assert config.select == tl.TopkConfig().select and config.logits.block_Q == tl.LogitsConfig().block_Q
    with pytest.raises(TypeError, match="no_such_field"):
        bk.with_overrides(tl.TopkConfig(), {"logits": {"no_such_field": 1}})


def test_sweep_entries_are_configs_other_than_the_default(modules):
    """Every entry builds a config of the kernel it sweeps (an unknown field raises), and every entry but
    "default" changes something: one equal to the op's default would time the default twice under another name."""
    bk, tl = modules
    for sweep, default in ((bk.LOGITS_SWEEP, tl.LogitsConfig()), (bk.SELECT_SWEEP, tl.SelectConfig()),
                           (bk.OP_SWEEP, tl.TopkConfig())):
        for name, over in sweep.items():
            config = bk.with_overrides(default, over)
            assert (config == default) == (name == "default"), f"{name}: {over}"
    assert bk.LOGITS_SWEEP["default"] == {} and bk.SELECT_SWEEP["default"] == {}


def test_select_sweep_entries_pass_the_select_builders_checks(modules):
    """Each select entry satisfies the select's constraints at the op's top-k (threads dividing 4096, candidates
    >= 1.25 topk, ...) and the launcher's (vec dividing its key padding), which otherwise fail only on the GPU
    machine, mid-run."""
    bk, tl = modules
    from glm52_model.ops.cuda.topk_select_tl import SelectSizes
    for name, over in bk.SELECT_SWEEP.items():
        config = bk.with_overrides(tl.SelectConfig(), over)
        SelectSizes.of(2048, config)
        tl.TopkConfig(select=config)
    with pytest.raises(AssertionError, match="candidates >= 1.25 topk"):
        SelectSizes.of(2048, dataclasses.replace(tl.SelectConfig(), candidates=2048))


def test_unknown_op_config_is_refused(modules):
    bk, _ = modules
    with pytest.raises(SystemExit, match="not in OP_SWEEP"):
        bk.main(["--op-configs", "overlap,no_such_variant"])
