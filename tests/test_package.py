"""The package itself: setup.py's dependencies, the public star import, and what importing sacpass and its CLI
pulls in."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_setup_keeps_the_lower_bound_only_and_depends_on_numpy():
    text = open(os.path.join(ROOT, "setup.py")).read()
    assert '"torch>=2.11"' in text and "<2.15" not in text and '"numpy"' in text


def test_policies_star_import():
    namespace: dict = {}
    exec("from sacpass.policies import *", namespace)  # noqa: S102
    assert {"Policy", "register_must_save", "registered_must_save", "clear_registry"} <= set(namespace)


def test_import_and_cli_do_not_import_dynamo_or_inductor(kept_dump):
    directory, _ = kept_dump
    code = ("import sys, sacpass, sacpass.cli;"
            f"rc = sacpass.cli.main(['report', {str(directory)!r}], out=open(__import__('os').devnull, 'w'));"
            "bad = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules];"
            "print('RC', rc, 'BAD', bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "RC 0 BAD []" in out.stdout, out.stdout + out.stderr


def test_import_and_compile_time_code_load_no_offload_runtime():
    """``import sacpass`` (which loads the passes) declares the runtime's ops and nothing of its state: the pool,
    the transfers, the stashed values, the plans' states and the host's budget load at the first offload or use of
    ``sacpass.offload``'s API."""
    runtime = ("sacpass.offload.runtime", "sacpass.offload.pool", "sacpass.offload.transfers",
               "sacpass.offload.stash", "sacpass.offload.plan_state", "sacpass.offload.api", "sacpass.host")
    code = ("import sys, torch, sacpass, sacpass.passes;"
            f"print('LOADED', [m for m in {runtime!r} if m in sys.modules]);"
            "assert hasattr(torch.ops.sacpass, 'stash') and hasattr(torch.ops.sacpass, 'reload');"
            "torch.ops.sacpass.offload(torch.ones(4), 0, []);"
            f"print('AFTER', [m for m in {runtime!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr
    assert "'sacpass.offload.runtime'" in out.stdout.split("AFTER", 1)[1], out.stdout
