"""Checkpointed regions Dynamo runs eagerly under a sacpass compile, and whether sacpass's policy holds there.

A graph break inside a checkpoint body (a data-dependent shape, an unsupported call) makes Dynamo give up
on the whole ``checkpoint(...)`` call, or on the whole frame when the call sits in a loop over layers: the
region then runs in eager PyTorch, outside every graph sacpass partitions. Its backward replays the top-k
again unless the checkpoint was given ``context_fn=sacpass.context_fn(...)`` (or ``backend.context_fn()``),
which applies the policy in eager too.

Dynamo reports each graph break on its ``graph_breaks`` log while the exception that caused it is being
handled; Dynamo tags an exception raised while tracing a checkpoint body with the checkpoint's name, and the
checkpoint's tracing frame holds the checkpointed function and the ``context_fn`` it was given. sacpass
listens on that one logger (a handler that stops it from propagating, so nothing extra is printed unless
``TORCH_LOGS`` asked for it). For a region of a sacpass compile it finds the module the region checkpoints
(its path relative to the compiled module) and the context, and warns once per region and context when the
backend's policy does not hold there; when it holds, it logs one line at INFO on the ``sacpass`` logger.
Nothing here reads a source file: code without one (``python -c``, ``exec``) is covered the same way.
"""
from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from .errors import warn
from .frames import innermost_frame, site, traceback_locals

__all__ = ["EagerRegion", "watch", "eager_regions", "hint"]

_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
_CHECKPOINT_HOP = "torch.utils.checkpoint.checkpoint"  # the name Dynamo tags checkpoint-body errors with
_log = logging.getLogger("sacpass")

# how the region's checkpoint was called: no context_fn, sacpass's context with the backend's policy, sacpass's
# context with another policy, or a context of its own
NO_CONTEXT, SAME_POLICY, OTHER_POLICY, FOREIGN = "none", "sacpass", "other-policy", "foreign"


@dataclass(frozen=True)
class EagerRegion:
    """A checkpointed region Dynamo ran eagerly."""

    module: str  # path of the checkpointed module relative to the compiled module, with its class ('' unknown)
    call_site: str  # "file.py:line" of the checkpoint call ('' unknown)
    break_site: str  # "file.py:line" of the graph break inside the body
    reason: str  # Dynamo's reason, its first lines
    context: str  # NO_CONTEXT | SAME_POLICY | OTHER_POLICY | FOREIGN
    context_policy: str = ""  # the policy (or the callable) the region's context_fn applies

    @property
    def holds(self) -> bool:
        """Whether the backend's policy holds in the eager region."""
        return self.context == SAME_POLICY

    def name(self) -> str:
        where = f"called at {self.call_site}" if self.call_site else "of unknown call site"
        return f"{self.module} ({where})" if self.module else where

    def describe(self) -> str:
        return (f"the checkpointed region {self.name()} runs eagerly: Dynamo could not trace its body "
                f"(graph break at {self.break_site or 'an unknown line'}: {self.reason})")


_REGIONS: dict[tuple[str, str, str, str], EagerRegion] = {}
_installed = False


def eager_regions() -> list[EagerRegion]:
    """Every region seen running eagerly under a sacpass compile in this process, in order."""
    return list(_REGIONS.values())


def hint() -> str:
    """Text for errors: which regions ran eagerly without the policy (empty when none)."""
    regions = [r for r in _REGIONS.values() if not r.holds]
    if not regions:
        return ""
    return (" Note: " + "; ".join(r.describe() for r in regions) + ". Ops in such a region never reach a "
            "sacpass graph: fix the graph break (fullgraph=True points at it) or pass "
            "context_fn=backend.context_fn() to that checkpoint.")


# ------------------------------------------------------------------------------------- the message
def _reason(message: str) -> str:
    text = message.split("Graph Break Reason:", 1)[-1]
    text = text.split("User code traceback:", 1)[0]
    if "Graph break encountered:" in text:
        text = text.split("Graph break encountered:", 1)[1]
    lines = [ln.strip() for ln in text.strip().splitlines()]
    keep = [ln for ln in lines if ln][:1]
    keep += [ln for ln in lines if ln.startswith(("Explanation:", "Hint:"))][:2]
    return " ".join(keep)


def _break_site(message: str) -> str:
    frame = innermost_frame(message.split("User code traceback:", 1)[-1])
    return frame.site if frame is not None else ""


