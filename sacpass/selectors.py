"""Selectors: which joint-graph nodes a policy talks about.

A selector is a small frozen, hashable dataclass with ``__call__(node) -> bool``. Everything a user may
pass as a selector (an OpOverload, an OpOverloadPacket, a string, a predicate) is turned into one by
:func:`as_selector`, so policies are printable and enter compile-cache keys. Selectors also answer for an
op at run time (``matches_op``), which the eager checkpoint context (:mod:`sacpass.context`) uses.

String forms::

    "aten.topk"                      every functional overload of aten::topk
    "aten::topk" / "aten::topk.default"
    "glm52::dsa_topk_indices"
    "layers.*.self_attn.indexer::aten::topk"   an op inside modules whose path matches the glob
    "GlmMoeDsaIndexer::aten.topk"              an op inside modules of that class

Module paths are relative to the module given to ``torch.compile`` (Dynamo's ``nn_module_stack``).
"""
from __future__ import annotations

import difflib
import fnmatch
import hashlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

import torch
import torch.fx

from .errors import SelectorError, UnknownOpError, warn
from .nodes import module_stack, node_op

__all__ = [
    "OpSelector", "ModuleOpSelector", "PredicateSelector", "CollectiveSelector", "DiscreteSelector",
    "Selector", "SelectorLike", "as_selector", "as_selectors", "DISCRETE_OPS", "VALUE_INDEX_OPS", "is_discrete_op",
    "INT32_LIMIT", "bound_args", "selection_extent", "tensors_in", "predicate_key", "PREDICATE_KEY_DEPTH",
]


# --------------------------------------------------------------------------- op names
def _all_op_names() -> set[str]:
    return set(torch._C._dispatch_get_all_op_names())


def _short_names() -> set[str]:
    return {n.split(".")[0] for n in _all_op_names()}


def _closest(name: str) -> list[str]:
    short = sorted(_short_names())
    close = difflib.get_close_matches(name, short, n=5, cutoff=0.6)
    if not close and "::" in name:  # try the bare op name across namespaces
        bare = name.split("::", 1)[1]
        close = [n for n in short if n.split("::", 1)[1] == bare][:5]
    return close


def nearest_first(name: str, candidates: Iterable[str], n: int = 8) -> list[str]:
    """Up to ``n`` of ``candidates``, the closest to ``name`` first (difflib's similarity ratio)."""
    def closeness(c: str) -> float:
        return difflib.SequenceMatcher(None, name.lower(), c.lower()).ratio()
    return sorted(set(candidates), key=lambda c: (-closeness(c), c))[:n]


def selector_parts(sel) -> tuple[str | None, str]:
    """(module pattern or None, op spelling) of a selector, to compare with what a graph holds."""
    if isinstance(sel, ModuleOpSelector):
        return sel.module, sel.op.qualname
    return None, getattr(sel, "qualname", str(sel))


def _op_exists(ns: str, name: str) -> bool:
    """Whether ``ns::name`` is a registered op. Asks the dispatcher's name table, never ``torch.ops``
    (whose attribute access creates a namespace for any spelling)."""
    if not (ns.isidentifier() and name.isidentifier()):
        return False
    return f"{ns}::{name}" in _short_names()


def _returns_tensor(schema) -> bool:
    return any("Tensor" in str(ret.type) for ret in schema.returns)


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


# ops that never reach a joint graph (they decompose before AOTAutograd traces it), spelled as the op they
# become when that op carries the same decision: ``aten::argsort`` is traced as ``aten::sort``
ALIASES = {"aten::argsort": "aten::sort", "aten::softmax": "aten::_softmax", "aten::log_softmax": "aten::_log_softmax",
           "aten::layer_norm": "aten::native_layer_norm", "aten::group_norm": "aten::native_group_norm",
           "aten::dropout": "aten::native_dropout"}
# what to select instead of a decomposing op with no single replacement
_DECOMPOSED_INTO = {"aten::linear": "aten::addmm or aten::mm", "aten::matmul": "aten::mm or aten::bmm",
                    "aten::einsum": "aten::bmm or aten::mm", "aten::rms_norm": "aten::rsqrt or aten::mul",
                    "aten::scaled_dot_product_attention": "aten::_scaled_dot_product_flash_attention, "
                    "aten::_scaled_dot_product_efficient_attention or the math ops it becomes (aten::bmm)"}


