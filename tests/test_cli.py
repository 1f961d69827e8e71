"""``python -m sacpass report|diff|show``. ``report`` and one corrupted dump run as subprocesses, side by side
(each one imports torch), through the real entry point; ``diff``, ``show`` and the other error cases run through
the same ``main()`` in-process."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from sacpass.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sacpass(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "sacpass", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)


def _in_process(*args) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args], out=out)
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def _corrupt(report_json):
    report_json.write_text('{"kind": "sacpass.report", "saved": [')


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, kept_dump, plain_dump):
    return tmp_path_factory.mktemp("cli"), kept_dump[0], plain_dump[0]


@pytest.fixture(scope="module")
def runs(dumps):
    """Every command the tests look at: the two subprocesses side by side, then the rest in-process."""
    base, kept, plain = dumps
    shown = base / "shown"
    shutil.copytree(kept, shown)
    (shown / "index.html").unlink()
    corrupted = base / "corrupted"
    shutil.copytree(kept, corrupted)
    _corrupt(corrupted / "g0" / "report.json")
    calls = {"report": ("report", kept), "corrupted": ("report", corrupted)}
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(calls, pool.map(lambda a: _sacpass(*a), calls.values())))
    results.update(diff=_in_process("diff", kept, plain), show=_in_process("show", shown))
    return {"shown": shown, **results}


def test_report_prints_table_and_totals(runs):
    r = runs["report"]
    assert r.returncode == 0, r.stderr
    assert "sacpass report g0" in r.stdout and "sacpass_toy::topk_ids.default" in r.stdout
    assert "must-save" in r.stdout and "1 graph(s)" in r.stdout and "saved bytes in all" in r.stdout


def test_diff_shows_the_topk_moving_to_backward(runs):
    r = runs["diff"]
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.startswith("g0: saved bytes") for ln in lines)
    assert any("no longer saved" in ln and "sacpass_toy::topk_ids.default" in ln for ln in lines)
    assert any("now recomputed in backward: sacpass_toy::topk_ids.default +1" in ln for ln in lines)


def test_show_writes_the_page(runs):
    r = runs["show"]
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip()
    assert path == str(runs["shown"] / "index.html") and os.path.exists(path)
    assert "sacpass-data" in open(path).read()


def test_corrupted_dump_exits_2_with_one_line(runs):
    r = runs["corrupted"]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("sacpass: ") and "not valid JSON" in r.stderr


def test_diff_same_dump_exits_0(dumps, capsys):
    _, kept, _ = dumps
    assert main(["diff", str(kept), str(kept)]) == 0
    assert "no differences" in capsys.readouterr().out


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("corrupted", "not valid JSON"),
    ("foreign", "not a sacpass report"),
    ("newer", "report version 99"),
    ("newer_index", "dump version 99"),
    ("no_index", "index.json does not exist"),
    ("bad_rows", "corrupted sacpass report"),
])
def test_bad_dumps_exit_2_with_one_line(dumps, tmp_path, capsys, case, message):
    _, kept, _ = dumps
    d = tmp_path / "dump"
    shutil.copytree(kept, d)
    report = d / "g0" / "report.json"
    good = json.loads(report.read_text())
    if case == "missing":
        d = tmp_path / "does-not-exist"
    elif case == "corrupted":
        _corrupt(report)
    elif case == "foreign":
        report.write_text(json.dumps({"kind": "something.else"}))
    elif case == "newer":
        report.write_text(json.dumps(dict(good, version=99)))
    elif case == "newer_index":
        (d / "index.json").write_text(json.dumps({"kind": "sacpass.dump", "version": 99, "graphs": ["g0"]}))
    elif case == "no_index":
        (d / "index.json").unlink()
    elif case == "bad_rows":
        report.write_text(json.dumps(dict(good, saved=[{"name": "x"}])))
    for argv in (["report", str(d)], ["diff", str(kept), str(d)], ["show", str(d)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("sacpass: ") and message in err, err


def test_demo_moved_to_the_model_package_names_the_new_command(capsys):
    """The library imports nothing from glm52_model: ``python -m sacpass demo`` (with any arguments) is one line
    on stderr naming the command that runs the demo now, and exit code 2."""
    assert main(["demo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("sacpass: "), err
    assert "python -m glm52_model.demo [ARGS...]" in err and "same arguments" in err


def test_cli_diff_prints_each_graphs_bytes_once(dumps):
    _, b, a = dumps
    buf = io.StringIO()
    assert main(["diff", str(a), str(b)], out=buf) == 1
    assert buf.getvalue().count("g0: saved bytes") == 1, buf.getvalue()


@pytest.mark.parametrize("argv, orig_argv, expected", [
    (["-m"], ["python", "-m", "sacpass", "report", "d"], True),  # `python -m sacpass` while it imports sacpass
    (["-m"], ["python", "-W", "ignore", "-msacpass", "report", "d"], True),
    (["-m"], ["python", "-m", "pytest", "tests"], False),  # a package whose import imports sacpass
    (["/venv/bin/sacpass", "report", "d"], ["python", "/venv/bin/sacpass", "report", "d"], True),
    (["-c"], ["python", "-c", "import sacpass"], False),
    (["train.py", "-m", "sacpass"], ["python", "train.py", "-m", "sacpass"], False),
])
def test_cli_process_is_told_at_import(monkeypatch, argv, orig_argv, expected):
    """The CLI leaves the newer-than-tested torch warning out of ``import sacpass`` (errors are one line)."""
    from sacpass._version import cli_process

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv, raising=False)
    assert cli_process() is expected
