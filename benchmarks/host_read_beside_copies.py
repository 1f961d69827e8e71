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
import time
from typing import Callable

import torch

from glm52_model.ops.grouped_mm import host_ints
from sacpass.offload.feeder import Feeder


class Copies:
    """The probes' copy of ``n`` bytes from a device buffer to a pinned host one on a side stream, begun as a mode
    says: ``one`` copy, ``chunks64m`` / ``chunks8m`` copies queued at once, or fed by the offload runtime's feeder
    (:mod:`sacpass.offload.feeder`), three 64 MiB chunks ahead at most (``fed64m``) or at its defaults
    (``sacpass``); ``none``: no copy."""

    QUEUED_AT_ONCE = {"one": None, "chunks64m": 64 << 20, "chunks8m": 8 << 20}  # mode -> chunk (None: whole)

    def __init__(self, n: int):
        self.n = n
        self.src = torch.empty(n, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self.side = torch.cuda.Stream()
        device = torch.cuda.current_device()
        self.feeders = {"fed64m": Feeder(self.side, device, chunk=64 << 20, queued=3),
                        "sacpass": Feeder(self.side, device)}

    def start(self, mode: str) -> Callable[[], None]:
        """Begin the copy after the current stream's work so far; returns what waits for its end."""
        if mode == "none":
            return lambda: None
        ready = torch.cuda.Event()
        ready.record()
        if mode in self.feeders:
            return self.feeders[mode].submit(self.dst, self.src, ready).synchronize
        chunk = self.QUEUED_AT_ONCE[mode] or self.n
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)
            for i in range(0, self.n, chunk):
                self.dst[i:i + chunk].copy_(self.src[i:i + chunk], non_blocking=True)
        return self.side.synchronize


def copy_probe(gib: float) -> tuple[argparse.Namespace, Copies]:
    """The probes' command line (``--gib`` of copy, ``--reps``, ``--out``) and their :class:`Copies`."""
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=gib)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args()
    return a, Copies(int(a.gib * 2 ** 30))


def main() -> None:
    a, copies = copy_probe(gib=4.0)
    small = torch.arange(257, device="cuda", dtype=torch.int64)

    def plain_read():
        return small.tolist()

    def kernel_read():  # the GLM-5.2 model's row-counts read: a kernel writes into pinned memory
        return host_ints(small)

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gib": a.gib}
    for mode in ("none", "one", "chunks64m", "chunks8m", "fed64m", "sacpass"):
        for read_name, read in (("tolist", plain_read), ("kernel_into_pinned", kernel_read)):
            reads, rates = [], []
            for _ in range(a.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                wait = copies.start(mode)
                time.sleep(0.005)
                r0 = time.perf_counter()
                vals = read()
                reads.append((time.perf_counter() - r0) * 1e3)
                assert vals[-1] == 256
                wait()
                rates.append(copies.n / (time.perf_counter() - t0) / 1e9)
            out[f"{mode}/{read_name}"] = {"read_ms": statistics.median(reads), "copy_gb_s": statistics.median(rates)}
            print(mode, read_name, out[f"{mode}/{read_name}"], flush=True)
    print(json.dumps(out))
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
