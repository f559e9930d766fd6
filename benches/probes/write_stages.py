"""Where a lone small write's fixed cost goes: one request of ``--blocks`` blocks sent by a
`KVSender` to a receiver in another process, each stage's time on CLOCK_MONOTONIC (shared by
the processes of one host), median over ``--reps`` writes after warm-up.

Stages, from the sender's ``send_chunks`` call:
- ``submit``: ``send_chunks`` returned (the plan, the copy queued or launched);
- ``copied``: the copy ended (the copy engine's own record: a CUDA event, the CPU worker);
- ``woken``: the code told of the copy's end ran (`Pending.when_done`'s callback);
- ``posting``/``posted``: the transport's ``post`` began and returned (the notices sent);
- ``read``: the receiver's endpoint began handling the frame (it was read and decoded);
- ``delivered``: the receiver's last ``deliver`` for the request returned;
- ``waited``: the receiver's ``wait`` for the request returned (what a decode step sees).

    PYTHONPATH=python python benches/probes/write_stages.py --device cpu --transport shm
    PYTHONPATH=python python benches/probes/write_stages.py --device cuda --transport cuda-ipc,staging
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
import statistics
import time
from typing import Any

import numpy as np

STAGES = ("submit", "copied", "woken", "posting", "posted", "read", "delivered", "waited")


def _receiver_main(conn: Any, kind: str, authkey: bytes, layers: int, blocks: int, block_kib: int, device: str) -> None:
    import torch
    from kvferry.receiver import KVReceiver
    from kvferry.transports import registry
    from kvferry.transports.control import LocalEndpoint

    read: dict[int, float] = {}
    delivered: dict[int, float] = {}
    dispatch, deliver = LocalEndpoint.dispatch, KVReceiver.deliver

    def timed_dispatch(self: Any, peer: Any, frame: Any) -> None:
        at = time.monotonic()
        for notice in getattr(frame, "notices", ()) or ():
            read.setdefault(notice.request_id, at)
        dispatch(self, peer, frame)

    def timed_deliver(self: Any, notice: Any, *args: Any, **kwargs: Any) -> Any:
        out = deliver(self, notice, *args, **kwargs)
        delivered[notice.request_id] = time.monotonic()
        return out

    LocalEndpoint.dispatch = timed_dispatch  # type: ignore[method-assign]
    KVReceiver.deliver = timed_deliver  # type: ignore[method-assign]
    pool = registry.receiver_pool(
        kind,
        num_layers=layers,
        # Room for more than the request, as in `bench copy`: a staging ring holds as many
        # blocks as the pool, and one write takes at most half the ring, so a pool of only the
        # request's blocks would send it as two writes.
        shape=(blocks + 64, block_kib * 256),
        dtype=torch.float32,
        tokens_per_block=16,
        device=device,
    )
    receiver = KVReceiver(pool.pool)
    served = registry.serve(kind, receiver, authkey=authkey, **pool.serve_options)
    conn.send(served.url)
    while True:
        op, rid = conn.recv()
        if op == "stop":
            break
        # Waiting already when the write starts, as the waiting thread of a decode server
        # would be: the pipe's next message does not take this process's GIL mid-write.
        receiver.expect(rid, blocks * 16)
        conn.send("ok")
        receiver.wait(rid, timeout=60)
        waited = time.monotonic()
        receiver.release(rid)
        # The frame's read time where the transport's frames carry notices (else the delivery).
        conn.send((read.get(rid, delivered[rid]), delivered[rid], waited))
    served.close()
    pool.close()


# The functions `--profile` prints, by their own time.
PROFILE_ROWS = 40

# What `--parts` times inside each `send_chunks` call (inclusive, nested parts overlap):
# (module, attribute path) pairs, each wrapped by a timer on its class or module.
PARTS = (
    ("kvferry.sender", "KVSender._refuse_revoked"),
    ("kvferry.sender", "KVSender._dispatch"),
    ("kvferry.sender", "KVSender._queue"),
    ("kvferry.sender", "KVSender._submit"),
    ("kvferry.sender", "KVSender._kick"),
    ("kvferry.engine", "CudaCopyEngine.submit_call"),
    ("kvferry.engine", "CudaCopyEngine._enqueue"),
    ("kvferry.engine", "copy_blocks"),
    ("kvferry.copy", "_packed_pairs"),
    ("kvferry._triton_copy", "copy_packed"),
    ("kvferry._triton_copy", "LaunchGraphs.copy"),
    ("torch.cuda", "CUDAGraph.replay"),
    ("kvferry._streams", "current_stream"),
    ("kvferry._streams", "run_on"),
)


def _time_parts(spent: dict[str, float]) -> None:
    """Wraps each of `PARTS` (where it exists in this tree) to add its calls' time to ``spent``."""
    import importlib

    for module_name, path in PARTS:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = getattr(owner, name, None)
        if fn is None:
            continue

        def timed(*args: Any, _fn: Any = fn, _key: str = path, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_key] = spent.get(_key, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)


def _inline_engine() -> Any:
    """A CPU copy engine that runs each copy inside the send call, on its thread: what is
    left of a write's time is its control path (planning, posting, the receiver's read,
    delivery and wake-up), without the copy thread's hand-off."""
    import concurrent.futures

    from kvferry.engine import CopyEngine, _FuturePending

    class InlineCopyEngine(CopyEngine):
        def submit_call(self, work: Any, *, after: Any = (), nbytes: int = 0) -> Any:
            start = time.monotonic()
            work()
            done: concurrent.futures.Future[tuple[float, float]] = concurrent.futures.Future()
            done.set_result((start, time.monotonic()))
            return _FuturePending(done)

    return InlineCopyEngine()


