"""How the way a NIXL transfer's state is asked changes its speed: two processes in two network
namespaces joined by a veth (tests/netns.py; root, iproute2, nixl), each pinned to one core,
UCX over TCP. One side moves 18 MiB in 32 KiB descriptors to (WRITE) or from (READ) the other
six times, and asks ``check_xfer_state`` in one of several ways; prints the median.

    sudo python benches/probes/nixl_poll.py [--modes write,read] [--rate-mbit 10000]

The figures behind CHECK_SECONDS in python/kvferry/transports/nixl.py (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

TOTAL = 18 << 20
REPS = 6
# name -> (seconds between asks, whether the loop spins in between instead of sleeping)
LOOPS = {
    "no-pause": (0.0, False),
    "sleep-0.2ms": (2e-4, False),
    "sleep-1ms": (1e-3, False),
    "spin-ask-0.5ms": (5e-4, True),
    "spin-ask-2ms": (2e-3, True),
}


def side(role: str, mode: str, loop: str, desc_kib: int, core: int, folder: str) -> None:
    """One process: registers TOTAL bytes, trades agent metadata through ``folder`` (files this
    run wrote, as hex and JSON), then moves or serves the bytes REPS times."""
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    os.sched_setaffinity(0, [core])
    d = Path(folder)
    n = TOTAL // (desc_kib << 10)
    t = torch.full((TOTAL // 4,), 1.0 if role == "a" else 0.0)
    agent = nixl_agent(f"probe-{role}", nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    agent.register_memory([t])
    descs = [(t.data_ptr() + i * (desc_kib << 10), desc_kib << 10, 0) for i in range(n)]
    (d / f"{role}.json.tmp").write_text(json.dumps({"meta": agent.get_agent_metadata().hex(), "descs": descs}))
    (d / f"{role}.json.tmp").rename(d / f"{role}.json")
    other = d / ("b.json" if role == "a" else "a.json")
    while not other.exists():
        time.sleep(0.01)  # waiting for the other process's file, not timing anything
    theirs = json.loads(other.read_text())
    name = agent.add_remote_agent(bytes.fromhex(theirs["meta"]))
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "DRAM")
    remote = agent.prep_xfer_dlist(name, [tuple(x) for x in theirs["descs"]], "DRAM")
    initiator = (mode == "write") == (role == "a")
    every, spin = LOOPS[loop]
    idx = list(range(n))
    times = []
    for rep in range(REPS):
        if initiator:
            while True:  # the other side's metadata may take a moment to be usable
                try:
                    h = agent.make_prepped_xfer(mode.upper(), local, idx, remote, idx, b"done%d" % rep)
                    break
                except Exception:
                    time.sleep(0.05)
            t0 = time.perf_counter()
            agent.transfer(h)
            last = 0.0
            while True:
                now = time.perf_counter()
                if now - last >= every:
                    last = now
                    if agent.check_xfer_state(h) != "PROC":
                        break
                elif not spin:
                    time.sleep(every)
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(h)
            while not agent.get_new_notifs():  # the other side's ack of this rep
                time.sleep(1e-4)
        else:
            while not agent.get_new_notifs():
                time.sleep(1e-4)
            agent.send_notif(name, b"ack")
    if initiator:
        m = statistics.median(times)
        print(
            f"{mode:5} {loop:15} desc {desc_kib} KiB: median {m * 1e3:.1f} ms ({TOTAL / m / 1e6:.0f} MB/s)", flush=True
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="write,read", help="write, read or both (default: %(default)s)")
    parser.add_argument("--loops", default=",".join(LOOPS), help=f"which of {', '.join(LOOPS)} (default: all)")
    parser.add_argument("--desc-kib", type=int, default=32, help="descriptor size, KiB (default: %(default)s)")
    parser.add_argument("--rate-mbit", type=float, default=10000.0, help="tc rate of the veth (default: %(default)s)")
    parser.add_argument("--side", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        role, mode, loop, kib, core, folder = args.side
        side(role, mode, loop, int(kib), int(core), folder)
        return 0
    from netns import TwoHosts, unavailable

    why = unavailable()
    if why is not None:
        print(f"nixl_poll: {why}", file=sys.stderr)
        return 2
    with TwoHosts() as hosts:
        hosts.shape(args.rate_mbit)
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=f"{hosts.a.device},{hosts.b.device}")
        for mode in args.modes.split(","):
            for loop in args.loops.split(","):
                with tempfile.TemporaryDirectory() as folder:
                    procs = [
                        subprocess.Popen(
                            hosts.command(
                                h,
                                [
                                    sys.executable,
                                    __file__,
                                    "--side",
                                    r,
                                    mode,
                                    loop,
                                    str(args.desc_kib),
                                    str(core),
                                    folder,
                                ],
                            ),
                            env=env,
                            stderr=subprocess.DEVNULL,
                        )
                        for h, r, core in ((hosts.a, "a", 0), (hosts.b, "b", 1 % os.cpu_count()))  # type: ignore[operator]
                    ]
                    for p in procs:
                        p.wait(300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
