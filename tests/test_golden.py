"""Golden forward/backward graphs: one file per case in tests/expected_graphs/ (``pytest -m golden``).

The cases (tests/support/golden_cases.py) compile with ``inner="aot_eager"``: the same sacpass partition as
Inductor, executed eagerly, so the whole file runs in about two minutes on two CPU cores. One file holds on
every tested torch (2.13 to 2.15); a release that partitions a case differently reads its own
``<case>.torch-X.Y.txt`` instead (sacpass.testing). After an intended change:
``EXPECTTEST_ACCEPT=1 python -m pytest -m golden tests/`` on each tested torch, and review the diff of the files.
"""
import os
import re
import shutil

import pytest
import torch

import sacpass
from sacpass.testing import ACCEPT_ENV, assert_graphs_match, expected_path, golden_text, release_path
from tests.support.golden_cases import CASES, GLM_CASES, build, glm_available
from tests.support.toy import ToyLayer, compile_and_train

pytestmark = pytest.mark.golden
EXPECTED = os.path.join(os.path.dirname(__file__), "expected_graphs")
TOPK = "sacpass_toy::topk_ids"


def _needs_glm(name):
    if name in GLM_CASES and not glm_available():
        pytest.skip("glm52_model is not importable")


QUICK_GLM_CASE = "glm_moe_sacpass"  # the quick run (-m "not slow") checks the toy cases and this GLM layer


@pytest.mark.parametrize("name", [*CASES, *(n if n == QUICK_GLM_CASE else pytest.param(n, marks=pytest.mark.slow)
                                            for n in GLM_CASES)])
def test_golden_graphs(name):
    _needs_glm(name)
    assert_graphs_match(name, build(name))


