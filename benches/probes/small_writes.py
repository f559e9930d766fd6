"""What one scheduler step's small writes cost: N requests of 8 blocks whose last chunk ends
in the same step, all to one receiver.

Two parts:
- ``hook``: through `TransferHook.after_forward` over each transport, the step's N chunks as
  one call (batched) against one call per request; the time from the first call to the
  sender's completion signal (`KVSender.flush` returned: every write landed and its notices
  were posted), after warm-up, median of ``--reps`` steps, per write.
- ``worker``: the vLLM connector's prefill worker (`PrefillWorker.after_forward`) over the
  in-process transport, the wall time of the call alone (what the engine thread spends),
  median of ``--reps`` steps.

    PYTHONPATH=python python benches/probes/small_writes.py --device cpu --transports in-process,shm
    PYTHONPATH=python python benches/probes/small_writes.py --device cuda --transports cuda-ipc,staging --parts hook
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any, Callable

import numpy as np
from kvferry.bench.copy import CopyBenchConfig, _RemoteReceiver, _sync, make_pool
from kvferry.hook import TransferHook
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports import registry

BLOCKS = 8  # each request's chunk: the turn's new KV


class _Counts:
    """Counts the writes and posts handed to ``tx`` (the submissions a step makes)."""

    def __init__(self, tx: Any) -> None:
        self.writes = self.posts = 0
        write, post = tx.write, tx.post

        def counted_write(*args: Any) -> Any:
            self.writes += 1
            return write(*args)

        def counted_post(*args: Any) -> Any:
            self.posts += 1
            return post(*args)

        tx.write, tx.post = counted_write, counted_post

    def take(self) -> tuple[int, int]:
        out = (self.writes, self.posts)
        self.writes = self.posts = 0
        return out


def _steps(run: Callable[[], float], reps: int) -> float:
    """Median of ``reps`` values of ``run`` after two warm-up steps."""
    return statistics.median([run() for _ in range(reps + 2)][2:])


def hook_part(
    cfg: CopyBenchConfig, name: str, counts: list[int], reps: int
) -> list[tuple[str, int, float, tuple[int, int]]]:
    """(batched or per request, requests, median seconds per step, writes and posts of one
    more step) for each count."""
    pool_blocks = max(counts) * BLOCKS
    src = make_pool(cfg, pool_blocks, fill=True)
    tpb = src.tokens_per_block
    remote = None
    if registry.spec(name).has_endpoint:
        remote = _RemoteReceiver(name, cfg, pool_blocks)
        tx, expect, wait = remote.transport(src), remote.expect, remote.wait
    else:
        receiver = KVReceiver(make_pool(cfg, pool_blocks, fill=False))
        tx, expect = registry.connect(name, receiver=receiver), receiver.expect

        def wait(rid: int) -> None:
            receiver.wait(rid, timeout=120)
            receiver.release(rid)

    sender = KVSender(src, tx)
    hook = TransferHook(sender)
    counted = _Counts(tx)
    ids = itertools.count(1)
    rows = []
    try:
        for n, batched in itertools.product(counts, (True, False)):

            def step() -> float:
                rids = [next(ids) for _ in range(n)]
                for i, rid in enumerate(rids):
                    blocks = np.arange(i * BLOCKS, (i + 1) * BLOCKS)
                    hook.add_request(rid, BLOCKS * tpb, reused_len=0, src_blocks=blocks, dst_blocks=blocks)
                    expect(rid, BLOCKS * tpb)
                _sync(cfg.device)
                t0 = time.perf_counter()
                if batched:
                    hook.after_forward(rids, [0] * n, [BLOCKS * tpb] * n)
                else:
                    for rid in rids:
                        hook.after_forward([rid], [0], [BLOCKS * tpb])
                sender.flush(120)
                seconds = time.perf_counter() - t0
                for rid in rids:
                    wait(rid)
                    hook.finish(rid)
                return seconds

            seconds = _steps(step, reps)
            counted.take()
            step()
            rows.append(("batched" if batched else "per request", n, seconds, counted.take()))
    finally:
        sender.close()
        if remote is not None:
            remote.close()
    return rows


def worker_part(cfg: CopyBenchConfig, counts: list[int], reps: int) -> list[tuple[int, float, tuple[int, int]]]:
    """`PrefillWorker.after_forward` over the in-process transport (a live peer, as the
    connector's own tests build it)."""
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.metadata import Chunk, KvferryMetadata, SendSpec
    from kvferry.vllm.prefill_worker import PrefillWorker, _Peer
    from kvferry.vllm.worker import WorkerCommon

    pool_blocks = max(counts) * BLOCKS
    src = make_pool(cfg, pool_blocks, fill=True)
    tpb = src.tokens_per_block
    receiver = KVReceiver(make_pool(cfg, pool_blocks, fill=False))
    common = WorkerCommon(ConnectorConfig(), block_size=tpb, num_blocks=pool_blocks, authkey=b"k" * 32)
    common.pool = src
    worker = PrefillWorker(common)
    sender = KVSender(src, registry.connect("in-process", receiver=receiver), record=True)
    worker._peers["p"] = peer = _Peer("p", sender, TransferHook(sender), src)
    counted = _Counts(sender.transport)
    ids = itertools.count(1)
    rows = []
    try:
        for n in counts:

            def step() -> float:
                kvs = [next(ids) for _ in range(n)]
                sends, chunks = [], []
                for i, kv in enumerate(kvs):
                    blocks = list(range(i * BLOCKS, (i + 1) * BLOCKS))
                    epoch = receiver.expect(kv, BLOCKS * tpb)
                    dest = {"request_id": kv, "held_blocks": 0, "epoch": epoch, "endpoint": "p", "dst_blocks": blocks}
                    sends.append(SendSpec(f"r{kv}", f"T{kv}", BLOCKS * tpb, 0, "rdv", dest, 60.0))
                    chunks.append(Chunk(f"r{kv}", 0, BLOCKS * tpb, [blocks]))
                worker.bind(KvferryMetadata(sends=sends, chunks=chunks))
                _sync(cfg.device)
                t0 = time.perf_counter()
                worker.after_forward()
                seconds = time.perf_counter() - t0
                peer.sender.flush(120)
                for kv in kvs:
                    receiver.wait(kv, timeout=120)
                assert worker.results({f"r{kv}" for kv in kvs}) == {f"r{kv}" for kv in kvs}
                for kv in kvs:
                    receiver.release(kv)
                return seconds

            seconds = _steps(step, reps)
            counted.take()
            step()
            rows.append((n, seconds, counted.take()))
    finally:
        worker.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--transports", default="in-process,shm")
    ap.add_argument("--requests", default="1,8,32")
    ap.add_argument("--reps", type=int, default=15)
    # `kvferry bench copy`'s geometry: 8 layers of 64 KiB on CPU, 32 of 128 KiB (4 MiB blocks) on CUDA.
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--block-kib", type=int, default=None)
    ap.add_argument("--parts", default="hook,worker")
    args = ap.parse_args()
    counts = [int(x) for x in args.requests.split(",")]
    cuda = args.device.startswith("cuda")
    layers = args.layers or (32 if cuda else 8)
    block_kib = args.block_kib or (128 if cuda else 64)
    cfg = CopyBenchConfig(device=args.device, layers=layers, block_kib=block_kib)
    parts = args.parts.split(",")
    block = layers * block_kib
    print(f"# {args.device}, {BLOCKS} blocks of {block} KiB per request, median of {args.reps} steps")
    if "hook" in parts:
        for name in args.transports.split(","):
            print(f"== {name}: one step, from the first after_forward call to the sender's flush")
            rows = hook_part(cfg, name, counts, args.reps)
            for how, n, seconds, (writes, posts) in rows:
                print(
                    f"{name:10} {how:12} {n:3} requests: {seconds * 1e3:8.3f} ms/step {seconds / n * 1e6:9.1f} us/write"
                    f"  ({writes} writes, {posts} posts)"
                )
            for n in counts:
                one = next(s for h, m, s, _ in rows if m == n and h == "batched")
                each = next(s for h, m, s, _ in rows if m == n and h != "batched")
                print(f"{name:10} {n:3} requests: batched / per request = {one / each:.2f}")
    if "worker" in parts:
        print("== prefill worker after_forward, in-process transport (the engine thread's time)")
        for n, seconds, (writes, posts) in worker_part(cfg, counts, args.reps):
            print(
                f"worker     {n:3} requests: {seconds * 1e3:8.3f} ms/step {seconds / n * 1e6:9.1f} us/request"
                f"  ({writes} writes, {posts} posts)"
            )


if __name__ == "__main__":
    main()
