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
``TORCH_LOGS`` asked for it). For a region of a sacpass compile it finds the module the region checkpoints,
whatever the checkpoint was given (the module, a bound method, transformers' ``partial(forward, layer, **kw)``,
``partial(layer.__call__)``, a lambda over the module, ``checkpoint_wrapper``'s child), and its full path: relative
to the outermost module running, so that a layer compiled on its own is named by its place in the model.
Dynamo compiles a frame once for every module of its owner's class, so one graph break there is one region
per such module (each layer of a model). It warns once per region and context when the backend's policy does
not hold there (one warning for the regions of one graph break); when it holds, it logs one line at INFO on
the ``sacpass`` logger. Nothing here reads a source file: code without one (``python -c``, ``exec``) is
covered the same way.
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
from .modules import named_modules, path_in, running_modules

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

    module: str  # "path (Class)" of the checkpointed module, from the outermost module running ('' unknown)
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
        return f"{self.module} ({self._where()})" if self.module else self._where()

    def _where(self) -> str:
        return f"called at {self.call_site}" if self.call_site else "of unknown call site"

    def describe(self) -> str:
        return describe_regions([self])


def describe_regions(regions: list[EagerRegion]) -> str:
    """One sentence for the regions one graph break makes run eagerly (one region, or the modules that share
    the frame Dynamo compiled)."""
    first = regions[0]
    if len(regions) == 1:
        head = f"the checkpointed region {first.name()} runs eagerly: Dynamo could not trace its body"
    else:
        names = [r.module or "?" for r in regions[:_SHOWN]]
        names += [f"{len(regions) - _SHOWN} more"] if len(regions) > _SHOWN else []
        head = (f"the checkpointed regions {', '.join(names)} ({first._where()}) run eagerly: Dynamo could not "
                f"trace their body, in the frame it compiled once for all of them")
    return f"{head} (graph break at {first.break_site or 'an unknown line'}: {first.reason})"


_SHOWN = 8  # module paths a message names before it counts the rest


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
    return (" Note: " + "; ".join(describe_regions(g) for g in _by_site(regions)) + ". Ops in such a region "
            "never reach a sacpass graph: fix the graph break (fullgraph=True points at it) or pass "
            "context_fn=backend.context_fn() to that checkpoint.")


def _by_site(regions: list[EagerRegion]) -> list[list[EagerRegion]]:
    """Regions grouped by checkpoint call site and graph break, in order."""
    groups: dict[tuple[str, str, str], list[EagerRegion]] = {}
    for r in regions:
        groups.setdefault((r.call_site, r.break_site, r.reason), []).append(r)
    return list(groups.values())


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


def _python_refs(obj: Any) -> list[Any]:
    """What a plain Python callable runs on: a bound method's object, a partial's function and first argument,
    the contents of a function's closure."""
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args[:1]]
    if getattr(obj, "__self__", None) is not None:
        return [obj.__self__]
    cells = getattr(obj, "__closure__", None) or ()
    out = []
    for cell in cells:
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return out


def _traced_refs(var: Any, tx: Any) -> list[Any]:
    """What a callable Dynamo tracks runs on: a bound method's object (``obj`` up to torch 2.14, ``im_self``
    from 2.15), a ``functools.partial``'s function and first argument, the cells of a function made while
    tracing (a lambda, a nested function), the Python function behind a tracked one."""
    refs = [getattr(var, name, None) for name in ("obj", "im_self", "func")]
    args = getattr(var, "args", None)
    refs += list(args[:1]) if isinstance(args, (list, tuple)) else []
    closure = getattr(getattr(var, "closure", None), "items", None) or []
    side_effects = getattr(getattr(tx, "output", None), "side_effects", None)
    for cell in closure:
        try:
            refs.append(side_effects.load_cell(cell))
        except Exception:  # an empty cell, or a Dynamo whose cells read otherwise
            continue
    fn = getattr(var, "fn", None)
    refs += _python_refs(fn) if fn is not None else []
    return [r for r in refs if r is not None]


def _as_module(x: Any) -> torch.nn.Module | None:
    if isinstance(x, torch.nn.Module):
        return x
    value = getattr(x, "value", None)  # a tracked module's object
    return value if isinstance(value, torch.nn.Module) else None


