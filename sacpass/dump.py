"""Graph dumps: per compiled graph, the tagged joint graph, the forward and backward graphs, the report.

Layout::

    DIR/index.json                  {"kind": "sacpass.dump", "version": 1, "graphs": ["g0", ...]}
    DIR/index.html                  the partition page for every graph (self-contained, see sacpass.html)
    DIR/g0/joint.txt                joint graph with sacpass/PyTorch tags (before the min-cut)
    DIR/g0/forward.txt              forward graph (print_readable)
    DIR/g0/backward.txt             backward graph (print_readable)
    DIR/g0/forward.normalized.txt   forward graph, normalised as in golden tests (sacpass.graphs)
    DIR/g0/backward.normalized.txt  backward graph, normalised
    DIR/g0/report.json              the saved-set report (Report.to_json)
    DIR/g0/graph.json               the nodes the page draws (sacpass.html.graph_view)

Everything is text or JSON: dumps are read back with json only, never pickle.
"""
from __future__ import annotations

import json
import os
import re

from .errors import DumpError

__all__ = ["Dumper", "DUMP_VERSION", "read_index", "read_report", "read_view", "render_dump", "trace_report"]

DUMP_VERSION = 1


def trace_report(report) -> None:
    """Emit ``report`` as a structured-trace artifact (``TORCH_TRACE``), so tlparse shows it beside the AOT
    graphs of the same compile. Costs nothing when structured tracing is off."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": f"sacpass_report_{report.graph}", "encoding": "json"},
                     payload_fn=report.to_json)


class Dumper:
    """Writes dumps into one directory; checks at construction that it can."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = os.fspath(directory)
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, ".sacpass-write-test")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise DumpError(
                f"sacpass: dump_dir {self.dir!r} cannot be written ({e.strerror or e}). Pass a writable "
                f"directory as dump_dir= (or SACPASS_DUMP_DIR), or leave it unset to dump nothing.") from e
        self.graphs: list[str] = []
        self._views: dict[str, dict] = {}

    def write(self, result) -> str:
        """Write one PartitionResult; returns its folder. Rewrites index.json and index.html."""
        from .graphs import normalized_graphs, readable
        from .html import graph_view, render_html

        gid = result.report.graph
        folder = os.path.join(self.dir, gid)
        view = graph_view(result)
        forward, backward, _, _ = normalized_graphs(result)
        try:
            os.makedirs(folder, exist_ok=True)
            files = {
                "joint.txt": result.joint_text,
                "forward.txt": readable(result.forward),
                "backward.txt": readable(result.backward),
                "forward.normalized.txt": forward,
                "backward.normalized.txt": backward,
                "report.json": result.report.to_json(),
                "graph.json": json.dumps(view, indent=1, sort_keys=True),
            }
            for name, text in files.items():
                with open(os.path.join(folder, name), "w") as f:
                    f.write(text)
            if gid not in self.graphs:
                self.graphs.append(gid)
            self._views[gid] = view
            with open(os.path.join(self.dir, "index.json"), "w") as f:
                json.dump({"kind": "sacpass.dump", "version": DUMP_VERSION, "graphs": self.graphs}, f, indent=1)
            with open(os.path.join(self.dir, "index.html"), "w") as f:
                f.write(render_html([self._views[g] for g in self.graphs], title=f"sacpass dump {self.dir}"))
        except OSError as e:
            raise DumpError(f"sacpass: could not write dump {folder!r} ({e}). Free space or pick another "
                            f"dump_dir.") from e
        return folder


# ---------------------------------------------------------------------------------------------- reading
_GRAPH_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def _load_json(path: str, what: str):
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError as e:
        raise DumpError(f"sacpass: {path} does not exist; is this a sacpass dump ({what})?") from e
    except OSError as e:
        raise DumpError(f"sacpass: cannot read {path} ({e.strerror or e}).") from e
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DumpError(f"sacpass: {path} is not valid JSON ({e}).") from e


