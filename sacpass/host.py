"""The host's memory as sacpass budgets it: what this machine or container has, and this process's share.

- **node memory**: the least of physical memory, the container's limit (cgroup v2 ``memory.max`` of this
  process's cgroup and those above it, or cgroup v1 ``memory/memory.limit_in_bytes``) and the memory available
  when the process first asks (``MemAvailable``);
- **local ranks**: the processes of this job on this host, as the launcher says (``LOCAL_WORLD_SIZE`` from
  torchrun, Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's ``MPI_LOCALNRANKS``, Slurm's
  ``SLURM_NTASKS_PER_NODE``), else one;
- **node budget**: ``HOST_SHARE`` of node memory, what sacpass's host pools of every local rank together may hold;
- **rank budget**: the node budget over the local ranks, the default cap of this process's pool
  (``sacpass.offload.host_limit()``), so ranks that each keep to theirs never pass the node's together.

Passing a container's limit is met by the kernel's OOM killer, not by an allocation error, which is why the
limit is read rather than found out. One place for the offload runtime and the planner.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Mapping

from .errors import SacpassError

__all__ = ["HOST_SHARE", "HostBudget", "physical_memory", "available_memory", "cgroup_limit", "local_ranks",
           "host_budget"]

HOST_SHARE = 0.8  # of node memory: what sacpass's pools may hold together; the rest is the processes' own
_GIB = 1 << 30

# the launchers' names for the local rank count and this process's local rank, in the order they are read
_LOCAL_SIZE = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
_LOCAL_RANK = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def physical_memory() -> int:
    """Bytes of physical memory on this machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def available_memory(meminfo: str = "/proc/meminfo") -> int:
    """Bytes the kernel could hand out now without swapping (``MemAvailable``), or physical memory where the
    kernel does not say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        pass
    return physical_memory()


def _read_limit(path: str) -> int | None:
    """A cgroup memory limit file's bytes; None where the file is absent or says there is no limit."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < 1 << 62 else None  # v1 writes a page-rounded 2**63 for "no limit"


def _own_cgroup_v2(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path (the ``0::/path`` line of /proc/self/cgroup), or None."""
    try:
        with open(proc_cgroup) as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def cgroup_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The memory limit of the container this process runs in, in bytes; None where none is set.

    cgroup v2: the least ``memory.max`` from this process's cgroup up to ``root`` (a limit set on a parent holds
    for its children). cgroup v1: ``root/memory/memory.limit_in_bytes``."""
    limits = []
    own = _own_cgroup_v2(proc_cgroup)
    if own is not None:
        parts = [p for p in own.split("/") if p]
        for depth in range(len(parts), -1, -1):
            limits.append(_read_limit(os.path.join(root, *parts[:depth], "memory.max")))
    else:
        limits.append(_read_limit(os.path.join(root, "memory.max")))
    limits.append(_read_limit(os.path.join(root, "memory", "memory.limit_in_bytes")))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def _launcher_int(environ: Mapping[str, str], names: tuple[str, ...], smallest: int) -> tuple[int, str] | None:
    for name in names:
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        text = raw.split("(")[0].split(",")[0].strip()  # Slurm: "8(x2)" or "8,8"
        try:
            value = int(text)
        except ValueError:
            value = smallest - 1
        if value < smallest:
            raise SacpassError(f"sacpass: the environment variable {name}={raw!r} is not a valid count (an int >= "
                               f"{smallest}); sacpass reads it to share the host's memory among this job's "
                               f"processes on the host. Fix the launcher's setting, or unset it.")
        return value, name
    return None


def local_ranks(environ: Mapping[str, str] | None = None) -> tuple[int, int, str]:
    """(local ranks, this process's local rank, where the count came from) as the launcher says."""
    environ = os.environ if environ is None else environ
    size = _launcher_int(environ, _LOCAL_SIZE, 1)
    rank = _launcher_int(environ, _LOCAL_RANK, 0)
    if size is None:
        return 1, 0 if rank is None else rank[0], "one process (no launcher variable)"
    return size[0], 0 if rank is None else rank[0], size[1]


@dataclass(frozen=True)
class HostBudget:
    """This host's memory as sacpass shares it (see the module docstring)."""

    physical: int  # bytes of physical memory
    cgroup: int | None  # the container's limit, None where none is set
    available: int  # MemAvailable when first read
    local_ranks: int  # processes of this job on this host
    local_rank: int  # this process's
    ranks_from: str  # the launcher variable local_ranks came from
    node_bytes: int  # HOST_SHARE x node memory: all local ranks' pools together
    rank_bytes: int  # node_bytes / local_ranks: this process's pool

    @property
    def node_memory(self) -> int:
        return min(x for x in (self.physical, self.cgroup, self.available) if x is not None)

    def describe(self) -> str:
        limit = "no cgroup limit" if self.cgroup is None else f"cgroup limit {self.cgroup}"
        return (f"{self.rank_bytes} bytes for local rank {self.local_rank} of {self.local_ranks} ({self.ranks_from}): "
                f"{int(100 * HOST_SHARE)}% of {self.node_memory} bytes of node memory (the least of physical "
                f"{self.physical}, {limit}, available {self.available}), shared by the host's local ranks")


def _round_down(nbytes: int) -> int:
    """Whole GiB from one up, so that a budget (which enters the compile caches' key) stays put when the memory
    available moves by a little."""
    return nbytes // _GIB * _GIB if nbytes >= _GIB else nbytes


def host_budget(environ: Mapping[str, str] | None = None, cgroup_root: str = "/sys/fs/cgroup",
                proc_cgroup: str = "/proc/self/cgroup", meminfo: str = "/proc/meminfo") -> HostBudget:
    """This process's share of the host's memory, from the given sources (defaults: this machine's)."""
    physical, cgroup, available = physical_memory(), cgroup_limit(cgroup_root, proc_cgroup), available_memory(meminfo)
    ranks, rank, source = local_ranks(environ)
    node_memory = min(x for x in (physical, cgroup, available) if x is not None)
    node = _round_down(int(HOST_SHARE * node_memory))
    return HostBudget(physical=physical, cgroup=cgroup, available=available, local_ranks=ranks, local_rank=rank,
                      ranks_from=source, node_bytes=node, rank_bytes=_round_down(node // ranks))


@functools.lru_cache(maxsize=1)
def process_host_budget() -> HostBudget:
    """This process's :func:`host_budget`, read once (the memory available then), so that every budget derived
    from it in the process agrees."""
    return host_budget()
