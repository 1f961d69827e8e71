"""Golden graph tests for users: pin what a compiled layer saves and recomputes, fail when it moves.

::

    be = sacpass.backend(save=[...], inner="aot_eager")
    torch.compile(layer, backend=be, fullgraph=True)(x).sum().backward()
    sacpass.testing.assert_graphs_match("my_layer", be)

File-based, in the spirit of ``expecttest``: the expected text lives in ``expected_graphs/<name>.txt`` next to
the calling test file (or in ``directory=``). ``EXPECTTEST_ACCEPT=1 pytest ...`` writes or rewrites it; a
mismatch fails with a unified diff. Each file records the torch version it was made with; under another
torch version the test is skipped (the partitioner and node naming change between releases).
"""
from __future__ import annotations

import contextlib
import difflib
import os
import re

import torch

from .frames import first_outside
from .graphs import graph_text, report_text
from .report import Report

__all__ = ["assert_graphs_match", "golden_text", "expected_path", "ACCEPT_ENV", "OpCounter", "no_compile_caches"]

ACCEPT_ENV = "EXPECTTEST_ACCEPT"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_HEADER = "# sacpass golden graphs: {name}"
_VERSION = "# torch {version}"
_HOWTO = "# regenerate: EXPECTTEST_ACCEPT=1 pytest <this test>"


def golden_text(obj) -> str:
    """The normalised text of a Backend (every graph it compiled), a PartitionResult or a Report."""
    __tracebackhide__ = True
    from .compiler import Backend
    from .partitioner import PartitionResult

    if isinstance(obj, PartitionResult):
        return graph_text(obj)
    if isinstance(obj, Report):
        return report_text(obj)
    if isinstance(obj, Backend):
        if not obj.reports:
            raise ValueError("sacpass.testing: the backend has compiled nothing yet; run the compiled model "
                             "forward and backward before comparing its graphs.")
        cached = [r.graph for r in obj.reports if r.from_cache]
        if cached:
            raise GoldenFromCacheError(
                f"sacpass.testing: graph(s) {', '.join(cached)} came from PyTorch's AOTAutograd cache, so their "
                f"forward and backward graphs were never built in this process and cannot be compared or written. "
                f"Compile the model under `with sacpass.testing.no_compile_caches():` (or set "
                f"torch._functorch.config.enable_autograd_cache=False and "
                f"torch._inductor.config.fx_graph_cache=False), call torch._dynamo.reset(), and run again.")
        region_ids: dict = {}  # one renumbering of checkpoint regions over the whole backend
        return "\n".join(graph_text(result, region_ids=region_ids) for result in obj.results)
    raise TypeError(f"sacpass.testing: cannot compare {type(obj).__name__!r}; pass a sacpass Backend, a "
                    f"PartitionResult (backend.results[i]) or a Report (backend.reports[i]).")


class GoldenFromCacheError(AssertionError):
    """The graphs to compare were served by a compile cache; there is nothing to compare."""


