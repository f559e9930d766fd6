"""NIXL across two hosts on one machine: `kvferry bench copy` and `kvferry bench agentic` with
the sender in one network namespace and the receiver in another, joined by a veth pair
shaped with tc (tests/netns.py makes them; needs root and iproute2); and `kvferry bench vllm`
with the decode server in the other namespace (`--benches vllm`, run with vLLM's venv).

    sudo .venv/bin/python benches/python/two_hosts.py [--rate-mbit 2000] [--out DIR] [--reps 5]
    sudo .venv-vllm/bin/python benches/python/two_hosts.py --benches vllm [--vllm-args "..."]

Both sides run with ``UCX_TLS=tcp`` on the veth (UCX's defaults would see one node and move
the bytes by cross-memory attach). Each bench also measures the same run's ceiling: one raw
TCP stream to the receiver's namespace over the same shaped veth. `kvferry bench vllm` shapes
the veth itself (kvferry.bench.link): sized from its own prefill, or to ``--vllm-args
"--link-mbit N"``; --rate-mbit does not apply to it. Writes copy.json, agentic.json,
vllm.json and their tables to --out; the namespaces are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from netns import TwoHosts, unavailable  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=2000.0, help="tc rate of each end of the veth (Mbit/s)")
    parser.add_argument("--out", default="two-hosts", help="directory for the JSON and tables")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--benches", default="copy,agentic", help="which of copy, agentic, vllm to run (default: %(default)s)"
    )
    parser.add_argument("--vllm-args", default="", help="more arguments for kvferry bench vllm (default: none)")
    args = parser.parse_args()
    chosen = [b.strip() for b in args.benches.split(",") if b.strip()]
    bad = [b for b in chosen if b not in ("copy", "agentic", "vllm")]
    if bad or not chosen:
        parser.error(f"invalid --benches={args.benches!r}: choose from copy, agentic, vllm")
    reason = unavailable()
    if reason is not None:
        print(f"two_hosts: {reason}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with TwoHosts() as hosts:
        hosts.shape(args.rate_mbit)
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=f"{hosts.a.device},{hosts.b.device}")
        place = ["--transport", "nixl", "--listen", f"tcp://{hosts.b.ip}:0", "--receiver-netns", hosts.b.namespace]
        runs = {
            "copy": ["bench", "copy", "--blocks", "64,1024", "--reps", str(args.reps), *place],
            "agentic": ["bench", "agentic", "--png", str(out / "agentic-timeline.png"), *place],
            "vllm": ["bench", "vllm", "--decode-netns", hosts.b.namespace, "--decode-host", hosts.b.ip,
                     "--prefill-host", hosts.a.ip, "--png", str(out / "vllm-timeline.png"), *args.vllm_args.split()],
        }  # fmt: skip
        runs = {name: argv for name, argv in runs.items() if name in chosen}
        for name, argv in runs.items():
            json_path = out / f"{name}.json"
            cmd = hosts.command(hosts.a, [sys.executable, "-m", "kvferry.cli", *argv, "--json", str(json_path)])
            print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
            start = time.monotonic()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            sys.stderr.write(done.stderr[-4000:])
            if done.returncode:
                print(done.stdout, file=sys.stderr)
                return done.returncode
            shaped = (
                "veth shaped by the bench (its link line says how)"
                if name == "vllm"
                else f"veth shaped to {args.rate_mbit:g} Mbit/s each way (tc tbf)"
            )
            table = f"{' '.join(argv)}\n{shaped}, UCX_TLS=tcp\n{done.stdout}"
            (out / f"{name}.txt").write_text(table)
            result = json.loads(json_path.read_text())
            rate = None if name == "vllm" else args.rate_mbit
            result["two_hosts"] = {"rate_mbit": rate, "seconds": time.monotonic() - start, "argv": argv}
            json_path.write_text(json.dumps(result, indent=2))
            print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
