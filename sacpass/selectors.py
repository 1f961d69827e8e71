"""Selectors: which joint-graph nodes a policy talks about.

A selector is a small frozen, hashable dataclass with ``__call__(node) -> bool``. Everything a user may
pass as a selector (an OpOverload, an OpOverloadPacket, a string, a predicate) is turned into one by
:func:`as_selector`, so policies are printable and enter compile-cache keys.

String forms::

    "aten.topk"                      every functional overload of aten::topk
    "aten::topk" / "aten::topk.default"
    "glm52::dsa_topk_indices"
    "layers.*.self_attn.indexer::aten::topk"   an op inside modules whose path matches the glob
    "GlmMoeDsaIndexer::aten.topk"              an op inside modules of that class

Module paths are relative to the module given to ``torch.compile`` (dynamo's ``nn_module_stack``).
"""
from __future__ import annotations

import difflib
import fnmatch
import hashlib
import inspect
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Union

import torch
import torch.fx

from .errors import SelectorError, UnknownOpError

__all__ = [
    "OpSelector", "ModuleOpSelector", "PredicateSelector", "CollectiveSelector", "Selector", "SelectorLike",
    "as_selector", "as_selectors", "node_op", "module_path_of", "module_stack_of",
]


# --------------------------------------------------------------------------- nodes -> ops
_WRAPPER_ARG = {}  # higher-order wrapper -> index of the wrapped op in node.args


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


_ROOT = re.compile(r"^L\[['\"][^'\"]*['\"]\]\.?")
_SUBSCRIPT = re.compile(r"\[['\"]?([^'\"\]]*)['\"]?\]")


def _clean_path(path: str) -> str:
    path = _ROOT.sub("", path)
    path = _SUBSCRIPT.sub(r".\1", path)
    path = path.replace("._modules.", ".")
    return path.strip(".")


