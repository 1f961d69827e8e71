"""The README: its backend example runs as written and its options table lists every backend option."""
import os
import re



README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


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


def test_readme_documents_every_backend_option():
    readme = open(README).read()
    from sacpass.options import VALID_OPTIONS
    for option in VALID_OPTIONS:
        assert f"| `{option}` |" in readme, option
