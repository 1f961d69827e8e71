"""Facts about one FX node, answered in one place.

The selectors, the tag passes, the partition audit, the report and the partition page all ask the same
questions of a node: which op produced it, in which module, from which source line, how many bytes its
value takes, whether it is a view or a cast, whether the backward recomputes it. Each question has one
answer here. This module imports torch only (no Dynamo, no Inductor): the CLI reads dumps without them.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from .frames import innermost_frame

__all__ = [
    "node_op", "op_name", "module_stack", "module_path", "clean_module_path", "source_of", "code_line",
    "value_text", "tensor_nbytes", "node_nbytes", "size_hint", "shape_text", "dtype_text", "is_getitem",
    "is_random", "is_view", "is_cast", "is_cast_or_view", "is_cheap_unary", "unpackers", "backward_part",
    "recomputed_names", "tag_name", "NodeFacts", "snapshot",
]


# --------------------------------------------------------------------------------------------- ops
_WRAPPER_ARG: dict = {}  # higher-order wrapper -> index of the wrapped op in node.args


def _wrappers() -> dict:
    if not _WRAPPER_ARG:
        hop = torch.ops.higher_order
        for name, idx in (("auto_functionalized", 0), ("auto_functionalized_v2", 0), ("with_effects", 1)):
            if hasattr(hop, name):
                _WRAPPER_ARG[getattr(hop, name)] = idx
    return _WRAPPER_ARG


def node_op(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    """The ATen/custom OpOverload a node computes, looking through auto_functionalized/with_effects."""
    if node.op != "call_function":
        return None
    target = node.target
    idx = _wrappers().get(target)
    if idx is not None and len(node.args) > idx:
        target = node.args[idx]
    return target if isinstance(target, torch._ops.OpOverload) else None


def op_name(node: torch.fx.Node) -> str:
    """'ns::op.overload' of the node's op; a getitem is named after the op it unpacks."""
    op = node_op(node)
    if op is not None:
        return f"{op._schema.name}.{op._overloadname or 'default'}"
    if node.op == "call_function":
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            return op_name(node.args[0])
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def is_random(node: torch.fx.Node) -> bool:
    """A call of a random op (``torch.Tag.nondeterministic_seeded``: dropout, rand, Inductor's seeds)."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in node.target.tags)


def is_view(node: torch.fx.Node) -> bool:
    """An op whose output aliases an input (a view), by its schema. Wrapped ops return fresh tensors."""
    op = node_op(node)
    if op is None or node.target is not op:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


_CASTS = frozenset({"aten::_to_copy", "prims::convert_element_type", "aten::to", "aten::clone"})


def is_cast(node: torch.fx.Node) -> bool:
    op = node_op(node)
    return op is not None and node.target is op and op._schema.name in _CASTS


def is_cast_or_view(node: torch.fx.Node) -> bool:
    """A node whose value is its single input's value in another dtype or layout."""
    return is_cast(node) or is_view(node)


def is_cheap_unary(node: torch.fx.Node) -> bool:
    """A view, cast or pointwise op with exactly one tensor input: as cheap to redo as to load."""
    op = node_op(node)
    if op is None or node.target is not op or len(node.all_input_nodes) != 1:
        return False
    return is_cast_or_view(node) or torch.Tag.pointwise in op.tags


def unpackers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The getitem users of a multi-output node, recursively (nested tuples)."""
    out = []
    for user in node.users:
        if is_getitem(user):
            out.append(user)
            out.extend(unpackers(user))
    return out


def tag_name(node: torch.fx.Node) -> str | None:
    """The node's checkpoint policy (``meta["recompute"]``) by name, or None."""
    return getattr(node.meta.get("recompute"), "name", None)


# ------------------------------------------------------------------------------------------ modules
_ROOT = re.compile(r"^L\[['\"][^'\"]*['\"]\]\.?")
_SUBSCRIPT = re.compile(r"\[['\"]?([^'\"\]]*)['\"]?\]")


def clean_module_path(path: str) -> str:
    """Dynamo's module path (``L['self'].layers[0]._modules['attn']``) as a dotted path (``layers.0.attn``)."""
    path = _ROOT.sub("", path)
    path = _SUBSCRIPT.sub(r".\1", path)
    path = path.replace("._modules.", ".")
    return path.strip(".")


def module_stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """[(module path relative to the compiled root, class name)], outermost first."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value[0], value[1]
        name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
        out.append((clean_module_path(str(path)), name))
    return out


def module_path(node: torch.fx.Node) -> str:
    """Innermost module path of a node ('' for the compiled root or when unknown)."""
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


# ------------------------------------------------------------------------------------------- source
def source_of(node: torch.fx.Node) -> str:
    """'file.py:line' of the innermost user frame in the node's stack trace ('' when unknown)."""
    frame = innermost_frame(node.meta.get("stack_trace"))
    return frame.site if frame is not None else ""


def code_line(node: torch.fx.Node) -> str:
    """The innermost source line of a node's stack trace (the line under the last ``File "..."``)."""
    frame = innermost_frame(node.meta.get("stack_trace"))
    return frame.code if frame is not None else ""


