"""The persisted reports: what a compile reports when PyTorch serves its graph from a warm cache.

A partition that runs stores its report under the graph's artifact key (:func:`artifact_key`) in the
Inductor cache directory; a later compile whose graph PyTorch serves from its AOTAutograd cache runs no
partition, and reads the report back instead. A graph that had no partition (an inference graph) is stored
as such, so its warm rebuild reports nothing and warns of nothing.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
import torch.fx

from .errors import warn
from .report import Report

__all__ = ["artifact_key", "report_dir", "persist", "load", "cache_hits"]

_NO_PARTITION = '{"kind": "sacpass.no_partition"}'  # persisted for a graph that had no partition to report


def artifact_key(gm: torch.fx.GraphModule, example_inputs: list[Any], uuid: str | None, inner: str) -> str | None:
    """Identifies one Dynamo graph under one backend: the key a persisted report is stored under.

    Every input of a partition decision is in this key, and (through ``uuid``, the partitioner's
    ``uuid()``) in Inductor's FX-graph and AOTAutograd cache keys, or the caches are bypassed:

    - the policy: explicit save / recompute / offload selectors; predicate selectors by
      :func:`~sacpass.selectors.predicate_key` (source, defaults, closure cells, globals read; computed at
      each compile; a predicate without a stable key bypasses the caches, with a warning and a report line)
    - the registry (``register_must_save``), read at each compile when ``use_registered``
    - the defaults (``save_discrete``, ``save_collectives``), ``strict``, ``memory_budget``
    - the plan: its fields, its cost model, and its host budget as resolved on this host
      (``host_bytes=None``: a share of this machine's memory)
    - sacpass's sources and versions (:func:`sacpass._version.sources_digest`), the torch version,
      ``inner`` (the inner compiler; Inductor's own config is in its keys)
    - PyTorch's ``activation_memory_budget`` (the whole functorch config is in AOTAutograd's key)
    - grad mode, autocast state, deterministic algorithms
    - the Dynamo graph's code, and per input: shape (symbolic where dynamic), strides, dtype, device,
      requires_grad; a non-tensor input by type
    Not in the key: ``dump_dir`` (it only writes files).
    With dynamic shapes the planner's byte counts are taken at the sizes of the compile that filled
    the cache, as PyTorch's own knapsack does.
    """
    if uuid is None:
        return None
    from torch._functorch import config as fc
    autocast = [(d, torch.get_autocast_dtype(d)) for d in torch._C._autocast_supported_devices()
                if torch.is_autocast_enabled(d)]
    parts = [uuid, inner, torch.__version__, str(fc.activation_memory_budget), str(torch.is_grad_enabled()),
             str(autocast), str(torch.are_deterministic_algorithms_enabled()), gm.code]
    placeholders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    for i, x in enumerate(example_inputs):
        fake = placeholders[i] if i < len(placeholders) else None
        t = fake if isinstance(fake, torch.Tensor) else x  # symbolic sizes where Dynamo made them dynamic
        if isinstance(t, torch.Tensor):
            parts.append(f"{tuple(map(str, t.shape))}:{tuple(map(str, t.stride()))}:{t.dtype}:"
                         f"{t.device}:{t.requires_grad}")
        else:
            parts.append(repr(type(x)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def report_dir() -> str:
    """Where the reports are persisted: ``sacpass_reports`` in the Inductor cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return os.path.join(cache_dir(), "sacpass_reports")


def persist(key: str, report: Report | None) -> None:
    """Store ``report`` for a warm-cache rebuild; None: the graph is one without a partition."""
    folder = report_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{key}.json.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(_NO_PARTITION if report is None else report.to_json())
        os.replace(tmp, os.path.join(folder, f"{key}.json"))
    except OSError as e:  # the compile itself succeeded; losing the report is worth a warning only
        warn(f"sacpass: could not persist the report for a warm-cache rebuild ({e}).")


def load(key: str | None) -> Report | None:
    """The report persisted under ``key``; None for a graph without a partition, and (with a warning that
    says how to rebuild it) when none was persisted."""
    path = os.path.join(report_dir(), f"{key}.json") if key is not None else None
    if path is None or not os.path.exists(path):
        warn("sacpass: PyTorch served this graph from its AOTAutograd cache, and no sacpass report was "
             "persisted for it, so backend.reports has no entry for it. Clear the Inductor cache "
             "(TORCHINDUCTOR_CACHE_DIR) once to rebuild it.")
        return None
    with open(path) as f:
        text = f.read()
    return None if text == _NO_PARTITION else Report.from_json(text, where=path)


def cache_hits() -> int:
    """PyTorch's count of AOTAutograd cache hits in this process (a hit runs no partition)."""
    from torch._dynamo.utils import counters
    return counters["aot_autograd"]["autograd_cache_hit"]
