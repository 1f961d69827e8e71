"""Activation checkpointing and compilation of the decoder layers, in one place (as torchtitan's
``apply_ac`` / ``apply_compile``). A parallel run applies, in this order: ``parallel.apply_sp`` /
``apply_ep`` -> :func:`apply_ac` -> :func:`apply_compile` -> ``parallel.apply_fsdp``.

The checkpoint call sits inside ``DecoderLayer.forward``, and :func:`apply_compile` compiles that forward,
so each layer runs compile(checkpoint(body)): one graph per layer kind with ``fullgraph=True``, partitioned
as a whole (by sacpass, with ``backend=sacpass.backend()``). The module's ``__call__`` and its hooks (FSDP2's
all-gather and reshard) stay eager around the compiled region.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .model import decoder_layers

__all__ = ["apply_ac", "apply_compile", "mark_tokens_dynamic"]


def apply_ac(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Checkpoint (``enabled``) or stop checkpointing the body of every decoder layer of ``model`` (a
    model, one layer, or a wrapper), in place. A new model starts as ``GLM52Config.recompute`` says."""
    for layer in decoder_layers(model):
        layer.recompute = enabled
    return model


def apply_compile(model: nn.Module, backend="inductor", fullgraph: bool = True, dynamic_tokens: bool = False,
                  **compile_kwargs) -> nn.Module:
    """Compile the forward of every decoder layer of ``model`` in place; ``backend`` and ``compile_kwargs``
    go to ``torch.compile``. Layers of the same structure share one compiled graph.

    ``dynamic_tokens=True`` marks dim 0 (tokens) of the layer inputs dynamic before each call: one graph
    serves every packed length (only the token count is symbolic: cheaper than ``dynamic=True``, which also
    makes widths and float attributes symbolic). It costs several times the compile time of static shapes
    on CPU, hence off by default."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"apply_compile: {type(model).__name__} holds no DecoderLayer to compile")
    for layer in layers:
        if "forward" in vars(layer):
            raise ValueError(f"apply_compile: decoder layer {layer.layer_id} is compiled already; call "
                             f"apply_compile once per model")
        compiled = torch.compile(layer.forward, backend=backend, fullgraph=fullgraph, **compile_kwargs)
        layer.forward = _with_dynamic_tokens(compiled) if dynamic_tokens else compiled
    return model


def mark_tokens_dynamic(*tensors: Tensor | None) -> None:
    """Mark dim 0 (tokens) of each tensor dynamic for the next compiled call (None entries are skipped)."""
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _with_dynamic_tokens(compiled):
    def forward(*args, **kwargs):
        mark_tokens_dynamic(*(a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)))
        return compiled(*args, **kwargs)
    return forward
