"""How many NIXL agents, memory registrations and threads a process holds for 1 and for N
NIXL peers, on either side, counted (not timed) with real processes over UCX on loopback:

    decode side:  one process serving N endpoints (receivers over N head slices of one pool,
                  as a decode worker with N prefill ranks has), N prefill processes, one
                  transport each, one request each
    prefill side: one process with transports to N decode processes, one endpoint each

Counts in each measured process, while every peer is connected and its request arrived:
NIXL agents made, ``register_memory`` calls, threads Python did not start (NIXL's progress
threads, UCX's) above the process's own before any agent, and kvferry's notification pollers.

    PYTHONPATH=python python benches/probes/nixl_agents.py [--peers 1,8]

Runs against whichever kvferry is on the path (so an older tree's too). docs/benchmarks.md
(NIXL agents per process).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import threading
from collections import Counter
from typing import Any, Optional

LAYERS, BLOCKS, TOKENS, CONTENT = 2, 16, 4, 8
SRC_IDS, DST_IDS = [1, 2, 5], [7, 3, 4]
SLACK = 60.0


class Counts:
    """NIXL agents made and memory registered in this process, from the moment it is made."""

    def __init__(self) -> None:
        from nixl._api import nixl_agent

        self.calls: Counter[str] = Counter()
        real_init, real_register = nixl_agent.__init__, nixl_agent.register_memory

        def init(agent: Any, *args: Any, **kwargs: Any) -> None:
            self.calls["agents"] += 1
            real_init(agent, *args, **kwargs)

        def register(agent: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls["registrations"] += 1
            return real_register(agent, *args, **kwargs)

        nixl_agent.__init__, nixl_agent.register_memory = init, register
        self.base = _foreign_threads()

    def report(self) -> dict[str, int]:
        return {
            "agents": self.calls["agents"],
            "registrations": self.calls["registrations"],
            "nixl_threads": _foreign_threads() - self.base,
            "pollers": sum(t.name == "kvferry-nixl-notifs" for t in threading.enumerate()),
        }


def _foreign_threads() -> int:
    python = {t.native_id for t in threading.enumerate()}
    return sum(1 for task in os.listdir("/proc/self/task") if int(task) not in python)


def _warm() -> None:
    import torch

    torch.randn(1 << 20).add_(1).sum()  # torch's own worker threads, before the baseline


def _heads_pool(heads: int, seed: Optional[int] = None, *, part: bool = True) -> Any:
    """A pool of ``heads`` KV heads in one allocation: random from ``seed``, else zeros;
    ``part``: as the slice of them (a rank's part), else whole (to be sliced)."""
    import torch
    from kvferry.layout import paged_kv_from_views

    shape = (LAYERS, BLOCKS, heads, TOKENS, CONTENT)
    whole = torch.zeros(shape) if seed is None else torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return paged_kv_from_views(
        list(whole.unbind(0)), num_blocks=BLOCKS, tokens_per_block=TOKENS, heads=(0, 1) if heads == 1 else None
    )


def _send(pool: Any, address: str, authkey: bytes, epoch: int) -> Any:
    import numpy as np
    from kvferry.sender import KVSender
    from kvferry.transports.nixl import NixlTransport

    sender = KVSender(pool, NixlTransport(address, authkey=authkey, src=pool), timeout=SLACK)
    n = len(SRC_IDS) * TOKENS
    sender.add(1, n, epoch=epoch)
    sender.send_chunks([1], [0], [n], np.array([SRC_IDS]), np.array([DST_IDS]))
    sender.flush(timeout=SLACK)
    return sender


def prefill_child(conn: Any, rank: int) -> None:
    """A prefill rank: one transport to the endpoint it is told, one request."""
    _warm()
    counts = Counts()
    address, authkey, epoch = conn.recv()
    sender = _send(_heads_pool(1, rank), address, authkey, epoch)
    conn.send(counts.report())
    conn.recv()  # every peer measured
    sender.close()


def decode_child(conn: Any) -> None:
    """A decode rank: one endpoint, one request expected."""
    from kvferry.receiver import KVReceiver
    from kvferry.transports.nixl import NixlEndpoint

    _warm()
    counts = Counts()
    authkey = secrets.token_bytes(32)
    receiver = KVReceiver(_heads_pool(1))
    endpoint = NixlEndpoint(receiver, authkey=authkey)
    conn.send((endpoint.address, authkey, receiver.expect(1, len(DST_IDS) * TOKENS)))
    receiver.wait(1, timeout=SLACK)
    conn.send(counts.report())
    conn.recv()
    endpoint.close()


def decode_side(peers: int) -> dict[str, Any]:
    from kvferry.receiver import KVReceiver
    from kvferry.transports.nixl import NixlEndpoint

    _warm()
    counts = Counts()
    authkey = secrets.token_bytes(32)
    if peers == 1:  # one head: its own part (a pool of one head has no heads to slice)
        receivers = [KVReceiver(_heads_pool(1))]
    else:
        pool = _heads_pool(peers, part=False)
        receivers = [KVReceiver(pool.heads(r, r + 1)) for r in range(peers)]
    endpoints = [NixlEndpoint(r, authkey=authkey) for r in receivers]
    ctx = mp.get_context("spawn")
    pipes = []
    for r, (receiver, endpoint) in enumerate(zip(receivers, endpoints)):
        ours, theirs = ctx.Pipe()
        ctx.Process(target=prefill_child, args=(theirs, r), daemon=True).start()
        ours.send((endpoint.address, authkey, receiver.expect(1, len(DST_IDS) * TOKENS)))
        pipes.append(ours)
    prefill = [p.recv() for p in pipes]
    for receiver in receivers:
        receiver.wait(1, timeout=SLACK)
    decode = counts.report()
    for p in pipes:
        p.send("close")
    for endpoint in endpoints:
        endpoint.close()
    return {"decode process": decode, "each prefill process": _same(prefill)}


def prefill_side(peers: int) -> dict[str, Any]:
    _warm()
    counts = Counts()
    ctx = mp.get_context("spawn")
    pipes = []
    for _ in range(peers):
        ours, theirs = ctx.Pipe()
        ctx.Process(target=decode_child, args=(theirs,), daemon=True).start()
        pipes.append(ours)
    pool = _heads_pool(1, 0)
    senders = [_send(pool, *p.recv()) for p in pipes]
    decode = [p.recv() for p in pipes]
    prefill = counts.report()
    for p in pipes:
        p.send("close")
    for sender in senders:
        sender.close()
    return {"prefill process": prefill, "each decode process": _same(decode)}


def _same(reports: list[dict[str, int]]) -> Any:
    """One report when every process counted the same, else all of them."""
    return reports[0] if all(r == reports[0] for r in reports) else reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="1,8", help="peer counts, comma-separated (default %(default)s)")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    for peers in (int(p) for p in args.peers.split(",")):
        print(json.dumps({"peers": peers, "decode side": decode_side(peers)}), flush=True)
        print(json.dumps({"peers": peers, "prefill side": prefill_side(peers)}), flush=True)


if __name__ == "__main__":
    main()