def measure(
    kind: str,
    device: str,
    layers: int,
    blocks: int,
    block_kib: int,
    reps: int,
    profile: bool = False,
    parts: bool = False,
    inline: bool = False,
) -> dict[str, float]:
    """Median microseconds from the ``send_chunks`` call to each stage (`STAGES`); with
    ``profile``, prints the sender thread's ``send_chunks`` calls' top functions (cProfile);
    with ``parts``, the median time inside each of `PARTS` during a ``send_chunks`` call."""
    import cProfile
    import pstats

    from kvferry.bench.copy import CopyBenchConfig, make_pool
    from kvferry.sender import KVSender
    from kvferry.transports import registry

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    authkey = secrets.token_bytes(32)
    proc = ctx.Process(
        target=_receiver_main, args=(child, kind, authkey, layers, blocks, block_kib, device), daemon=True
    )
    proc.start()
    url = parent.recv()
    cfg = CopyBenchConfig(device=device, transports=(kind,), blocks=(blocks,), layers=layers, block_kib=block_kib)
    src = make_pool(cfg, blocks, fill=True)
    tx = registry.connect(url, authkey=authkey, src=src)
    marks: dict[str, float] = {}
    write, post = tx.write, tx.post

    def timed_write(engine: Any, job: Any) -> Any:
        pending = write(engine, job)
        when_done = pending.when_done

        def told(callback: Any) -> bool:
            def wrapped() -> None:
                marks.setdefault("woken", time.monotonic())
                callback()

            return bool(when_done(wrapped))

        pending.when_done = told
        marks["pending"] = pending
        return pending

    def timed_post(*args: Any, **kwargs: Any) -> None:
        marks.setdefault("posting", time.monotonic())
        post(*args, **kwargs)
        marks.setdefault("posted", time.monotonic())

    tx.write, tx.post = timed_write, timed_post
    spent: dict[str, float] = {}
    if parts:
        _time_parts(spent)
    sender = KVSender(src, tx, engine=_inline_engine() if inline else None)
    ids = np.arange(blocks)[None, :]
    rows: list[dict[str, float]] = []
    part_rows: list[dict[str, float]] = []
    profiler = cProfile.Profile() if profile else None
    try:
        for rid in range(1, reps + 4):
            sender.add(rid, blocks * 16)
            parent.send(("expect", rid))
            parent.recv()  # the receiver expects it, and waits for it from now on
            marks.clear()
            if device == "cuda":
                import torch

                torch.cuda.synchronize()
            if profiler is not None and rid > 3:
                profiler.enable()
            spent.clear()
            t0 = time.monotonic()
            sender.send_chunks([rid], [0], [blocks * 16], ids, ids)
            submitted = time.monotonic()
            part_rows.append({k: v * 1e6 for k, v in spent.items()})
            if profiler is not None:
                profiler.disable()
            read, delivered, waited = parent.recv()
            sender.flush(60)
            sender.remove(rid)
            interval = marks["pending"].interval()  # type: ignore[union-attr]
            stamps = {
                "submit": submitted,
                "copied": interval[1] if interval else float("nan"),
                "woken": marks.get("woken", float("nan")),
                "posting": marks["posting"],
                "posted": marks["posted"],
                "read": read,
                "delivered": delivered,
                "waited": waited,
            }
            if rid > 3:  # three warm-up writes
                rows.append({k: (v - t0) * 1e6 for k, v in stamps.items()})
    finally:
        sender.close()
        parent.send(("stop", 0))
        proc.join(30)
    if parts:
        print(f"== {kind}, {blocks} blocks: median us inside each part during send_chunks (inclusive)")
        for _, path in PARTS:
            got = [r[path] for r in part_rows[3:] if path in r]
            if got:
                print(f"   {path:<32} {statistics.median(got):8.1f}")
    if profiler is not None:
        print(f"== {kind}, {blocks} blocks: send_chunks, {len(rows)} calls")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(PROFILE_ROWS)
    return {stage: statistics.median(r[stage] for r in rows) for stage in STAGES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--transport", default="shm", help="comma-separated transports with an endpoint")
    ap.add_argument("--blocks", default="1,8,64", help="comma-separated blocks per write")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-kib", type=int, default=128, help="KiB per block and layer")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--profile", action="store_true", help="cProfile the send_chunks calls")
    ap.add_argument("--parts", action="store_true", help="time the parts of each send_chunks call")
    ap.add_argument("--inline", action="store_true", help="CPU: each copy runs inside the send call (no copy thread)")
    args = ap.parse_args()
    print(f"{'transport':>10} {'blocks':>6} " + " ".join(f"{s:>9}" for s in STAGES) + "   (us from send_chunks)")
    for kind in args.transport.split(","):
        for blocks in map(int, args.blocks.split(",")):
            med = measure(
                kind, args.device, args.layers, blocks, args.block_kib, args.reps, args.profile, args.parts, args.inline
            )
            print(f"{kind:>10} {blocks:>6} " + " ".join(f"{med[s]:9.0f}" for s in STAGES), flush=True)


if __name__ == "__main__":
    main()