def _checkpointed_module(body: Any, tx: Any = None) -> torch.nn.Module | None:
    """The module a checkpointed function runs: the module itself, a bound method of it, a
    ``functools.partial`` of either or of a function given the module as its first argument (transformers'
    ``partial(forward, layer, **kw)``), a lambda or nested function over one module; searched nearest first.
    None when none is found, or when one level refers to two modules (which one is ambiguous)."""
    level = [body]
    for _ in range(4):
        level = [x.realize() if hasattr(x, "realize") else x for x in level]
        found = {id(m): m for m in map(_as_module, level) if m is not None}
        if found:
            return next(iter(found.values())) if len(found) == 1 else None
        level = [r for x in level for r in _refs(x, tx)]
    return None


def _refs(x: Any, tx: Any) -> list[Any]:
    from torch._dynamo.variables.base import VariableTracker

    return _traced_refs(x, tx) if isinstance(x, VariableTracker) else _python_refs(x)


def _label(path: str, module: torch.nn.Module) -> str:
    return f"{path} ({type(module).__name__})" if path else type(module).__name__


def _compiled_roots() -> list[torch.nn.Module]:
    from .passes.module_paths import compiled_frame_scopes

    return [v for v in compiled_frame_scopes().get("L", {}).values() if isinstance(v, torch.nn.Module)]


def _region_modules(module: torch.nn.Module | None) -> list[str]:
    """The labels (``path (Class)``) of the modules a region runs eagerly in, paths relative to the outermost
    module running (a layer compiled on its own is named by its place in the model).

    The frame Dynamo compiles runs inside the innermost module running (the owner: a layer compiled on its
    own, a wrapper module, the model). Dynamo compiles that frame once for every module of
    the owner's class, so the region runs eagerly in each of them: one label per module of that class in the
    model, the checkpointed module at the same place under each."""
    if module is None:
        return [""]
    running = running_modules()
    if not running:  # a compiled function, called outside any module: paths from the frame's own modules
        path = next((p for p in (path_in(r, module) for r in _compiled_roots()) if p is not None), "")
        return [_label(path, module)]
    root, owner = running[0][1], running[-1][1]
    path = path_in(root, module)
    below = path_in(owner, module)
    if path is None or below is None:  # not inside the owner: that module alone
        return [_label(path or "", module)]
    labels = []
    for shared_path, shared in named_modules(root):
        inner = _submodule(shared, below) if type(shared) is type(owner) else None
        if inner is not None:
            labels.append(_label(".".join(x for x in (shared_path, below) if x), inner))
    return labels


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:  # a module of the owner's class built without that child
        return None


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


def regions_of(message: str, exc: BaseException | None) -> list[EagerRegion]:
    """The regions a graph break of a sacpass compile makes run eagerly (one per module that runs the compiled
    frame; see ``_region_modules``), or [] when it is not in a checkpoint body or the compile is not sacpass's."""
    call = checkpoint_call(exc)
    if call is None:
        return []
    ours, policy = _sacpass_backend()
    if not ours:
        return []
    context, applied = _context_of(call.get("context_fn"), policy)
    body = (call.get("args") or [None])[0]
    site, broke, reason = _call_site(call), _break_site(message), _reason(message)
    return [EagerRegion(label, site, broke, reason, context, applied)
            for label in _region_modules(_checkpointed_module(body, call.get("tx")))]


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


def _report(regions: list[EagerRegion]) -> None:
    """Record the regions not seen before; one warning (or INFO line, where the policy holds) for them."""
    new = []
    for region in regions:
        key = (region.module, region.call_site, region.context, region.context_policy)
        if key not in _REGIONS:
            _REGIONS[key] = region
            new.append(region)
    if not new:
        return
    if new[0].holds:  # one graph break: one context for all of them
        _log.info("sacpass: %s; its context_fn applies the backend's policy there.", describe_regions(new))
        return
    warn(f"sacpass: {describe_regions(new)}. {_advice(new[0])}")


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            regions = regions_of(record.getMessage(), sys.exc_info()[1])
        except Exception:  # a log handler must never break the compile
            return
        _report(regions)


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
