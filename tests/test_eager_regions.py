"""Checkpointed regions that run eagerly under a sacpass compile, and finding regions and their module scope
in code whose source cannot be read (``python -c``, ``exec``)."""
import functools
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import sacpass
import sacpass.graph_breaks as gb
from sacpass.testing import OpCounter
from tests.support.toy import BreakingLayer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Model(nn.Module):
    def __init__(self, context_fn=None):
        super().__init__()
        self.layers = nn.ModuleList(BreakingLayer() for _ in range(2))
        self.context_fn = context_fn

    def forward(self, x):
        for layer in self.layers:
            kw = {"context_fn": self.context_fn} if self.context_fn is not None else {}
            x = checkpoint(layer, x, use_reentrant=False, **kw)
        return x.tanh()


def _run(be, context_fn):
    """Build a model (always at this line), compile and step it: (eager-region warnings, backward top-k runs)."""
    torch._dynamo.reset()
    model = Model(context_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend=be)(torch.randn(8, 16, requires_grad=True))
        with OpCounter("aten::topk") as calls:
            out.sum().backward()
    eager = [str(w.message) for w in caught if issubclass(w.category, sacpass.SacpassWarning)
             and "runs eagerly" in str(w.message)]
    return eager, calls.count("backward", "aten::topk")


def test_warns_exactly_where_the_policy_does_not_hold():
    gb._REGIONS.clear()
    be = sacpass.backend(inner="aot_eager")
    eager, replays = _run(be, be.context_fn())
    assert eager == [] and replays == 0  # the context applies the policy: the top-k is not replayed
    assert [r.holds for r in gb.eager_regions()] == [True]

    eager, replays = _run(be, None)  # the same model, built at the same line, without the context
    assert replays == 2  # both layers replay their top-k
    assert len(eager) == 1, eager
    assert "layers.0 (BreakingLayer)" in eager[0] and "test_eager_regions.py" in eager[0]
    assert "context_fn=backend.context_fn()" in eager[0] and "fullgraph=True" in eager[0]

    eager, _ = _run(be, None)  # the same region and context again: said once
    assert eager == []


def test_a_context_with_another_policy_is_named():
    gb._REGIONS.clear()
    be = sacpass.backend(inner="aot_eager")
    eager, replays = _run(be, sacpass.context_fn(save_discrete=False))
    assert replays == 2
    assert len(eager) == 1 and "save=[]" in eager[0] and "not this backend's" in eager[0], eager
    assert "context_fn=backend.context_fn()" in eager[0]


SCRIPT = textwrap.dedent("""
    import functools, warnings
    import torch, torch.nn as nn
    import sacpass
    from torch.utils.checkpoint import checkpoint

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, scale=1.0):
            return torch.sin(self.lin(x)) * scale

    class Breaking(Layer):
        def forward(self, x, scale=1.0):
            y = self.lin(x)
            torch._dynamo.graph_break()
            return torch.sin(y) * scale

    class Model(nn.Module):
        def __init__(self, cls):
            super().__init__()
            self.layers = nn.ModuleList(cls() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:  # transformers' GradientCheckpointingLayer form (modeling_layers.py)
                x = checkpoint(functools.partial(type(layer).forward, layer, scale=2.0), x, use_reentrant=False)
            return x

    be = sacpass.backend(save=["Layer::aten::sin"], inner="aot_eager")
    torch.compile(Model(Layer), backend=be)(torch.randn(4, 8, requires_grad=True)).sum().backward()
    SCOPED = sorted({t["module"] for r in be.reports for t in r.tagged if t["selector"] == "Layer::aten::sin"})

    torch._dynamo.reset()
    other = sacpass.backend(inner="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(Model(Breaking), backend=other)(torch.randn(4, 8, requires_grad=True)).sum().backward()
    EAGER = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
""")


