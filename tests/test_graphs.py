"""The normalisation behind golden graphs: symbols, devices, addresses, region ids."""
from sacpass.graphs import SymbolRenamer, module_of_source, stable_symbols


def test_symbols_renamed_by_first_appearance():
    text = 'x: "f32[s77, s3]" = f(s3 * s77, u12);  y: "u8[s3]"; sum_1 s77_x'
    assert stable_symbols(text) == 'x: "f32[s0, s1]" = f(s1 * s0, u0);  y: "u8[s1]"; sum_1 s77_x'


def test_one_renamer_shares_its_mapping():
    r = SymbolRenamer()
    assert (r("s9 s4"), r("s4 s5")) == ("s0 s1", "s1 s2")


def test_source_keeps_the_file_name_only():
    assert module_of_source("model.py:93") == "model.py" and module_of_source("") == ""


def test_device_abstracted_and_tags_marked():
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.checkpoint import CheckpointPolicy

    from sacpass.graphs import normalized_graph

    gm = make_fx(lambda x: x + torch.ones(3, device=x.device))(torch.randn(3))
    add = next(n for n in gm.graph.nodes if n.name.startswith("add"))
    add.meta.update(recompute=CheckpointPolicy.MUST_SAVE, ac_graph_id=41)
    regions = {}
    text = normalized_graph(gm, regions)
    assert "device('DEVICE')" in text and "cpu" not in text
    assert "# MUST_SAVE (region 0)" in text and regions == {41: 0}
    assert "File" not in text and "#" not in text.replace("# MUST_SAVE (region 0)", "")


def test_recomputes_are_found_by_what_they_compute_not_only_by_name():
    """A backward copy of a forward op is a recompute whether or not it kept the forward node's name (some torch
    releases name the copy anew): renaming every backward call leaves the same {copy: forward op} pairs."""
    import copy

    from tests.support.golden_cases import build

    from sacpass.nodes import recomputed_names
    result = build("toy_sacpass").results[0]
    pairs = recomputed_names(result.forward, result.backward)
    assert {"ge", "clamp", "bmm"} <= set(pairs.values()) and "topk_ids" not in pairs.values()
    assert len(pairs) == sum(result.report.recomputed.values())
    assert all(b == f for b, f in pairs.items())           # here the partitioner kept the names
    bw = copy.deepcopy(result.backward)
    for node in bw.graph.nodes:
        if node.op == "call_function":
            node.name = f"{node.name}_copy"
    renamed = recomputed_names(result.forward, bw)
    assert renamed == {f"{b}_copy": f for b, f in pairs.items()}
    # a backward op that the forward never ran (one that reads the output's gradient) is not a recompute
    grads = [n for n in bw.graph.nodes if any(a.name.startswith("tangents_") for a in n.all_input_nodes)]
    assert grads and not any(n.name in renamed for n in grads)
