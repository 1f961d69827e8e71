"""The README's backend example runs as written."""
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
    # the int32 narrowing of the int64 top-k indices is what is saved
    assert [(s.dtype, s.reason) for s in report.saved if s.reason == "must-save"] == [("int32", "must-save")]
