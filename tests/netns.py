"""Two test hosts on one machine: two network namespaces joined by a veth pair.

```
namespace <name>-a                           namespace <name>-b
  lo (up)                                      lo (up)
  <veth>a  10.X.Y.1/30  <---- veth pair ---->  <veth>b  10.X.Y.2/30
```
Nothing else is reachable from either namespace, and they share no socket path reachable by
address (tcp:// only) and no interface with the machine: a process started in one (`popen`,
through ``ip netns exec``) reaches the other only over the veth. Names are unique per
instance (pid and random bits), the /30 is drawn from 10.0.0.0/8; `close` removes both
namespaces (and with them the veth pair), and is safe to call after a failed setup.

Needs root and iproute2's ``ip`` (``tc`` for `shape`); `unavailable` says why not, for a
skip.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["TwoHosts", "unavailable"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> Optional[str]:
    """Why two namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"kvfp{os.getpid()}{secrets.token_hex(2)}"
    try:
        _run(["ip", "netns", "add", probe])
    except (subprocess.CalledProcessError, OSError) as err:
        detail = err.stderr.strip() if isinstance(err, subprocess.CalledProcessError) else repr(err)
        return f"ip netns add failed: {detail}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@dataclass(frozen=True)
class Side:
    namespace: str
    device: str  # its end of the veth pair
    ip: str


class TwoHosts:
    """Two namespaces and the veth between them (see the module doc)."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        net = secrets.randbelow(1 << 14)  # the /30's position in 10.0.0.0/8
        x, y = 1 + net // 64 % 254, (net % 64) * 4
        self.a = Side(f"kvferry-{tag}-a", f"kvf{tag}a", f"10.{x}.{y}.1")
        self.b = Side(f"kvferry-{tag}-b", f"kvf{tag}b", f"10.{x}.{y}.2")
        self._made: list[str] = []
        try:
            for side in (self.a, self.b):
                _run(["ip", "netns", "add", side.namespace])
                self._made.append(side.namespace)
                _run(["ip", "-n", side.namespace, "link", "set", "lo", "up"])
            _run(["ip", "link", "add", self.a.device, "type", "veth", "peer", "name", self.b.device])
            # Until moved, the pair lives in this (the machine's) namespace: move it first.
            for side in (self.a, self.b):
                _run(["ip", "link", "set", side.device, "netns", side.namespace])
                _run(["ip", "-n", side.namespace, "addr", "add", f"{side.ip}/30", "dev", side.device])
                _run(["ip", "-n", side.namespace, "link", "set", side.device, "up"])
        except BaseException:
            self.close()
            raise

    def command(self, side: Side, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``side``'s namespace."""
        return ["ip", "netns", "exec", side.namespace, *argv]

    def popen(self, side: Side, argv: Sequence[str], env: Optional[dict[str, str]] = None) -> subprocess.Popen[str]:
        """Starts ``argv`` in ``side``'s namespace, its stdin and stdout pipes to this process
        (line-buffered text), stderr inherited."""
        return subprocess.Popen(
            self.command(side, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env
        )

    def set_link(self, up: bool) -> None:
        """Takes the veth down (both ends: nothing crosses) or up again."""
        for side in (self.a, self.b):
            _run(["ip", "-n", side.namespace, "link", "set", side.device, "up" if up else "down"])

    def shape(self, rate_mbit: float, delay_ms: float = 0.0) -> None:
        """Each end sends at most ``rate_mbit`` Mbit/s (a token bucket; netem adds ``delay_ms``
        one way when given)."""
        for side in (self.a, self.b):
            base = ["tc", "-n", side.namespace, "qdisc", "replace", "dev", side.device, "root"]
            if delay_ms:
                _run([*base, "netem", "delay", f"{delay_ms}ms", "rate", f"{rate_mbit}mbit"])
            else:
                _run([*base, "tbf", "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", "50ms"])

    def tx_bytes(self, side: Side) -> int:
        """Bytes ``side``'s end of the veth has sent."""
        return int(_run(self.command(side, ["cat", f"/sys/class/net/{side.device}/statistics/tx_bytes"])).stdout)

    def close(self) -> None:
        """Removes both namespaces (the veth pair goes with them); idempotent."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True, timeout=30)

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
