"""The host's memory, as the offload runtime and the planner read it (one place for both)."""
from __future__ import annotations

import os

__all__ = ["physical_memory", "available_memory"]


def physical_memory() -> int:
    """Bytes of physical memory on this machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def available_memory() -> int:
    """Bytes the kernel could hand out now without swapping (``MemAvailable``), or physical memory where the
    kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        pass
    return physical_memory()
