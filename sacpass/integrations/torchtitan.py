"""sacpass in torchtitan, turned on from its config: one ``override.imports`` entry.

::

    --override.imports 'sacpass.integrations.torchtitan.sacpass={"inner": "inductor"}'

or, in a ``config_registry`` function::

    config.override.imports.append(("sacpass.integrations.torchtitan.sacpass", {"save": ["aten::topk"]}))

The override targets torchtitan's activation-checkpointing policy (``ActivationCheckpointing.Config``): it
replaces ``FullAC``, ``SelectiveAC``, ``MemoryBudgetAC`` (or a subclass of one) by a sacpass variant of the same
policy. The variant wraps the blocks exactly as the original does, then routes each block's
``.compile(...)``, which torchtitan's ``apply_compile`` calls right after, to ``torch.compile`` with a sacpass
backend built from the entry's options. torchtitan's own code is not edited and its checks run unchanged:
leave ``compile.backend`` at ``"inductor"`` (the default), so its FlexAttention check passes, and sacpass
compiles the block with Inductor behind its partition (``inner="inductor"``, the default), so FlexAttention
lowers as on torchtitan's own path.

The options are those of :func:`sacpass.backend` (``save``, ``recompute``, ``offload``, ``inner``,
``strict``, ``dump_dir``, ``use_registered``, ``save_collectives``, ``save_discrete``, ``memory_budget``,
``plan``) as JSON values; a relative ``dump_dir`` lands under torchtitan's ``dump_folder``. The backend the
blocks were compiled with (its reports) is :func:`backend_of` the model.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import torch

import sacpass as _sacpass  # the override below is named ``sacpass``
from sacpass.errors import BackendOptionError, SacpassError
from sacpass.options import VALID_OPTIONS, check_known

try:
    from torchtitan.config.override import derive, override
    from torchtitan.distributed.activation_checkpoint import (
        ActivationCheckpointing, FullAC, MemoryBudgetAC, SelectiveAC,
    )
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        f"sacpass.integrations.torchtitan needs torchtitan (0.3.0), which could not be imported: {e}. Install "
        f"it with `pip install \"sacpass[torchtitan]\"` (or `pip install --no-deps torchtitan==0.3.0` plus the "
        f"packages it imports) and run again.") from e

__all__ = ["sacpass", "OVERRIDE", "OPTIONS", "backend_of", "sacpass_variant", "SacpassFullAC",
           "SacpassSelectiveAC", "SacpassMemoryBudgetAC"]

OVERRIDE = f"{__name__}.sacpass"  # what to list in override.imports
OPTIONS = VALID_OPTIONS  # the options an entry may carry: those of sacpass.backend
_BACKEND_ATTR = "_sacpass_backend"
_log = logging.getLogger("sacpass")


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    check_known(options, where=f"sacpass.integrations.torchtitan (the override.imports entry {OVERRIDE!r})",
                example=f"For example: --override.imports '{OVERRIDE}={{\"inner\": \"inductor\", "
                        f"\"save\": [\"aten::topk\"]}}'.")
    if "dump_dir" in options and not isinstance(options["dump_dir"], (str, type(None))):
        raise BackendOptionError(f"sacpass.integrations.torchtitan: dump_dir={options['dump_dir']!r} must be a "
                                 f"path (a string) or null.")
    _sacpass.backend(**_with_dump_dir(options, ""))  # every value checked now, before torchtitan builds anything
    return dict(options)


def _with_dump_dir(options: dict[str, Any], dump_folder: str) -> dict[str, Any]:
    options = dict(options)
    if options.get("dump_dir") and dump_folder and not os.path.isabs(options["dump_dir"]):
        options["dump_dir"] = os.path.join(dump_folder, options["dump_dir"])
    return options


def backend_of(model: torch.nn.Module) -> _sacpass.Backend:
    """The sacpass Backend the model's blocks were compiled with (its ``reports``, ``results``)."""
    be = model.__dict__.get(_BACKEND_ATTR)
    if be is None:
        raise SacpassError(
            f"sacpass.integrations.torchtitan: {type(model).__name__} was not prepared by the sacpass override; "
            f"list {OVERRIDE!r} in override.imports and apply the activation-checkpointing policy it built.")
    return be


