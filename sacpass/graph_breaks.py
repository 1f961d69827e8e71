"""Checkpointed regions Dynamo runs eagerly under a sacpass compile, and why.

A graph break inside a checkpoint body (a data-dependent shape, an unsupported call) makes Dynamo give up
on the whole ``checkpoint(...)`` call, or on the whole frame when the call sits in a loop over layers: the
region then runs in eager PyTorch, outside every graph sacpass partitions, and its backward replays the
top-k again. Dynamo reports each graph break, with its user stack, on its ``graph_breaks`` log; sacpass
listens there (a handler on that one logger, which stops it from propagating so nothing extra is printed
unless ``TORCH_LOGS`` asked for it) and, when the stack runs through a checkpoint call and the compile uses
a sacpass backend, warns once per region, naming Dynamo's reason.
"""
from __future__ import annotations

import linecache
import logging
import re
from dataclasses import dataclass

from .errors import warn

__all__ = ["EagerRegion", "watch", "eager_regions", "hint"]

_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


@dataclass(frozen=True)
class EagerRegion:
    """A checkpointed region Dynamo ran eagerly."""

    call_site: str  # "file.py:line" of the checkpoint call
    break_site: str  # "file.py:line" of the graph break inside the body
    reason: str  # Dynamo's reason, its first lines

    def describe(self) -> str:
        return (f"the checkpointed region called at {self.call_site} runs eagerly: Dynamo could not trace its body "
                f"(graph break at {self.break_site}: {self.reason})")


_REGIONS: dict[tuple[str, str], EagerRegion] = {}
_installed = False


def eager_regions() -> list[EagerRegion]:
    """Every region seen running eagerly under a sacpass compile in this process, in order."""
    return list(_REGIONS.values())


def hint() -> str:
    """Text for errors: which regions ran eagerly (empty when none)."""
    if not _REGIONS:
        return ""
    return (" Note: " + "; ".join(r.describe() for r in _REGIONS.values()) + ". Ops in such a region never reach "
            "a sacpass graph: fix the graph break (fullgraph=True points at it) or pass "
            "context_fn=sacpass.context_fn(...) to that checkpoint.")


def _short(path: str, line: str) -> str:
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def _reason(message: str) -> str:
    text = message.split("Graph Break Reason:", 1)[-1]
    text = text.split("User code traceback:", 1)[0]
    if "Graph break encountered:" in text:
        text = text.split("Graph break encountered:", 1)[1]
    lines = [ln.strip() for ln in text.strip().splitlines()]
    keep = [ln for ln in lines if ln][:1]
    keep += [ln for ln in lines if ln.startswith(("Explanation:", "Hint:"))][:2]
    return " ".join(keep)


def _frames(message: str) -> list[tuple[str, str, str, str]]:
    """(file, line, function, source) of each frame of the user traceback."""
    out = []
    lines = message.split("User code traceback:", 1)[-1].splitlines()
    for i, ln in enumerate(lines):
        m = _FRAME.match(ln)
        if not m:
            continue
        src = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
        src = src or linecache.getline(m["file"], int(m["line"])).strip()
        out.append((m["file"], m["line"], m["func"], src))
    return out


def region_of(message: str) -> EagerRegion | None:
    """The region a graph-break message speaks of, when its stack runs through a checkpoint call."""
    frames = [f for f in _frames(message) if "/torch/" not in f[0] or "/torch/utils/checkpoint.py" in f[0]]
    for i, (file, line, func, src) in enumerate(frames[:-1]):
        if "checkpoint" in src or "/torch/utils/checkpoint.py" in file:
            last = frames[-1]
            return EagerRegion(_short(file, line), _short(last[0], last[1]), _reason(message))
    return None


def _compiling_with_sacpass() -> bool:
    from torch._dynamo.symbolic_convert import InstructionTranslator

    from .backend import Backend

    tx = InstructionTranslator.current_tx()
    fn, seen = getattr(getattr(tx, "output", None), "compiler_fn", None), 0
    while fn is not None and seen < 8:
        if isinstance(fn, Backend) or getattr(fn, "__module__", "") == "sacpass.backend":
            return True
        fn = (getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
              or getattr(fn, "_compiler_fn", None))
        seen += 1
    return False


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            region = region_of(message) if "User code traceback:" in message else None
            if region is None or not _compiling_with_sacpass():
                return
        except Exception:  # a log handler must never break the compile
            return
        key = (region.call_site, region.break_site)
        if key in _REGIONS:
            return
        _REGIONS[key] = region
        warn(f"sacpass: {region.describe()}. sacpass's policy does not apply there: its backward recomputes it "
             f"(the top-k included). Fix the graph break (compile with fullgraph=True to see it as an error), or "
             f"pass context_fn=sacpass.context_fn(...) (or backend.context_fn()) to that checkpoint so the policy "
             f"holds in eager too.")


def watch() -> None:
    """Listen to Dynamo's graph-break log (once per process)."""
    global _installed
    if _installed:
        return
    import torch._logging._internal as internal

    logger = logging.getLogger(_LOGGER)
    if not internal.log_state.is_artifact_enabled("graph_breaks"):  # TORCH_LOGS did not ask for them
        logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_Handler())
    _installed = True