def _decomposes(ops: Sequence[torch._ops.OpOverload]) -> bool:
    """Whether every overload decomposes before the joint graph (a CompositeImplicitAutograd kernel)."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return bool(ops) and all(op.has_kernel_for_dispatch_key(key) for op in ops)


def _refuse_decomposing(sel: "OpSelector", quoted: str) -> None:
    if not _decomposes(sel.overloads(quoted)):
        return
    instead = _DECOMPOSED_INTO.get(sel.qualname)
    raise SelectorError(
        f"sacpass: selector {quoted!r} names {sel}, which decomposes into other ops before the joint graph "
        f"is traced (it is CompositeImplicitAutograd), so no node ever carries it. Select "
        f"{instead or 'the ops it decomposes into'} instead (dump_dir= writes the joint graph to read them).")


def _looks_like_module(ns: str) -> bool:
    return not ns.isidentifier()


def _parse_op_name(spelled: str, quoted: str) -> tuple[str, str, str | None]:
    """'ns::op', 'ns::op.overload', 'ns.op', 'ns.op.overload' -> (ns, op, overload|None)."""
    if "::" in spelled:
        ns, rest = spelled.split("::", 1)
        name, _, overload = rest.partition(".")
    else:
        parts = spelled.split(".")
        if len(parts) < 2:
            raise SelectorError(
                f"sacpass: cannot read op selector {quoted!r}; write 'namespace::op', "
                f"'namespace::op.overload' or 'namespace.op' (e.g. 'aten::topk').")
        ns, name = parts[0], parts[1]
        overload = ".".join(parts[2:])
    if not ns or not name or "::" in name:
        raise SelectorError(f"sacpass: cannot read op selector {quoted!r}; write e.g. 'aten::topk'.")
    return ns, name, (overload or None)


# --------------------------------------------------------------------------- selectors
@dataclass(frozen=True)
class OpSelector:
    """Every node produced by one op (all its functional overloads when ``overload`` is None)."""

    qualname: str  # "ns::op"
    overload: str | None = None  # None: every functional overload of the packet

    @classmethod
    def from_spelling(cls, spelled: str, *, quoted: str | None = None) -> "OpSelector":
        """Parse ``spelled``; errors quote ``quoted`` (the whole selector the user wrote)."""
        quoted = quoted or spelled
        ns, name, overload = _parse_op_name(spelled, quoted)
        qual = f"{ns}::{name}"
        if qual in ALIASES:  # the op it is traced as; its overloads differ, so the whole packet
            (ns, name), overload = ALIASES[qual].split("::"), None
            qual = f"{ns}::{name}"
        if not _op_exists(ns, name):
            if _looks_like_module(ns):
                raise UnknownOpError(
                    f"sacpass: selector {quoted!r} reads as module pattern {ns!r} and op {name!r}, but an op "
                    f"needs its namespace: write '{ns}::aten::{name}' (or the op's own namespace, e.g. "
                    f"'{ns}::mylib::{name}').")
            close = _closest(qual)
            hint = f" Closest registered ops: {', '.join(close)}." if close else ""
            raise UnknownOpError(
                f"sacpass: selector {quoted!r} names op {qual}, which is not registered.{hint} "
                f"Import the module that defines the op before building the policy, or fix the name.")
        sel = cls(qual, overload)
        sel.overloads(quoted)  # validates the overload and the schema
        _refuse_decomposing(sel, quoted)
        return sel

    @classmethod
    def from_op(cls, op: Any) -> "OpSelector":
        if isinstance(op, torch._ops.OpOverload):
            sel = cls(op._schema.name, op._overloadname or "default")
        else:
            sel = cls(op._qualified_op_name, None)
        if sel.qualname in ALIASES:
            sel = cls(ALIASES[sel.qualname], None)
        sel.overloads(str(op))
        _refuse_decomposing(sel, str(op))
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

    def matches_op(self, op: torch._ops.OpOverload | None, modules: Sequence[tuple[str, str]] = ()) -> bool:
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

    def matches_module(self, modules: Sequence[tuple[str, str]]) -> bool:
        """Whether a module stack [(path, class name)] passes through a module this selector names."""
        return any(cls == self.module or fnmatch.fnmatchcase(path, self.module) for path, cls in modules)

    def matches_op(self, op: torch._ops.OpOverload | None, modules: Sequence[tuple[str, str]] = ()) -> bool:
        return self.op.matches_op(op) and self.matches_module(modules)

    def __call__(self, node: torch.fx.Node) -> bool:
        return self.op(node) and self.matches_module(module_stack(node))

    def __str__(self) -> str:
        return f"{self.module}::{self.op}"


# --------------------------------------------------------------------------- predicate keys
PREDICATE_KEY_DEPTH = 4  # how deep a predicate's calls into other module-level functions are followed
_PLAIN_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


class _Unkeyable(Exception):
    """What a predicate reads that has no stable key (the message names it)."""


def _value_key(value: Any, what: str, stack: tuple) -> str:
    """A stable key for a value a predicate reads, or _Unkeyable: plain values (and tuples / frozensets of
    them) by value, objects with ``cache_hash`` by it, functions by what they read, modules / classes / ops
    by name."""
    if isinstance(value, _PLAIN_TYPES):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, frozenset) else value
        return f"{type(value).__name__}(" + ",".join(_value_key(v, what, stack) for v in items) + ")"
    hashed = getattr(value, "cache_hash", None)
    if isinstance(hashed, str):
        return f"cache_hash:{hashed}"
    if inspect.ismodule(value):  # modules, torch.ops namespaces
        return f"module:{value.__name__}"
    if isinstance(value, type):
        return f"class:{value.__module__}.{value.__qualname__}"
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return f"op:{value}"
    if inspect.isbuiltin(value):
        return f"builtin:{getattr(value, '__module__', '')}.{value.__qualname__}"
    if inspect.isfunction(value) and value.__name__ != "<lambda>":
        if value in stack:  # recursion: the function's own key is being computed
            return f"recursive:{value.__qualname__}"
        if len(stack) > PREDICATE_KEY_DEPTH:
            raise _Unkeyable(f"calls {value.__qualname__} through more than {PREDICATE_KEY_DEPTH} functions")
        try:
            return f"function:{_function_key(value, stack)}"
        except _Unkeyable as e:
            raise _Unkeyable(f"calls {value.__qualname__}, which {e}") from None
    raise _Unkeyable(f"reads {what} ({type(value).__name__}), which has no stable key")


def _global_names(code) -> set[str]:
    """The globals a code object (and the code nested in it) loads."""
    import dis
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def _function_key(fn: Callable, stack: tuple = ()) -> str:
    """A function by its source, defaults, closure cells and the globals its code loads; ``stack``: the
    functions whose key is being computed (their calls led here)."""
    stack = stack + (fn,)
    try:
        parts = [fn.__module__ or "", fn.__qualname__, inspect.getsource(fn)]
    except (OSError, TypeError):
        raise _Unkeyable(f"has no source file ({fn.__qualname__} was not defined in a file)") from None
    parts += [_value_key(v, f"a default argument of {fn.__qualname__}", stack) for v in fn.__defaults__ or ()]
    parts += [f"{k}={_value_key(v, f'default argument {k!r}', stack)}"
              for k, v in sorted((fn.__kwdefaults__ or {}).items())]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            raise _Unkeyable(f"reads closure variable {name!r} before it is assigned") from None
        parts.append(f"{name}={_value_key(value, f'closure variable {name!r}', stack)}")
    for name in sorted(_global_names(fn.__code__)):
        if name in fn.__globals__:  # otherwise a builtin (or undefined): nothing the user changes
            parts.append(f"{name}={_value_key(fn.__globals__[name], f'global {name!r}', stack)}")
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def predicate_key(fn: Callable) -> tuple[str | None, str]:
    """``(key, "")`` for a predicate, or ``(None, why)`` when what it reads has no stable key.

    ``fn.cache_hash`` wins when present. Otherwise a function is keyed by its source, default arguments,
    closure cells and the globals its code (nested code included) loads, each by value for plain values
    (numbers, strings, bools, None, dtypes, devices, tuples / frozensets of those), by ``cache_hash`` where
    an object has one, by this same key for the module-level functions it calls (``PREDICATE_KEY_DEPTH``
    deep), by name for modules, classes and ops. A lambda (its source line may hold others), a callable
    object, or anything else read makes the predicate uncacheable. Computed at each compile: a global
    changed after the backend was built changes the key."""
    hashed = getattr(fn, "cache_hash", None)
    if hashed is not None:
        return str(hashed), ""
    if not inspect.isfunction(fn):
        return None, f"is a {type(fn).__name__} object without a `cache_hash`"
    if fn.__name__ == "<lambda>":
        return None, "is a lambda (its source line does not identify it)"
    try:
        return _function_key(fn), ""
    except _Unkeyable as e:
        return None, str(e)


@dataclass(frozen=True)
class PredicateSelector:
    """A user predicate ``fn(node) -> bool``. Its cache key (:func:`predicate_key`) is computed at each
    compile, from ``fn.cache_hash`` or from what ``fn`` reads."""

    fn: Callable[[torch.fx.Node], bool]
    name: str

    @classmethod
    def from_callable(cls, fn: Callable[[torch.fx.Node], bool]) -> "PredicateSelector":
        return cls(fn, getattr(fn, "__qualname__", None) or type(fn).__name__)

    def key(self) -> tuple[str | None, str]:
        """``(key, "")``, or ``(None, why)`` when the compile caches must be bypassed (see predicate_key)."""
        return predicate_key(self.fn)

    @property
    def cache_key(self) -> str | None:  # None: the compile caches are bypassed
        return self.key()[0]

    def matches_op(self, op, modules=()) -> bool:
        return False  # a node predicate has no answer for an op at run time (see sacpass.context)

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

    def matches_op(self, op, modules=()) -> bool:
        return op is not None and op.namespace == "_c10d_functional" and \
            op._schema.name != "_c10d_functional::wait_tensor"

    def __call__(self, node: torch.fx.Node) -> bool:
        return self.matches_op(node_op(node))

    def __str__(self) -> str:
        return "collectives(_c10d_functional)"


# Discrete selection ops of ATen: they return integer indices chosen by comparing floating-point values.
DISCRETE_OPS = ("topk", "sort", "argsort", "argmax", "argmin", "max", "min", "kthvalue", "mode", "median",
                "nanmedian", "cummax", "cummin", "searchsorted", "bucketize")
# discrete ops returning (values, indices): the values are the input's elements at the indices along ``dim``;
# "same": indices shaped like the values; "reduce": the dim is reduced (kept with keepdim=True)
VALUE_INDEX_OPS = {"aten::topk": "same", "aten::sort": "same", "aten::cummax": "same", "aten::cummin": "same",
                   "aten::max": "reduce", "aten::min": "reduce", "aten::kthvalue": "reduce", "aten::mode": "reduce",
                   "aten::median": "reduce", "aten::nanmedian": "reduce"}
_SKIP_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional", "higher_order", "ao",
                              "sacpass"})


def _is_int(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool


INT32_LIMIT = 2 ** 31 - 1  # indices over fewer positions than this are kept as int32


def bound_args(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict) -> dict:
    """An op call's arguments by schema name, defaults filled in."""
    out = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def selection_extent(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict,
                     size: Callable[[Any], int] = int) -> int:
    """How many positions a selection's indices range over: the selected dim of its input (all of it without
    a dim). ``size`` reads a size (symbolic sizes at their hints). Past INT32_LIMIT when unknown."""
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if src is None:
        return INT32_LIMIT + 1
    dim = bound_args(op, args, kwargs).get("dim")
    return size(src.numel()) if dim is None or src.dim() == 0 else size(src.shape[dim])


