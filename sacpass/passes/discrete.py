"""keep_decisions_pass: save a discrete decision as its narrowest integer form, rebuild its values from it.

Requires: a joint graph after :func:`~sacpass.passes.tag_policy.tag_policy_pass`, whose records say which
nodes were saved as discrete decisions (reason ``discrete``).
Ensures, for each such ATen selection op (topk, sort, max/min/kthvalue/mode/median along a dim, cummax,
cummin) that also returns the selected *values*:

- every use of the values is rewired to ``gather(input, dim, indices)``, a forward node with the op's
  original checkpoint tag. The values equal the op's own (the same elements), the backward rebuilds them
  from the recomputed input and the saved indices, and gradients flow through the gather as before; the
  float values themselves are never saved. Values that carry no gradient (a group score that only feeds
  another decision) leave the joint graph without a getitem of the indices: one is made, tagged as the
  decision's outputs are;
- an int64 index output is saved as int32 (``convert_element_type``, ``MUST_SAVE``) and widened again where it
  is used (``MUST_RECOMPUTE``), so the backward loads half the bytes. Indices along a dim of 2**31 or more
  elements are left int64.

A selection op an ``offload=`` selector chose (reason ``offload``) gets the same int32 form of its indices,
offloaded in place of the int64 ones (half the bytes each way); its values are left as they are.

Other discrete ops (argmax, argmin, searchsorted, custom ops with integer outputs) are left as the tag pass
left them. Returns the records of the nodes this pass added, and the names of value getitems it removed.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from ..nodes import is_getitem, node_op, size_hint
from ..selectors import INT32_LIMIT, VALUE_INDEX_OPS, bound_args, selection_extent
from .tag_policy import DISCRETE, OFFLOAD, OFFLOAD_KEY, TagResult

__all__ = ["keep_decisions_pass"]

_COPIED_META = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "ac_graph_id", "seq_nr",
                "source_fn_stack", "partitioner_tag")


def _vals(node: torch.fx.Node) -> tuple[list, dict]:
    """The node's args and kwargs with every node replaced by its (fake) value."""
    def val(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a
    return [val(a) for a in node.args], {k: val(v) for k, v in node.kwargs.items()}


def _getitem(node: torch.fx.Node, index: int) -> torch.fx.Node | None:
    return next((u for u in node.users if is_getitem(u) and u.args[1] == index), None)


def _new_node(graph: torch.fx.Graph, like: torch.fx.Node, target, args, tag) -> torch.fx.Node:
    """A call_function node with ``like``'s provenance meta, its fake value computed from the args' values."""
    node = graph.call_function(target, args)
    for key in _COPIED_META:
        if key in like.meta:
            node.meta[key] = like.meta[key]
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with fake_mode if fake_mode is not None else torch._subclasses.fake_tensor.unset_fake_temporarily():
        node.meta["val"] = target(*vals)
    if tag is not None:
        node.meta["recompute"] = tag
    return node


def _indices_of(graph: torch.fx.Graph, node: torch.fx.Node, values: torch.fx.Node, result: TagResult,
                rec) -> torch.fx.Node:
    """The getitem of ``node``'s indices, made (after ``values``, tagged as the tag pass tags a decision's
    outputs) when the joint graph has none: the values carry no gradient, so nothing read them."""
    indices = _getitem(node, 1)
    if indices is not None:
        return indices
    with graph.inserting_after(values):
        indices = graph.call_function(operator.getitem, (node, 1))
    indices.name = graph._graph_namespace.create_name(f"{values.name}_indices", None)
    for key in _COPIED_META:
        if key in values.meta:
            indices.meta[key] = values.meta[key]
    indices.meta["val"] = node.meta["val"][1]
    indices.meta["recompute"] = getattr(CheckpointPolicy, rec.previous) if rec.previous else None
    result.add(indices, CheckpointPolicy.MUST_SAVE, rec.reason, rec.selector)
    return indices


def _rebuild_values(graph: torch.fx.Graph, node: torch.fx.Node, op, kind: str, previous,
                    order: dict[torch.fx.Node, int], result: TagResult, rec) -> list[str]:
    """Rewire the uses of ``node``'s values to a gather from its input at its indices. ``order``: the
    position of each node the graph held when the pass began (what this pass inserts keeps their order)."""
    values = _getitem(node, 0)
    if values is None or not values.users:
        return []
    indices = _indices_of(graph, node, values, result, rec)
    args = bound_args(op, node.args, node.kwargs)
    dim, src = args.get("dim", -1), node.args[0]
    aten = torch.ops.aten
    last = indices if indices not in order else max(values, indices, key=order.__getitem__)  # a new one: after values
    with graph.inserting_after(last):
        if kind == "same" or args.get("keepdim", False):
            rebuilt = _new_node(graph, values, aten.gather.default, (src, dim, indices), previous)
        else:
            wide = _new_node(graph, values, aten.unsqueeze.default, (indices, dim), previous)
            with graph.inserting_after(wide):
                picked = _new_node(graph, values, aten.gather.default, (src, dim, wide), previous)
            with graph.inserting_after(picked):
                rebuilt = _new_node(graph, values, aten.squeeze.dim, (picked, dim), previous)
    values.replace_all_uses_with(rebuilt)
    graph.erase_node(values)
    return [values.name]


def _save_as_int32(graph: torch.fx.Graph, idx: torch.fx.Node, result: TagResult, selector: str, decision: str,
            reason: str = DISCRETE) -> None:
    """Save (or, ``reason`` offload, offload) int64 ``idx`` as int32: idx -> narrow (MUST_SAVE) -> wide
    (MUST_RECOMPUTE) -> former users."""
    convert = torch.ops.prims.convert_element_type.default
    users = list(idx.users)
    with graph.inserting_after(idx):
        narrow = _new_node(graph, idx, convert, (idx, torch.int32), None)
        narrow.name = graph._graph_namespace.create_name(f"{idx.name}_int32", None)
    with graph.inserting_after(narrow):
        wide = _new_node(graph, idx, convert, (narrow, torch.int64), None)
    for user in users:
        user.replace_input_with(idx, wide)
    offload = reason == OFFLOAD
    if offload:  # the int32 form leaves the device; the int64 one is only its input now
        idx.meta.pop(OFFLOAD_KEY, None)
    result.add(narrow, CheckpointPolicy.MUST_SAVE, reason, f"{selector} (int32)", op=decision, offload=offload)
    result.add(wide, CheckpointPolicy.MUST_RECOMPUTE, "derived", f"derived from {selector}")


def keep_decisions_pass(gm: torch.fx.GraphModule, tags: TagResult) -> list[str]:
    """Rebuild the values of saved discrete selections from their indices and save int64 indices as int32
    (see the module docstring). Mutates ``tags`` (adds the new nodes, drops removed getitems)."""
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    removed: list[str] = []
    for rec in [r for r in tags.records if r.reason in (DISCRETE, OFFLOAD)]:
        node = by_name.get(rec.name)
        op = node_op(node) if node is not None else None
        if op is None or node.target is not op:  # getitems, wrapped ops
            continue
        kind = VALUE_INDEX_OPS.get(op._schema.name)
        if rec.reason == OFFLOAD and kind is None:  # an offloaded selection: its indices leave as int32
            continue
        previous = getattr(CheckpointPolicy, rec.previous) if rec.previous else None
        if kind is not None and rec.reason == DISCRETE:
            removed += _rebuild_values(graph, node, op, kind, previous, order, tags, rec)
        idx = _getitem(node, 1) if kind is not None else (node if isinstance(node.meta.get("val"), torch.Tensor) else None)
        if idx is not None and idx.meta["val"].dtype == torch.int64 and idx.users \
                and selection_extent(op, *_vals(node), size=size_hint) <= INT32_LIMIT:
            _save_as_int32(graph, idx, tags, rec.selector, rec.op, rec.reason)
    tags.records = [r for r in tags.records if r.name not in removed]
    graph.lint()
    return removed
