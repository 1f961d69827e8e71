"""The CUDA source TileLang generates for each kernel CI builds, written to files, and two such dumps compared:
a refactor of a kernel builder that must not change the kernel shows an empty diff. No GPU needed (nvcc is).

    python3 benchmarks/kernel_sources.py dump /tmp/kernels_before                # every ci_kernel_names() build
    python3 benchmarks/kernel_sources.py dump /tmp/kernels_after --names 'topk_select[k2048]' 'fp8_quant_cols[c2048]'
    python3 benchmarks/kernel_sources.py diff /tmp/kernels_before /tmp/kernels_after

``dump`` writes ``<dir>/<name>.cu`` per kernel (``--arch``, default sm_90a) through
:func:`glm52_model.ops.cuda.build_kernel_source`, the function ``tests/test_kernels_build.py`` checks, with
TileLang's disk cache off. ``diff`` prints a unified diff per kernel whose source differs, and the kernels only one
dump has; it exits 1 when any kernel in both differs. It first normalises the two things TileLang does not generate
the same way twice (two builds of the same code in two processes differ there):

- which of the reduction workspaces it declares (``workspace``, ``workspace_1``, ..., scratch regions of shared
  memory) a cross-thread reduction passes to ``tl::AllReduce``: every use is renamed ``workspace`` (the
  declarations are compared as they are);
- which shared-memory slot each unnamed buffer gets (buffers allocated in a Python list are named ``v``, ``v_1``,
  ...; equal-sized ones trade places between builds): each is renamed by its first use in the kernel, and their
  offsets are compared as a sorted list.

A kernel equal only after the normalisation is reported so.
"""
from __future__ import annotations

import argparse
import difflib
import pathlib
import re
import sys
import time

_WORKSPACE_USE = re.compile(r"\(\(float\*\)workspace(_\d+)?\)")
_UNNAMED_SHARED = re.compile(r"^\s*void\* (v(?:_\d+)?) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);\n",
                             re.MULTILINE)


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


def normalise(source: str) -> str:
    """``source`` with every use of a reduction workspace named ``workspace``, and the unnamed shared buffers
    renamed by first use, their declarations replaced by the sorted list of their offsets (the module docstring)."""
    source = _WORKSPACE_USE.sub("((float*)workspace)", source)
    unnamed = dict(_UNNAMED_SHARED.findall(source))
    if not unnamed:
        return source
    offsets = sorted(int(o) for o in unnamed.values())
    source = _UNNAMED_SHARED.sub("", source)
    order = {}
    for m in re.finditer(r"\b(" + "|".join(map(re.escape, unnamed)) + r")\b", source):
        order.setdefault(m.group(1), f"unnamed_shared_{len(order)}")
    source = re.sub(r"\b(" + "|".join(map(re.escape, unnamed)) + r")\b", lambda m: order[m.group(1)], source)
    return f"// unnamed shared buffers at offsets {offsets}\n" + source


def diff(before: pathlib.Path, after: pathlib.Path) -> int:
    """Kernels whose (normalised) source differs between the two dumps (a diff printed for each)."""
    a = {p.stem: p for p in before.glob("*.cu")}
    b = {p.stem: p for p in after.glob("*.cu")}
    changed = 0
    for name in sorted(a.keys() & b.keys()):
        raw_old, raw_new = a[name].read_text(), b[name].read_text()
        old, new = normalise(raw_old), normalise(raw_new)
        if old == new:
            print(f"same      {name} ({len(raw_old)} bytes{'' if raw_old == raw_new else ', equal once normalised'})")
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
    d.add_argument("--names", nargs="+", default=None, help="kernel names (default: every CI build)")
    d.add_argument("--arch", default="sm_90a")
    c = sub.add_parser("diff", help="compare two dumps; exit 1 if a kernel in both differs")
    c.add_argument("before", type=pathlib.Path)
    c.add_argument("after", type=pathlib.Path)
    args = p.parse_args(argv)
    if args.command == "dump":
        dump(args.dir, args.names, args.arch)
    else:
        sys.exit(1 if diff(args.before, args.after) else 0)


if __name__ == "__main__":
    main()
