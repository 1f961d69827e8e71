"""Modules at run time: which are running now, and where a module sits in the model that holds it.

Read off the Python call stack (``Module._call_impl`` frames, and ``forward`` frames of a module) and the
modules' own children: no hooks, nothing installed globally. The outermost module running is the root every
path here is relative to. Wrappers that are not part of the user's model are looked through: a
``torch.compile``'d module (``OptimizedModule``) stands for the module it compiles, and its ``_orig_mod`` never
appears in a path.
"""
from __future__ import annotations

import sys
from types import CodeType
from typing import Iterator

import torch

from .frames import locals_of

__all__ = ["running_modules", "named_modules", "path_in"]

_COMPILE_WRAPPER = "_orig_mod"  # OptimizedModule's attribute holding the compiled module


def _is_compile_wrapper(module: torch.nn.Module) -> bool:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing was compiled, no wrapper
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def _clean(path: str) -> str:
    return ".".join(p for p in path.split(".") if p != _COMPILE_WRAPPER)


def named_modules(root: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``root.named_modules()`` with compile wrappers looked through: a compiled module at the wrapper's path."""
    for name, m in root.named_modules():
        if not _is_compile_wrapper(m):
            yield _clean(name), m


def path_in(root: torch.nn.Module, module: torch.nn.Module) -> str | None:
    """The dotted path of ``module`` in ``root`` ('' for the root itself), or None when it is not there."""
    return next((path for path, m in named_modules(root) if m is module), None)


def _runs_a_module(code: CodeType) -> bool:
    """A frame that runs a module: its ``__call__`` (``Module._call_impl``), or a ``forward`` called directly
    (a checkpoint of ``partial(Layer.forward, layer)`` never enters ``layer.__call__``)."""
    return code is torch.nn.Module._call_impl.__code__ or code.co_name == "forward"


def running_modules() -> list[tuple[str, torch.nn.Module]]:
    """[(path relative to the outermost module being called, module)] of the modules running now (called, or
    their ``forward`` run directly), outermost first. A module called through a compile wrapper appears once,
    as itself."""
    mods: list[torch.nn.Module] = []
    for m in locals_of(_runs_a_module, "self"):
        if isinstance(m, torch.nn.Module) and not _is_compile_wrapper(m) and (not mods or mods[-1] is not m):
            mods.append(m)
    out: list[tuple[str, torch.nn.Module]] = []
    for i, m in enumerate(mods):
        path = ""
        if i > 0:
            name = next((n for n, c in mods[i - 1].named_children() if c is m), None)
            if name is None:  # not a direct child (a shared module, a compiled child): its path from the root
                path = path_in(mods[0], m)
                path = type(m).__name__ if path is None else path
            else:
                path = f"{out[-1][0]}.{name}" if out[-1][0] else name
        out.append((path, m))
    return out
