"""How long the engine thread spends in kvferry before the first forward, for an early send
of a prefix many times the staging ring. Run with

    python benches/probes/early_ring.py [--runs 7] [--ring-mib 4] [--prefix-rings 16]

Geometry: Llama-8B's per-layer block (8 KV heads x 128 x K|V, 16 tokens, bf16: 64 KiB)
over 8 layers instead of 32, so one block is 512 KiB and the ring of ``--ring-mib`` holds
a few blocks. The receiver is a `StagingEndpoint` in this process (its connection thread
applies the batches, as the decode worker's does). Each run times, on this thread:

- ``none``: the forward alone (a CPU matmul loop standing in for the prefill), no kvferry;
- ``early``: `KVSender.send_early` of the whole prefix, then the same forward; the figure
  is the send's own time (the delay of the forward's start) and the step's;
- ``waited``: the same send followed by a wait until every write of it had been handed to
  the ring (`flush`), which is what the send cost before the backlog (it waited for room
  until the last ring's worth was submitted): the delay the fix removed.

Prints the median of ``--runs`` runs of each, and the ratios against ``none`` measured in
the same run.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time

import numpy as np
import torch
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports.staging import StagingEndpoint, StagingTransport

LAYERS, HEADS, DIM, TPB = 8, 8, 128, 16


def pool(blocks: int) -> PagedKV:
    shape = (blocks, 2, TPB, HEADS * DIM)
    return PagedKV(tuple(torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)), TPB)


def forward(a: torch.Tensor) -> None:
    for _ in range(6):
        a = torch.tanh(a @ a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--ring-mib", type=int, default=4)
    ap.add_argument("--prefix-rings", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    src = pool(1)
    block_bytes = src.block_bytes * LAYERS
    ring_blocks = (args.ring_mib << 20) // block_bytes
    prefix = ring_blocks * args.prefix_rings
    src, dst = pool(prefix + 1), pool(prefix + 1)
    for layer in src.layers:
        layer.normal_()
    receiver = KVReceiver(dst)
    authkey = secrets.token_bytes(32)
    endpoint = StagingEndpoint(receiver, authkey=authkey, capacity_blocks=ring_blocks)
    sender = KVSender(src, StagingTransport(endpoint.address, authkey=authkey), timeout=600)
    table = np.arange(prefix + 1, dtype=np.int64)[None, :]
    prompt = prefix * TPB + 1
    work = torch.randn(384, 384) / 20
    times: dict[str, list[float]] = {"none": [], "early": [], "early step": [], "waited": []}
    rid = 0
    try:
        for run in range(args.runs + 1):  # the first run warms up, not counted
            t0 = time.perf_counter()
            forward(work)
            none = time.perf_counter() - t0
            for mode in ("early", "waited"):
                rid += 1
                receiver.expect(rid, prompt)
                sender.add(rid, prompt, reused_len=prompt - 1)
                t0 = time.perf_counter()
                sender.send_early([rid], table, table)
                if mode == "waited":
                    while sender.backlogged:  # a bench, not a test: polling is what it measures
                        time.sleep(100e-6)
                sent = time.perf_counter() - t0
                forward(work)
                step = time.perf_counter() - t0
                sender.send_chunks([rid], [prompt - 1], [prompt], table, table)
                receiver.wait(rid, timeout=600)
                sender.flush(timeout=600)
                sender.remove(rid)
                receiver.release(rid, timeout=0)
                if run:
                    times[mode].append(sent)
                    if mode == "early":
                        times["early step"].append(step)
            if run:
                times["none"].append(none)
    finally:
        sender.close()
        endpoint.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"ring {ring_blocks} blocks ({args.ring_mib} MiB), prefix {prefix} blocks "
        f"({prefix * block_bytes >> 20} MiB, {args.prefix_rings}x the ring), {args.runs} runs, medians:"
    )
    print(f"  forward, no kvferry:                  {med['none'] * 1e3:8.2f} ms")
    print(
        f"  early send (forward start delayed by): {med['early'] * 1e3:8.2f} ms  ({med['early'] / med['none']:.3f}x "
        "the forward)"
    )
    print(
        f"  early step (send + forward):           {med['early step'] * 1e3:8.2f} ms  "
        f"({med['early step'] / med['none']:.3f}x)"
    )
    print(
        f"  send waiting for ring room (before):   {med['waited'] * 1e3:8.2f} ms  ({med['waited'] / med['none']:.3f}x "
        "the forward)"
    )


if __name__ == "__main__":
    main()
