"""The link of a two-namespace ``kvferry bench vllm`` run: sized from the run's own prefill,
shaped with ``tc`` on the veth between the bench's two network namespaces, and measured.

Shaping touches only the veth of a network namespace a kvferry bench made (named
``kvferry-*`` by ``ip netns add``: benches/python/two_hosts.py makes them): :func:`veth_of`
refuses anything else, so the bench never shapes a real network.
"""

from __future__ import annotations

import os
import subprocess
from typing import Callable, Optional

from kvferry.errors import InvalidArgumentError

__all__ = ["corrected_mbit", "mbit_for", "shape", "steer_receive", "veth_of"]

# A tbf rate counts whole frames; a TCP stream's payload gets about this share of it
# (measured on this project's veths: 2000 mbit gave 225 MB/s, 900 mbit 105 MB/s).
TCP_SHARE = 0.93


def mbit_for(prefix_bytes: int, prefill_s: float) -> float:
    """The tbf rate (Mbit/s) at which ``prefix_bytes`` of TCP payload take ``prefill_s``."""
    if prefix_bytes <= 0:
        raise InvalidArgumentError(f"invalid prefix_bytes={prefix_bytes!r}: must be > 0 (a turn reuses no prefix)")
    if not prefill_s > 0:
        raise InvalidArgumentError(f"invalid prefill_s={prefill_s!r}: must be > 0")
    return prefix_bytes * 8 / prefill_s / 1e6 / TCP_SHARE


def corrected_mbit(set_mbit: float, want_bytes_per_s: float, got_bytes_per_s: float) -> float:
    """The rate to set next when ``set_mbit`` gave ``got_bytes_per_s`` and
    ``want_bytes_per_s`` is wanted (a tbf's payload rate is proportional to its rate)."""
    if not (set_mbit > 0 and want_bytes_per_s > 0 and got_bytes_per_s > 0):
        raise InvalidArgumentError(
            f"invalid rates: set {set_mbit!r} Mbit/s, want {want_bytes_per_s!r} B/s, got {got_bytes_per_s!r} B/s"
        )
    return set_mbit * want_bytes_per_s / got_bytes_per_s


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout


NETNS_DIR = "/run/netns"  # where `ip netns add` names namespaces
BENCH_PREFIX = "kvferry-"  # tests/netns.py's TwoHosts names its namespaces so


def _inode(path: str) -> int:
    return os.stat(path).st_ino


def netns_name(netns: Optional[str]) -> str:
    """The name of network namespace ``netns`` (None: this process's own) after checking that
    it is one a kvferry bench made: named by ``ip netns add`` with the bench's prefix, and not
    the namespace of the machine's first process (where that can be read)."""
    what = netns or "(this process's)"
    try:
        if netns is not None:
            inode, name = _inode(os.path.join(NETNS_DIR, netns)), netns
        else:
            inode = _inode("/proc/self/ns/net")
            names = sorted(os.listdir(NETNS_DIR)) if os.path.isdir(NETNS_DIR) else []
            name = next((n for n in names if _inode(os.path.join(NETNS_DIR, n)) == inode), "")
    except OSError as err:
        raise InvalidArgumentError(f"invalid network namespace {what}: {err}") from None
    try:
        machine = _inode("/proc/1/ns/net")
    except OSError:  # not readable in some containers: the name alone decides then
        machine = None
    if not name.startswith(BENCH_PREFIX) or inode == machine:
        raise InvalidArgumentError(
            f"refusing to shape network namespace {what}: not one a kvferry bench made (a namespace named "
            f"{BENCH_PREFIX}* by ip netns add); run the bench through benches/python/two_hosts.py"
        )
    return name


def veth_of(netns: Optional[str], run: Callable[[list[str]], str] = _run) -> str:
    """The one veth device of network namespace ``netns`` (None: this process's own), after
    checking (`netns_name`) that a kvferry bench made the namespace: the only links it shapes."""
    netns_name(netns)
    argv = ["ip", *(["-n", netns] if netns else []), "-o", "link", "show", "type", "veth"]
    devices = [line.split(":")[1].strip().split("@")[0] for line in run(argv).splitlines() if line.strip()]
    if len(devices) != 1:
        raise InvalidArgumentError(
            f"invalid network namespace {netns or '(this process)'}: {len(devices)} veth devices ({devices}), "
            "need exactly one"
        )
    return devices[0]


def shape(netns: Optional[str], device: str, mbit: float, run: Callable[[list[str]], str] = _run) -> None:
    """Each end's sending rate to ``mbit`` (a token bucket, as tests/netns.py shapes)."""
    if not mbit > 0:
        raise InvalidArgumentError(f"invalid mbit={mbit!r}: must be > 0")
    netns_name(netns)
    run(
        [
            "tc",
            *(["-n", netns] if netns else []),
            "qdisc",
            "replace",
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            f"{mbit:.1f}mbit",
            "burst",
            "256kb",
            "latency",
            "50ms",
        ]
    )


def steer_receive(netns: Optional[str], device: str, cpu: int, run: Callable[[list[str]], str] = _run) -> None:
    """Has the kernel process what ``device`` receives on CPU ``cpu`` (receive packet
    steering: each receive queue's ``rps_cpus``). A veth hands a frame to its peer on the
    sending CPU, so without it the receiving "host"'s whole network stack (IP, TCP, the
    socket's wake-ups) runs on the sender's core; two real hosts each receive on their own."""
    if isinstance(cpu, bool) or not isinstance(cpu, int) or not 0 <= cpu < (os.cpu_count() or 1):
        raise InvalidArgumentError(f"invalid cpu={cpu!r}: not a CPU of this machine")
    netns_name(netns)
    if not device.replace("-", "").replace("_", "").isalnum():
        raise InvalidArgumentError(f"invalid device={device!r}: not a network device name")
    script = f"for q in /sys/class/net/{device}/queues/rx-*; do echo {1 << cpu:x} > $q/rps_cpus; done"
    run([*(["ip", "netns", "exec", netns] if netns else []), "sh", "-c", script])
