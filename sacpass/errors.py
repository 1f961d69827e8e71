"""One error hierarchy for sacpass. Every message names the thing, the value and the fix."""
from __future__ import annotations

import os
import warnings

from .frames import first_outside


class SacpassError(Exception):
    """Base class of every error sacpass raises."""


class UnsupportedTorchVersion(SacpassError, ImportError):
    """The installed torch is outside the range sacpass supports."""


class SelectorError(SacpassError, ValueError):
    """A selector could not be understood or names an op that cannot be tagged."""


class UnknownOpError(SelectorError):
    """A string selector names an op that is not registered."""


class UnmatchedSelectorError(SacpassError):
    """A selector given explicitly matched no node in a graph that could hold it (strict mode)."""


class PolicyConflictError(SacpassError):
    """One node is selected for two different actions (save, offload, recompute)."""


class MustSaveViolation(SacpassError):
    """A node tagged must-save (or offload) is still computed in the backward graph, or an offloaded value
    stays on the device between forward and backward."""


class BackendOptionError(SacpassError, TypeError):
    """An unknown or ill-typed option was passed to the sacpass backend."""


class DumpError(SacpassError, OSError):
    """A dump directory cannot be written or a dump cannot be read."""


class OffloadError(SacpassError, RuntimeError):
    """An offload could not be carried out at run time (host budget exceeded, a value never reloaded)."""


class SacpassWarning(UserWarning):
    """Warnings sacpass emits: non-strict violations, cache bypass, checkpoint outside compile."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _in_library(path: str) -> bool:
    return path.startswith(_PACKAGE) or f"{os.sep}torch{os.sep}" in path


def warn(message: str, category: type[Warning] = SacpassWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside sacpass (and outside torch's compile
    machinery), so the warning points at the user's line, not into the library."""
    found = first_outside(_in_library, skip=1)
    warnings.warn(message, category, stacklevel=found[0] + 1 if found is not None else 2)
