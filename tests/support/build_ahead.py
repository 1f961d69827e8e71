"""Compile functions for the build-ahead workers' tests: importable by a worker (it finds a compile function by
module and name), and cheap (no TileLang build)."""
from glm52_model.ops.cuda.ahead import kernel_cache


@kernel_cache
def square(n: int, offset: int = 0):
    """Stands in for a compile function: what it "builds" is n * n + offset."""
    return n * n + offset


@kernel_cache
def broken(n: int):
    """A compile function that always fails, as a build with a bad configuration would."""
    raise ValueError(f"no kernel for n={n}")
