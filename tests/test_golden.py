"""Golden forward/backward graphs: one file per case in tests/expected_graphs/ (``pytest -m golden``).

The cases (tests/golden_cases.py) compile with ``inner="aot_eager"``: the same sacpass partition as
Inductor, executed eagerly, so the whole file runs in about two minutes on two CPU cores. Goldens are made
with one torch version (recorded in each file) and skip under another. After an intended change:
``EXPECTTEST_ACCEPT=1 python -m pytest -m golden tests/test_golden.py`` and review the diff of the files.
"""
import os
import shutil

import pytest
import torch

import golden_cases
import sacpass
from golden_cases import CASES, GLM_CASES, build, glm_available
from sacpass.testing import ACCEPT_ENV, assert_graphs_match, expected_path
from toy import ToyLayer, compile_and_train

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
    if not os.path.exists(expected_path("toy_sacpass", EXPECTED)):
        pytest.skip("tests/expected_graphs/toy_sacpass.txt not written yet (run with EXPECTTEST_ACCEPT=1)")
    be = golden_cases._toy(golden_cases._aot())  # a fresh compile, no policy
    with pytest.raises(AssertionError) as info:
        assert_graphs_match("toy_sacpass", be, directory=EXPECTED)
    diff = str(info.value)
    assert "@@" in diff and "EXPECTTEST_ACCEPT=1" in diff
    removed = [ln for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    added = [ln for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert any("MUST_SAVE topk_ids" in ln for ln in removed)
    # the backward now calls the top-k op again
    assert any("torch.ops.sacpass_toy.topk_ids.default" in ln for ln in added)


@pytest.mark.slow
def test_corrupting_one_expected_file_fails_exactly_that_case(tmp_path, monkeypatch):
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    names = [n for n in [*CASES, *GLM_CASES]
             if os.path.exists(expected_path(n, EXPECTED)) and (n in CASES or glm_available())]
    if "toy_sacpass" not in names:
        pytest.skip("goldens not written yet (run with EXPECTTEST_ACCEPT=1)")
    made_with = open(expected_path("toy_sacpass", EXPECTED)).read().splitlines()[1].removeprefix("# torch ")
    if made_with.split("+")[0] != torch.__version__.split("+")[0]:
        pytest.skip(f"the goldens were made with torch {made_with}; this is torch {torch.__version__}: they skip "
                    f"here, so a corrupted one cannot fail")
    copy = tmp_path / "expected_graphs"
    shutil.copytree(EXPECTED, copy)
    target = copy / "toy_sacpass.txt"
    target.write_text(target.read_text().replace("int32[", "int64[", 1))
    failed = []
    for name in names:
        try:
            assert_graphs_match(name, build(name), directory=copy)
        except AssertionError as e:
            failed.append(name)
            assert "int64[" in str(e) and "int32[" in str(e)
        except pytest.skip.Exception:  # made with another torch version: neither pass nor fail
            pass
    assert failed == ["toy_sacpass"]


def test_accept_writes_and_version_mismatch_skips(tmp_path, monkeypatch):
    be = build("toy_sacpass")
    monkeypatch.setenv(ACCEPT_ENV, "1")
    assert_graphs_match("case", be, directory=tmp_path)
    text = (tmp_path / "case.txt").read_text()
    import torch
    assert text.splitlines()[1] == f"# torch {torch.__version__}"
    monkeypatch.delenv(ACCEPT_ENV)
    assert_graphs_match("case", be, directory=tmp_path)  # matches what it just wrote
    assert_graphs_match("case", be.results[0], directory=tmp_path)  # a single PartitionResult reads the same
    with pytest.raises(AssertionError, match="no golden file"):
        assert_graphs_match("missing", be, directory=tmp_path)
    (tmp_path / "case.txt").write_text(text.replace(f"# torch {torch.__version__}", "# torch 2.99.0", 1))
    with pytest.raises(pytest.skip.Exception) as info:
        assert_graphs_match("case", be, directory=tmp_path)
    assert "2.99.0" in str(info.value) and torch.__version__ in str(info.value)


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