# -------------------------------------------------------------------------- the checkpoint's frame
def _exception_chain(exc: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _traces_checkpoint(f_locals: dict[str, Any]) -> bool:
    """Whether a frame's locals are those of Dynamo tracing a checkpoint call."""
    return "context_fn" in f_locals and "args" in f_locals and "Checkpoint" in type(f_locals.get("self")).__name__


def _hop_frame_locals(tb: TracebackType | None) -> dict[str, Any]:
    """Locals of the innermost frame in ``tb`` where Dynamo traced the checkpoint call ({} when none is found)."""
    return next((f for f in reversed(traceback_locals(tb)) if _traces_checkpoint(f)), {})


def checkpoint_call(exc: BaseException | None) -> dict[str, Any] | None:
    """The checkpoint call a graph break happened in: the locals of its tracing frame ({} when they cannot
    be read), or None when the graph break is not inside a checkpoint body."""
    for e in _exception_chain(exc):
        if getattr(e, "_hop_name", None) == _CHECKPOINT_HOP:
            return _hop_frame_locals(e.__traceback__)
    return None


def _checkpointed_module(body: Any) -> torch.nn.Module | None:
    """The module a checkpointed function belongs to: the module itself, a bound method of it, or a
    ``functools.partial`` of either (as Dynamo tracks them: a bound method's object is ``obj`` up to torch
    2.14, ``im_self`` from 2.15)."""
    for _ in range(6):
        if body is None:
            return None
        if hasattr(body, "realize"):
            body = body.realize()
        value = getattr(body, "value", None)
        if isinstance(value, torch.nn.Module):
            return value
        body = getattr(body, "obj", None) or getattr(body, "im_self", None) or getattr(body, "func", None)
    return None


def _module_label(module: torch.nn.Module | None) -> str:
    """``path (Class)`` of a module relative to the module being compiled."""
    if module is None:
        return ""
    from .passes.module_paths import compiled_frame_scopes

    roots = [v for v in compiled_frame_scopes().get("L", {}).values() if isinstance(v, torch.nn.Module)]
    path = next((name for root in roots for name, m in root.named_modules() if m is module), None)
    cls = type(module).__name__
    return f"{path} ({cls})" if path else cls


def _call_site(f_locals: dict[str, Any]) -> str:
    try:
        summary = f_locals["tx"].frame_summary()
        return site(summary.filename, summary.lineno)
    except Exception:  # no translator in this frame
        return ""


def _context_of(context_fn: Any, policy) -> tuple[str, str]:
    """(how the checkpoint applies the policy, the policy or callable it applies)."""
    from .context import _SPECS, _context

    if context_fn is None:
        return NO_CONTEXT, ""
    if isinstance(context_fn, functools.partial) and context_fn.func is _context and context_fn.args:
        spec = _SPECS.get(context_fn.args[0])
        if spec is not None and (policy is None or spec.policy == policy):
            return SAME_POLICY, str(spec.policy)
        return OTHER_POLICY, str(spec.policy) if spec is not None else "an unknown sacpass policy"
    return FOREIGN, getattr(context_fn, "__qualname__", None) or type(context_fn).__name__


def _sacpass_backend():
    """(whether Dynamo compiles for a sacpass backend, that backend's policy when it is one object). A sacpass
    backend (the Backend object, the named entry point) carries ``is_sacpass_backend``."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    fn, seen = getattr(getattr(tx, "output", None), "compiler_fn", None), 0
    while fn is not None and seen < 8:
        if getattr(fn, "is_sacpass_backend", False) is True:
            return True, getattr(fn, "policy", None)
        fn = (getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
              or getattr(fn, "_compiler_fn", None))
        seen += 1
    return False, None


def region_of(message: str, exc: BaseException | None) -> EagerRegion | None:
    """The region a graph break of a sacpass compile speaks of, or None when it is not in a checkpoint body
    or the compile is not sacpass's."""
    call = checkpoint_call(exc)
    if call is None:
        return None
    ours, policy = _sacpass_backend()
    if not ours:
        return None
    context, applied = _context_of(call.get("context_fn"), policy)
    args = call.get("args") or [None]
    return EagerRegion(_module_label(_checkpointed_module(args[0])), _call_site(call), _break_site(message),
                       _reason(message), context, applied)


# ------------------------------------------------------------------------------------- reporting
def _advice(region: EagerRegion) -> str:
    fix = "Fix the graph break (compile with fullgraph=True to see it as an error), or"
    if region.context == OTHER_POLICY:
        return (f"Its context_fn applies sacpass policy {region.context_policy}, not this backend's. {fix} pass "
                f"context_fn=backend.context_fn() to that checkpoint so the backend's policy holds in eager too.")
    if region.context == FOREIGN:
        return (f"Its context_fn ({region.context_policy}) is not sacpass's, so sacpass's policy does not apply "
                f"there. {fix} replace it with context_fn=backend.context_fn() (or sacpass.context_fn(...)).")
    return ("sacpass's policy does not apply there: its backward recomputes the region (the top-k included). "
            f"{fix} pass context_fn=backend.context_fn() (or sacpass.context_fn(...)) to that checkpoint so the "
            "policy holds in eager too.")


def _report(region: EagerRegion) -> None:
    key = (region.module, region.call_site, region.context, region.context_policy)
    if key in _REGIONS:
        return
    _REGIONS[key] = region
    if region.holds:
        _log.info("sacpass: %s; its context_fn applies the backend's policy there.", region.describe())
        return
    warn(f"sacpass: {region.describe()}. {_advice(region)}")


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            region = region_of(record.getMessage(), sys.exc_info()[1])
        except Exception:  # a log handler must never break the compile
            return
        if region is not None:
            _report(region)


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
