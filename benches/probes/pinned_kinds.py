"""Does the kind of page-locked memory set the staging path's PCIe rate?

The staging ring is shared memory mapped in both processes and page-locked with
``cudaHostRegister`` (kvferry.transports.staging); the host link's ceiling in `bench copy` is a
``torch`` pinned tensor (``cudaHostAlloc``). Each leg of the staging path measured about 43
GB/s on an H200 where that ceiling was 55. This times both directions, whole and in the
staging path's pieces (one DMA per layer and segment), for:

- ``torch``: ``torch.empty(pin_memory=True)``, the ceiling's kind;
- ``shm``: a shared-memory file (memfd, tmpfs like POSIX shm) mapped and registered as the
  ring is;
- ``shm+thp``: the same with ``MADV_HUGEPAGE`` (transparent huge pages for shared memory, if
  ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows ``advise``);
- ``shm+hugetlb``: a ``MFD_HUGETLB`` memfd (2 MiB pages reserved in ``nr_hugepages``; the row
  says "unavailable" when none are).

    python3 benches/probes/pinned_kinds.py [--mib 512] [--piece-mib 4] [--reps 7]

Each figure: bytes per second, the median of ``reps`` timings (CUDA events) after a warm-up.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
from typing import Any, Callable

import torch


def registered(nbytes: int, huge: str = "") -> tuple[torch.Tensor, Callable[[], Any], Any]:
    fd = os.memfd_create("kvferry-pinned-kinds", os.MFD_HUGETLB if huge == "hugetlb" else 0)
    try:
        os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    if huge == "thp":
        region.madvise(mmap.MADV_HUGEPAGE)
    host = torch.frombuffer(region, dtype=torch.uint8)
    host.fill_(1)  # every page touched before it is locked, as the ring's are
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (error {int(err)})")
    return host, lambda: cudart.cudaHostUnregister(host.data_ptr()), region


def _gbps(fn: Callable[[], None], nbytes: int, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def _rates(host: torch.Tensor, dev: torch.Tensor, piece: int, reps: int) -> list[float]:
    n = host.numel()
    cuts = [(i, min(n, i + piece)) for i in range(0, n, piece)]

    def h2d_pieces() -> None:
        for lo, hi in cuts:
            dev[lo:hi].copy_(host[lo:hi], non_blocking=True)

    def d2h_pieces() -> None:
        for lo, hi in cuts:
            host[lo:hi].copy_(dev[lo:hi], non_blocking=True)

    return [
        _gbps(lambda: dev.copy_(host, non_blocking=True), n, reps),
        _gbps(lambda: host.copy_(dev, non_blocking=True), n, reps),
        _gbps(h2d_pieces, n, reps),
        _gbps(d2h_pieces, n, reps),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes of each copy (MiB)")
    ap.add_argument("--piece-mib", type=int, default=4, help="the pieces' size (MiB): one DMA each")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    nbytes, piece = args.mib << 20, args.piece_mib << 20
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            thp = f.read().strip()
    except OSError as err:
        thp = f"unreadable ({err.strerror})"
    name = torch.cuda.get_device_name()
    print(f"{name}; shmem_enabled: {thp}; {args.mib} MiB copies, pieces of {args.piece_mib} MiB")
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.fill_(2)
    print(f"{'kind':<11} {'h2d':>8} {'d2h':>8} {'h2d pieces':>11} {'d2h pieces':>11}  (GB/s)")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    kinds: list[tuple[str, torch.Tensor, Callable[[], Any]]] = [("torch", pinned, lambda: None)]
    regions = []
    for name, huge in (("shm", ""), ("shm+thp", "thp"), ("shm+hugetlb", "hugetlb")):
        try:
            host, unregister, region = registered(nbytes, huge)
        except OSError as err:
            print(f"{name:<11} unavailable ({err.strerror})")
            continue
        kinds.append((name, host, unregister))
        regions.append(region)
    for name, host, unregister in kinds:
        rates = _rates(host, dev, piece, args.reps)
        print(f"{name:<11} " + " ".join(f"{r:>{w}.1f}" for r, w in zip(rates, (8, 8, 11, 11))))
        unregister()


if __name__ == "__main__":
    main()
