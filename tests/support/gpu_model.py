"""The GLM-5.2 bench model the GPU tests' fresh processes step: built, compiled and fed the same way in each."""
import torch

from glm52_model import GLM52Config, GLM52ForCausalLM
from glm52_model.compile import apply_ac, apply_compile


def compiled_bench_model(layers: int, seq: int):
    """(model, ids): the bench preset with FP8 linears and experts, ``layers`` MoE layers each compiled with its
    checkpoint (Inductor), in bf16 on CUDA from seed 0, and ``seq`` token ids from seed 1."""
    torch.manual_seed(0)
    cfg = GLM52Config.preset("bench", num_layers=layers, mtp_layers=0, fp8=True, first_k_dense=0)
    with torch.device("cuda"):
        model = GLM52ForCausalLM(cfg).to(torch.bfloat16)
    apply_compile(apply_ac(model, True))
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    return model, ids


def run_fresh(script: str, **env) -> dict:
    """Runs ``script`` in a fresh Python process at the repository's root with ``env`` added to this one's, and
    returns the JSON it printed after "RESULT" on its last such line (the process must exit 0)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, **env})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT"):])
