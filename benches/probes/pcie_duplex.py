"""Can the two PCIe legs of the staging path overlap on this machine? Times pinned
host-to-device and device-to-host copies alone, together from two streams of one process, and
together from two processes (as the staging sender and receiver run).

    python benches/probes/pcie_duplex.py [--gib N] [--reps N]

Each figure: bytes moved per second over all copies running, median of ``reps`` runs after a
warm-up (wall clock around device-synchronised copies).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any, Callable

import torch


def _buffers(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    return host, torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def _median_gbps(fn: Callable[[], None], nbytes: int, reps: int) -> float:
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _one_leg(direction: str, nbytes: int, start: Any, done: Any, reps: int) -> None:
    host, dev = _buffers(nbytes)
    copy = (
        (lambda: dev.copy_(host, non_blocking=True))
        if direction == "h2d"
        else (lambda: host.copy_(dev, non_blocking=True))
    )
    copy()
    torch.cuda.synchronize()
    for _ in range(reps):
        start.wait()
        t0 = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        done.put(time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    host_a, dev_a = _buffers(nbytes)
    host_b, dev_b = _buffers(nbytes)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    # The buffers are deleted below, after the last call of these closures.
    h2d = _median_gbps(lambda: dev_a.copy_(host_a, non_blocking=True), nbytes, args.reps)  # noqa: F821
    d2h = _median_gbps(lambda: host_b.copy_(dev_b, non_blocking=True), nbytes, args.reps)  # noqa: F821

    def both() -> None:
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)  # noqa: F821
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)  # noqa: F821

    together = _median_gbps(both, 2 * nbytes, args.reps)
    del host_a, dev_a, host_b, dev_b
    ctx = mp.get_context("spawn")
    start, done = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_one_leg, args=(d, nbytes, start, done, args.reps)) for d in ("h2d", "d2h")]
    for p in procs:
        p.start()
    walls = []
    for _ in range(args.reps):
        start.wait()
        walls.append(max(done.get(), done.get()))
    for p in procs:
        p.join()
    two_procs = 2 * nbytes / statistics.median(walls) / 1e9
    print(f"{torch.cuda.get_device_name(0)}, {args.gib} GiB per copy, median of {args.reps}:")
    print(f"  host-to-device alone          {h2d:6.1f} GB/s")
    print(f"  device-to-host alone          {d2h:6.1f} GB/s")
    print(f"  both, two streams, 1 process  {together:6.1f} GB/s (sum of both directions)")
    print(f"  both, two processes           {two_procs:6.1f} GB/s (sum of both directions)")


if __name__ == "__main__":
    main()
