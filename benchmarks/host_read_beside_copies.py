"""How long a host read of a small device tensor (``.tolist()``, what an MoE's per-expert row counts need) waits
while large device-to-host copies run on another stream: one copy, the same bytes in chunks all queued at once,
chunks fed a few at a time from a thread (the offload runtime's feeder, :mod:`sacpass.offload.feeder`: three
64 MiB chunks queued at most, or ``sacpass``: at its defaults), and the small read written by a kernel into
pinned memory (no copy engine: the model's ``host_ints``). Prints one JSON object: per mode, the read's median
ms and the copy's GB/s."""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from glm52_model.ops.grouped_mm import host_ints
from sacpass.offload.feeder import Feeder


def copy_probe(gib: float):
    """The probes' command line (``--gib`` of copy, ``--reps``, ``--out``) and the copy's ends: (args, bytes,
    device source, pinned host destination)."""
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=gib)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args()
    n = int(a.gib * 2 ** 30)
    return a, n, torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, pin_memory=True)


def main() -> None:
    a, n, src, dst = copy_probe(gib=4.0)
    small = torch.arange(257, device="cuda", dtype=torch.int64)
    side = torch.cuda.Stream()
    # the fed modes: the offload runtime's feeder, three 64 MiB chunks queued at most, or at its defaults
    feeders = {"fed64m": Feeder(side, torch.cuda.current_device(), chunk=64 << 20, queued=3),
               "sacpass": Feeder(side, torch.cuda.current_device())}

    def plain_read():
        return small.tolist()

    def kernel_read():  # the GLM-5.2 model's row-counts read: a kernel writes into pinned memory
        return host_ints(small)

    def start_copy(mode):
        if mode == "none":
            return None
        if mode in feeders:
            ready = torch.cuda.Event()
            ready.record()
            fed = feeders[mode].submit(dst, src, ready)
            t = threading.Thread(target=fed.synchronize)
            t.start()
            return t
        chunk = {"one": n, "chunks64m": 64 << 20, "chunks8m": 8 << 20}[mode]
        with torch.cuda.stream(side):
            for i in range(0, n, chunk):
                dst[i:i + chunk].copy_(src[i:i + chunk], non_blocking=True)
        return None

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gib": a.gib}
    for mode in ("none", "one", "chunks64m", "chunks8m", "fed64m", "sacpass"):
        for read_name, read in (("tolist", plain_read), ("kernel_into_pinned", kernel_read)):
            reads, rates = [], []
            for _ in range(a.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                th = start_copy(mode)
                time.sleep(0.005)
                r0 = time.perf_counter()
                vals = read()
                reads.append((time.perf_counter() - r0) * 1e3)
                assert vals[-1] == 256
                if th is not None:
                    th.join()
                side.synchronize()
                rates.append(n / (time.perf_counter() - t0) / 1e9)
            out[f"{mode}/{read_name}"] = {"read_ms": statistics.median(reads), "copy_gb_s": statistics.median(rates)}
            print(mode, read_name, out[f"{mode}/{read_name}"], flush=True)
    print(json.dumps(out))
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
