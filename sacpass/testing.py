"""Golden graph tests for users: pin what a compiled layer saves and recomputes, fail when it moves.

::

    be = sacpass.backend(save=[...], inner="aot_eager")
    torch.compile(layer, backend=be, fullgraph=True)(x).sum().backward()
    sacpass.testing.assert_graphs_match("my_layer", be)

File-based, through ``expecttest``: the expected text lives in ``expected_graphs/<name>.txt`` next to the
calling test file (or in ``directory=``). ``EXPECTTEST_ACCEPT=1 pytest ...`` (expecttest's switch, read the way
its ``assertExpectedInline`` reads it) writes or rewrites it; a mismatch fails through ``expecttest.assert_eq``
with its unified diff, then the one command that rewrites the file.

Small partitions can be pinned inline instead, as PyTorch's own tests pin graphs::

    class MyLayerTest(expecttest.TestCase):
        def test_partition(self):
            self.assertExpectedInline(sacpass.testing.golden_text(be.results[0]), '''...''')

One golden holds on every torch release: the text (:mod:`sacpass.graphs`) has no torch-made node names,
printing or op spellings, so it changes only when the partition does. Where a release really partitions
differently (it decomposes an op another way, say), that release gets its own file,
``<name>.torch-<major>.<minor>.txt``, which is read instead of ``<name>.txt`` on that release:

- comparing on torch X.Y reads ``<name>.torch-X.Y.txt`` if it exists, else ``<name>.txt``; a mismatch fails,
  naming the command that writes the file for this release;
- accepting on torch X.Y writes ``<name>.txt`` when there is none, or when it was made on X.Y (a change of the
  graphs themselves); else, when this release's graphs differ from ``<name>.txt``, it writes
  ``<name>.torch-X.Y.txt``, and when they match it removes a stale one.
"""
from __future__ import annotations

import contextlib
import os
import re

import torch

from .frames import first_outside
from .graphs import graph_text, report_text
from .report import Report

__all__ = ["assert_graphs_match", "golden_text", "expected_path", "release_path", "release", "accept_command",
           "ACCEPT_ENV", "OpCounter", "no_compile_caches"]

ACCEPT_ENV = "EXPECTTEST_ACCEPT"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_HEADER = "# sacpass golden graphs: {name}"
_VERSION = "# torch {version}"
_HOWTO = "# regenerate: EXPECTTEST_ACCEPT=1 pytest <this test>  (see sacpass.testing)"


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


def release(version: str | None = None) -> str:
    """``"2.15"`` for torch 2.15.0 (or ``version``): the part of a version a golden file is chosen by."""
    parts = (version or torch.__version__).split("+")[0].split(".")
    return ".".join(parts[:2])


def release_path(path: str, version: str | None = None) -> str:
    """The golden file of one torch release beside ``path``: ``<name>.torch-2.15.txt``."""
    return f"{path[:-len('.txt')]}.torch-{release(version)}.txt"


def _compose(name: str, body: str) -> str:
    return "\n".join([_HEADER.format(name=name), _VERSION.format(version=torch.__version__), _HOWTO, body])


def _split(text: str) -> tuple[str | None, str]:
    """(torch version, body) of a golden file; version None when the header is missing."""
    lines = text.split("\n")
    if len(lines) < 3 or not lines[0].startswith("# sacpass golden graphs:") or not lines[1].startswith("# torch "):
        return None, text
    body_start = 3 if lines[2].startswith("# regenerate:") else 2
    return lines[1][len("# torch "):].strip(), "\n".join(lines[body_start:])


def _read(path: str) -> tuple[str, str]:
    with open(path) as f:
        version, body = _split(f.read())
    if version is None:
        raise AssertionError(f"sacpass: {path} has no sacpass golden header; rewrite it with {ACCEPT_ENV}=1.")
    return version, body


def _expecttest():
    """expecttest, which decides acceptance and reports mismatches for file and inline goldens alike."""
    try:
        import expecttest
    except ImportError as e:
        raise ImportError("sacpass.testing: golden graph tests need expecttest; pip install expecttest (it comes "
                          "with sacpass's test extra: pip install 'sacpass[test]').") from e
    return expecttest


def _accepting() -> bool:
    """Whether this run writes goldens instead of comparing: ``EXPECTTEST_ACCEPT`` set to anything non-empty,
    read at each call, as expecttest's ``assertExpectedInline`` reads it."""
    return bool(os.getenv(ACCEPT_ENV))


