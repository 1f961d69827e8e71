"""One launch of each top-k kernel (the op's logits kernel, FP8, and its select) at one length, for Nsight
Compute: ``ncu --kernel-name regex:'indexer_logits|topk_select' python3 benchmarks/ncu_topk_kernels.py 16384``."""
import sys

import torch

from bench_kernels import quantize_indexer, topk_inputs


def main(S: int) -> None:
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    q, k, w, starts, ends = topk_inputs(S)
    q8, k8, w8, ks = quantize_indexer(q, k, w)
    arch = tl.cuda_target()["arch"]
    logits = torch.empty(S, S, dtype=torch.float32, device="cuda")
    lk = tl.logits_kernel(32, 128, torch.float8_e4m3fn, arch)
    lk(q8.view(S * 32, 128), k8, ks.float(), (w8.float() * 128 ** -0.5).contiguous(), starts, ends, logits)
    out = torch.empty(S, 2048, dtype=torch.int32, device="cuda")
    tl.select_kernel(2048, arch)(logits, starts, ends, out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]))
