"""tag_must_save_pass: stamp PyTorch's own checkpoint tags on selected joint-graph nodes.

Requires: an AOTAutograd joint graph (placeholders ``primals_*`` and ``tangents_*``), before partitioning.
Ensures: every forward node produced by a must-save selector, and every getitem that unpacks it (nested
tuples included), has ``meta["recompute"] = CheckpointPolicy.MUST_SAVE``; every forward node produced by a
must-recompute selector has ``MUST_RECOMPUTE``; along chains of cheap unary ops (casts, views, pointwise)
fed only by a must-save value, links no smaller than what precedes them are ``MUST_RECOMPUTE`` and links
narrower than everything before them are ``MUST_SAVE``, so the narrowest form (int32, never a widened
int64) is what the backward loads. Nothing else is changed: other tags, ``ac_graph_id`` and
the graph's structure stay as they were. Nodes computed from tangents (the backward part of the joint) are
never tagged: they are not recomputations.
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import PolicyConflictError, SacpassWarning, SelectorError, UnmatchedSelectorError
from ..policies import Policy
from ..selectors import module_path_of, node_op

__all__ = ["TagRecord", "TagResult", "tag_must_save_pass", "source_of", "op_name_of"]


@dataclass(frozen=True)
class TagRecord:
    """One node the pass tagged."""

    name: str  # node name in the joint graph
    op: str  # producing op, "ns::op.overload"
    tag: str  # "MUST_SAVE" or "MUST_RECOMPUTE"
    selector: str  # the selector that matched
    module: str  # module path relative to the compiled root
    source: str  # "file.py:line" of the user code that produced it
    previous: str | None  # the tag the node had before (PREFER_RECOMPUTE inside a checkpoint, None outside)


@dataclass
class TagResult:
    """What one run of the pass did."""

    records: list[TagRecord] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # explicit selectors that matched no forward node
    skipped_backward: list[str] = field(default_factory=list)  # matches inside the backward part, left alone

    def names(self, tag: str = "MUST_SAVE") -> set[str]:
        return {r.name for r in self.records if r.tag == tag}


def op_name_of(node: torch.fx.Node) -> str:
    op = node_op(node)
    if op is not None:
        return f"{op._schema.name}.{op._overloadname or 'default'}"
    if node.op == "call_function":
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            return op_name_of(node.args[0])  # an unpacked output is reported as its producer
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def source_of(node: torch.fx.Node) -> str:
    """'file.py:line' of the innermost user frame in the node's stack trace ('' when unknown)."""
    trace = node.meta.get("stack_trace") or ""
    last = ""
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            try:
                path = line.split('"')[1]
                lineno = line.split("line ")[1].split(",")[0]
            except IndexError:
                continue
            last = f"{path.rsplit('/', 1)[-1]}:{lineno}"
    return last


