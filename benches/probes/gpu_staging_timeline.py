"""Where the staging path's time goes on one GPU: a sender process writes one 1024-block
request in writes of ``--write-mib``; prints each write's device-to-host interval (the
sender's records) next to the receiver's interval for the same batch (its frame read ..
the write delivered and its slots freed), both on CLOCK_MONOTONIC, relative to the send
call.

    python benches/probes/gpu_staging_timeline.py [--write-mib 128] [--blocks 1024]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
import time
from typing import Any

import numpy as np
import torch

GEOMETRY = dict(layers=32, block_kib=128, pool_blocks=1088)


def _pool(fill: bool) -> Any:
    from kvferry.layout import PagedKV

    words = GEOMETRY["block_kib"] * 256
    layers = []
    for _ in range(GEOMETRY["layers"]):
        t = torch.empty((GEOMETRY["pool_blocks"], words), dtype=torch.int32, device="cuda")
        t.random_() if fill else t.zero_()
        layers.append(t.view(torch.float32))
    return PagedKV(tuple(layers), 16)


def _receiver(conn: Any, authkey: bytes, blocks: int) -> None:
    from kvferry.receiver import KVReceiver
    from kvferry.transports.staging import StagingEndpoint

    starts: list[float] = []
    ends: list[float] = []

    # A write's copies are queued when its frame is read (`stage`) and it is delivered, its
    # slots freed, once they ended (`_reply`, in write order): the span between the two.
    class Timed(StagingEndpoint):
        def stage(self, *args: Any) -> None:
            starts.append(time.monotonic())
            super().stage(*args)

        def _reply(self, freed: int) -> None:
            ends.append(time.monotonic())
            super()._reply(freed)

    receiver = KVReceiver(_pool(False))
    endpoint = Timed(receiver, authkey=authkey, capacity_blocks=GEOMETRY["pool_blocks"])
    conn.send(endpoint.address)
    for rid in (1, 2):
        receiver.expect(rid, blocks * 16)
        conn.send("expecting")
        receiver.wait(rid, timeout=120)
        receiver.release(rid)
        conn.send(list(zip(starts, ends)))
        starts.clear()
        ends.clear()
    conn.recv()
    endpoint.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-mib", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=1024)
    args = parser.parse_args()
    from kvferry.sender import KVSender
    from kvferry.transports.staging import StagingTransport

    authkey = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, authkey, args.blocks), daemon=True)
    proc.start()
    address = conn.recv()
    src = _pool(True)
    tx = StagingTransport(address, authkey=authkey, write_bytes=args.write_mib << 20)
    sender = KVSender(src, tx, record=True)
    rng = np.random.default_rng(0)
    for rid in (1, 2):  # the first warms up
        assert conn.recv() == "expecting"
        s = rng.permutation(GEOMETRY["pool_blocks"])[: args.blocks][None, :]
        d = rng.permutation(GEOMETRY["pool_blocks"])[: args.blocks][None, :]
        sender.add(rid, args.blocks * 16)
        assert sender.records is not None
        sender.records.clear()
        torch.cuda.synchronize()
        t0 = time.monotonic()
        sender.send_chunks([rid], [0], [args.blocks * 16], s, d)
        sender.flush()
        spans = conn.recv()
        total = max(e for _, e in spans) - t0
        sender.remove(rid)
    payload = args.blocks * GEOMETRY["layers"] * GEOMETRY["block_kib"] * 1024
    print(
        (
            f"{args.blocks} blocks in writes of {args.write_mib} MiB: {total * 1e3:.1f} ms, "
            f"{payload / total / 1e9:.1f} GB/s"
        )
    )
    print("write  sender d2h start..end (ms)  receiver frame read..delivered (ms)")
    for i, (r, (a, b)) in enumerate(zip(sender.records, spans)):
        print(
            (
                f"{i:5d}  {(r.started - t0) * 1e3:8.1f} .. {(r.finished - t0) * 1e3:8.1f}      "
                f"{(a - t0) * 1e3:8.1f} .. {(b - t0) * 1e3:8.1f}"
            )
        )
    sender.close()
    conn.send("stop")
    proc.join(timeout=30)


if __name__ == "__main__":
    main()
