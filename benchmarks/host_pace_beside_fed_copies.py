"""How fast the launching thread runs while the offload runtime's feeder (:mod:`sacpass.offload.feeder`) feeds a
large device-to-host copy from its thread: the feeder wakes once per finished chunk and takes Python's GIL, so
work on the launching thread that needs the GIL (an Inductor wrapper's Python between its kernels) may wait for it.

Two workloads on the launching thread, each timed alone and beside a copy of ``--gib`` GiB: ``launches``, small
kernels launched from a Python loop (each op gives the GIL up in its C++ part, as a compiled graph's kernels
do), and ``python``, pure Python that never gives it up by itself (the interpreter hands it over when another
thread has asked for it for ``sys.getswitchinterval()``). The copy: ``queued``, its 64 MiB chunks queued at once
on the side stream from the launching thread (no thread), or ``fed``, the Feeder at its defaults. Prints one JSON
object: per copy and workload, the workload's median ms over ``--reps`` and the copy's GB/s."""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from host_read_beside_copies import copy_probe

MODES = {"none": "none", "queued": "chunks64m", "fed": "sacpass"}  # this probe's copies, as Copies names them


def main() -> None:
    a, copies = copy_probe(gib=8.0)
    x = torch.zeros(256, device="cuda")

    def launches():
        for _ in range(3000):
            torch.add(x, 1.0, out=x)

    def python():
        return sum(i * i for i in range(300_000))

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gib": a.gib,
           "switch_interval_ms": sys.getswitchinterval() * 1e3}
    for copy in ("none", "queued", "fed"):
        for name, work in (("launches", launches), ("python", python)):
            ms, rates = [], []
            for _ in range(a.reps + 1):  # the first warms the loop and the feeder's thread
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                wait = copies.start(MODES[copy])
                time.sleep(0.003)  # the copy under way
                w0 = time.perf_counter()
                work()
                ms.append((time.perf_counter() - w0) * 1e3)
                wait()
                torch.cuda.synchronize()
                rates.append(copies.n / (time.perf_counter() - t0) / 1e9)
            row = {"work_ms": statistics.median(ms[1:]), "copy_gb_s": statistics.median(rates[1:])}
            out[f"{copy}/{name}"] = row
            print(copy, name, row, flush=True)
    print(json.dumps(out))
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
