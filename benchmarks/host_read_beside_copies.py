"""How long a host read of a small device tensor (``.tolist()``, what an MoE's per-expert row counts need) waits
while large device-to-host copies run on another stream: one copy, the same bytes in chunks all queued at once,
chunks fed a few at a time from a thread (three 64 MiB chunks queued at most; ``sacpass``: the offload runtime's
own feeder, :mod:`sacpass.offload.feeder`, at its defaults), and the small read written by a kernel into pinned
memory (no copy engine). Prints one JSON object: per mode, the read's median ms and the copy's GB/s."""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from sacpass.offload.feeder import Feeder


def zero_copy_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over pinned ``host`` memory: kernels write it over the bus, no copy engine involved."""
    class Iface:
        __cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i8", "version": 3,
                                    "data": (host.data_ptr(), False), "strides": None}
    return torch.as_tensor(Iface(), device="cuda")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args()
    n = int(a.gib * 2 ** 30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    small = torch.arange(257, device="cuda", dtype=torch.int64)
    side = torch.cuda.Stream()
    pinned = torch.empty(257, dtype=torch.int64, pin_memory=True)
    view = zero_copy_view(pinned)

    def plain_read():
        return small.tolist()

    def kernel_read():
        torch.add(small, 0, out=view)
        torch.cuda.current_stream().synchronize()
        return pinned.tolist()

    def start_copy(mode):
        chunk = {"one": n, "chunks64m": 64 << 20, "chunks8m": 8 << 20, "fed64m": 64 << 20}.get(mode)
        if mode == "none":
            return None
        if mode == "sacpass":  # the offload runtime's own feeder, at its defaults
            feeder = Feeder(side, torch.cuda.current_device())
            ready = torch.cuda.Event()
            ready.record()
            fed = feeder.submit(dst, src, ready)
            t = threading.Thread(target=fed.synchronize)
            t.start()
            return t
        if mode.startswith("fed"):
            def feed():
                pending = []
                for i in range(0, n, chunk):
                    with torch.cuda.stream(side):
                        dst[i:i + chunk].copy_(src[i:i + chunk], non_blocking=True)
                        e = torch.cuda.Event()
                        e.record(side)
                    pending.append(e)
                    if len(pending) > 2:
                        pending.pop(0).synchronize()
            t = threading.Thread(target=feed)
            t.start()
            return t
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
