"""sacpass: selective activation checkpointing under torch.compile, decided in the AOTAutograd joint graph.

Tag what to save, offload or recompute before PyTorch's min-cut partitioner runs, audit the partition, and
report what the forward keeps for the backward and why. ``import sacpass`` loads torch only; Dynamo and
Inductor are imported when a compile starts.
"""
from ._version import __version__, check_torch_version, cli_process

check_torch_version(warn_untested=not cli_process())

from .errors import (  # noqa: E402
    BackendOptionError, DumpError, MustSaveViolation, OffloadError, PolicyConflictError, SacpassError,
    SacpassWarning, SelectorError, UnknownOpError, UnmatchedSelectorError, UnsupportedTorchVersion,
)
from .selectors import (  # noqa: E402
    CollectiveSelector, DiscreteSelector, ModuleOpSelector, OpSelector, PredicateSelector, as_selector,
)
from .policies import Policy, clear_registry, register_must_save, registered_must_save  # noqa: E402
from .plan import CostModel, ModelPlan, Plan  # noqa: E402
from .report import Decision, Report, SavedTensor, format_report, print_report  # noqa: E402
from .compiler import Backend, backend, named_backend  # noqa: E402
from .context import context_fn  # noqa: E402

__all__ = [
    "__version__", "SacpassError", "SacpassWarning", "SelectorError", "UnknownOpError",
    "UnmatchedSelectorError", "PolicyConflictError", "MustSaveViolation", "BackendOptionError", "DumpError",
    "OffloadError", "UnsupportedTorchVersion", "OpSelector", "ModuleOpSelector", "PredicateSelector",
    "CollectiveSelector", "DiscreteSelector", "as_selector", "Policy", "register_must_save",
    "registered_must_save", "clear_registry", "Plan", "ModelPlan", "CostModel", "Report", "SavedTensor", "Decision",
    "format_report", "print_report", "Backend", "backend", "named_backend", "context_fn",
]
