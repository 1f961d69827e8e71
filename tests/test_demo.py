"""The main job runs as the README says: ``python -m glm52_model.demo``, then the CLI reads its dumps."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_demo_command() -> list[str]:
    """The command after ``&&`` on the README's set-up line (``pip install ... && python -m glm52_model.demo``)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        steps = [ln.split("&&") for ln in f if ln.strip().startswith("pip install torch==")]
    (setup,) = [s for s in steps if len(s) == 2 and s[1].split()[:2] == ["python", "-m"]]
    return setup[1].split()


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    dump = tmp_path / "dumps"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    python, *command = _readme_demo_command()
    assert python == "python" and command == ["-m", "glm52_model.demo"], command
    proc = subprocess.run([sys.executable, *command, "--steps", "2", "--seq", "64",
                           "--dump-dir", str(dump)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "demo: OK" in out and out.count("graph breaks: 0") == 2
    assert "top-k executions during backward per step: [2, 2]" in out  # control: 2 full top-k layers
    assert "top-k executions during backward per step: [0, 0]" in out  # sacpass
    assert "glm52::dsa_topk_indices.default" in out and "must-save" in out
    # which layers share which graph (layer 2 and the MTP layer have one structure), in both runs
    assert out.count("  g2: moe/shared-topk: layer 2, mtp 0") == 2, out
    # activations apart from graph inputs: the control saves none; sacpass the two full layers' int32 IDs
    # [64, 32] and, in each of the two MoE graphs, the router's decisions as int32 (top-k [64, 2], argsort [128])
    assert "saved for backward, all graphs: activations 0 bytes in 0 tensors;" in out
    ids, router = 2 * 64 * 32 * 4, 2 * (64 * 2 * 4 + 128 * 4)
    assert f"saved for backward, all graphs: activations {ids + router} bytes in 6 tensors;" in out
    diff = subprocess.run([sys.executable, "-m", "sacpass", "diff", str(dump / "control"), str(dump / "sacpass")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert diff.returncode == 1, diff.stdout + diff.stderr  # the top-k moved from backward to saved
    assert "dsa_topk_indices" in diff.stdout
