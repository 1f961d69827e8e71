"""``python -m sacpass``: read graph dumps (JSON only), compare two, open the partition page.

    python -m sacpass report DIR          saved-set table and totals of every graph in a dump
    python -m sacpass diff DIR_A DIR_B    what moved between forward and backward; exit 1 if anything did
    python -m sacpass show DIR [--open]   (re)write DIR/index.html from the dump's JSON and print its path

A missing directory, a corrupted or foreign JSON file, or a dump from a newer sacpass is one line on stderr
and exit code 2. The GLM-5.2 demo is the model package's own command (``python -m sacpass demo`` says which).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import IO, Sequence

from .dump import read_index, read_report, render_dump
from .errors import DumpError
from .report import Report, format_report

__all__ = ["main", "format_diff", "diff_dumps"]

EXIT_SAME, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


def _load(directory: str) -> dict[str, Report]:
    return {g: read_report(directory, g) for g in read_index(directory)}


# ------------------------------------------------------------------------------------------------- report
def cmd_report(args, out: IO[str]) -> int:
    reports = _load(args.dir)
    for report in reports.values():
        print(format_report(report, verbose=args.verbose), file=out)
        print(file=out)
    total = sum(r.total_bytes for r in reports.values())
    print(f"dump {args.dir}: {len(reports)} graph(s), {total} saved bytes in all", file=out)
    return EXIT_SAME


# --------------------------------------------------------------------------------------------------- diff
def _saved_keys(report: Report) -> Counter:
    """Saved tensors by what they are, not by node name (names shift when unrelated nodes move)."""
    keys: Counter = Counter()
    for s in report.saved:
        what = s.name if s.op == "input" else s.op
        keys[f"{what} {s.dtype}[{', '.join(s.shape)}] ({s.module or '<root>'}; {s.reason})"] += 1
    return keys


def diff_dumps(a: dict[str, Report], b: dict[str, Report]) -> list[str]:
    """Lines describing every difference between two dumps' reports ([] when they agree)."""
    lines = []
    for g in sorted(set(a) | set(b), key=lambda g: (len(g), g)):
        if g not in b:
            lines.append(f"{g}: only in A ({a[g].total_bytes} saved bytes)")
            continue
        if g not in a:
            lines.append(f"{g}: only in B ({b[g].total_bytes} saved bytes)")
            continue
        ra, rb = a[g], b[g]
        body = []
        sa, sb = _saved_keys(ra), _saved_keys(rb)
        for key, n in sorted((sb - sa).items()):
            body.append(f"  now saved for backward: {key}" + (f" x{n}" if n > 1 else ""))
        for key, n in sorted((sa - sb).items()):
            body.append(f"  no longer saved:        {key}" + (f" x{n}" if n > 1 else ""))
        ca, cb = Counter(ra.recomputed), Counter(rb.recomputed)
        for op, n in sorted((cb - ca).items()):
            body.append(f"  now recomputed in backward: {op} +{n}")
        for op, n in sorted((ca - cb).items()):
            body.append(f"  no longer recomputed:       {op} -{n}")
        if ra.policy != rb.policy:
            body.append(f"  policy: {ra.policy} -> {rb.policy}")
        if body or ra.total_bytes != rb.total_bytes:
            delta = rb.total_bytes - ra.total_bytes
            host = (f"; on the host {ra.host_bytes} -> {rb.host_bytes}" if ra.host_bytes or rb.host_bytes else "")
            lines.append(f"{g}: saved bytes {ra.total_bytes} -> {rb.total_bytes} ({delta:+d}){host}")
            lines.extend(body)
    return lines


def format_diff(a: dict[str, Report], b: dict[str, Report], name_a: str = "A", name_b: str = "B") -> str:
    """A header, then per graph either its differences (led by one bytes line) or "no differences"."""
    lines = [f"A: {name_a}", f"B: {name_b}"]
    changes = diff_dumps(a, b)
    changed = {ln.split(":", 1)[0] for ln in changes if not ln.startswith(" ")}
    for g in sorted(set(a) & set(b) - changed, key=lambda g: (len(g), g)):
        lines.append(f"{g}: no differences ({a[g].total_bytes} saved bytes)")
    lines.extend(changes)
    if not changes:
        lines.append("no differences")
    return "\n".join(lines)


def cmd_diff(args, out: IO[str]) -> int:
    a, b = _load(args.dir_a), _load(args.dir_b)
    print(format_diff(a, b, args.dir_a, args.dir_b), file=out)
    return EXIT_DIFFERENT if diff_dumps(a, b) else EXIT_SAME


# --------------------------------------------------------------------------------------------------- show
def cmd_show(args, out: IO[str]) -> int:
    path = os.path.abspath(render_dump(args.dir))
    print(path, file=out)
    if args.open:
        import pathlib
        import webbrowser

        if not webbrowser.open(pathlib.Path(path).as_uri()):
            print(f"sacpass: no browser could be started; open {path} yourself.", file=sys.stderr)
    return EXIT_SAME


# --------------------------------------------------------------------------------------------------- demo
DEMO_MOVED = ("sacpass: the demo is the model package's command now: run `python -m glm52_model.demo [ARGS...]` "
              "(same arguments) from the sacpass repository root or with glm52_model installed.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sacpass", description="Inspect sacpass graph dumps.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("report", help="print the saved-set table and totals of every graph in a dump")
    p.add_argument("dir", help="a dump directory (dump_dir= / SACPASS_DUMP_DIR)")
    p.add_argument("-v", "--verbose", action="store_true", help="also list every tagged node")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("diff", help="compare two dumps; exit 1 if what is saved or recomputed differs")
    p.add_argument("dir_a")
    p.add_argument("dir_b")
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser("show", help="write DIR/index.html from the dump's JSON and print its path")
    p.add_argument("dir")
    p.add_argument("--open", action="store_true", help="also open it in a web browser")
    p.set_defaults(func=cmd_show)
    return parser


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg if msg.startswith("sacpass:") else f"sacpass: {type(e).__name__}: {msg}"


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # moved: say where to, whatever arguments follow
        print(DEMO_MOVED, file=sys.stderr)
        return EXIT_ERROR
    args = build_parser().parse_args(argv)
    out = out or sys.stdout
    try:
        return args.func(args, out)
    except (DumpError, OSError, ValueError, KeyError, TypeError) as e:  # reading a dump: never a traceback
        print(_one_line(e), file=sys.stderr)
        return EXIT_ERROR