def tensors_in(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in tensors_in(v)]
    return []


def is_discrete_op(op: torch._ops.OpOverload | None, inputs: Sequence[Any], outputs: Any) -> bool:
    """A discrete decision: an ATen selection op (``DISCRETE_OPS``: top-k, sort/argsort, argmax, ...) with an
    integer output, or a custom op that returns an integer tensor computed from a floating-point input."""
    if op is None or op.namespace in _SKIP_NAMESPACES - {"aten"}:
        return False
    if not any(_is_int(t.dtype) for t in tensors_in(outputs)):
        return False
    if op.namespace == "aten":
        return op._schema.name.split("::", 1)[1] in DISCRETE_OPS
    return any(t.dtype.is_floating_point for t in tensors_in(list(inputs)))


@dataclass(frozen=True)
class DiscreteSelector:
    """Discrete decisions (top-k, sort, argmax, a router's expert choice, integer-valued custom ops):
    recomputing one in the backward can decide differently from the forward. Saved by default
    (``save_discrete=True``); an explicit ``recompute=`` selector overrides it for its ops."""

    def __call__(self, node: torch.fx.Node) -> bool:
        op = node_op(node)
        if op is None:
            return False
        inputs = [a.meta.get("val") for a in node.all_input_nodes]
        return is_discrete_op(op, inputs, node.meta.get("val"))

    def matches_op(self, op, modules=()) -> bool:  # run time: decided with the op's values (sacpass.context)
        return False

    def __str__(self) -> str:
        return "discrete"


