"""The floor of a lone write's notification path in Python, without kvferry: what the
steps a notice takes cost on this host when each does nothing else.

Two processes on one host. Measured, each the median over ``--reps`` of one-way times on
CLOCK_MONOTONIC (shared by the processes of one host):

- ``event``: one thread sets a `threading.Event` that another thread of the process waits
  on, until the waiter runs (a hand-off between two threads of one process: the copy's
  completion to the announcer, or the receiver's connection thread to the waiting decode
  thread);
- ``socket``: a 64-byte message sent on a Unix socket by one process until the other
  process's thread blocked in ``recv`` returns with it;
- ``socket+event``: the same message, its reader then waking another thread of its process
  by an event (the receiver's connection thread delivering to a waiting thread): the two
  hand-offs a notice makes once it is sent.

A kvferry write's notification is at least one ``socket+event`` after the copy ends, plus
the sender's own hand-off where another thread posts it. ``benches/probes/write_stages.py``
measures what kvferry's write path spends at each stage, to set against these.

    python3 benches/probes/handoff_floor.py --reps 2000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
from typing import Any


def _thread_handoff(reps: int) -> list[float]:
    """One-way times of an Event set by this thread until a waiting thread runs."""
    go, back = threading.Event(), threading.Event()
    got: list[float] = []
    sent = [0.0]

    def waiter() -> None:
        for _ in range(reps):
            go.wait()
            got.append(time.monotonic() - sent[0])
            go.clear()
            back.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    for _ in range(reps):
        back.clear()
        sent[0] = time.monotonic()
        go.set()
        back.wait()
    thread.join()
    return got


def _peer_main(path: str, reps: int, relay: bool, conn: Any) -> None:
    """The receiving process: reads each message on a thread blocked in ``recv``; with
    ``relay``, wakes a second thread that takes the time. Sends back the one-way times."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    times: list[float] = []
    handed = threading.Event()
    stamp = [0.0]

    def taker() -> None:
        for _ in range(reps):
            handed.wait()
            handed.clear()
            times.append(time.monotonic() - stamp[0])
            sock.sendall(b"k")  # the next message may go

    thread = threading.Thread(target=taker) if relay else None
    if thread is not None:
        thread.start()
    for _ in range(reps):
        data = sock.recv(64)
        sent = float(data.split(b" ")[0])
        if thread is not None:
            stamp[0] = sent
            handed.set()
        else:
            times.append(time.monotonic() - sent)
            sock.sendall(b"k")
    if thread is not None:
        thread.join()
    conn.send(times)


def _socket_handoff(reps: int, relay: bool) -> list[float]:
    """One-way times of a 64-byte message to another process's reading thread (``relay``:
    until that thread woke a second one)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "floor.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        proc = ctx.Process(target=_peer_main, args=(path, reps, relay, child), daemon=True)
        proc.start()
        sock, _ = listener.accept()
        for _ in range(reps):
            sock.sendall(f"{time.monotonic():.9f} ".encode().ljust(64, b"x"))
            sock.recv(1)
        times = parent.recv()
        proc.join(30)
        sock.close()
        listener.close()
    return list(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    rows = {
        "event": _thread_handoff(args.reps),
        "socket": _socket_handoff(args.reps, relay=False),
        "socket+event": _socket_handoff(args.reps, relay=True),
    }
    print(f"{'hand-off':>14} {'p50 us':>8} {'p90 us':>8}   (one way, median of {args.reps})")
    for name, times in rows.items():
        cut = sorted(times[len(times) // 10 :])  # the first tenth warms up
        p50 = statistics.median(cut) * 1e6
        p90 = cut[int(len(cut) * 0.9)] * 1e6
        print(f"{name:>14} {p50:8.1f} {p90:8.1f}")


if __name__ == "__main__":
    main()