class _Sacpass:
    """The sacpass half of a variant policy: after the original policy wrapped the blocks, route each block's
    ``compile`` (torchtitan's ``apply_compile`` calls ``block.compile(backend=..., fullgraph=True)``) to the
    sacpass backend."""

    def apply(self, model: torch.nn.Module) -> None:
        super().apply(model)  # type: ignore[misc]
        options = _with_dump_dir(self.config.sacpass, getattr(self, "dump_folder", ""))  # type: ignore[attr-defined]
        be = _sacpass.backend(**options)
        model.__dict__[_BACKEND_ATTR] = be
        layers = model.get_submodule("layers")
        pending = {}
        for name, block in layers.named_children():
            fqn = f"layers.{name}"
            block.__dict__["compile"] = functools.partial(_compile_block, block, be, fqn, pending)
            pending[fqn] = block
        if pending:
            handle: list = []
            handle.append(model.register_forward_pre_hook(functools.partial(_check_compiled, pending, handle)))
        _log.info("sacpass: %s routes the compile of %d block(s) to sacpass (inner=%s)",
                  type(self).__name__, len(pending), be.inner)


def _compile_block(block: torch.nn.Module, be: _sacpass.Backend, fqn: str, pending: dict, *args,
                   backend: Any = None, **kwargs) -> None:
    if backend not in (None, "inductor", be) and isinstance(backend, str):
        _log.info("sacpass: %s compiles with sacpass (inner=%s) in place of compile.backend=%r", fqn, be.inner,
                  backend)
    torch.nn.Module.compile(block, *args, backend=be, **kwargs)
    pending.pop(fqn, None)


def _check_compiled(pending: dict, handle: list, module, args) -> None:
    handle[0].remove()
    if pending:
        raise SacpassError(
            f"sacpass.integrations.torchtitan: the sacpass override is on, but torchtitan did not compile "
            f"{', '.join(sorted(pending, key=lambda f: int(f.split('.')[-1]) if f.split('.')[-1].isdigit() else 0))}"
            f", so sacpass partitions nothing. sacpass works inside torch.compile: set --compile.enable and keep "
            f"'model' in --compile.components, or remove {OVERRIDE!r} from override.imports.")


_VARIANTS: dict[type, type] = {}


def sacpass_variant(policy: type) -> type:
    """The sacpass variant of a torchtitan activation-checkpointing policy class (made once per class): the
    same policy, same config fields plus ``sacpass`` (the backend options), whose ``apply`` also routes the
    blocks' compile to sacpass."""
    if issubclass(policy, _Sacpass):
        return policy
    if not (isinstance(policy, type) and issubclass(policy, ActivationCheckpointing)):
        raise TypeError(f"sacpass.integrations.torchtitan: {policy!r} is not a torchtitan "
                        f"ActivationCheckpointing policy.")
    if policy not in _VARIANTS:
        name = f"Sacpass{policy.__name__}"
        config = dataclasses.dataclass(kw_only=True, slots=True)(type("Config", (policy.Config,), {
            "__annotations__": {"sacpass": "dict"},
            "sacpass": dataclasses.field(default_factory=dict),
            "__module__": __name__, "__qualname__": f"{name}.Config",
            "__doc__": f"{policy.__name__}.Config plus ``sacpass``: the sacpass backend options.",
        }))
        _VARIANTS[policy] = type(name, (_Sacpass, policy), {
            "Config": config, "__module__": __name__, "__qualname__": name,
            "__doc__": f"torchtitan's {policy.__name__}, with each block compiled by sacpass.",
        })
    return _VARIANTS[policy]


SacpassFullAC = sacpass_variant(FullAC)
SacpassSelectiveAC = sacpass_variant(SelectiveAC)
SacpassMemoryBudgetAC = sacpass_variant(MemoryBudgetAC)


@override(target=ActivationCheckpointing.Config,
          description="sacpass: compile each block with the sacpass backend under this AC policy")
def sacpass(cfg: ActivationCheckpointing.Config, **options) -> ActivationCheckpointing.Config:
    """Swap the activation-checkpointing policy for its sacpass variant, carrying the entry's options."""
    options = _check_options(options)
    variant = sacpass_variant(type(cfg)._owner)
    return derive(cfg, variant.Config, sacpass=options)