Selector = Union[OpSelector, ModuleOpSelector, PredicateSelector, CollectiveSelector, DiscreteSelector]
SelectorLike = Union[Selector, str, torch._ops.OpOverload, torch._ops.OpOverloadPacket, Callable[[torch.fx.Node], bool]]


def _from_string(spelled: str) -> Selector:
    spelled = spelled.strip()
    parts = spelled.split("::")
    if len(parts) == 1:
        return OpSelector.from_spelling(spelled)
    if len(parts) == 2:
        ns, rest = parts
        if _op_exists(ns, rest.split(".")[0]) or "." not in rest:
            # 'ns::op[.overload]', or an unknown 'ns::op' (reported as such, never read as a module pattern)
            return OpSelector.from_spelling(spelled)
        return ModuleOpSelector(ns, OpSelector.from_spelling(rest, quoted=spelled))
    if len(parts) == 3:
        module, ns, rest = parts
        if not module:
            raise SelectorError(f"sacpass: selector {spelled!r} has an empty module pattern before '::'.")
        return ModuleOpSelector(module, OpSelector.from_spelling(f"{ns}::{rest}", quoted=spelled))
    raise SelectorError(
        f"sacpass: cannot read selector {spelled!r}; write 'ns::op', 'ns::op.overload', 'ns.op' or "
        f"'<module glob or class>::ns::op'.")