def module_stack_of(node: torch.fx.Node) -> list[tuple[str, str]]:
    """[(module path relative to the compiled root, class name)], outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value[0], value[1]
        name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
        out.append((_clean_path(str(path)), name))
    return out


def module_path_of(node: torch.fx.Node) -> str:
    """Innermost module path of a node ('' for the compiled root or when unknown)."""
    stack = module_stack_of(node)
    return stack[-1][0] if stack else ""


# --------------------------------------------------------------------------- op names
def _all_op_names() -> list[str]:
    return sorted(set(torch._C._dispatch_get_all_op_names()))


def _closest(name: str) -> list[str]:
    names = _all_op_names()
    short = {n.split(".")[0] for n in names}
    close = difflib.get_close_matches(name, sorted(short), n=5, cutoff=0.6)
    if not close and "::" in name:  # try the bare op name across namespaces
        bare = name.split("::", 1)[1]
        close = [n for n in sorted(short) if n.split("::", 1)[1] == bare][:5]
    return close


def _returns_tensor(schema) -> bool:
    for ret in schema.returns:
        t = str(ret.type)
        if "Tensor" in t:
            return True
    return False


def _returns_mutated_input(schema) -> bool:
    return any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)


def _check_taggable(op: torch._ops.OpOverload, spelled: str) -> None:
    """Refuse ops whose result is a mutated input (in-place, out=) or that return no tensor.

    Ops that mutate an auxiliary argument but return a fresh tensor are accepted: in the joint graph they
    appear wrapped in ``auto_functionalized`` and the pass tags the wrapper and its outputs.
    """
    schema = op._schema
    if _returns_mutated_input(schema):
        raise SelectorError(
            f"sacpass: selector {spelled!r} names {schema.name}.{op._overloadname or 'default'}, which returns "
            f"an input it mutates ({schema}). A mutated input cannot be saved for backward; select its "
            f"functional variant instead, or return a fresh tensor from a functional custom op.")
    if not _returns_tensor(schema):
        raise SelectorError(
            f"sacpass: selector {spelled!r} names {schema.name}, which returns no tensor ({schema}); "
            f"there is nothing to save. Select the op that produces the tensor you want kept.")


def _parse_op_name(spelled: str) -> tuple[str, str, str | None]:
    """'ns::op', 'ns::op.overload', 'ns.op', 'ns.op.overload' -> (ns, op, overload|None)."""
    if "::" in spelled:
        ns, rest = spelled.split("::", 1)
        name, _, overload = rest.partition(".")
    else:
        parts = spelled.split(".")
        if len(parts) < 2:
            raise SelectorError(
                f"sacpass: cannot read op selector {spelled!r}; write 'namespace::op', "
                f"'namespace::op.overload' or 'namespace.op' (e.g. 'aten::topk').")
        ns, name = parts[0], parts[1]
        overload = ".".join(parts[2:])
    if not ns or not name or "::" in name:
        raise SelectorError(f"sacpass: cannot read op selector {spelled!r}; write e.g. 'aten::topk'.")
    return ns, name, (overload or None)


def _op_exists(ns: str, name: str) -> bool:
    try:
        packet = getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return False
    return isinstance(packet, torch._ops.OpOverloadPacket)


# --------------------------------------------------------------------------- selectors
@dataclass(frozen=True)
class OpSelector:
    """Every node produced by one op (all its functional overloads when ``overload`` is None)."""

    qualname: str  # "ns::op"
    overload: str | None = None  # None: every functional overload of the packet

    @classmethod
    def from_spelling(cls, spelled: str) -> "OpSelector":
        ns, name, overload = _parse_op_name(spelled)
        qual = f"{ns}::{name}"
        if not _op_exists(ns, name):
            close = _closest(qual)
            hint = f" Closest registered ops: {', '.join(close)}." if close else ""
            raise UnknownOpError(
                f"sacpass: selector {spelled!r} names op {qual}, which is not registered.{hint} "
                f"Import the module that defines the op before building the policy, or fix the name.")
        sel = cls(qual, overload)
        sel.overloads(spelled)  # validates the overload and the schema
        return sel

    @classmethod
    def from_op(cls, op: Any) -> "OpSelector":
        if isinstance(op, torch._ops.OpOverload):
            sel = cls(op._schema.name, op._overloadname or "default")
        elif isinstance(op, torch._ops.OpOverloadPacket):
            sel = cls(op._qualified_op_name, None)
        else:  # pragma: no cover - guarded by as_selector
            raise SelectorError(f"sacpass: {op!r} is not an op")
        sel.overloads(str(op))
        return sel

    def packet(self) -> torch._ops.OpOverloadPacket:
        ns, name = self.qualname.split("::", 1)
        return getattr(getattr(torch.ops, ns), name)

    def overloads(self, spelled: str | None = None) -> tuple[torch._ops.OpOverload, ...]:
        """The OpOverloads this selector matches; raises if that set is empty or untaggable."""
        spelled = spelled or str(self)
        packet = self.packet()
        if self.overload is not None:
            try:
                op = getattr(packet, self.overload)
            except AttributeError:
                raise UnknownOpError(
                    f"sacpass: selector {spelled!r}: op {self.qualname} has no overload {self.overload!r}; "
                    f"it has {', '.join(packet.overloads())}.") from None
            _check_taggable(op, spelled)
            return (op,)
        ops = [getattr(packet, o) for o in packet.overloads()]
        functional = tuple(op for op in ops
                           if not _returns_mutated_input(op._schema) and _returns_tensor(op._schema))
        if not functional:
            _check_taggable(ops[0], spelled)  # raises with the reason
        return functional

    def matches_op(self, op: torch._ops.OpOverload | None) -> bool:
        if op is None or op._schema.name != self.qualname:
            return False
        return self.overload is None or (op._overloadname or "default") == self.overload

    def __call__(self, node: torch.fx.Node) -> bool:
        return self.matches_op(node_op(node))

    def __str__(self) -> str:
        return self.qualname + (f".{self.overload}" if self.overload else "")


@dataclass(frozen=True)
class ModuleOpSelector:
    """Nodes produced by ``op`` inside a module whose path matches the glob, or whose class has that name."""

    module: str  # glob on the module path (relative to the compiled root) or a class name
    op: OpSelector

    def matches_module(self, node: torch.fx.Node) -> bool:
        for path, cls in module_stack_of(node):
            if cls == self.module or fnmatch.fnmatchcase(path, self.module):
                return True
        return False

    def __call__(self, node: torch.fx.Node) -> bool:
        return self.op(node) and self.matches_module(node)

    def __str__(self) -> str:
        return f"{self.module}::{self.op}"


@dataclass(frozen=True)
class PredicateSelector:
    """A user predicate ``fn(node) -> bool``. Its cache key is ``fn.cache_hash`` or its source text."""

    fn: Callable[[torch.fx.Node], bool]
    name: str
    cache_key: str | None  # None: the compile caches are bypassed (a lambda or closure without cache_hash)

    @classmethod
    def from_callable(cls, fn: Callable[[torch.fx.Node], bool]) -> "PredicateSelector":
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        key = getattr(fn, "cache_hash", None)
        if key is None and inspect.isfunction(fn) and fn.__name__ != "<lambda>" and not fn.__closure__:
            try:
                key = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
            except (OSError, TypeError):
                key = None
        return cls(fn, name, None if key is None else str(key))

    def __call__(self, node: torch.fx.Node) -> bool:
        return bool(self.fn(node))

    def __str__(self) -> str:
        return f"predicate:{self.name}"


@dataclass(frozen=True)
class CollectiveSelector:
    """Every functional collective (``_c10d_functional`` ops other than ``wait_tensor``).

    PyTorch force-saves collectives unless they are tagged for recompute, and a checkpoint region tags
    everything; this selector restores "a collective is never replayed in backward" inside checkpoints.
    """

    def __call__(self, node: torch.fx.Node) -> bool:
        op = node_op(node)
        return op is not None and op.namespace == "_c10d_functional" and \
            op._schema.name != "_c10d_functional::wait_tensor"

    def __str__(self) -> str:
        return "collectives(_c10d_functional)"


Selector = Union[OpSelector, ModuleOpSelector, PredicateSelector, CollectiveSelector]
SelectorLike = Union[Selector, str, torch._ops.OpOverload, torch._ops.OpOverloadPacket, Callable[[torch.fx.Node], bool]]


def _from_string(spelled: str) -> Selector:
    spelled = spelled.strip()
    parts = spelled.split("::")
    if len(parts) == 1:
        return OpSelector.from_spelling(spelled)
    if len(parts) == 2:
        ns, rest = parts
        if _op_exists(ns, rest.split(".")[0]):
            return OpSelector.from_spelling(spelled)
        if "." not in rest:
            # 'ns::op' where the op does not exist: an unknown op, not a module pattern.
            return OpSelector.from_spelling(spelled)
        return ModuleOpSelector(ns, OpSelector.from_spelling(rest))
    if len(parts) == 3:
        module, ns, rest = parts
        if not module:
            raise SelectorError(f"sacpass: selector {spelled!r} has an empty module pattern before '::'.")
        return ModuleOpSelector(module, OpSelector.from_spelling(f"{ns}::{rest}"))
    raise SelectorError(
        f"sacpass: cannot read selector {spelled!r}; write 'ns::op', 'ns::op.overload', 'ns.op' or "
        f"'<module glob or class>::ns::op'.")


def as_selector(x: SelectorLike) -> Selector:
    """Turn anything accepted as a selector into a hashable selector object."""
    if isinstance(x, (OpSelector, ModuleOpSelector, PredicateSelector, CollectiveSelector)):
        return x
    if isinstance(x, str):
        return _from_string(x)
    if isinstance(x, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return OpSelector.from_op(x)
    if isinstance(x, torch._ops.HigherOrderOperator):
        raise SelectorError(f"sacpass: {x!r} is a higher-order operator; select the op it wraps instead.")
    if callable(x):
        return PredicateSelector.from_callable(x)
    raise SelectorError(
        f"sacpass: {x!r} ({type(x).__name__}) is not a selector; pass an op (torch.ops.ns.op[.overload]), "
        f"a string such as 'aten::topk', or a predicate taking a torch.fx.Node.")


def as_selectors(xs: SelectorLike | Iterable[SelectorLike] | None) -> tuple[Selector, ...]:
    if xs is None:
        return ()
    if isinstance(xs, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or callable(xs) and not isinstance(xs, (list, tuple)):
        xs = [xs]
    out: list[Selector] = []
    for x in xs:
        s = as_selector(x)
        if s not in out:
            out.append(s)
    return tuple(out)


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
