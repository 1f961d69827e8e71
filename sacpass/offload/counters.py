"""The runtime's counters: what the benchmarks report and the tests pin."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OffloadStats"]


@dataclass
class OffloadStats:
    """Counters since the last :func:`sacpass.offload.reset_stats`, and the state now."""

    offloaded_bytes: int = 0  # device -> host
    reloaded_bytes: int = 0  # host -> device
    prefetched_bytes: int = 0  # reloads issued ahead, before the backward asked for them
    waited_reloads: int = 0  # reloads whose copy was issued only when the backward asked for it
    device_copied_bytes: int = 0  # values the backward asked for while their copy to the host still ran: copied on
    #                               the device instead (not in reloaded_bytes)
    copy_out_waits: int = 0  # copies out the forward waited for (on the host) before offloading more: it ran more
    #                          than one bundle's bytes ahead of the copy engine
    copy_out_wait_ms: float = 0.0  # the host time those waits took (what they held the forward back, at most)
    largest_reload_bytes: int = 0  # the largest single copy back (a prefetch limit below it copies it alone)
    dropped_prefetch_bytes: int = 0  # prefetched, but no backward consumed them: freed when that backward ended
    bundles: int = 0  # bundles opened (forward executions that offloaded)
    host_bytes_alive: int = 0  # pool bytes live offloads use now (their blocks)
    peak_host_bytes: int = 0
    host_bytes_held: int = 0  # pool bytes held now (its slabs): the host memory sacpass really takes
    peak_host_bytes_held: int = 0
    bundles_alive: int = 0  # bundles whose host tensors are still referenced (by an autograd graph)
    kept_bytes: int = 0  # values a model plan kept on the device instead of offloading
    packed_bytes: int = 0  # values a model plan sent to the host packed (their own bytes; offloaded_bytes
    #                        counts the packed bytes copied)

    # what reset_stats() leaves alone: the state now, not counters
    STATE = ("host_bytes_alive", "host_bytes_held", "bundles_alive")

    def format(self) -> str:
        gib = 2 ** 30
        return (f"offload: {self.offloaded_bytes / gib:.3f} GiB out, {self.reloaded_bytes / gib:.3f} GiB back "
                f"({self.prefetched_bytes / gib:.3f} prefetched, {self.waited_reloads} reloads waited, "
                f"{self.dropped_prefetch_bytes / gib:.3f} GiB prefetched unused"
                + (f", {self.device_copied_bytes / gib:.3f} GiB copied on the device, their copy out unfinished"
                   if self.device_copied_bytes else "")
                + (f", the forward waited for {self.copy_out_waits} copies out ({self.copy_out_wait_ms:.1f} ms)"
                   if self.copy_out_waits else "")
                + "); host pool: "
                f"{self.host_bytes_alive / gib:.3f} GiB in use of {self.host_bytes_held / gib:.3f} GiB held "
                f"(peaks {self.peak_host_bytes / gib:.3f} / {self.peak_host_bytes_held / gib:.3f}); "
                f"{self.bundles_alive} bundles alive of {self.bundles} opened"
                + (f"; model plan kept {self.kept_bytes / gib:.3f} GiB on the device" if self.kept_bytes else "")
                + (f"; {self.packed_bytes / gib:.3f} GiB of values went packed" if self.packed_bytes else ""))
