"""benchmarks/results/ and docs/results.md: the page is what the files give, the files follow the naming rule and
carry their command, commit, versions and machine, and a changed file makes the check fail."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "results_page.py")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGE = os.path.join(ROOT, "docs", "results.md")


def _module():
    spec = importlib.util.spec_from_file_location("results_page", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(*args):
    return subprocess.run([sys.executable, SCRIPT, "--check", *args], capture_output=True, text=True, cwd=ROOT)


def test_page_in_sync_with_results():
    r = _check()
    assert r.returncode == 0, r.stderr


def test_results_files_named_by_what_they_measure():
    bad = [n for n in os.listdir(RESULTS) if re.search(r"(run|issue)[0-9]+", n, re.I)]
    assert not bad, f"named by run or issue: {bad}"


def test_every_result_has_meta():
    mod = _module()
    names = os.listdir(RESULTS)
    for name in names:
        if name.endswith(".json"):
            with open(os.path.join(RESULTS, name)) as f:
                meta = json.load(f).get("meta")
        else:
            assert name + ".meta.json" in names, f"{name}: no {name}.meta.json beside it"
            continue
        assert isinstance(meta, dict), f"{name}: no meta"
        for key in mod.META_KEYS:
            assert meta.get(key), f"{name}: meta lacks {key}"
        assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"]), f"{name}: commit {meta['commit']!r}"
        cmds = meta["command"] if isinstance(meta["command"], list) else [meta["command"]]
        assert all("/root/" not in c for c in cmds), f"{name}: command writes outside the repository"


def test_page_wording():
    with open(PAGE) as f:
        text = f.read()
    for pat in (r"\bsessions?\b", r"\bissue\s*#?[0-9]+", r"\brun\s*#?[0-9]+"):
        assert not re.search(pat, text, re.I), f"docs/results.md says {re.search(pat, text, re.I).group(0)!r}"


@pytest.fixture
def copy(tmp_path):
    shutil.copytree(RESULTS, tmp_path / "results")
    (tmp_path / "docs").mkdir()
    shutil.copy(PAGE, tmp_path / "docs" / "results.md")
    shutil.copytree(os.path.join(ROOT, "docs", "results"), tmp_path / "docs" / "results")
    return tmp_path


def _args(tmp):
    return "--results", str(tmp / "results"), "--page", str(tmp / "docs" / "results.md")


def test_check_passes_on_an_unchanged_copy(copy):
    assert _check(*_args(copy)).returncode == 0


def test_changed_result_fails_the_check(copy):
    path = copy / "results" / "topk_op_h200.json"
    data = json.loads(path.read_text())
    data["topk"][0]["fp8_ms"] += 1.0
    path.write_text(json.dumps(data, indent=1) + "\n")
    r = _check(*_args(copy))
    assert r.returncode == 1
    assert "python3 benchmarks/results_page.py" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_new_run_named_file_or_missing_meta_is_refused(copy):
    numbered = copy / "results" / ("router_drift_" + "run" + "2_h200.json")    # a name that carries a run number
    shutil.copy(copy / "results" / "router_drift_h200.json", numbered)
    r = _check(*_args(copy))
    assert r.returncode == 2 and "run or issue" in r.stderr
    os.remove(numbered)
    path = copy / "results" / "router_drift_h200.json"
    data = json.loads(path.read_text())
    del data["meta"]["commit"]
    path.write_text(json.dumps(data))
    r = _check(*_args(copy))
    assert r.returncode == 2 and "meta lacks commit" in r.stderr


def test_missing_plot_fails_the_check(copy):
    os.remove(copy / "docs" / "results" / "layer_h200.png")
    r = _check(*_args(copy))
    assert r.returncode == 1 and "layer_h200.png" in r.stderr


def test_plots_are_reproducible(copy):
    pytest.importorskip("matplotlib")
    mod = _module()
    _, plots = mod.render(mod.load(str(copy / "results")))
    for name, draw in plots:
        a, b = copy / f"a_{name}", copy / f"b_{name}"
        draw(str(a))
        draw(str(b))
        assert a.read_bytes() == b.read_bytes(), f"{name}: two renderings differ"


def test_a_model_variant_that_ran_out_of_memory_is_a_row_with_its_error():
    page = _module()
    ran = {"step_ms_median": 2000.0, "peak_allocated_gib": 10.0, "peak_reserved_gib": 12.0, "loss": 1.0,
           "memory_phases": [{"phase": "layer 0 backward", "start_gib": 1.0, "peak_gib": 10.0, "reserved_peak_gib": 12.0}]}
    entry = {"meta": {"kind": "model"}, "data": {"args": {"layers": 2, "seq": 1024, "steps": 2, "warmup": 1},
                      "variants": {"control": ran, "model_plan:8": {"status": "oom", "error": "CUDA out of memory."}}}}
    text = "\n".join(page.r_model(entry, []))
    assert "| `model_plan:8` | out of memory |" in text
    assert "`model_plan:8`: CUDA out of memory." in text
    assert "| `control` | 2.00 | 1.000 | 10.00 | 12.00 |" in text
    assert "1.00 / **10.00 (12.00)**" not in text and "**1.00 / 10.00 (12.00)**" in text  # the peak phase, reserved


def test_the_segments_a_model_step_added_are_a_table_with_the_allocator_state_before_each():
    page = _module()
    seg = {"phase": "layer 1 backward", "segment_gib": 6.0, "request_gib": 6.0, "reserved_gib": 55.42,
           "allocated_gib": 39.93, "awaiting_free_gib": 0.0, "cached_free_gib": 15.49, "largest_free_gib": 3.0,
           "where": "fp8_grouped_mm.py:171:fp8_grouped_mm_bwd_kernel"}
    phases = [{"phase": "layer 1 backward", "start_gib": 19.0, "peak_gib": 53.3, "reserved_peak_gib": 65.9,
               "segments_added": [seg]},
              {"phase": "layer 0 backward", "start_gib": 23.0, "peak_gib": 57.5, "reserved_peak_gib": 71.9,
               "segments_added": []}]
    entry = {"meta": {"kind": "model"}, "data": {"args": {"layers": 2, "seq": 1024, "steps": 1, "warmup": 1},
                      "variants": {"model_plan_auto": {"step_ms_median": 3800.0, "memory_phases": phases}}}}
    text = "\n".join(page.r_model(entry, []))
    assert ("| layer 1 backward | 6.00 | 6.00 | `fp8_grouped_mm.py:171:fp8_grouped_mm_bwd_kernel` | 55.42 | 39.93 | "
            "0.00 | 15.49 | 3.00 |") in text
    assert text.count("| layer 0 backward |") == 1  # its phase row only: it added no segment
    for m in entry["data"]["variants"].values():
        for p in m["memory_phases"]:
            del p["segments_added"]
    assert "asked the driver for" not in "\n".join(page.r_model(entry, []))  # a step recorded without --segments


def test_a_profiled_model_variant_shows_its_kernels_by_kind_and_its_copies():
    page = _module()
    profile = {"kernel_ms_by_kind": {"gemm": 1500.0, "sparse_mla": 2500.0}, "kernel_busy_ms": 3900.0,
               "copy_ms": {"HtoD": 700.0, "DtoH": 710.0}, "copy_not_hidden_ms": {"HtoD": 90.0, "DtoH": 40.0}}
    entry = {"meta": {"kind": "model"}, "data": {"args": {"layers": 2, "seq": 1024, "steps": 2, "warmup": 1},
                      "variants": {"control": {"step_ms_median": 4000.0},
                                   "model_plan:8": {"step_ms_median": 3800.0, "profile": profile}}}}
    text = "\n".join(page.r_model(entry, []))
    assert "| variant | gemm | sparse_mla | kernels busy |" in text
    assert "| `model_plan:8` | 1.50 | 2.50 | 3.90 | 0.70 / 0.71 | 0.09 / 0.04 |" in text
    assert "largest GPU idle gaps" not in text  # a profile from before the gaps were explained: no such table
    profile["idle_over_1ms"] = {"count": 2, "ms": 30.0, "largest_ms_at": [[25.0, 240.0], [5.0, 900.0]], "largest_why": [
        {"next_kernel": "triton_red_fused_rmsnorm_0", "launched_ms_before_start": 0.05,
         "host_ranges": [["## Call CompiledFxGraph abc ##", 24.0], ["CompiledFunction", 24.5]], "host_syncs": [],
         "host_work": [["sacpass::stash", 22, 20.5]]},
        {"next_kernel": "sparse_mla_bwd", "launched_ms_before_start": 5.2,
         "host_ranges": [["cudaStreamSynchronize", 5.0]], "host_syncs": [["cudaStreamSynchronize", 6.5]]}]}
    text = "\n".join(page.r_model(entry, []))
    assert "`model_plan:8`, the profiled step's largest GPU idle gaps (2 over 1 ms, 30 ms in all)" in text
    assert ("| 25.0 | 240 | triton_red_fused_rmsnorm_0 | 0.05 | ## Call CompiledFxGraph abc ##; CompiledFunction | - | "
            "sacpass::stash x22 20.5 ms |" in text)
    assert "| 5.0 | 900 | sparse_mla_bwd | 5.20 | cudaStreamSynchronize | cudaStreamSynchronize 6.5 ms | - |" in text


def test_the_host_pace_probe_is_a_row_per_copy_mode():
    page = _module()
    data = {"none/launches": {"work_ms": 26.2, "copy_gb_s": 290.0}, "none/python": {"work_ms": 27.0, "copy_gb_s": 1.0},
            "fed/launches": {"work_ms": 30.4, "copy_gb_s": 54.6}, "fed/python": {"work_ms": 20.1, "copy_gb_s": 50.7}}
    text = "\n".join(page.r_host_pace({"meta": {"kind": "host_pace"}, "data": data}, []))
    assert "| `none` | 26.20 | 27.00 | - |" in text and "| `fed` | 30.40 | 20.10 | 54.60 |" in text


def test_a_model_plan_s_regions_show_their_expected_and_measured_copy_times():
    page = _module()
    gib = 2 ** 30
    regions = [{"region": 0, "device_bytes": 0, "host_bytes": 6 * gib, "values": 12, "copy_ms_expected": 113.2,
                "d2h_ms_measured": 130.4, "h2d_ms_measured": None, "reloads_waited": 3,
                "forward_ms_expected": 301.25, "forward_ms_measured": None, "backward_ms_expected": 702.0,
                "backward_ms_measured": 812.5},
               {"region": 1, "device_bytes": 11 * gib, "host_bytes": 0, "values": 12, "copy_ms_expected": 0.0,
                "d2h_ms_measured": 0.0, "h2d_ms_measured": 0.0, "reloads_waited": 0,
                "forward_ms_expected": 301.25, "forward_ms_measured": 350.0, "backward_ms_expected": 702.0,
                "backward_ms_measured": None}]
    old = [{k: v for k, v in r.items() if not k.endswith("_measured")} for r in regions]
    entry = {"meta": {"kind": "model"}, "data": {"args": {"layers": 2, "seq": 1024, "steps": 2, "warmup": 1},
                      "variants": {"control": {"step_ms_median": 4000.0},
                                   "model_plan:8": {"step_ms_median": 3800.0, "placements": regions},
                                   "model_plan:4": {"step_ms_median": 3900.0, "placements": old}}}}
    text = "\n".join(page.r_model(entry, []))
    assert ("| region | device GiB | host GiB | copy ms expected | D2H ms measured | H2D ms measured | reloads waited "
            "| forward ms expected / measured | backward ms expected / measured |") in text
    assert "| 0 | 0.00 | 6.00 | 113.2 | 130.4 | - | 3 | 301.2 / - | 702.0 / 812.5 |" in text
    assert "| 1 | 11.00 | 0.00 | 0.0 | 0.0 | 0.0 | 0 | 301.2 / 350.0 | 702.0 / - |" in text
    assert "`model_plan:8`, where its last timed step" in text and "`model_plan:4`, where" not in text


def test_the_whole_model_summary_puts_each_row_against_its_own_file_s_control():
    """Two files of one shape, each with its control: every row is a share of its own control (a row set
    against the other file's would read differently), FP8-packed variants are flagged, an allocator set on the
    command is named, a row that ran out of memory stays, and the plot is asked for."""
    page = _module()

    def row(step, alloc, reserved, loss, **kw):
        return {"step_ms_median": step, "peak_allocated_gib": alloc, "peak_reserved_gib": reserved, "loss": loss, **kw}

    args = {"layers": 4, "seq": 2048, "steps": 2, "warmup": 1}
    first = {"args": args, "meta": {"command": "python3 benchmarks/bench_model.py"},
             "variants": {"control": row(1000.0, 10.0, 20.0, 2.0), "model_plan:8": row(900.0, 11.0, 25.0, 2.001),
                          "model_plan:16": {"status": "oom", "error": "CUDA out of memory."}}}
    second = {"args": args, "meta": {"command": "python3 benchmarks/bench_model.py"},
              "variants": {"control": row(2000.0, 20.0, 40.0, 2.0),
                           "model_plan_fp8:8@3": row(1700.0, 15.0, 30.0, 1.999),
                           "model_plan:0": row(1900.0, 20.0, 40.0, 2.0, command="PYTORCH_CUDA_ALLOC_CONF="
                                               "expandable_segments:True python3 benchmarks/bench_model.py")}}
    entries = [{"name": n, "meta": {"kind": "model"}, "data": d} for n, d in (("a.json", first), ("b.json", second))]
    plots = []
    text = "\n".join(page.model_against_control(entries, plots))
    assert "4 layers, S=2K:" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert lines == [
        "| `model_plan_fp8:8@3` | `b.json` | 0.850 | 0.750 | 0.750 | FP8-packed | default | -0.0010 |",
        "| `model_plan:8` | `a.json` | 0.900 | 1.100 | 1.250 | exact | default | +0.0010 |",
        "| `model_plan:0` | `b.json` | 0.950 | 1.000 | 1.000 | exact | expandable_segments:True | +0.0000 |",
        "| `model_plan:16` | `a.json` | out of memory | - | - | exact | default | - |"], lines
    assert [n for n, _ in plots] == ["model_against_control_h200.png"]
    assert "--against-control benchmarks/results/a.json benchmarks/results/b.json --out" in text
    assert page.model_against_control([], []) == []  # no model file: no section


def test_the_whole_model_summary_says_where_pytorch_s_solver_stops():
    """Per shape and kind of peak: the lowest peak PyTorch's budget solver reached and the lowest of sacpass's plans,
    as shares of control's, counting only the default allocator's rows (those the plot draws); a solver that never
    gets down to control's peak is said to, one that does is not; no solver row, no sentence."""
    page = _module()
    pf = page._pf()

    def row(step, alloc, reserved, **kw):
        return {"step_ms_median": step, "peak_allocated_gib": alloc, "peak_reserved_gib": reserved, "loss": 2.0, **kw}

    expandable = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/bench_model.py"
    wide = {"args": {"layers": 4, "seq": 2048}, "meta": {"command": "python3 benchmarks/bench_model.py"},
            "variants": {"control": row(1000.0, 10.0, 20.0), "pytorch_budget:0.1": row(980.0, 12.0, 26.0),
                         "pytorch_budget:0.05": row(990.0, 10.5, 19.0), "model_plan_fp8:16@5": row(900.0, 9.0, 21.0),
                         "model_plan:0": row(950.0, 8.0, 16.0, command=expandable)}}
    long = {"args": {"layers": 2, "seq": 4096}, "meta": {"command": "python3 benchmarks/bench_model.py"},
            "variants": {"control": row(1000.0, 10.0, 20.0), "model_plan:8": row(900.0, 9.0, 18.0)}}
    entries = [{"name": n, "meta": {"kind": "model"}, "data": d} for n, d in (("a.json", wide), ("b.json", long))]
    text = "\n".join(page.model_against_control(entries, []))
    notes = [ln for ln in text.splitlines() if ln.startswith("Peak ")]
    assert notes == [
        "Peak allocated, default allocator: PyTorch's solver: lowest peak 1.050 of control's (never down to "
        "control's); sacpass plans: lowest peak 0.900 of control's.",
        "Peak reserved, default allocator: PyTorch's solver: lowest peak 0.950 of control's; sacpass plans: lowest "
        "peak 1.050 of control's."], notes
    assert pf.solver_note({"control": (77.4, 13.5), "pytorch_budget:0.05": (79.9, 13.4), "model_plan:8": (78.9, 12.7),
                           "sacpass": (70.0, 13.2)}) == [
        "PyTorch's solver: lowest peak 79.9 GiB (never down to control's)", "sacpass plans: lowest peak 78.9 GiB"]
    assert pf.solver_note({"control": (77.4, 13.5), "model_plan:8": (78.9, 12.7)}) == []