# ------------------------------------------------------------------ every checkpoint form names its module
class Counting(nn.Module):
    """A layer whose body Dynamo cannot trace (a Python int read off a tensor), so a checkpoint around it runs
    eagerly."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        y = self.lin(x)
        n = int((y > 0).sum())  # a data-dependent Python value: a graph break
        return torch.sin(y) * scale + 0 * n


def _checkpoint_wrapped(layer):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(layer)


# how the model's forward checkpoints a layer: what transformers, torchtitan and plain PyTorch code write
FORMS = {
    # transformers >= 5 (GradientCheckpointingLayer, modeling_layers.py): the class's forward, the module first
    "transformers": lambda layer: functools.partial(type(layer).forward, layer, scale=2.0),
    "partial of __call__": lambda layer: functools.partial(layer.__call__, scale=2.0),  # transformers 4.x
    "bound method": lambda layer: layer.forward,
    "lambda": lambda layer: (lambda x: layer(x, scale=2.0)),
    "module": lambda layer: layer,
}


class Looping(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.layers = nn.ModuleList(Counting() for _ in range(2))
        self.form = form

    def forward(self, x):
        for layer in self.layers:
            if self.form == "checkpoint_wrapper":  # torchtitan, FSDP: the wrapper module checkpoints its child
                x = layer(x)
            else:
                x = checkpoint(FORMS[self.form](layer), x, use_reentrant=False)
        return x


def _eager_regions_of(model) -> tuple[list[str], list[str]]:
    """Step the model: (the modules of the regions that ran eagerly, the warnings about them)."""
    gb._REGIONS.clear()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    return [r.module for r in gb.eager_regions()], [str(w.message) for w in caught if "eagerly" in str(w.message)]


@pytest.mark.parametrize("form", [*FORMS, "checkpoint_wrapper"])
def test_every_checkpoint_form_names_the_module_of_its_region(form):
    model = Looping(form)
    if form == "checkpoint_wrapper":
        model.layers = nn.ModuleList(_checkpoint_wrapped(layer) for layer in model.layers)
    be = sacpass.backend(inner="aot_eager")
    regions, _ = _eager_regions_of(torch.compile(model, backend=be))
    if form == "checkpoint_wrapper":  # Dynamo gives up on the loop, then compiles the wrapper's forward once
        assert regions == [f"layers.{i}._checkpoint_wrapped_module (Counting)" for i in range(2)]
    else:  # Dynamo gives up on the loop at its first checkpoint; the rest of the frame runs in eager PyTorch
        assert regions == ["layers.0 (Counting)"]


class SelfCheckpointing(Counting):
    """transformers' GradientCheckpointingLayer: the layer's own forward checkpoints its body."""

    def forward(self, x):
        return checkpoint(functools.partial(Counting.forward, self, scale=2.0), x, use_reentrant=False)


class Stack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = nn.ModuleList(SelfCheckpointing() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.stack = Stack()

    def forward(self, x):
        return self.stack(x).tanh()


def test_each_layer_compiled_on_its_own_is_its_own_region_named_by_its_full_path():
    be = sacpass.backend(inner="aot_eager")
    model = Decoder()
    for layer in model.stack.layers:
        layer.compile(backend=be)
    regions, eager = _eager_regions_of(model)
    assert regions == [f"stack.layers.{i} (SelfCheckpointing)" for i in range(3)], regions
    assert len(eager) == 1 and "stack.layers.2 (SelfCheckpointing)" in eager[0], eager  # one graph break


def _check(scoped, eager):
    assert scoped == ["layers.0", "layers.1"], scoped
    assert len(eager) == 1 and "layers.0 (Breaking)" in eager[0], eager


def test_module_scope_and_regions_in_exec_code():
    namespace = {"__name__": "generated"}
    gb._REGIONS.clear()
    exec(SCRIPT, namespace)  # file "<string>": Dynamo keeps no stack trace of it
    _check(namespace["SCOPED"], namespace["EAGER"])


@pytest.mark.slow
def test_module_scope_and_regions_in_python_c():
    script = SCRIPT + "\nprint(repr((SCOPED, EAGER)))\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _check(*eval(r.stdout.strip().splitlines()[-1]))
