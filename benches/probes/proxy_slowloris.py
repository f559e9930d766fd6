"""How long `kvferry proxy` takes to answer a client while another client holds half-sent
requests, with the proxy's client bounds (a head whole within `--head-timeout`, at most
`--max-client-connections` per address) at their defaults and lifted (the proxy before them).

The proxy runs as its own process (`kvferry proxy`) under a limit of 256 descriptors. The
attacker opens 300 connections from 127.0.0.2, each sending half a request head; then a client
at 127.0.0.1 asks ``/health`` ``--asks`` times in turn (the upstreams are dead ports, so each
answer is an immediate 503), each with a bound of ``--bound`` seconds. Printed per setting:
answers, median and worst answer time. The baseline, measured in the same run: the same asks
with no attacker.

    .venv/bin/python benches/probes/proxy_slowloris.py [--asks 20] [--bound 5]
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_proxy import HALF_HEAD, dead_urls  # noqa: E402

ATTACKERS = 300


def ask(url: str, bound: float) -> float | None:
    """Seconds to an answer of ``/health`` (any status), or None past ``bound``."""
    start = time.perf_counter()
    try:
        urllib.request.urlopen(url + "/health", timeout=bound).read()
    except urllib.error.HTTPError as err:
        err.read()
    except (OSError, TimeoutError):
        return None
    return time.perf_counter() - start


def attack(url: str) -> list[socket.socket]:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    held = []
    for _ in range(ATTACKERS):
        try:
            sock = socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.2", 0))
            sock.sendall(HALF_HEAD)
            held.append(sock)
        except OSError:
            break  # the client's own descriptors, or the listen backlog: it holds what it has
    return held


def start_proxy(prefill: str, decode: str, flags: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "kvferry.cli", "proxy", "--prefill", prefill, "--decode", decode,
            "--port", str(port), *flags]  # fmt: skip

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc = subprocess.Popen(argv, preexec_fn=limit, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while ask(url, 1.0) is None:  # started (a probe: polling is fine here)
        if proc.poll() is not None:
            raise SystemExit(f"kvferry proxy exited with {proc.returncode}")
        time.sleep(0.1)
    return proc, url


def run(setting: str, flags: list[str], asks: int, bound: float, attacked: bool) -> None:
    with dead_urls(2) as (p, d):
        proc, url = start_proxy(p, d, flags)
        held = attack(url) if attacked else []
        try:
            times = [ask(url, bound) for _ in range(asks)]
        finally:
            for sock in held:
                sock.close()
            proc.terminate()
            proc.wait(30)
    got = [t for t in times if t is not None]
    median = f"{statistics.median(got) * 1e3:.1f} ms" if got else "-"
    worst = f"{max(got) * 1e3:.1f} ms" if got else "-"
    print(
        f"{setting:<28} attacker connections {len(held):>3}  answered {len(got):>2}/{asks}  median {median:>9}  "
        f"worst {worst:>9}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--asks", type=int, default=20)
    parser.add_argument("--bound", type=float, default=5.0)
    args = parser.parse_args()
    lifted = ["--head-timeout", "3600", "--max-client-connections", "100000"]
    run("no attacker (baseline)", [], args.asks, args.bound, attacked=False)
    run("attacker, bounds (default)", [], args.asks, args.bound, attacked=True)
    run("attacker, bounds lifted", lifted, args.asks, args.bound, attacked=True)


if __name__ == "__main__":
    main()