@contextlib.contextmanager
def no_compile_caches():
    """Compile with the FX-graph and AOTAutograd caches off, so every partition runs (and a golden test sees
    its graphs). Use around the first call of the compiled model."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller_dir() -> str:
    """Folder of the first caller outside sacpass (the user's test file)."""
    found = first_outside(lambda path: path.startswith(_PACKAGE))
    return os.path.dirname(os.path.abspath(found[1].f_code.co_filename)) if found else os.getcwd()


def expected_path(name: str, directory: str | os.PathLike | None = None) -> str:
    """Where the golden file ``name`` lives: ``directory/<name>.txt``, by default ``expected_graphs/`` beside
    the calling test file."""
    if not _NAME.match(name):
        raise ValueError(f"sacpass.testing: golden name {name!r} may only use letters, digits, '_', '-', '.'; "
                         f"it becomes a file name.")
    folder = os.fspath(directory) if directory is not None else os.path.join(_caller_dir(), "expected_graphs")
    return os.path.join(folder, f"{name}.txt")


def _base_version(version: str) -> str:
    return version.split("+")[0]


def _skip(msg: str):
    try:
        import pytest
    except ImportError:  # plain unittest
        import unittest
        raise unittest.SkipTest(msg) from None
    pytest.skip(msg)


def _compose(name: str, body: str) -> str:
    return "\n".join([_HEADER.format(name=name), _VERSION.format(version=torch.__version__), _HOWTO, body])


def _split(text: str) -> tuple[str | None, str]:
    """(torch version, body) of a golden file; version None when the header is missing."""
    lines = text.split("\n")
    if len(lines) < 3 or not lines[0].startswith("# sacpass golden graphs:") or not lines[1].startswith("# torch "):
        return None, text
    body_start = 3 if lines[2].startswith("# regenerate:") else 2
    return lines[1][len("# torch "):].strip(), "\n".join(lines[body_start:])


def assert_graphs_match(name: str, obj, *, directory: str | os.PathLike | None = None) -> None:
    """Compare the normalised graphs of ``obj`` (a Backend, PartitionResult or Report) with the golden file
    ``name``. ``EXPECTTEST_ACCEPT=1`` writes the file instead; a mismatch raises AssertionError with a
    unified diff; a file made under another torch version skips the test. Graphs served by a compile cache
    are refused (:class:`GoldenFromCacheError`), in both modes: compile under :func:`no_compile_caches`."""
    __tracebackhide__ = True  # pytest shows the caller's line and the diff, not this helper's source
    path = expected_path(name, directory)
    actual = golden_text(obj)
    accept = os.environ.get(ACCEPT_ENV, "") not in ("", "0")
    if accept:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(_compose(name, actual))
        return
    if not os.path.exists(path):
        raise AssertionError(f"sacpass: no golden file {path}; run the test with {ACCEPT_ENV}=1 to write it, "
                             f"then review and commit it.")
    with open(path) as f:
        version, expected = _split(f.read())
    if version is None:
        raise AssertionError(f"sacpass: {path} has no sacpass golden header; rewrite it with {ACCEPT_ENV}=1.")
    if _base_version(version) != _base_version(torch.__version__):
        _skip(f"sacpass golden {name!r} was made with torch {version}; this is torch {torch.__version__}. "
              f"Run with {ACCEPT_ENV}=1 to regenerate it for this version.")
    if expected == actual:
        return
    diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), actual.splitlines(keepends=True),
                                        fromfile=f"{path} (expected)", tofile=f"{name} (actual)"))
    raise AssertionError(f"sacpass: compiled graphs differ from golden {path}. If the change is intended, "
                         f"rerun with {ACCEPT_ENV}=1 and review the new file.\n{diff}")


class OpCounter:
    """Counts, at run time, how often chosen ops execute in the forward and in the backward.

    ::

        with sacpass.testing.OpCounter("glm52::dsa_topk_indices") as topk:
            model(x).sum().backward()
        assert topk.backward == 0        # the backward never re-ran the top-k

    A ``TorchDispatchMode`` that ignores compile internals: it counts real executions (eager code, the
    graphs ``aot_eager`` runs and the extern kernels Inductor calls), never the fake runs of tracing. An op
    counts as backward when it runs while autograd executes a backward node (a recompute, a custom op's
    backward). Ops are OpOverloads, OpOverloadPackets or strings ``"ns::op"`` / ``"ns::op.overload"``.
    """

    def __init__(self, *ops):
        if not ops:
            raise ValueError("sacpass.testing.OpCounter: name at least one op to count.")
        self._match = tuple(_op_key(op) for op in ops)
        self.counts: dict[tuple[str, str], int] = {}
        self._mode = None

    def _hit(self, func) -> None:
        name = func._schema.name
        overload = func._overloadname or "default"
        for packet, ov in self._match:
            if packet == name and (ov is None or ov == overload):
                phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
                key = (f"{name}.{overload}", phase)
                self.counts[key] = self.counts.get(key, 0) + 1
                return

    def count(self, phase: str | None = None, op: str | None = None) -> int:
        """Executions in ``phase`` ("forward", "backward" or None for both) of ``op`` (None: all)."""
        return sum(n for (name, ph), n in self.counts.items()
                   if (phase is None or ph == phase) and (op is None or name.startswith(op)))

    @property
    def forward(self) -> int:
        return self.count("forward")

    @property
    def backward(self) -> int:
        return self.count("backward")

    @property
    def total(self) -> int:
        return self.count()

    def reset(self) -> None:
        self.counts.clear()

    def __enter__(self) -> "OpCounter":
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            supports_higher_order_operators = True  # auto_functionalized / with_effects wrap the op counted

            @classmethod
            def ignore_compile_internals(cls):
                return True

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if isinstance(func, torch._ops.OpOverload):
                    counter._hit(func)
                else:
                    for op in [a for a in args if isinstance(a, torch._ops.OpOverload)]:
                        counter._hit(op)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)

    def __repr__(self) -> str:
        return f"OpCounter(forward={self.forward}, backward={self.backward})"


def _op_key(op) -> tuple[str, str | None]:
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name, op._overloadname or "default"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name, None
    if isinstance(op, str) and "::" in op:
        name, _, overload = op.partition(".")
        return name, overload or None
    raise ValueError(f"sacpass.testing.OpCounter: {op!r} is not an op; pass torch.ops.ns.op, "
                     f"torch.ops.ns.op.overload or 'ns::op'.")
