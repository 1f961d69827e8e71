"""repair_module_paths_pass: give the ops of a checkpointed module the module path however it was called.

Runs on the Dynamo graph, before AOTAutograd traces it (module paths flow from there to the joint graph).

Why: Dynamo records a module in ``nn_module_stack`` when it calls the module object. A checkpoint called
the way transformers' ``GradientCheckpointingLayer`` calls it, ``checkpoint(partial(forward, layer, **kw), x)``
(the class's own forward, the layer its first argument; ``partial(layer.__call__, **kw)`` before transformers 5),
enters ``forward`` as a plain function: the ops written directly in that ``forward`` get no module at all,
and the ops of its submodules lose the layer's entry. ``"Layer::aten::sin"`` and ``"layers.*::aten::sin"``
would then match nothing, while ``checkpoint(layer, x)`` works. Module scoping must not depend on that.

Requires: the GraphModule Dynamo hands to a backend.
Ensures: in every ``tag_activation_checkpoint`` body where some op has no module entry, the module whose
``forward`` those ops were traced in is found, and put at the outer end of every op's ``nn_module_stack`` in
the body that lacks it. Its path is the common parent of the body's submodule paths. Its class comes from the
ops' stack trace when they have one (the ``nn.Module`` subclass whose ``forward`` spans that file and line, by
its code object: no source file is read). Dynamo leaves frames of code without a file (``python -c``,
``exec`` of a string: file ``<string>``) out of stack traces, so when the ops have none, the class is that of
the module at the common parent path, looked up from the compiled frame's own variables. Bodies where every
op has its module are left alone. Returns the repaired module paths.
"""
from __future__ import annotations

import re

import torch
import torch.fx

from ..frames import innermost_frame
from ..nodes import clean_module_path

__all__ = ["repair_module_paths_pass", "compiled_frame_scopes"]

_ROOT = re.compile(r"^(?P<scope>[LG])\[['\"](?P<name>[^'\"]+)['\"]\]")


def _module_classes() -> list[type]:
    out, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            out.append(sub)
            stack.append(sub)
    return out


def _class_defining(file: str, line: int, func: str) -> type | None:
    """The nn.Module subclass whose method ``func`` spans ``file:line`` (its own definition, not inherited)."""
    for cls in _module_classes():
        fn = cls.__dict__.get(func)
        code = getattr(fn, "__code__", None)
        if code is None or code.co_filename != file:
            continue
        lines = [ln for _, _, ln in code.co_lines() if ln is not None]
        if lines and min(lines + [code.co_firstlineno]) <= line <= max(lines):
            return cls
    return None


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def compiled_frame_scopes() -> dict[str, dict]:
    """The local and global variables of the frame Dynamo is compiling ({} outside a Dynamo compile)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except Exception:  # not inside a Dynamo compile, or a Dynamo without it
        return {}
    if tx is None:
        return {}
    return {"L": getattr(tx, "f_locals", None) or {}, "G": getattr(tx, "f_globals", None) or {}}


def _module_at(path: str) -> torch.nn.Module | None:
    """The module a Dynamo module path (``L['self'].layers.0``) names, read from the compiled frame."""
    m = _ROOT.match(path)
    root = compiled_frame_scopes().get(m["scope"], {}).get(m["name"]) if m else None
    if not isinstance(root, torch.nn.Module):
        return None
    try:
        return root.get_submodule(clean_module_path(path))
    except AttributeError:
        return None


def _own_forward(cls: type) -> bool:
    """Whether ``cls`` runs a forward of its own (not a torch.nn container's or the base class's)."""
    forward = getattr(cls, "forward", None)
    return not (getattr(forward, "__module__", "") or "").startswith("torch.nn.")


def _owner_class(bare: list[torch.fx.Node], path: str) -> type | None:
    """The class whose forward the module-less ops ran in (see the module docstring)."""
    frame = next((f for f in (innermost_frame(n.meta.get("stack_trace")) for n in bare) if f is not None), None)
    if frame is not None:
        return _class_defining(frame.file, frame.line, frame.func)
    module = _module_at(path) if path else None
    return type(module) if module is not None and _own_forward(type(module)) else None


def _repair_body(body: torch.fx.GraphModule) -> str | None:
    nodes = [n for n in body.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    bare = [n for n in nodes if not n.meta.get("nn_module_stack")]
    if not bare:
        return None
    outer = {next(iter(n.meta["nn_module_stack"].values()))[0] for n in nodes if n.meta.get("nn_module_stack")}
    parents = {_parent(p) for p in outer}
    path = parents.pop() if len(parents) == 1 else ""
    cls = _owner_class(bare, path)
    if cls is None:
        return None
    if not path:  # no submodule to place it: the module is known by class only
        path = f"L['<checkpoint>'].{cls.__name__}"
    entry = (path, cls)
    key = f"sacpass_repaired_{id(cls)}_{path}"
    for n in nodes:
        stack = n.meta.get("nn_module_stack") or {}
        if any(v[0] == path for v in stack.values()):
            continue
        n.meta["nn_module_stack"] = {key: entry, **stack}
    return path


def repair_module_paths_pass(gm: torch.fx.GraphModule) -> list[str]:
    """Repair the module stacks of checkpoint bodies (see the module docstring)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    if hop is None:
        return []
    repaired = []
    for owner in gm.modules():
        if not isinstance(owner, torch.fx.GraphModule):
            continue
        for node in owner.graph.find_nodes(op="call_function", target=hop):
            target = node.args[0].target if node.args and isinstance(node.args[0], torch.fx.Node) else None
            try:
                body = owner.get_submodule(target) if target else None
            except AttributeError:
                body = None
            if isinstance(body, torch.fx.GraphModule):
                path = _repair_body(body)
                if path is not None:
                    repaired.append(path)
    return repaired
