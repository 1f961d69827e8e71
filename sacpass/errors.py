"""One error hierarchy for sacpass. Every message names the thing, the value and the fix."""
from __future__ import annotations


class SacpassError(Exception):
    """Base class of every error sacpass raises."""


class UnsupportedTorchVersion(SacpassError, ImportError):
    """The installed torch is outside the range sacpass supports."""


class SelectorError(SacpassError, ValueError):
    """A selector could not be understood or names an op that cannot be tagged."""


class UnknownOpError(SelectorError):
    """A string selector names an op that is not registered."""


class UnmatchedSelectorError(SacpassError):
    """A selector given explicitly matched no node in a compiled graph (strict mode)."""


class PolicyConflictError(SacpassError):
    """One node is selected both to save and to recompute."""


class MustSaveViolation(SacpassError):
    """A node tagged must-save is still computed in the backward graph."""


class BackendOptionError(SacpassError, TypeError):
    """An unknown or ill-typed option was passed to the sacpass backend."""


class DumpError(SacpassError, OSError):
    """A dump directory cannot be written or a dump cannot be read."""


class SacpassWarning(UserWarning):
    """Warnings sacpass emits: non-strict violations, cache bypass, checkpoint outside compile."""
