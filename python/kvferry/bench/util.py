"""Pieces every `kvferry bench` command shares: the machine's name, percentiles, progress."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import torch

__all__ = ["emulated_link", "enter_netns", "machine", "percentile", "stderr_progress", "tcp_stream_gbps"]


def machine(device: str) -> str:
    """The GPU's name, or the CPU's model and core count."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def emulated_link(device: str, transport: str) -> bool:
    """Whether a bench emulates the link (`ThreadCopyEngine(link_gbps)`): on CPU pools, for a
    transport whose copies the sender's engine makes (the registry's ``direct_copy``); the
    others move their bytes through their own agent or ring, at their own speed."""
    from kvferry.transports import registry

    return device == "cpu" and registry.spec(transport).direct_copy


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``0 <= q <= 1``) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def stderr_progress(command: str) -> Callable[[str], None]:
    """A progress callback printing ``[command] message`` lines to stderr."""

    def report(message: str) -> None:
        print(f"[{command}] {message}", file=sys.stderr, flush=True)

    return report


def enter_netns(name: Optional[str]) -> None:
    """Moves the calling thread into network namespace ``name`` (``ip netns add`` made it:
    /var/run/netns/<name>), so the sockets and threads it makes afterwards live there. A
    bench's receiver process calls it first thing, to stand for a second host. None: stays."""
    if name is None:
        return
    import ctypes

    clone_newnet, clone_newns = 0x40000000, 0x00020000
    ms_rec, ms_slave, mnt_detach = 0x4000, 0x80000, 2
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} (network namespace {name!r}): {os.strerror(err)}")

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, clone_newnet), "setns")
    finally:
        os.close(fd)
    # As `ip netns exec` does: a private mount namespace whose /sys shows this namespace's
    # interfaces (UCX lists devices there, then checks them against the namespace's own).
    check(libc.unshare(clone_newns), "unshare")
    check(libc.mount(b"none", b"/", None, ms_rec | ms_slave, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", mnt_detach), "umount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def _tcp_sink(conn: Any, netns: Optional[str], host: str) -> None:
    enter_netns(netns)
    import socket

    with socket.create_server((host, 0)) as server:
        conn.send(server.getsockname()[1])
        total = conn.recv()
        peer, _ = server.accept()
        with peer:
            got = 0
            view = bytearray(1 << 20)
            while got < total:
                n = peer.recv_into(view)
                if not n:
                    break
                got += n
            peer.sendall(b"k")
    conn.send(got)


def tcp_stream_gbps(host: str, nbytes: int, *, netns: Optional[str] = None, reps: int = 3) -> float:
    """The same-run ceiling of a link: one raw TCP stream of ``nbytes`` from this process to
    a sink process at ``host`` (in network namespace ``netns``), bytes per second over the
    median of ``reps`` streams, each timed until the sink acknowledged its last byte."""
    import multiprocessing as mp
    import socket
    import statistics
    import time

    ctx = mp.get_context("spawn")
    payload = b"\x5a" * (1 << 20)
    times = []
    for _ in range(reps):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_tcp_sink, args=(child, netns, host), daemon=True)
        proc.start()
        try:
            port = parent.recv()
            parent.send(nbytes)
            with socket.create_connection((host, port), timeout=120) as s:
                start = time.perf_counter()
                left = nbytes
                while left > 0:
                    s.sendall(payload[: min(left, len(payload))])
                    left -= min(left, len(payload))
                s.recv(1)
                times.append(time.perf_counter() - start)
            if parent.recv() != nbytes:
                raise RuntimeError("the TCP sink got fewer bytes than were sent")
        finally:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return nbytes / statistics.median(times) / 1e9
