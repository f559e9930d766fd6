"""One side of the two-host tests (tests/test_two_hosts.py), run as its own process inside a
network namespace: ``python two_hosts_worker.py receiver tcp://IP:0`` or ``... sender``.

The test drives it with one JSON object per line on stdin and reads one JSON reply per line
on stdout (the test's own pipe, not the transfer's wire). The session key arrives on stdin,
never on the command line. The sender's pool is `source_pool`, so the test computes the
digests it expects without asking.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Optional

import numpy as np
import torch
from helpers import Pools, digest

# 96 blocks of 2 x 4 tokens x 64 floats per layer (4 KiB a block-layer), 4 layers.
POOLS = Pools(shape=(96, 2, 4, 64), layers=4, tpb=4)
LAYERS, TPB, SHAPE = POOLS.layers, POOLS.tpb, POOLS.shape


def source_pool(seed: int) -> Any:
    return POOLS.random(seed)


def _error(err: BaseException) -> dict[str, Any]:
    return {
        "ok": False,
        "error": f"{type(err).__name__}: {err}",
        "type": type(err).__name__,
        "request_ids": list(getattr(err, "request_ids", ())),
    }


# Replies go to the original stdout; anything else printing there (a library's log) goes to
# stderr instead, so every line the test reads is a reply.
_REPLIES = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def _reply(message: dict[str, Any]) -> None:
    _REPLIES.write(json.dumps(message) + "\n")
    _REPLIES.flush()


def _commands() -> Any:
    for line in sys.stdin:
        yield json.loads(line)


def receiver(address: str) -> None:
    from kvferry.receiver import KVReceiver
    from kvferry.transports import registry

    commands = _commands()
    key = bytes.fromhex(next(commands)["key"])
    pool = registry.receiver_pool("nixl", num_layers=LAYERS, shape=SHAPE, dtype=torch.float32, tokens_per_block=TPB)
    rx = KVReceiver(pool.pool)
    served = registry.serve("nixl", rx, authkey=key, address=address, handshake_timeout=2.0)
    _reply({"url": served.url})
    for cmd in commands:
        op = cmd["op"]
        try:
            if op == "stop":
                break
            if op == "expect":
                _reply({"ok": True, "epochs": {str(r): rx.expect(r, p) for r, p in cmd["requests"]}})
            elif op == "wait":
                rid = cmd["rid"]
                rx.wait(rid, timeout=cmd["timeout"])
                seen = np.zeros((LAYERS, len(cmd["dst"])), dtype=np.int64)
                for n in rx.notices(rid):
                    lo, hi = pool.pool.group_layers(n.group, n.groups)
                    seen[lo:hi, n.start : n.end] += 1
                _reply({"ok": True, "digest": digest(pool.pool, cmd["dst"]), "once": bool((seen == 1).all())})
            elif op == "release":
                rx.release(cmd["rid"], timeout=cmd["timeout"])
                _reply({"ok": True})
            elif op == "state":
                _reply(
                    {
                        "ok": True,
                        "live": len(rx),
                        "errors": [str(e) for e in served.endpoint.errors],
                        "error_count": served.endpoint.error_count,
                    }
                )
            else:
                _reply({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as err:  # reported to the test, which asserts on it
            _reply(_error(err))
    served.close()
    rx = None  # type: ignore[assignment]
    pool.close()


class _Sender:
    def __init__(self) -> None:
        self.sender: Optional[Any] = None
        self.src = source_pool(7)

    def connect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from kvferry.sender import KVSender
        from kvferry.transports import registry

        transport = registry.connect(cmd["url"], authkey=bytes.fromhex(cmd["key"]), src=self.src, handshake_timeout=2.0)
        groups = 2 if cmd.get("mode") == "layer" else 1
        self.sender = KVSender(
            self.src, transport, pipelined=cmd.get("mode") != "chunk", timeout=cmd.get("timeout"), layer_groups=groups
        )
        return {"ok": True}

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Early sends (none when the sender is not pipelined), then chunk by chunk; the last
        chunk's blocks by layer group first when the sender has groups. With ``pause``, stops
        after the early sends landed and waits for the test's ``go``."""
        sender = self.sender
        assert sender is not None
        requests = cmd["requests"]  # [rid, prompt, reused, epoch]
        src, dst = np.array(cmd["src"], dtype=np.int64), np.array(cmd["dst"], dtype=np.int64)
        ids = np.array([r[0] for r in requests])
        for rid, prompt, reused, epoch in requests:
            sender.add(rid, prompt, reused_len=reused, epoch=epoch)
        sender.send_early(ids, src, dst)
        if cmd.get("pause"):
            sender.flush(timeout=30)
            _reply({"paused": True})
            go = json.loads(sys.stdin.readline())
            assert go["op"] == "go", go
        pos = {r[0]: r[2] for r in requests}
        chunk = cmd.get("chunk", 8)
        while True:
            live = [i for i, (rid, prompt, _, _) in enumerate(requests) if pos[rid] < prompt]
            if not live:
                break
            starts = np.array([pos[requests[i][0]] for i in live])
            ends = np.array([min(pos[requests[i][0]] + chunk, requests[i][1]) for i in live])
            last = [k for k, i in enumerate(live) if ends[k] == requests[i][1]]
            if sender.layer_groups > 1 and last:
                rows = [live[k] for k in last]
                for group in range(sender.layer_groups):
                    sender.send_layers(ids[rows], starts[last], ends[last], group, src[rows], dst[rows])
            sender.send_chunks(ids[live], starts, ends, src[live], dst[live])
            for i, e in zip(live, ends):
                pos[requests[i][0]] = int(e)
            sender.poll()
        # The executor's step loop until every write posted: a write past the sender's
        # timeout is aborted by poll, which raises naming its requests.
        deadline = time.monotonic() + cmd.get("drain_seconds", 60)
        while any(sender.in_flight(r) for r in ids.tolist()):
            sender.poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"writes still in flight after {cmd.get('drain_seconds', 60)} s")
            time.sleep(0.005)
        sender.poll()
        return {"ok": True}

    def settle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Acknowledges every request (remove: complete or failed; cancel: the rest), and
        reports what the sender still holds."""
        sender = self.sender
        assert sender is not None
        failed = sorted(sender.failures())
        for rid in cmd["rids"]:
            try:
                sender.remove(rid)
            except Exception:
                sender.cancel(rid, timeout=30)
        return {
            "ok": True,
            "failed": failed,
            "leased": [r for r in cmd["rids"] if sender.leased(r)],
            "book": len(sender.book),
        }

    def close(self) -> dict[str, Any]:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        return {"ok": True}


def sender() -> None:
    worker = _Sender()
    for cmd in _commands():
        op = cmd["op"]
        if op == "stop":
            break
        try:
            _reply(getattr(worker, op)(cmd))
        except Exception as err:  # reported to the test, which asserts on it
            traceback.print_exc(file=sys.stderr)
            _reply(_error(err))
    try:
        worker.close()
    except Exception:
        traceback.print_exc(file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1] == "receiver":
        receiver(sys.argv[2])
    else:
        sender()