def _tangent_dependent(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The backward part of the joint: nodes computed from tangents, and nodes AOTAutograd traced while
    running the backward (``partitioner_tag == "is_backward"``), such as ``ids.long()`` inside a custom op's
    backward formula, which reads only forward values."""
    dependent: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            dependent.add(node)
        elif node.meta.get("partitioner_tag") == "is_backward":
            dependent.add(node)
        elif any(inp in dependent for inp in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _is_view_producer(node: torch.fx.Node) -> bool:
    op = node_op(node)
    if op is None or node.target is not op:  # wrapped ops return fresh tensors
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def _has_tensor_output(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return any(isinstance(v, torch.Tensor) or isinstance(v, (list, tuple)) for v in vals) or val is None


def _unpackers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The getitem users of a multi-output node, recursively (nested tuples)."""
    out = []
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            out.append(user)
            out.extend(_unpackers(user))
    return out


_CASTS = ("aten::_to_copy", "prims::convert_element_type", "aten::to", "aten::clone")


def _is_cheap_unary(node: torch.fx.Node) -> bool:
    """A view, cast or pointwise op with exactly one tensor input: as cheap to redo as to load."""
    op = node_op(node)
    if op is None or node.target is not op or len(node.all_input_nodes) != 1:
        return False
    if op._schema.name in _CASTS or torch.Tag.pointwise in op.tags:
        return True
    return any(r.alias_info is not None for r in op._schema.returns)  # a view


def _nbytes(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    from ..report import tensor_nbytes
    return tensor_nbytes(val)


def _cheap_derivatives(roots: list[torch.fx.Node], backward: set[torch.fx.Node]
                       ) -> list[tuple[torch.fx.Node, CheckpointPolicy]]:
    """Nodes computed from a must-save value by a chain of cheap unary ops (``ids.clamp(0).long()``).

    Left to the min-cut, such a chain can be saved in a widened form (int64 instead of int32). A link no
    smaller than the narrowest value before it is tagged MUST_RECOMPUTE (the backward rebuilds it); a link
    narrower than everything before it (``topk(...).indices.int()``), on a chain nothing else reads, is
    tagged MUST_SAVE, so the narrow form is what the backward loads and the wide producer need not be kept.
    """
    out: list[tuple[torch.fx.Node, CheckpointPolicy]] = []
    # (node, narrowest size so far, whether every link so far has this chain as its only user)
    frontier = [(r, _nbytes(r), len(r.users) == 1) for r in roots]
    seen = set(roots)
    while frontier:
        node, narrowest, linear = frontier.pop()
        for user in node.users:
            if user in seen or user in backward or not _is_cheap_unary(user):
                continue
            if user.meta.get("recompute") is CheckpointPolicy.MUST_SAVE:
                continue
            seen.add(user)
            size = _nbytes(user)
            # a narrower link replaces the wide value only if nothing else reads the wide value
            if linear and size is not None and narrowest is not None and size < narrowest:
                out.append((user, CheckpointPolicy.MUST_SAVE))
                frontier.append((user, size, len(user.users) == 1))
            else:
                out.append((user, CheckpointPolicy.MUST_RECOMPUTE))
                frontier.append((user, narrowest, linear and len(user.users) == 1))
    return out


def tag_must_save_pass(gm: torch.fx.GraphModule, policy: Policy, *, strict: bool = True) -> TagResult:
    """Tag the nodes ``policy`` selects. Returns what was tagged; raises on refused or conflicting input."""
    graph = gm.graph
    backward = _tangent_dependent(graph)
    result = TagResult()
    matched: set[object] = set()
    save_sels = policy.all_save()

    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        save_hit = next((s for s in save_sels if s(node)), None)
        rec_hit = next((s for s in policy.recompute if s(node)), None)
        if save_hit is None and rec_hit is None:  # a default (collectives) yields to any recompute selector
            save_hit = next((s for s in policy.defaults if s(node)), None)
        if save_hit is None and rec_hit is None:
            continue
        if node in backward:
            result.skipped_backward.append(node.name)
            continue
        if save_hit is not None and rec_hit is not None:
            raise PolicyConflictError(
                f"sacpass: node {node.name} ({op_name_of(node)}, module {module_path_of(node) or '<root>'}, "
                f"{source_of(node) or 'unknown source'}) is selected both to save ({save_hit}) and to "
                f"recompute ({rec_hit}). Remove it from one of save= / recompute=, or narrow a selector "
                f"with a module pattern ('<module>::ns::op').")
        sel = save_hit if save_hit is not None else rec_hit
        matched.add(sel)
        if save_hit is not None:
            if _is_view_producer(node):
                raise SelectorError(
                    f"sacpass: selector {save_hit} selects {node.name} ({op_name_of(node)}), a view. The "
                    f"partitioner cannot ban a view from recomputation; select the op that produces its base.")
            if not _has_tensor_output(node):
                raise SelectorError(
                    f"sacpass: selector {save_hit} selects {node.name} ({op_name_of(node)}), which produces no "
                    f"tensor; there is nothing to save. Select the op producing the tensor to keep.")
            tag = CheckpointPolicy.MUST_SAVE
        else:
            tag = CheckpointPolicy.MUST_RECOMPUTE
        targets = [(t, tag, str(sel)) for t in [node] + (_unpackers(node) if tag is CheckpointPolicy.MUST_SAVE else [])]
        if tag is CheckpointPolicy.MUST_SAVE:
            derived = _cheap_derivatives([t for t, _, _ in targets], backward)
            targets += [(d, d_tag, f"derived from {sel}") for d, d_tag in derived]
        for target, target_tag, why in targets:
            previous = target.meta.get("recompute")
            target.meta["recompute"] = target_tag
            result.records.append(TagRecord(
                name=target.name, op=op_name_of(target), tag=target_tag.name, selector=why,
                module=module_path_of(target), source=source_of(target),
                previous=previous.name if previous is not None else None))

    explicit = policy.save + policy.recompute
    result.unmatched = [str(s) for s in explicit if s not in matched]
    if result.unmatched:
        msg = (f"sacpass: selector(s) {', '.join(result.unmatched)} matched no forward node in this graph. "
               f"Check the op name and module pattern against the graph (module paths are relative to the "
               f"module given to torch.compile), or pass strict=False to allow graphs without them.")
        if strict:
            raise UnmatchedSelectorError(msg)
        warnings.warn(msg, SacpassWarning, stacklevel=2)
    return result