def read_index(directory: str | os.PathLike) -> list[str]:
    """The graph ids of the dump in ``directory``; DumpError when it is missing, foreign or newer."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise DumpError(f"sacpass: dump directory {directory!r} does not exist.")
    path = os.path.join(directory, "index.json")
    index = _load_json(path, "index.json")
    if not isinstance(index, dict) or index.get("kind") != "sacpass.dump":
        raise DumpError(f"sacpass: {path} is not a sacpass dump index (no kind='sacpass.dump').")
    version = index.get("version")
    if not isinstance(version, int) or version > DUMP_VERSION:
        raise DumpError(f"sacpass: {path} has dump version {version!r}; this sacpass reads up to {DUMP_VERSION}. "
                        f"Upgrade sacpass to read it.")
    graphs = index.get("graphs")
    if not isinstance(graphs, list) or not all(isinstance(g, str) and _GRAPH_ID.match(g) for g in graphs):
        raise DumpError(f"sacpass: {path} is corrupted: 'graphs' must be a list of graph ids like \"g0\".")
    return list(graphs)


def read_report(directory: str | os.PathLike, graph: str):
    """The Report of ``graph`` in the dump (read with json only)."""
    from .report import Report

    path = os.path.join(os.fspath(directory), graph, "report.json")
    return Report.from_dict(_load_json(path, "report.json"), where=path)


def read_view(directory: str | os.PathLike, graph: str) -> dict:
    """The page data of ``graph``: its graph.json, or the report alone for dumps without one."""
    from .html import VIEW_VERSION, view_from_report

    path = os.path.join(os.fspath(directory), graph, "graph.json")
    report = read_report(directory, graph)
    if not os.path.exists(path):
        return view_from_report(report)
    view = _load_json(path, "graph.json")
    if not isinstance(view, dict) or view.get("kind") != "sacpass.graph_view":
        raise DumpError(f"sacpass: {path} is not a sacpass graph view (no kind='sacpass.graph_view').")
    if not isinstance(view.get("version"), int) or view["version"] > VIEW_VERSION:
        raise DumpError(f"sacpass: {path} has graph-view version {view.get('version')!r}; this sacpass reads up "
                        f"to {VIEW_VERSION}. Upgrade sacpass to read it.")
    out = view_from_report(report)  # the saved set comes from the (validated) report
    for side in ("forward", "backward"):
        nodes = view.get(side)
        if not isinstance(nodes, list):
            raise DumpError(f"sacpass: {path} is corrupted: {side!r} must be a list of nodes.")
        out[side] = [_node(n, path) for n in nodes]
    return out


_NODE_FIELDS = {"name": str, "op": str, "value": str, "module": str, "source": str, "code": str, "tag": str,
                "must_save": bool, "selector": str, "recomputed": bool}


def _node(node, path: str) -> dict:
    """One node of a graph.json, checked field by field (the page trusts these types)."""
    if not isinstance(node, dict):
        raise DumpError(f"sacpass: {path} is corrupted: a node is {type(node).__name__}, not an object.")
    out = {}
    for key, typ in _NODE_FIELDS.items():
        if not isinstance(node.get(key), typ):
            raise DumpError(f"sacpass: {path} is corrupted: node field {key!r} must be {typ.__name__}.")
        out[key] = node[key]
    saved = node.get("saved_bytes")
    if saved is not None and (not isinstance(saved, int) or isinstance(saved, bool)):
        raise DumpError(f"sacpass: {path} is corrupted: node field 'saved_bytes' must be an integer or null.")
    out["saved_bytes"] = saved
    for key, typ, default in (("reason", str, ""), ("offload", bool, False)):  # graph.json version 2
        value = node.get(key, default)
        if not isinstance(value, typ):
            raise DumpError(f"sacpass: {path} is corrupted: node field {key!r} must be {typ.__name__}.")
        out[key] = value
    return out


def render_dump(directory: str | os.PathLike) -> str:
    """(Re)write ``DIR/index.html`` from the dump's JSON files; returns its path."""
    from .html import render_html

    directory = os.fspath(directory)
    views = [read_view(directory, g) for g in read_index(directory)]
    path = os.path.join(directory, "index.html")
    try:
        with open(path, "w") as f:
            f.write(render_html(views, title=f"sacpass dump {directory}"))
    except OSError as e:
        raise DumpError(f"sacpass: cannot write {path} ({e.strerror or e}).") from e
    return path
