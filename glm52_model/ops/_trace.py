"""The inputs the ops' fake kernels see while torch.compile traces them, for whoever listens.

A fake kernel decorated with :func:`announced` passes its arguments (fake tensors: shapes, dtypes, devices) to the
op's listener after it runs. ``glm52_model.ops.cuda`` listens, to start building the CUDA kernels those inputs will
run before the compiled graph first calls them (:mod:`glm52_model.ops.cuda.ahead`). One listener per op; without
one an announcement costs a dict lookup.
"""
from __future__ import annotations

import functools
from typing import Callable

_listeners: dict[str, Callable] = {}


def listen(op: str, fn: Callable) -> None:
    """``fn(*args, **kwargs)`` gets the arguments of each traced call of ``op`` (its schema's, as the op was called)."""
    _listeners[op] = fn


def announced(op: str) -> Callable:
    """Decorator of ``op``'s fake kernel: the fake's result, then its arguments to ``op``'s listener."""
    def decorate(fake: Callable) -> Callable:
        @functools.wraps(fake)
        def fake_and_announce(*args, **kwargs):
            out = fake(*args, **kwargs)
            fn = _listeners.get(op)
            if fn is not None:
                fn(*args, **kwargs)
            return out
        return fake_and_announce
    return decorate
