"""Can the staging path's legs skip their DMA? Kernel loads and stores straight over PCIe.

Today each staging leg is two steps per piece: the sender gathers blocks into a device
scratch pool (the fused copy kernel) and the copy engine moves the scratch to the pinned ring
(one DMA per layer and segment); the receiver does the reverse. Each leg measured about 43 of
the link's 55 GB/s on an H200. Pinned host memory that CUDA registered is also addressable by
kernels (unified addressing), so the same fused kernel could gather from the device pool
straight into the ring's slots (stores over PCIe) and scatter from the ring straight into the
pool (loads over PCIe): one step per leg, no scratch pool, no DMA. Kernels that wait on PCIe
hold SMs, though, and the early send runs beside the forward: so this also times a matmul
loop alone and with each leg running beside it on another stream.

    python3 benches/probes/zero_copy.py [--blocks 128] [--reps 7]

Geometry: Llama-8B's KV in vLLM's FlashAttention layout (32 layers of ``(2, blocks, 32, 8,
128)`` bf16: 4 MiB a block); the ring holds ``--blocks`` slots (128: one 512 MiB write, kvferry's `WRITE_BYTES`),
shared memory registered with ``cudaHostRegister`` as kvferry's ring is. Blocks are drawn at
random from a 4160-block pool. Each figure: payload bytes per second, the median of ``reps``
CUDA-event timings after a warm-up; every path's bytes are checked against the source.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import numpy as np
import torch
from kvferry import _triton_copy
from kvferry.layout import PagedKV
from kvferry.transports.staging import device_view
from pinned_kinds import registered  # benches/probes: a shared-memory buffer page-locked as the ring is

LAYERS, SEGMENTS, SEG_ELEMS, TPB = 32, 2, 32 * 8 * 128, 32
POOL_BLOCKS = 4160


def ring_pool(flat: torch.Tensor, slots: int) -> PagedKV:
    """The ring's layout (kvferry.transports.staging): per layer ``(segments, slots, bytes)``."""
    per_layer = flat.view(LAYERS, SEGMENTS, slots, SEG_ELEMS * 2)
    return PagedKV(tuple(per_layer.unbind(0)), TPB, 1)


def device_pool(blocks: int, fill: bool) -> PagedKV:
    shape = (SEGMENTS, blocks, TPB, 8, 128)  # vLLM's FlashAttention layout: K and V outermost
    words = blocks * SEGMENTS * SEG_ELEMS // 2
    make = (
        (lambda: torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device="cuda"))
        if fill
        else (lambda: torch.zeros(words, dtype=torch.int32, device="cuda"))
    )
    return PagedKV(tuple(make().view(torch.bfloat16).view(shape) for _ in range(LAYERS)), TPB, 1)


def ids_of(src: np.ndarray, dst: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.stack([src, dst]).astype(np.int64)).cuda()


