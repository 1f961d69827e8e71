"""sacpass: selective activation checkpointing under torch.compile, decided in the AOTAutograd joint graph.

Mark the outputs of chosen ops must-save before PyTorch's min-cut partitioner runs, audit the partition,
and report what the forward saves for the backward and why.
"""
from ._version import __version__, check_torch_version

check_torch_version()

from .errors import (  # noqa: E402
    BackendOptionError, DumpError, MustSaveViolation, PolicyConflictError, SacpassError, SacpassWarning,
    SelectorError, UnknownOpError, UnmatchedSelectorError, UnsupportedTorchVersion,
)
from .selectors import (  # noqa: E402
    ModuleOpSelector, OpSelector, PredicateSelector, as_selector, module_path_of, node_op,
)
from .policies import Policy, clear_registry, register_must_save, registered_must_save  # noqa: E402
from .report import Report, SavedTensor, format_report, print_report  # noqa: E402
from .backend import Backend, backend, named_backend  # noqa: E402

__all__ = [
    "__version__", "SacpassError", "SacpassWarning", "SelectorError", "UnknownOpError",
    "UnmatchedSelectorError", "PolicyConflictError", "MustSaveViolation", "BackendOptionError",
    "DumpError", "UnsupportedTorchVersion", "OpSelector", "ModuleOpSelector", "PredicateSelector",
    "as_selector", "node_op", "module_path_of", "Policy", "register_must_save", "registered_must_save",
    "clear_registry", "Report", "SavedTensor", "format_report", "print_report", "Backend", "backend",
    "named_backend",
]