def accept_command() -> str:
    """The command that rewrites the goldens of the running test: ``EXPECTTEST_ACCEPT=1 python -m pytest
    '<its node id>'`` under pytest, else a generic one."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    node = current.rsplit(" (", 1)[0] if current else "<this test>"
    return f"{ACCEPT_ENV}=1 python -m pytest '{node}'" if current else f"{ACCEPT_ENV}=1 pytest <this test>"


def _accept(name: str, path: str, actual: str) -> None:
    """Write what acceptance writes (see the module docstring)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    mine = release_path(path)
    target = path
    if os.path.exists(path):
        version, shared = _read(path)
        if release(version) != release():
            if shared == actual:
                if os.path.exists(mine):
                    os.remove(mine)
                return
            target = mine
    if target == path and os.path.exists(mine):
        os.remove(mine)         # this release's file would shadow the one just written
    with open(target, "w") as f:
        f.write(_compose(name, actual))
    return target


def assert_graphs_match(name: str, obj, *, directory: str | os.PathLike | None = None) -> None:
    """Compare the normalised graphs of ``obj`` (a Backend, PartitionResult or Report) with the golden file
    ``name`` of this torch release (``<name>.torch-X.Y.txt`` if there is one, else ``<name>.txt``).
    ``EXPECTTEST_ACCEPT=1`` writes the file instead; a mismatch or a missing file raises AssertionError with a
    unified diff and the command that writes it. Graphs served by a compile cache are refused
    (:class:`GoldenFromCacheError`), in both modes: compile under :func:`no_compile_caches`."""
    __tracebackhide__ = True  # pytest shows the caller's line and the diff, not this helper's source
    expecttest = _expecttest()
    path = expected_path(name, directory)
    actual = golden_text(obj)
    if _accepting():
        _accept(name, path, actual)
        return
    mine = release_path(path)
    chosen = mine if os.path.exists(mine) else path
    if not os.path.exists(chosen):
        raise AssertionError(f"sacpass: no golden file {path}; write it with `{accept_command()}`, then review "
                             f"and commit it.")
    version, expected = _read(chosen)
    if expected == actual:
        return
    if chosen == path and release(version) != release():
        how = (f"It was made with torch {version}; this is torch {torch.__version__}. If this release partitions "
               f"differently by design, `{accept_command()}` writes {os.path.basename(mine)} for torch "
               f"{release()} (read instead of {os.path.basename(path)} here); if the graphs changed for every "
               f"release, rewrite {os.path.basename(path)} on torch {release(version)}.")
    else:
        how = f"If the change is intended, rewrite it with `{accept_command()}` and review the new file."
    expecttest.assert_eq(expected, actual, msg=f"sacpass: compiled graphs differ from golden {chosen}. {how} "
                                               f"(expected: written with torch {version}; actual: torch "
                                               f"{torch.__version__})")


class OpCounter:
    """Counts, at run time, how often chosen ops execute in the forward and in the backward.

    ::

        with sacpass.testing.OpCounter("glm52::dsa_topk_indices") as topk:
            model(x).sum().backward()
        assert topk.backward == 0        # the backward never re-ran the top-k

    A ``TorchDispatchMode`` that ignores compile internals: it counts real executions (eager code, the
    graphs ``aot_eager`` runs and the extern kernels Inductor calls), never the fake runs of tracing. An op
    counts as backward when it runs while autograd executes a backward node (a recompute, a custom op's
    backward). Ops are OpOverloads, OpOverloadPackets or strings ``"ns::op"`` / ``"ns::op.overload"``;
    :meth:`decisions` counts every discrete decision instead.
    """

    def __init__(self, *ops):
        if not ops:
            raise ValueError("sacpass.testing.OpCounter: name at least one op to count, or use "
                             "OpCounter.decisions() to count every discrete decision.")
        self._setup(tuple(_op_key(op) for op in ops), decisions=False)

    def _setup(self, match: tuple, decisions: bool) -> None:
        self._match, self._decisions = match, decisions  # the ops named, or every discrete decision
        self.counts: dict[tuple[str, str], int] = {}
        self._mode = None

    @classmethod
    def decisions(cls) -> "OpCounter":
        """A counter of every discrete decision, told by the values it ran on as sacpass tells them
        (``save_discrete``): top-k, sort, argmax, max/min along a dim, ..., and custom ops returning an
        integer tensor computed from a floating-point input. ``assert counter.backward == 0``: no decision
        was made again in the backward."""
        counter = cls.__new__(cls)
        counter._setup((), decisions=True)
        return counter

    def _hit(self, func, inputs=(), out=None) -> None:
        name = func._schema.name
        overload = func._overloadname or "default"
        if self._decisions:
            from .selectors import is_discrete_op, tensors_in

            hit = is_discrete_op(func, tensors_in(list(inputs)), out)
        else:
            hit = any(packet == name and (ov is None or ov == overload) for packet, ov in self._match)
        if hit:
            phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
            key = (f"{name}.{overload}", phase)
            self.counts[key] = self.counts.get(key, 0) + 1

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
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                inputs = [*args, *kwargs.values()]
                if isinstance(func, torch._ops.OpOverload):
                    counter._hit(func, inputs, out)
                else:
                    for op in [a for a in args if isinstance(a, torch._ops.OpOverload)]:
                        counter._hit(op, inputs, out)
                return out

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