def test_changed_policy_fails_the_golden(monkeypatch):
    """Compiling the toy without its must-save policy puts the top-k back into the backward: the golden fails."""
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    be = build("toy_baseline")  # the same toy compiled without the policy
    with pytest.raises(AssertionError) as info:
        assert_graphs_match("toy_sacpass", be, directory=EXPECTED)
    diff = str(info.value)
    assert "@@" in diff and "EXPECTTEST_ACCEPT=1" in diff
    removed = [ln for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert any("MUST_SAVE topk_ids" in ln for ln in removed)
    # the backward now calls the top-k op again; the golden's backward never did
    backward = lambda text: text.split("# backward")[1].split("# saved")[0]            # noqa: E731
    assert "sacpass_toy.topk_ids.default(" in backward(golden_text(be))
    assert "sacpass_toy.topk_ids.default(" not in backward(open(expected_path("toy_sacpass", EXPECTED)).read())


@pytest.mark.slow
def test_corrupting_one_expected_file_fails_exactly_that_case(tmp_path, monkeypatch):
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    names = [n for n in [*CASES, *GLM_CASES]
             if os.path.exists(expected_path(n, EXPECTED)) and (n in CASES or glm_available())]
    assert "toy_sacpass" in names
    copy = tmp_path / "expected_graphs"
    shutil.copytree(EXPECTED, copy)
    target = copy / os.path.basename(_chosen("toy_sacpass"))
    target.write_text(target.read_text().replace("i32[", "i64[", 1))
    failed = []
    for name in names:
        try:
            assert_graphs_match(name, build(name), directory=copy)
        except AssertionError as e:
            failed.append(name)
            assert "i64[" in str(e) and "i32[" in str(e)
    assert failed == ["toy_sacpass"]


def _chosen(name):
    """The file this torch reads for golden ``name``."""
    mine = release_path(expected_path(name, EXPECTED))
    return mine if os.path.exists(mine) else expected_path(name, EXPECTED)


def test_one_golden_holds_on_every_release_and_a_release_can_have_its_own(tmp_path, monkeypatch):
    be = build("toy_sacpass")
    monkeypatch.setenv(ACCEPT_ENV, "1")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert_graphs_match("case", be, directory=tmp_path)
    shared = tmp_path / "case.txt"
    text = shared.read_text()
    assert text.splitlines()[1] == "# torch 2.13.0+cpu"
    monkeypatch.delenv(ACCEPT_ENV)
    for version in ("2.13.0+cpu", "2.14.1+cu128", "2.15.0"):          # the same graphs: one file for all
        monkeypatch.setattr(torch, "__version__", version)
        assert_graphs_match("case", be, directory=tmp_path)
        assert_graphs_match("case", be.results[0], directory=tmp_path)  # a single PartitionResult reads the same
    # a release that partitions differently (here: the shared file says something else) fails, naming the fix
    shared.write_text(text.replace("i32[", "i64[", 1))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_x.py::test_y[case] (call)")
    with pytest.raises(AssertionError) as info:
        assert_graphs_match("case", be, directory=tmp_path)
    msg = str(info.value)
    assert "made with torch 2.13.0+cpu; this is torch 2.15.0" in msg and "case.torch-2.15.txt" in msg
    assert "EXPECTTEST_ACCEPT=1 python -m pytest 'tests/test_x.py::test_y[case]'" in msg
    assert re.search(r'^-.*"i64\[', msg, re.M) and re.search(r'^\+.*"i32\[', msg, re.M)
    # accepting on 2.15 writes 2.15's own file and leaves the shared one alone; 2.15 then reads its own
    monkeypatch.setenv(ACCEPT_ENV, "1")
    assert_graphs_match("case", be, directory=tmp_path)
    assert (tmp_path / "case.torch-2.15.txt").exists() and "i64[" in shared.read_text()
    monkeypatch.delenv(ACCEPT_ENV)
    assert_graphs_match("case", be, directory=tmp_path)
    monkeypatch.setattr(torch, "__version__", "2.14.1")
    with pytest.raises(AssertionError, match="case.torch-2.14.txt"):   # 2.14 has no file of its own
        assert_graphs_match("case", be, directory=tmp_path)
    # a release's own file that is wrong fails as a plain mismatch
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    own = tmp_path / "case.torch-2.15.txt"
    own.write_text(own.read_text().replace("i32[", "i16[", 1))
    with pytest.raises(AssertionError, match=r"differ from golden .*case\.torch-2\.15\.txt\. If the change is intended"):
        assert_graphs_match("case", be, directory=tmp_path)
    # once the shared file matches again, accepting on 2.15 removes 2.15's stale file
    shared.write_text(text)
    monkeypatch.setenv(ACCEPT_ENV, "1")
    assert_graphs_match("case", be, directory=tmp_path)
    assert not own.exists() and shared.read_text() == text
    # accepting on the release the shared file was made with rewrites the shared file
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    shared.write_text(text.replace("i32[", "i64[", 1))
    assert_graphs_match("case", be, directory=tmp_path)
    assert shared.read_text() == text and not own.exists()
    monkeypatch.delenv(ACCEPT_ENV)
    with pytest.raises(AssertionError, match=r"no golden file .*missing\.txt; write it with `EXPECTTEST_ACCEPT=1"):
        assert_graphs_match("missing", be, directory=tmp_path)


def test_golden_text_has_no_torch_made_names():
    """Node names come from the op and its order in the graph, not from torch's names (which carry
    process-wide counters and differ between releases): renaming every node of a forward and its backward
    leaves the text as it was; ops are spelled without ``torch.ops.`` and there are no deletion notes."""
    import copy

    from sacpass.graphs import CanonicalNames, normalized_graph
    result = build("toy_sacpass").results[0]

    def text(fwd, bwd):
        names = CanonicalNames()
        return normalized_graph(fwd, {}, names) + normalized_graph(bwd, {}, names)

    fwd, bwd = copy.deepcopy(result.forward), copy.deepcopy(result.backward)
    for gm in (fwd, bwd):
        for node in gm.graph.nodes:
            if node.op != "output" and not node.name.startswith(("primals_", "tangents_")):
                node.name = f"{node.name}_77"
    before = text(result.forward, result.backward)
    assert text(fwd, bwd) == before
    assert any(n.name.endswith("_77") for n in fwd.graph.nodes)
    assert "torch.ops." not in before and "aten.mm.default(primals_1, t)" in before and " = None" not in before
    assert 'topk_ids: "i32[24, 4]" = input' in before.split("return")[1]   # the saved value keeps its name


def test_report_golden_has_saved_table_only(tmp_path, monkeypatch):
    be = build("toy_sacpass")
    monkeypatch.setenv(ACCEPT_ENV, "1")
    assert_graphs_match("report", be.reports[0], directory=tmp_path)
    text = (tmp_path / "report.txt").read_text()
    assert "# saved" in text and "# forward" not in text
    assert "sacpass_toy::topk_ids.default" in text and "toy.py:" not in text  # file name, no line number


def test_default_directory_is_beside_the_calling_test(monkeypatch, tmp_path):
    assert expected_path("x") == os.path.join(EXPECTED, "x.txt")
    with pytest.raises(ValueError, match="file name"):
        expected_path("../escape")


@pytest.mark.slow
def test_golden_helper_refuses_graphs_from_the_cache(fresh_cache, tmp_path):
    from sacpass.testing import GoldenFromCacheError, no_compile_caches

    model, x = ToyLayer(), torch.randn(16, 32)
    compile_and_train(sacpass.backend(save=[TOPK]), model, x)
    torch._dynamo.reset()
    warm = sacpass.backend(save=[TOPK])
    compile_and_train(warm, model, x)
    assert warm.reports[0].from_cache
    os.environ["EXPECTTEST_ACCEPT"] = "1"
    try:
        with pytest.raises(GoldenFromCacheError, match="no_compile_caches"):
            assert_graphs_match("warm", warm, directory=tmp_path)
    finally:
        del os.environ["EXPECTTEST_ACCEPT"]
    assert not (tmp_path / "warm.txt").exists()  # nothing useless written
    torch._dynamo.reset()
    fresh = sacpass.backend(save=[TOPK])
    with no_compile_caches():
        compile_and_train(fresh, model, x)
    assert not fresh.reports[0].from_cache and fresh.results