# ------------------------------------------------------------------------------------------- values
_DTYPE_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b8",
                "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}


def dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def shape_text(val: Any) -> tuple[str, ...]:
    return tuple(str(s) for s in val.shape)


def value_text(val: Any) -> str:
    """A short text of a node's value: ``bf16[s0, 64]``, a tuple of those, ``Sym(s0)``."""
    if isinstance(val, torch.Tensor):
        dt = dtype_text(val.dtype)
        return f"{_DTYPE_SHORT.get(dt, dt)}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(value_text(v) for v in val) + ")"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"Sym({val})"
    return "" if val is None else type(val).__name__


def size_hint(s: Any) -> int:
    """A size at its hint; a data-dependent (unbacked) size has none and counts at Inductor's
    ``unbacked_symint_fallback`` (8192 by default), as Inductor's own estimates do."""
    if isinstance(s, int):
        return s
    node = getattr(s, "node", None)
    if node is None:
        return int(s)
    hint = getattr(node, "hint", None)
    if hint is None and getattr(node, "shape_env", None) is not None:
        hint = node.shape_env.size_hint(node.expr, allow_none=True)
    if hint is None:
        from torch._inductor import config as inductor_config  # only reached while compiling
        return int(inductor_config.unbacked_symint_fallback)
    return int(hint)


def tensor_nbytes(val: Any) -> int:
    """Storage bytes of a (fake) tensor's own elements, symbolic sizes at their hints."""
    numel = 1
    for s in val.shape:
        numel *= size_hint(s)
    return numel * val.element_size()


def node_nbytes(node: torch.fx.Node) -> int | None:
    """Bytes of a node's tensor value (None when it is not one tensor)."""
    val = node.meta.get("val")
    return tensor_nbytes(val) if isinstance(val, torch.Tensor) else None


# ----------------------------------------------------------------------------------- graph relations
def backward_part(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The backward part of a joint graph: nodes computed from tangents, and nodes AOTAutograd traced while
    running the backward (``partitioner_tag == "is_backward"``), such as ``ids.long()`` inside a custom
    op's backward formula, which reads only forward values. They are never recomputations."""
    part: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            part.add(node)
        elif node.meta.get("partitioner_tag") == "is_backward":
            part.add(node)
        elif any(inp in part for inp in node.all_input_nodes):
            part.add(node)
    return part


def recomputed_names(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule) -> dict[str, str]:
    """The forward ops the backward runs again, as {backward node name: forward node name}; the getitems that
    unpack a recomputed op are not counted.

    A backward call recomputes a forward one when it has the forward node's name (the partitioner keeps
    joint-graph names) or when it is the same op on the same values: its inputs are graph inputs or saved
    values of the forward (matched by name) or are themselves recomputes. The second rule does not depend on
    names, which some torch releases give anew to the backward's copy."""
    fw_names = {n.name for n in forward.graph.nodes if n.op in ("placeholder", "call_function")}
    by_key: dict = {}
    for n in forward.graph.nodes:
        if n.op == "call_function":
            by_key.setdefault(_call_key(n, lambda a: a.name), n.name)
    same: dict[torch.fx.Node, str] = {}
    for n in backward.graph.nodes:
        if n.op == "placeholder" and n.name in fw_names:
            same[n] = n.name
        elif n.op == "call_function":
            if n.name in fw_names:
                same[n] = n.name
                continue
            try:
                key = _call_key(n, lambda a: same[a])
            except KeyError:        # an input the forward never had: a backward value
                continue
            if key in by_key:
                same[n] = by_key[key]
    return {n.name: fw for n, fw in same.items() if n.op == "call_function" and not is_getitem(n)}


def _call_key(node: torch.fx.Node, name_of) -> tuple:
    """(op, args, kwargs) of a call, its node inputs given by ``name_of``: equal keys compute the same value."""
    def norm(a):
        if isinstance(a, torch.fx.Node):
            return ("node", name_of(a))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, norm(v)) for k, v in a.items())))
        try:
            hash(a)
        except TypeError:
            return ("repr", repr(a))
        return ("const", type(a).__name__, a)
    return (node.target, norm(tuple(node.args)), norm(dict(node.kwargs)))


# --------------------------------------------------------------------------------------- snapshots
@dataclass(frozen=True)
class NodeFacts:
    """What the report and the page need of a joint-graph node, taken before the min-cut rewrites it."""

    name: str
    op: str  # "ns::op.overload", "placeholder", ...
    is_input: bool
    module: str  # module path relative to the compiled root
    source: str  # "file.py:line"
    code: str  # the source line itself
    value: str  # value_text of the node's value
    parent: str | None  # first input node (to see through views and casts)
    cast_or_view: bool


def snapshot(gm: torch.fx.GraphModule) -> dict[str, NodeFacts]:
    out = {}
    for node in gm.graph.nodes:
        parent = next((a.name for a in node.all_input_nodes), None)
        out[node.name] = NodeFacts(
            name=node.name, op=op_name(node), is_input=node.op == "placeholder", module=module_path(node),
            source=source_of(node), code=code_line(node), value=value_text(node.meta.get("val")),
            parent=parent, cast_or_view=is_cast_or_view(node))
    return out
