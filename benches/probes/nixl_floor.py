"""NIXL's own cost per descriptor, without kvferry: the floor kvferry's NIXL transport's
cost per descriptor for scattered blocks is measured against.

Two processes on one host, each with one registered buffer of slots (VRAM with ``--device
cuda``, DRAM with ``cpu``); the first WRITEs ``count`` descriptors of ``--desc-kib`` into the
second's, as kvferry's NIXL transport does with prepared descriptor lists (one list of every
slot per side, prepared once; each transfer names the slots by index), in three patterns:

- ``scattered``: both sides' slots in a random order (an engine's block tables);
- ``contiguous``: consecutive slots on both sides;
- ``one``: a single descriptor of ``count x desc`` bytes (what coalescing a run gives).

For each, the median over ``--reps`` of: building the transfer (``make_prepped_xfer``),
posting it (``transfer``), and posting to completion (``check_xfer_state`` until done, asked
without pause), each also per descriptor; the payload's rate over the whole.

    python3 benches/probes/nixl_floor.py --device cuda [--desc-kib 64] [--counts 1024,32768]

`kvferry bench copy --transport nixl` at the same blocks and pattern is kvferry's figure to set
against this one (a kvferry write of B blocks of L layers and S segments is B x L x S
descriptors of one segment each).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

PATTERNS = ("scattered", "contiguous", "one")


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))


def _buffer(nbytes: int, device: str) -> Any:
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t.fill_(0)
    return t


def _target(conn: Any, nbytes: int, device: str) -> None:
    """The written side: registers its buffer, sends its metadata and address, waits to end."""
    buf = _buffer(nbytes, device)
    agent = _agent("floor-target")
    registered = agent.register_memory([buf])
    conn.send((bytes(agent.get_agent_metadata()), buf.data_ptr()))
    conn.recv()  # the initiator is done
    agent.deregister_memory(registered)


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--desc-kib", type=int, default=64, help="bytes of each descriptor (KiB; bench copy's block per layer)"
    )
    ap.add_argument("--counts", default="1024,32768", help="descriptors per transfer, comma separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import numpy as np

    counts = [int(c) for c in args.counts.split(",")]
    size = args.desc_kib << 10
    slots = max(counts)
    nbytes = slots * size
    mem = "VRAM" if args.device == "cuda" else "DRAM"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = ctx.Process(target=_target, args=(child, nbytes, args.device), daemon=True)
    target.start()
    buf = _buffer(nbytes, args.device)
    buf.fill_(7)
    agent = _agent("floor-initiator")
    registered = agent.register_memory([buf])
    meta, remote_base = parent.recv()
    remote_name = agent.add_remote_agent(meta)
    gpu = 0  # the device id of each descriptor (both buffers on GPU 0; ignored for DRAM)
    local_slots = [(buf.data_ptr() + i * size, size, gpu) for i in range(slots)]
    local_all = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_slots, mem)
    remote_all = agent.prep_xfer_dlist(remote_name, [(remote_base + i * size, size, gpu) for i in range(slots)], mem)
    rng = np.random.default_rng(args.seed)
    print(
        f"nixl floor: {args.device} ({mem}), descriptors of {args.desc_kib} KiB, two processes on one host; "
        f"median of {args.reps}"
    )
    print(f"{'pattern':<11} {'count':>6} {'build ms':>9} {'post ms':>8} {'done ms':>8} {'us/desc':>8} {'GB/s':>7}")
    try:
        for count in counts:
            for pattern in PATTERNS:
                build, post, done = [], [], []
                for rep in range(args.reps + 1):  # the first warms the connection and the lists
                    if pattern == "one":
                        one_local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(buf.data_ptr(), count * size, gpu)], mem)
                        one_remote = agent.prep_xfer_dlist(remote_name, [(remote_base, count * size, gpu)], mem)
                        lists, src, dst = (one_local, one_remote), [0], [0]
                    else:
                        order = rng.permutation(slots)[:count] if pattern == "scattered" else np.arange(count)
                        other = rng.permutation(slots)[:count] if pattern == "scattered" else np.arange(count)
                        lists, src, dst = (local_all, remote_all), order.tolist(), other.tolist()
                    t0 = time.perf_counter()
                    handle = agent.make_prepped_xfer("WRITE", lists[0], src, lists[1], dst, b"")
                    t1 = time.perf_counter()
                    agent.transfer(handle)
                    t2 = time.perf_counter()
                    while True:
                        state = agent.check_xfer_state(handle)
                        if state == "DONE":
                            break
                        if state == "ERR":
                            raise RuntimeError(f"NIXL transfer failed ({pattern}, {count} descriptors)")
                    t3 = time.perf_counter()
                    agent.release_xfer_handle(handle)
                    if pattern == "one":
                        agent.release_dlist_handle(lists[0])
                        agent.release_dlist_handle(lists[1])
                    if rep:
                        build.append(t1 - t0)
                        post.append(t2 - t1)
                        done.append(t3 - t1)
                per = f"{1e3 * _median_ms(done) / len(src):>8.2f}" if len(src) > 1 else f"{'-':>8}"
                rate = count * size / (statistics.median(done)) / 1e9
                print(
                    f"{pattern:<11} {count:>6} {_median_ms(build):>9.2f} {_median_ms(post):>8.2f} "
                    f"{_median_ms(done):>8.2f} {per} {rate:>7.1f}",
                    flush=True,
                )
    finally:
        parent.send("done")
        target.join(30)
        agent.deregister_memory(registered)


if __name__ == "__main__":
    main()
