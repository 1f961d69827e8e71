"""The README: a short manual, and its quick-start example runs as written."""
import os
import re

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
README_MAX_LINES = 250  # the detail lives on the docs/ pages the README links


def test_readme_example_runs():
    text = open(README).read()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class Layer(torch.nn.Module)" in b]
    block = block.replace('sacpass.backend(save=["Indexer::aten::topk"])',
                          'sacpass.backend(save=["Indexer::aten::topk"], inner="aot_eager")')
    scope = {"__name__": "readme"}
    exec(compile(block, "README.md", "exec"), scope)
    report = scope["be"].reports[0]
    # an explicitly saved top-k is kept as a discrete decision: its indices narrowed to int32, its values rebuilt
    kept = [(s.op, s.dtype, s.reason) for s in report.saved if s.reason != "graph input"]
    assert kept == [("aten::topk.default", "int32", "discrete")]
    assert "aten::topk.default" not in report.recomputed


def test_readme_is_a_short_manual():
    lines = open(README).read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to a docs/ page"
