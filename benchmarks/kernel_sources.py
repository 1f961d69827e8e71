"""The CUDA source TileLang generates for each kernel CI builds, written to files, and two such dumps compared:
a refactor of a kernel builder that must not change the kernel shows an empty diff. No GPU needed (nvcc is).

    python3 benchmarks/kernel_sources.py dump /tmp/kernels_before                # every ci_kernel_names() build
    python3 benchmarks/kernel_sources.py dump /tmp/kernels_after --names 'topk_select[k2048]'
    python3 benchmarks/kernel_sources.py diff /tmp/kernels_before /tmp/kernels_after

``dump`` writes ``<dir>/<name>.cu`` per kernel (``--arch``, default sm_90a) through
:func:`glm52_model.ops.cuda.build_kernel_source`, the function ``tests/test_kernels_build.py`` checks, with
TileLang's disk cache off. ``diff`` prints a unified diff per kernel whose source differs, and the kernels only one
dump has; it exits 1 when any kernel in both differs.
"""
from __future__ import annotations

import argparse
import difflib
import pathlib
import sys
import time


def dump(out: pathlib.Path, names: list[str] | None, arch: str) -> None:
    import glm52_model.ops  # noqa: F401  (defines the ops before the cuda package registers on them)
    from glm52_model.ops.cuda import build_kernel_source, ci_kernel_names

    known = ci_kernel_names(arch)
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        sys.exit(f"kernel_sources: unknown kernel(s) {unknown}; known: {known}")
    out.mkdir(parents=True, exist_ok=True)
    for name in names or known:
        t0 = time.time()
        (out / f"{name}.cu").write_text(build_kernel_source(name, arch))
        print(f"{name}: {time.time() - t0:.1f} s", flush=True)


def diff(before: pathlib.Path, after: pathlib.Path) -> int:
    """Kernels whose source differs between the two dumps (a diff printed for each)."""
    a = {p.stem: p for p in before.glob("*.cu")}
    b = {p.stem: p for p in after.glob("*.cu")}
    changed = 0
    for name in sorted(a.keys() & b.keys()):
        old, new = a[name].read_text(), b[name].read_text()
        if old == new:
            print(f"same      {name} ({len(old)} bytes)")
            continue
        changed += 1
        print(f"DIFFERENT {name}")
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                   str(a[name]), str(b[name])))
    for name in sorted(a.keys() - b.keys()):
        print(f"only in {before}: {name}")
    for name in sorted(b.keys() - a.keys()):
        print(f"only in {after}: {name}")
    return changed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="build each kernel and write its CUDA source to DIR/<name>.cu")
    d.add_argument("dir", type=pathlib.Path)
    d.add_argument("--names", default="", help="comma-separated kernel names (default: every CI build)")
    d.add_argument("--arch", default="sm_90a")
    c = sub.add_parser("diff", help="compare two dumps; exit 1 if a kernel in both differs")
    c.add_argument("before", type=pathlib.Path)
    c.add_argument("after", type=pathlib.Path)
    args = p.parse_args(argv)
    if args.command == "dump":
        dump(args.dir, [n for n in args.names.split(",") if n] or None, args.arch)
    else:
        sys.exit(1 if diff(args.before, args.after) else 0)


if __name__ == "__main__":
    main()