_SELECTOR_TYPES = (OpSelector, ModuleOpSelector, PredicateSelector, CollectiveSelector, DiscreteSelector)


def as_selector(x: SelectorLike) -> Selector:
    """Turn anything accepted as a selector into a hashable selector object."""
    if isinstance(x, _SELECTOR_TYPES):
        return x
    if isinstance(x, str):
        return _from_string(x)
    if isinstance(x, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return OpSelector.from_op(x)
    if isinstance(x, torch._ops.HigherOrderOperator):
        raise SelectorError(f"sacpass: {x!r} is a higher-order operator; select the op it wraps instead.")
    if callable(x):
        sel = PredicateSelector.from_callable(x)
        if sel.cache_key is None:
            warn(f"sacpass: predicate selector {sel.name} has no stable cache key (it {sel.key()[1]}); the "
                 f"FX-graph and AOTAutograd caches are bypassed for backends using it. Give the predicate a "
                 f"`cache_hash` attribute (a string that changes when its logic does) to cache.")
        return sel
    raise SelectorError(
        f"sacpass: {x!r} ({type(x).__name__}) is not a selector; pass an op (torch.ops.ns.op[.overload]), "
        f"a string such as 'aten::topk', or a predicate taking a torch.fx.Node.")


def as_selectors(xs: SelectorLike | Iterable[SelectorLike] | None) -> tuple[Selector, ...]:
    if xs is None:
        return ()
    if isinstance(xs, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or \
            callable(xs) and not isinstance(xs, (list, tuple)):
        xs = [xs]
    out: list[Selector] = []
    for x in xs:
        s = as_selector(x)
        if s not in out:
            out.append(s)
    return tuple(out)
