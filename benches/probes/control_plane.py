"""What the control plane costs per prefill request: handshakes, connections and threads
(counted, not timed) for a burst of new prefill requests from one prefill server, and how
many of them fail when the rendezvous's handshakes are slow (a loaded host).

A prefill scheduler half (kvferry.vllm.scheduler, on tests/sched_fakes.py: no vLLM) asks
for ``--requests`` destinations at once from one or two decode rendezvous (``--tp 2``: a
prefill server and a decode server of two tensor-parallel ranks each, one lookup per link);
the decode side publishes them all. Counted in this one process: handshakes the rendezvous
completed (one per authenticated connection), threads started (by name: the rendezvous's
and the prefill side's) and lookups that failed. ``--hold`` holds every rendezvous
handshake until all requests have asked (a loaded host, where a handshake takes seconds).

    PYTHONPATH=python .venv/bin/python benches/probes/control_plane.py [--requests 200] [--tp 1|2] [--hold]

It runs against any kvferry tree whose scheduler half takes these arguments (put that tree's
python/ first on PYTHONPATH), so a tree from before the kept connections is measured the same way.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from kvferry.transports import wire  # noqa: E402
from kvferry.vllm import rendezvous, trust  # noqa: E402
from kvferry.vllm.config import ConnectorConfig  # noqa: E402
from kvferry.vllm.metadata import leg_name  # noqa: E402
from kvferry.vllm.scheduler import SchedulerSide  # noqa: E402
from sched_fakes import Manager, Request, publish  # noqa: E402

KEY = b"p" * 32
WAIT_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tp", type=int, choices=(1, 2), default=1)
    parser.add_argument("--hold", action="store_true", help="hold the rendezvous's handshakes until all have asked")
    args = parser.parse_args()

    release = threading.Event()
    if not args.hold:
        release.set()
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    real_handshake, real_start = wire.handshake, threading.Thread.start

    def handshake(sock: Any, key: bytes, role: int, *a: Any, **k: Any) -> Any:
        if role == wire.ROLE_ENDPOINT:
            release.wait(WAIT_S)
        out = real_handshake(sock, key, role, *a, **k)
        if role == wire.ROLE_ENDPOINT:
            with lock:
                counts["handshakes"] += 1
        return out

    def start(self: threading.Thread) -> None:
        with lock:
            counts[f"thread {self.name.rstrip('_0123456789')}"] += 1
        real_start(self)

    wire.handshake = handshake  # type: ignore[assignment]
    threading.Thread.start = start  # type: ignore[method-assign]

    servers = [
        rendezvous.Rendezvous(KEY, lambda sender: "staging+unix:///nowhere.sock", listen="tcp://127.0.0.1:0")
        for _ in range(args.tp)
    ]
    peer = " ".join(s.address for s in servers)
    mac = trust.sign_peer(KEY, peer)
    manager = Manager({})
    prefill = SchedulerSide(ConnectorConfig(), block_size=4, role="kv_producer", engine_id="prefill-engine",
                            kv_cache_manager_getter=lambda: manager, authkey=KEY, tp_size=args.tp,
                            num_kv_heads=2)  # fmt: skip
    prompts = {i: [i % 1000 + 1] * 8 for i in range(args.requests)}
    for i, prompt in prompts.items():
        for rank, server in enumerate(servers):
            name = f"T{i}" if args.tp == 1 else leg_name(f"T{i}", rank, args.tp, 1)
            publish(server, name, prompt)
    before = dict(counts)
    lookups = []
    for i, prompt in prompts.items():
        params = {"kvferry": {"op": "send", "transfer": f"T{i}", "peer": peer, "peer_mac": mac}}
        prefill.get_num_new_matched_tokens(Request(f"r{i}", prompt, params), 0)
        found = prefill._lookups.get(f"r{i}")  # (a lookup done already moved on to its send)
        lookups.append(found if found is not None else prefill._sending[f"r{i}"].lookup)
    release.set()
    errors = collections.Counter()
    for found in lookups:
        if not found.done.wait(WAIT_S):
            errors["no answer"] += 1
        elif found.error is not None:
            errors[found.error.split(": ")[0][:60]] += 1
    failed = sum(errors.values())
    prefill.close()
    for server in servers:
        server.close()
    asked = {k: v - before.get(k, 0) for k, v in counts.items() if v - before.get(k, 0)}
    n = args.requests
    print(f"{n} new prefill requests, tp {args.tp}, handshakes {'held' if args.hold else 'not held'}:")
    print(f"  lookups failed: {failed} of {n}")
    for why, count in errors.most_common(3):
        print(f"    {count}: {why}")
    print(f"  handshakes: {asked.get('handshakes', 0)} ({asked.get('handshakes', 0) / n:.3f} per request)")
    for name, count in sorted(asked.items()):
        if name.startswith("thread "):
            print(f"  {name}: {count} ({count / n:.3f} per request)")
    threads = sum(v for k, v in asked.items() if k.startswith("thread "))
    print(f"  threads started in all: {threads} ({threads / n:.3f} per request)")


if __name__ == "__main__":
    main()
