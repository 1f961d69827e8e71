"""sacpass version, the torch versions it supports, and the digest of the sources a process runs."""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings

__version__ = "0.1.0"
PASS_VERSION = 1  # bump when the pass or the partitioner changes what is saved: it enters cache keys
MIN_TORCH = (2, 11)
MAX_TESTED_TORCH = (2, 15)


def _parse(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version(version: str | None = None, warn_untested: bool = True) -> tuple[int, int]:
    """Refuse torch older than 2.11; warn on one newer than the newest tested release (unless
    ``warn_untested`` is False)."""
    from .errors import SacpassWarning, UnsupportedTorchVersion

    if version is None:
        import torch
        version = torch.__version__
    parsed = _parse(version)
    if parsed < MIN_TORCH:
        raise UnsupportedTorchVersion(
            f"sacpass: torch {version} is too old; sacpass needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} "
            f"(CustomPartitionerFn and the SAC tags it relies on). Upgrade with `pip install 'torch>=2.11'`.")
    if parsed > MAX_TESTED_TORCH and warn_untested:
        warnings.warn(
            f"sacpass: torch {version} is newer than the newest tested version "
            f"{MAX_TESTED_TORCH[0]}.{MAX_TESTED_TORCH[1]}; the partitioner may have changed. "
            f"Run the sacpass test suite on it before relying on the saved set.", SacpassWarning, stacklevel=3)
    return parsed


def cli_process() -> bool:
    """Whether ``import sacpass`` runs for sacpass's command line (``python -m sacpass``, the ``sacpass``
    script). Its commands only read dumps (JSON), and an error is one line on stderr: the newer-than-tested
    warning at import would be a second."""
    argv = list(getattr(sys, "orig_argv", ()))
    if sys.argv[:1] == ["-m"]:  # `python -m PKG` imports PKG before setting argv[0]: PKG is the -m target
        for i, arg in enumerate(argv[1:], start=1):
            if arg == "-m" or arg.startswith("-m"):
                target = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else arg[2:]
                return target == "sacpass"
        return False
    return bool(sys.argv) and os.path.basename(sys.argv[0]) in ("sacpass", "sacpass.exe")


@functools.lru_cache(maxsize=None)
def _files_digest() -> str:
    """sacpass's sources as this process read them: hashed once, so an edit on disk while a process runs
    (whose code stays what it imported) does not change its keys."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for sub in ("", "passes", "partitioner"):
        folder = os.path.join(root, sub)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()


def sources_digest() -> str:
    """The code this process partitions with: the versions and the sources (a part of every cache key)."""
    return hashlib.sha256(f"{__version__}:{PASS_VERSION}:{_files_digest()}".encode()).hexdigest()[:16]