def median_ms(fn: Callable[[], None], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def runs(ring: PagedKV, scratch: PagedKV, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Ring slots [0, k) and scratch blocks [0, k) of every layer and segment (one DMA each)."""
    out = []
    for staged, view in zip(ring.layers, scratch.segment_views(torch.uint8)):
        for seg in range(staged.shape[0]):
            out.append((staged[seg, :k].view(-1), view[seg, :k].reshape(-1)))
    return out


def blocks_equal(a: PagedKV, a_ids: np.ndarray, b: PagedKV, b_ids: np.ndarray) -> bool:
    """Blocks ``a_ids`` of ``a`` and ``b_ids`` of ``b`` hold the same bytes (either pool may be
    on the host: each is indexed where it lives and compared on the host)."""
    ia, ib = torch.from_numpy(a_ids), torch.from_numpy(b_ids)
    return all(
        torch.equal(va.index_select(1, ia.to(va.device)).cpu(), vb.index_select(1, ib.to(vb.device)).cpu())
        for va, vb in zip(a.segment_views(torch.uint8), b.segment_views(torch.uint8))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=128, help="ring slots, one write's blocks (4 MiB each)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    k = args.blocks
    payload = k * LAYERS * SEGMENTS * SEG_ELEMS * 2
    print(f"{torch.cuda.get_device_name()}; {k} blocks = {payload >> 20} MiB a write; median of {args.reps}")
    src, dst = device_pool(POOL_BLOCKS, True), device_pool(POOL_BLOCKS, False)
    scratch = device_pool(k, False)
    host, unregister, _region = registered(LAYERS * SEGMENTS * k * SEG_ELEMS * 2)  # as kvferry's ring is
    host_ring = ring_pool(host, k)
    dev_ring = device_view(host_ring, torch.device("cuda"))  # what the direct legs address
    rng = np.random.default_rng(7)
    s_ids = rng.permutation(POOL_BLOCKS)[:k].astype(np.int64)
    d_ids = rng.permutation(POOL_BLOCKS)[:k].astype(np.int64)
    slots = np.arange(k, dtype=np.int64)
    gather, scatter = ids_of(s_ids, slots), ids_of(slots, d_ids)
    dma_runs = runs(host_ring, scratch, k)
    flat = torch.empty(payload, dtype=torch.uint8, device="cuda")

    def rate(ms: float) -> str:
        return f"{payload / ms / 1e6:6.1f} GB/s ({ms:6.2f} ms)"

    def dma_d2h() -> None:
        for staged, held in dma_runs:
            staged.copy_(held, non_blocking=True)

    def dma_h2d() -> None:
        for staged, held in dma_runs:
            held.copy_(staged, non_blocking=True)

    legs: dict[str, Callable[[], None]] = {
        "ceiling d2h (one DMA)": lambda: host.copy_(flat, non_blocking=True),
        "ceiling h2d (one DMA)": lambda: flat.copy_(host, non_blocking=True),
        "sender today: gather + DMA": lambda: (_triton_copy.copy_blocks(src, scratch, gather), dma_d2h()),
        "sender direct: kernel stores": lambda: _triton_copy.copy_blocks(src, dev_ring, gather),
        "receiver today: DMA + scatter": lambda: (dma_h2d(), _triton_copy.copy_blocks(scratch, dst, scatter)),
        "receiver direct: kernel loads": lambda: _triton_copy.copy_blocks(dev_ring, dst, scatter),
    }
    for config in (_triton_copy.SMALL, _triton_copy.LARGE):
        legs[f"sender direct, {config.num_warps} warps"] = lambda c=config: _triton_copy.copy_blocks(
            src, dev_ring, gather, c
        )
        legs[f"receiver direct, {config.num_warps} warps"] = lambda c=config: _triton_copy.copy_blocks(
            dev_ring, dst, scatter, c
        )
    timed = {}
    for name, fn in legs.items():
        timed[name] = median_ms(fn, args.reps)
        print(f"{name:<32} {rate(timed[name])}")

    # Bytes: the direct legs, each against the source.
    host.zero_()
    _triton_copy.copy_blocks(src, dev_ring, gather)
    torch.cuda.synchronize()
    ok_send = blocks_equal(src, s_ids, host_ring, slots)
    for layer in dst.layers:
        layer.fill_(float("nan"))
    _triton_copy.copy_blocks(dev_ring, dst, scatter)
    torch.cuda.synchronize()
    ok_recv = blocks_equal(src, s_ids, dst, d_ids)
    print(
        f"bytes: sender direct {'equal' if ok_send else 'DIFFER'}, receiver direct {'equal' if ok_recv else 'DIFFER'}"
    )

    # Beside a forward: a bf16 matmul loop on the default stream, each leg on another.
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def forward() -> None:
        for _ in range(20):
            torch.mm(a, b)

    alone = median_ms(forward, args.reps)
    print(f"matmul loop alone: {alone:.2f} ms")
    for name in (
        "sender today: gather + DMA",
        "sender direct: kernel stores",
        "receiver today: DMA + scatter",
        "receiver direct: kernel loads",
    ):
        leg = legs[name]
        repeat = max(1, round(alone / timed[name]))

        fwd_ms: list[float] = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(repeat):
                    leg()
            start.record()
            forward()
            end.record()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            fwd_ms.append(start.elapsed_time(end))
        print(f"matmul loop beside {name:<30} {statistics.median(fwd_ms):.2f} ms ({repeat} legs queued beside it)")
    unregister()


if __name__ == "__main__":
    main()
