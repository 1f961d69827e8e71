"""What a sacpass backend accepts, checked in one place: the arguments of :func:`sacpass.backend` and the
``options`` / ``mode`` of ``torch.compile(model, backend="sacpass", ...)``. Errors name the option, the value
and the fix. (``memory_budget`` and ``plan`` are read by :mod:`sacpass.plan`, which owns them.)
"""
from __future__ import annotations

import json
from typing import Any

from .errors import BackendOptionError

__all__ = ["VALID_OPTIONS", "INNERS", "check_options", "check_known", "options_key", "check_mode"]

VALID_OPTIONS = ("save", "recompute", "offload", "inner", "strict", "dump_dir", "use_registered",
                 "save_collectives", "save_discrete", "memory_budget", "plan")
INNERS = ("inductor", "aot_eager")


def check_options(inner: str, **flags: Any) -> None:
    """Refuse an unknown ``inner`` compiler and a switch (``strict=``, ``use_registered=``, ...) that is not a bool."""
    if inner not in INNERS:
        raise BackendOptionError(
            f"sacpass: inner={inner!r} is not supported; use one of {', '.join(map(repr, INNERS))}.")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise BackendOptionError(f"sacpass: {name}={value!r} must be True or False.")


def check_known(options: dict[str, Any], where: str = "sacpass", example: str = "") -> None:
    """Refuse an option :func:`sacpass.backend` does not take; ``where`` names who read the options, and
    ``example`` (a sentence) shows a valid spelling where they come from."""
    unknown = sorted(set(options) - set(VALID_OPTIONS))
    if unknown:
        raise BackendOptionError(
            f"{where}: unknown backend option(s) {', '.join(map(repr, unknown))}; valid options are "
            f"{', '.join(VALID_OPTIONS)}.{' ' + example if example else ''}")


def options_key(options: dict[str, Any]) -> str:
    """The key of a named backend's ``options`` (one backend per option set); refuses unknown options."""
    check_known(options)

    def norm(v):
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        return repr(v)
    return json.dumps({k: norm(v) for k, v in sorted(options.items())}, sort_keys=True)


def check_mode(mode: str | None) -> None:
    """Refuse a ``torch.compile`` mode: sacpass compiles with Inductor's own settings."""
    if mode not in (None, "default"):
        raise BackendOptionError(f"sacpass: mode={mode!r} is not supported by the sacpass backend; pass "
                                 f"Inductor settings through torch._inductor.config instead.")
