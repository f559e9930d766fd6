"""The ``kvferry`` command line: ``kvferry plan`` prints the transfer plan of one request."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Optional, Sequence

from kvferry._core import BlockRange, TransferLedger
from kvferry._optional import require
from kvferry.errors import InvalidArgumentError, KvFerryError
from kvferry.geometry import AGENTIC_MODEL, GEOMETRY_HELP, VLLM_BENCH_MODEL, VLLM_REALISTIC_MODEL, Geometry
from kvferry.transports import registry

# Host names that stay on this machine (a receiver or server there is not on another host).
LOOPBACK = ("127.0.0.1", "::1", "localhost")

if TYPE_CHECKING:
    from kvferry.bench.agentic import AgenticConfig

# KV bytes per token of a Llama-3-8B-shaped model in bf16: K and V x 8 KV heads x 128 dims
# x 2 bytes x 32 layers. The default block size of `kvferry plan` is this times tokens/block.
LLAMA8B_BYTES_PER_TOKEN = 2 * 8 * 128 * 2 * 32


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default: the value argparse holds (a list joined
    with commas, a flag as off), unless the help already says it in words ("default: ...")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text or action.required:
            return text
        default = action.default
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif isinstance(default, (tuple, list)):
            shown = ",".join(map(str, default))
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})"


class _Parser(argparse.ArgumentParser):
    """Bad arguments give one line on stderr and exit code 2 (argparse prints usage too).
    Help lists every option's default (`_Help`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    # nan would pass `< 0` and silently turn the emulated link off.
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _rate(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class Slice:
    """One row of the plan: what leaves, for which tokens."""

    name: str
    tokens: tuple[int, int]
    blocks: BlockRange


@dataclass(frozen=True)
class RequestPlan:
    """Every slice of one request, with the ledger that claimed them."""

    slices: list[Slice]
    ledger: TransferLedger
    needed_blocks: int


def plan_request(
    tokens_per_block: int,
    prompt: int,
    reused: int,
    chunk: Optional[int],
    *,
    early: bool = True,
    window: Optional[int] = None,
) -> RequestPlan:
    """Drives a ledger through one request: the early slice, then each prefill chunk."""
    ledger = TransferLedger(tokens_per_block, prompt, reused_len=reused, window=window)
    needed = sum(len(r) for r in ledger.missing())
    slices: list[Slice] = []
    if early:
        blocks = ledger.send_early()
        if blocks is not None:
            slices.append(Slice("early", (0, blocks.end * tokens_per_block), blocks))
    step = chunk if chunk is not None else prompt - reused
    for n, start in enumerate(range(reused, prompt, step), start=1):
        end = min(start + step, prompt)
        blocks = ledger.send_chunk(start, end)
        if blocks is not None:
            slices.append(Slice(f"chunk {n}", (start, end), blocks))
    return RequestPlan(slices, ledger, needed)


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


# The ledger's parameters as `kvferry plan` spells them: its refusals reach the user in the
# flags' words ("invalid --reused=8: must be < --prompt (8)"), not the Python names.
PLAN_FLAGS = {
    "tokens_per_block": "--tokens-per-block",
    "prompt_len": "--prompt",
    "reused_len": "--reused",
    "window": "--window",
}
_PLAN_NAME = re.compile(r"\b(" + "|".join(PLAN_FLAGS) + r")\b")


def _cmd_plan(args: argparse.Namespace) -> int:
    tpb = args.tokens_per_block
    block_bytes = args.block_bytes if args.block_bytes is not None else LLAMA8B_BYTES_PER_TOKEN * tpb
    try:
        plan = plan_request(tpb, args.prompt, args.reused, args.chunk, early=not args.no_early, window=args.window)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(_PLAN_NAME.sub(lambda m: PLAN_FLAGS[m.group(1)], str(err))) from None
    slices, ledger = plan.slices, plan.ledger
    window = "full attention" if ledger.window is None else f"sliding window {ledger.window}"
    print(
        f"prompt {args.prompt} tokens, {args.reused} reused, {tpb} tokens/block "
        f"({ledger.num_blocks} blocks of {_size(block_bytes)}), {window}, "
        f"early send {'off' if args.no_early else 'on'}"
    )
    header = f"{'slice':<10} {'tokens':>16} {'blocks':>14} {'count':>7} {'bytes':>11}"
    print(header)
    print("-" * len(header))
    for s in slices:
        tokens = f"[{s.tokens[0]}, {s.tokens[1]})"
        blocks = f"[{s.blocks.start}, {s.blocks.end})"
        print(f"{s.name:<10} {tokens:>16} {blocks:>14} {len(s.blocks):>7} {_size(len(s.blocks) * block_bytes):>11}")
    sent = sum(len(s.blocks) for s in slices)
    early_blocks = sum(len(s.blocks) for s in slices if s.name == "early")
    if not ledger.is_complete or sent != ledger.claimed_blocks:
        print(f"coverage FAILED: missing {ledger.missing()}", file=sys.stderr)
        return 1
    print(
        f"exact-once: {sent} of {plan.needed_blocks} needed blocks sent, none twice; "
        f"{early_blocks} ({100 * early_blocks / max(sent, 1):.1f}%) before the first forward"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvferry import __version__

    parser = _Parser(
        prog="kvferry", description="kvferry: early reused-prefix KV-cache transfer for disaggregated LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvferry {__version__}")
    # Not required: a bare `kvferry` (or `kvferry bench`) lists the commands (main).
    sub = parser.add_subparsers(dest="command", title="commands", parser_class=_Parser)
    plan = sub.add_parser("plan", help="print the transfer plan of one request")
    plan.add_argument(
        "--tokens-per-block", type=_positive, required=True, metavar="N", help="tokens per KV block (required)"
    )
    plan.add_argument("--prompt", type=_positive, required=True, metavar="TOKENS", help="prompt length (required)")
    plan.add_argument("--reused", type=_non_negative, default=0, metavar="TOKENS", help="reused prefix length")
    plan.add_argument(
        "--chunk", type=_positive, default=None, metavar="TOKENS", help="prefill chunk size (default: unchunked)"
    )
    plan.add_argument("--no-early", action="store_true", help="send the prefix with the first chunk instead")
    plan.add_argument(
        "--window",
        type=_positive,
        default=None,
        metavar="TOKENS",
        help="sliding attention window (default: full attention)",
    )
    plan.add_argument(
        "--block-bytes",
        type=_positive,
        default=None,
        metavar="N",
        help="bytes per block over all layers (default: Llama-3-8B bf16, 128 KiB per token)",
    )
    plan.set_defaults(func=_cmd_plan)

    proxy = sub.add_parser("proxy", help="OpenAI-compatible front for prefill/decode vLLM servers (docs/vllm.md)")
    proxy.add_argument(
        "--prefill", type=_urls, required=True, metavar="URL[,URL...]", help="prefill servers (required)"
    )
    proxy.add_argument("--decode", type=_urls, required=True, metavar="URL[,URL...]", help="decode servers (required)")
    proxy.add_argument(
        "--connector",
        choices=("nixl", "kvferry"),
        default="kvferry",
        help="the servers' KV connector: kvferry's KvferryConnector or vLLM's NixlConnector (default %(default)s)",
    )
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s, loopback only)")
    proxy.add_argument("--port", type=_port, required=True, metavar="N", help="port to listen on (required)")
    proxy.add_argument(
        "--max-client-connections",
        type=_positive,
        default=64,  # kvferry.vllm.proxy.MAX_PER_CLIENT
        metavar="N",
        help=(
            "connections one client address may hold at once; one more is closed on arrival (default %(default)s; "
            "raise it when a load balancer is the proxy's one client)"
        ),
    )
    proxy.add_argument(
        "--head-timeout",
        type=_positive_float,
        default=10.0,  # kvferry.vllm.proxy.HEAD_S
        metavar="S",
        help="seconds a request head has to arrive whole (default %(default)s)",
    )
    proxy.set_defaults(func=_cmd_proxy)

    doc = sub.add_parser(
        "doctor", help="what this host can run: versions, transports, UCX, limits, session key (changes nothing)"
    )
    doc.add_argument("--json", action="store_true", help="print the report as JSON (schema: docs/operations.md)")
    doc.add_argument(
        "--authkey-file",
        default=None,
        metavar="PATH",
        help="the session key file the servers use (default: the per-user default file)",
    )
    doc.add_argument("--no-ucx", action="store_true", help="skip UCX's put probes (a child process, a few seconds)")
    doc.add_argument(
        "--peer",
        default=None,
        metavar="URL",
        help="also handshake with, and send a small bit-exact transfer to, the probe at URL",
    )
    doc.add_argument("--serve", action="store_true", help="serve probes for --peer (until interrupted); no report")
    doc.add_argument(
        "--listen",
        default="tcp://127.0.0.1:0",
        metavar="URL",
        help="--serve: where the probe listens, tcp://HOST:PORT or unix:///PATH",
    )
    doc.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="--serve: the host a wildcard --listen is reached by (default: none)",
    )
    from kvferry.doctor import PROBE_TRANSPORTS

    doc.add_argument("--transport", default="staging", choices=PROBE_TRANSPORTS, help="--serve: how blocks move")
    doc.set_defaults(func=_cmd_doctor)

    tr = sub.add_parser("trace", help="merge both servers' trace files into one timeline per transfer (docs/vllm.md)")
    tr.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="the servers' trace files (kv_connector_extra_config trace), or logs holding trace lines",
    )
    tr.add_argument(
        "--transfer",
        action="append",
        default=None,
        metavar="ID",
        help="only this transfer (repeatable; default: every transfer)",
    )
    tr.add_argument(
        "--png",
        default="kvferry-trace.png",
        metavar="PATH",
        help="timeline picture; '' skips it (needs matplotlib, kvferry[bench]) (default: %(default)s)",
    )
    tr.set_defaults(func=_cmd_trace)

    benches = sub.add_parser("bench", help="benchmarks", description="kvferry's benchmarks (docs/benchmarks.md).")
    bench = benches.add_subparsers(dest="bench", title="benchmarks", parser_class=_Parser)
    copy = bench.add_parser("copy", help="bandwidth of copy_blocks and each transport next to the copy ceiling")
    copy.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the pools live")
    copy.add_argument(
        "--transport",
        type=_names,
        default=None,
        metavar="A,B",
        help=(
            f"torch and copy (bare copies) and transports ({', '.join(registry.names())}) with the pools they "
            "serve; default: all but nixl on CUDA"
        ),
    )
    copy.add_argument(
        "--blocks",
        type=_int_list,
        default=(8, 64, 1024, 4096),
        metavar="N,N",
        help="blocks per transfer (a comma-separated list)",
    )
    copy.add_argument(
        "--layers", type=_positive, default=None, metavar="N", help="layers (default: 8 on cpu, 32 on cuda)"
    )
    copy.add_argument(
        "--block-kib",
        type=_positive,
        default=None,
        metavar="KIB",
        help="KiB per block per layer (default: 64 on cpu, 128 on cuda)",
    )
    copy.add_argument(
        "--reps", type=_positive, default=5, metavar="N", help="timed repetitions per figure; the median is reported"
    )
    copy.add_argument(
        "--checksum",
        choices=("on", "off"),
        default=None,
        help="transports: per-block checksums summed by the sender and checked by the receiver (default: the "
        "library's default, kvferry.checksum.CHECKSUM_DEFAULT)",
    )
    copy.add_argument(
        "--contiguous",
        action="store_true",
        help="transports: each transfer's blocks consecutive on both sides (default: random blocks)",
    )
    copy.add_argument(
        "--write-mib",
        type=_positive,
        default=None,
        metavar="MIB",
        help="staging: the most MiB one write carries (default: 512, at most half the ring)",
    )
    copy.add_argument(
        "--ring-mib",
        type=_positive,
        default=None,
        metavar="MIB",
        help="staging: the ring's MiB, rounded down to whole blocks (default: as large as the receiver's pool)",
    )
    copy.add_argument(
        "--receiver-device",
        default=None,
        metavar="cuda:N",
        help=(
            "--device cuda, staging and cuda-ipc: the receiver's pool on this GPU (staging: each leg crosses its "
            "own GPU's link; cuda-ipc: the copy kernel writes over NVLink or PCIe peer-to-peer) (default: the "
            "sender's GPU)"
        ),
    )
    _placement_flags(copy)
    copy.add_argument(
        "--json", default=None, metavar="PATH", help="also write the figures as JSON (default: not written)"
    )
    copy.set_defaults(func=_cmd_bench_copy)

    agentic = bench.add_parser(
        "agentic", help="early versus baseline transfer on an agentic multi-turn workload (the main job)"
    )
    agentic.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the model and the KV pools live"
    )
    agentic.add_argument(
        "--sessions",
        type=_positive,
        default=3,
        metavar="N",
        help="concurrent conversations (one request each per turn, prefilled as one batch)",
    )
    agentic.add_argument(
        "--turns",
        type=_positive,
        default=4,
        metavar="N",
        help="measured turns, after one warm-up turn that fills the prefix cache; the ratio is their median",
    )
    agentic.add_argument(
        "--cached",
        type=_positive,
        default=3072,
        metavar="TOKENS",
        help="conversation length before the first measured turn",
    )
    agentic.add_argument("--new", type=_positive, default=256, metavar="TOKENS", help="new tokens per turn")
    agentic.add_argument("--output", type=_positive, default=8, metavar="TOKENS", help="output tokens per turn")
    agentic.add_argument("--tokens-per-block", type=_positive, default=32, metavar="N", help="tokens per KV block")
    agentic.add_argument(
        "--chunk", type=_positive, default=None, metavar="TOKENS", help="prefill chunk size (default: unchunked)"
    )
    agentic.add_argument(
        "--transport",
        choices=registry.names(),
        default="in-process",
        help="how the generation worker is reached; any but in-process runs it in another process",
    )
    _placement_flags(agentic)
    agentic.add_argument(
        "--link-gbps",
        type=_rate,
        default=0.5,
        metavar="GB/S",
        help="CPU, in-process and shm: emulated link rate, paced without taking the compute cores (0: raw copies)",
    )
    agentic.add_argument(
        "--ring-mib",
        type=_positive,
        default=None,
        metavar="MIB",
        help=(
            "--transport staging: the generation worker's ring in MiB, whole blocks, at least one (default: as "
            "large as its pool)"
        ),
    )
    _geometry_flags(agentic, AGENTIC_MODEL)
    agentic.add_argument(
        "--aware",
        action="store_true",
        help="also run early transfer with receiver prefix awareness (held blocks never cross)",
    )
    # A bare --layerwise (const 0) means one group per layer; resolved against --layers below.
    agentic.add_argument(
        "--layerwise",
        nargs="?",
        type=_positive,
        const=0,
        default=None,
        metavar="GROUPS",
        help=(
            "also run early transfer plus layer-wise streaming of the last prefill chunk, in GROUPS groups of "
            "consecutive layers (default: not run; a bare --layerwise: one group per layer)"
        ),
    )
    agentic.add_argument(
        "--check-kv",
        action="store_true",
        help="hash every transferred block on both workers and report differing blocks (slow)",
    )
    agentic.add_argument(
        "--json", default=None, metavar="PATH", help="write every figure as JSON (default: not written)"
    )
    agentic.add_argument(
        "--png",
        default="agentic-timeline.png",
        metavar="PATH",
        help=(
            "timeline picture of the last measured turn; '' skips it (needs matplotlib, kvferry[bench]) (default: "
            "%(default)s)"
        ),
    )
    agentic.set_defaults(func=_cmd_bench_agentic)

    vllm = bench.add_parser(
        "vllm",
        help=(
            "the agentic workload through real vLLM prefill/decode servers: NixlConnector and KvferryConnector "
            "side by side"
        ),
    )
    vllm.add_argument(
        "--sessions", type=_positive, default=3, metavar="N", help="concurrent conversations (default: %(default)s)"
    )
    vllm.add_argument(
        "--turns",
        type=_positive,
        default=4,
        metavar="N",
        help="measured turns per session, after one warm-up turn (default: %(default)s)",
    )
    vllm.add_argument(
        "--cached",
        type=_positive,
        default=2048,
        metavar="TOKENS",
        help="conversation length before the first measured turn (default: %(default)s)",
    )
    vllm.add_argument(
        "--new", type=_positive, default=128, metavar="TOKENS", help="new tokens per turn (default: %(default)s)"
    )
    vllm.add_argument(
        "--output", type=_positive, default=8, metavar="TOKENS", help="output tokens per turn (default: %(default)s)"
    )
    # 32, 64 or 128: what vLLM's CPU attention kernel takes.
    _geometry_flags(vllm, VLLM_BENCH_MODEL, head_dims=(32, 64, 128))
    vllm.add_argument(
        "--realistic",
        action="store_true",
        help=(
            "a realistic KV geometry instead of the geometry flags: 32 layers x 8 KV heads x 128 (fp32, 256 KiB of KV "
            "per token; the default 2048 cached tokens make a 512 MiB prefix, 8 staging rings)"
        ),
    )
    vllm.add_argument(
        "--transfer-threads",
        choices=("with-engine", "apart"),  # kvferry.bench.vllm.TRANSFER_THREADS
        default="with-engine",
        help=(
            "where each prefill server's transfer threads run, kvferry's and NIXL's alike: with-engine, on the "
            "prefill's own core; apart, off the core the forward computes on (as a GPU's copy engines work beside "
            "its forward): a third core, or on one host with two cores the decode servers' (default: %(default)s)"
        ),
    )
    vllm.add_argument(
        "--no-receive-steering",
        dest="receive_steering",
        action="store_false",
        help=(
            "with --decode-netns: leave each veth's receive work on the sending core (a veth's own way; every run "
            "before 2026-12-05) instead of each namespace receiving on its own servers' core"
        ),
    )
    vllm.add_argument(
        "--link-mbit",
        type=_positive_float,
        default=None,
        metavar="MBIT",
        help=(
            "with --decode-netns: shape the veth to this rate by hand (default: sized so that a measured turn's "
            "reused prefix crosses in the time of its prefill)"
        ),
    )
    vllm.add_argument(
        "--router",
        choices=("kvferry-proxy", "vllm-router"),  # kvferry.bench.vllm.ROUTERS
        default="kvferry-proxy",
        help=(
            "what sends each request's two legs: kvferry proxy (each connector's own flow), or vllm-router in its "
            "default P/D mode (--kv-connector nixl; both connectors in NixlConnector's protocol; needs `pip install "
            "vllm-router`, make setup-vllm does) (default: %(default)s)"
        ),
    )
    vllm.add_argument(
        "--layer-groups",
        type=_positive,
        default=4,
        metavar="G",
        help="layer groups of the kvferry-layers configuration (default: %(default)s)",
    )
    vllm.add_argument(
        "--chunk",
        type=_positive,
        default=512,
        metavar="TOKENS",
        help="max_num_batched_tokens: the prefill chunk (default %(default)s)",
    )
    vllm.add_argument(
        "--configs", type=_vllm_configs, default=None, metavar="A,B", help="configurations to run (default: all)"
    )
    vllm.add_argument(
        "--workdir", default=None, metavar="DIR", help="model and server logs (default: a fresh temp dir)"
    )
    vllm.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON (default: not written)")
    vllm.add_argument(
        "--png", default="vllm-timeline.png", metavar="PATH", help="timeline picture (default %(default)s)"
    )
    vllm.add_argument(
        "--decode-netns",
        default=None,
        metavar="NAME",
        help=(
            "run the decode server in this network namespace (ip netns, root), standing for a second host; needs "
            "--decode-host and --prefill-host (default: one host)"
        ),
    )
    vllm.add_argument(
        "--decode-host", default="127.0.0.1", metavar="IP", help="the decode server's address (default: %(default)s)"
    )
    vllm.add_argument(
        "--prefill-host",
        default="127.0.0.1",
        metavar="IP",
        help="the prefill server's address, in this process's namespace (default: %(default)s)",
    )
    vllm.add_argument(
        "--scrape",
        default=None,
        metavar="PATH",
        help="append the servers' /metrics, read before and after each turn, to PATH as JSON lines, for "
        "python -m kvferry.bench.dashboard (default: not sampled)",
    )
    vllm.add_argument(
        "--stress",
        action="store_true",
        help=(
            "instead: KvferryConnector under serving load (small KV pools, preemption on both servers, client "
            "hang-ups; docs/benchmarks.md)"
        ),
    )
    vllm.add_argument(
        "--stress-sessions",
        type=_positive,
        default=48,
        metavar="N",
        help="--stress: concurrent multi-turn sessions (default: %(default)s)",
    )
    vllm.add_argument(
        "--stress-late-host-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="--stress: the prefill server's late_host_bytes (default: its own, off; > 0: prompts computed before"
        " their destination park in that much host memory)",
    )
    vllm.set_defaults(func=_cmd_bench_vllm)

    fanout = bench.add_parser(
        "fanout", help="in-flight dedup: concurrent requests sharing one prefix, with and without dedup"
    )
    fanout.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the model and the KV pools live"
    )
    fanout.add_argument("--requests", type=_positive, default=8, metavar="N", help="concurrent requests")
    fanout.add_argument("--prefix", type=_positive, default=8192, metavar="TOKENS", help="shared prefix")
    fanout.add_argument("--suffix", type=_positive, default=32, metavar="TOKENS", help="each request's own tokens")
    fanout.add_argument("--output", type=_positive, default=4, metavar="TOKENS", help="output tokens per request")
    fanout.add_argument("--tokens-per-block", type=_positive, default=32, metavar="N", help="tokens per KV block")
    fanout.add_argument("--chunk", type=_positive, default=1024, metavar="TOKENS", help="prefill chunk size")
    fanout.add_argument(
        "--transport",
        choices=registry.names(),
        default="in-process",
        help="how the generation worker is reached; any but in-process runs it in another process",
    )
    fanout.add_argument(
        "--link-gbps",
        type=_rate,
        default=0.5,
        metavar="GB/S",
        help="CPU, in-process and shm: emulated link rate (0: raw copies)",
    )
    fanout.add_argument(
        "--json", default=None, metavar="PATH", help="write every figure as JSON (default: not written)"
    )
    fanout.set_defaults(func=_cmd_bench_fanout)

    tiers = bench.add_parser(
        "tiers",
        help="early send of a reused prefix split across device and host tiers: direct versus onboard-then-send",
    )
    tiers.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the device tier and the receiver's pool live"
    )
    tiers.add_argument(
        "--transport",
        choices=registry.names(),
        default=None,
        help=(
            "how the receiver is reached (default: in-process on cpu, staging on cuda); any but in-process runs it "
            "in another process"
        ),
    )
    tiers.add_argument("--blocks", type=_positive, default=512, metavar="N", help="blocks of the reused prefix")
    tiers.add_argument(
        "--host-fraction", type=_fraction, default=0.5, metavar="F", help="share of them in the host tier"
    )
    tiers.add_argument(
        "--layers", type=_positive, default=None, metavar="N", help="layers (default: 8 on cpu, 32 on cuda)"
    )
    tiers.add_argument(
        "--block-kib",
        type=_positive,
        default=None,
        metavar="KIB",
        help="KiB per block per layer (default: 32 on cpu, 128 on cuda)",
    )
    tiers.add_argument(
        "--link-gbps",
        type=_rate,
        default=0.5,
        metavar="GB/S",
        help="CPU, in-process and shm: emulated link rate (0: raw copies)",
    )
    tiers.add_argument(
        "--host-gbps",
        type=_rate,
        default=0.5,
        metavar="GB/S",
        help="CPU: emulated host-to-device rate of the onboarding (0: raw copies)",
    )
    tiers.add_argument(
        "--reps",
        type=_positive,
        default=5,
        metavar="N",
        help="timed repetitions of each mode, after one warm-up; the median is reported",
    )
    tiers.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON (default: not written)")
    tiers.set_defaults(func=_cmd_bench_tiers)
    return parser


def _geometry_flags(
    parser: argparse.ArgumentParser, default: Geometry, head_dims: Optional[tuple[int, ...]] = None
) -> None:
    """The model's geometry as flags, one per `Geometry` field (``--kv-heads`` for ``kv_heads``),
    defaulting to the bench's own geometry; `_geometry` reads them back."""
    for f in fields(Geometry):
        flag = "--" + f.name.replace("_", "-")
        kind: dict[str, Any] = {"type": _non_negative if f.name == "seed" else _positive, "metavar": "N"}
        if f.name == "head_dim" and head_dims is not None:
            kind = {"type": int, "choices": head_dims}
        parser.add_argument(
            flag, default=getattr(default, f.name), help=f"{GEOMETRY_HELP[f.name]} (default: %(default)s)", **kind
        )


def _geometry(args: argparse.Namespace) -> Geometry | str:
    """The geometry the flags of `_geometry_flags` name, or why not (in the flags' words)."""
    if args.heads % args.kv_heads:
        return f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}"
    if args.head_dim % 2:
        return f"--head-dim {args.head_dim} must be even (rotary embeddings rotate pairs of dimensions)"
    return Geometry(**{f.name: getattr(args, f.name) for f in fields(Geometry)})


def _placement_flags(parser: argparse.ArgumentParser) -> None:
    """Where a receiver in another process runs: a second host on one machine."""
    parser.add_argument(
        "--listen",
        default="unix://",
        metavar="URL",
        help="where the receiver's endpoint listens: unix:// (default) or tcp://HOST:PORT (port 0: any)",
    )
    parser.add_argument(
        "--receiver-netns",
        default=None,
        metavar="NAME",
        help=(
            "run the receiver process in this network namespace (ip netns), standing for a second host (default: "
            "none, the sender's own)"
        ),
    )


def _across_hosts(args: argparse.Namespace) -> bool:
    """Whether ``--listen``/``--receiver-netns`` put the receiver on another host: another
    namespace, or a tcp:// address off loopback (refused with anything but tcp://)."""
    from kvferry.transports.wire import parse_address

    where = parse_address(args.listen, "--listen")
    if args.receiver_netns is not None and where.scheme != "tcp":
        raise ValueError(
            (
                f"invalid --listen={args.listen!r} with --receiver-netns {args.receiver_netns}: another namespace "
                "is reached over tcp://"
            )
        )
    return args.receiver_netns is not None or (where.scheme == "tcp" and where.host not in LOOPBACK)


def _check_reach(names: Sequence[str]) -> None:
    """Refuses a transport with an endpoint that cannot run across hosts (registry.check)."""
    for name in names:
        if name in registry.names() and registry.spec(name).has_endpoint:
            registry.check(name, reach=registry.Reach.NETWORK, argument="--transport")


def _urls(text: str) -> tuple[str, ...]:
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if not urls or bad:
        raise argparse.ArgumentTypeError(f"expected http:// URLs separated by commas, got {text!r}")
    return urls


def _port(text: str) -> int:
    value = _int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be in [1, 65535], got {value}")
    return value


def _cmd_doctor(args: argparse.Namespace) -> int:
    from kvferry import doctor

    if args.serve:
        try:
            doctor.serve_probes(
                listen=args.listen, advertise=args.advertise, transport=args.transport, authkey_file=args.authkey_file
            )
        except KeyboardInterrupt:
            pass
        return 0
    r = doctor.report(authkey_file=args.authkey_file, ucx_puts=not args.no_ucx)
    if args.peer is not None:
        r["peer"] = doctor.probe_peer(args.peer, authkey_file=args.authkey_file)
    print(json.dumps(r, indent=2) if args.json else doctor.format_report(r), end="\n" if args.json else "")
    wrong = doctor.problems(r)
    if wrong:
        sys.stdout.flush()  # the report first, then why the status is 1
        print(f"kvferry doctor: this host cannot run what was checked: {'; '.join(wrong)}", file=sys.stderr)
    return 1 if wrong else 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from kvferry import trace

    timelines = trace.merge(trace.read(args.files), args.transfer)
    if not timelines:
        which = f" of {', '.join(args.transfer)}" if args.transfer else ""
        print(f"kvferry trace: no trace lines{which} in {', '.join(args.files)}", file=sys.stderr)
        return 1
    print(trace.format_timelines(timelines), end="")
    if args.png:
        trace.draw(timelines, args.png)
        print(f"timeline: {args.png}")
    return 0


def _cmd_proxy(args: argparse.Namespace) -> int:
    require("aiohttp", "kvferry proxy")  # its one dependency past numpy: `pip install 'kvferry[proxy]'`
    from kvferry.vllm.proxy import serve

    print(
        (
            f"kvferry proxy ({args.connector}) on http://{args.host}:{args.port}: prefill "
            f"{', '.join(args.prefill)}; decode {', '.join(args.decode)}"
        ),
        file=sys.stderr,
    )
    serve(
        args.prefill,
        args.decode,
        host=args.host,
        port=args.port,
        connector=args.connector,
        max_per_client=args.max_client_connections,
        head_s=args.head_timeout,
    )
    return 0


def _vllm_configs(text: str) -> tuple[str, ...]:
    from kvferry.bench.vllm import CONFIGS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in CONFIGS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown configuration {bad or text!r}: choose from {', '.join(CONFIGS)}")
    return names


def _cmd_bench_vllm(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        return _refuse(
            f"bench vllm needs vLLM ({err}): make setup-vllm, then run it with .venv-vllm/bin/python -m kvferry.cli"
        )
    from kvferry.bench.vllm import (
        CONFIGS,
        VllmBenchConfig,
        draw_timeline,
        format_vllm_bench,
        placement,
        progress_to_stderr,
        run_vllm_bench,
        write_json,
    )

    if args.stress:
        from kvferry.bench.stress import StressConfig, format_stress, run_stress

        stressed = run_stress(
            StressConfig(
                sessions=args.stress_sessions, workdir=args.workdir, late_host_bytes=args.stress_late_host_bytes
            ),
            progress=progress_to_stderr,
        )
        print(format_stress(stressed))
        if args.json:
            write_json(stressed, args.json)
        return (
            0
            if stressed["mismatches"] == 0 and not any(stressed["leaked_blocks"].values()) and stressed["serves_after"]
            else 1
        )
    model = VLLM_REALISTIC_MODEL if args.realistic else _geometry(args)
    if isinstance(model, str):
        return _refuse(model)
    if args.layer_groups > model.layers:
        return _refuse(f"--layer-groups {args.layer_groups} must be <= --layers {model.layers}")
    if args.link_mbit is not None and args.decode_netns is None:
        return _refuse(f"--link-mbit {args.link_mbit} shapes the veth to another host: it needs --decode-netns")
    if args.new > args.cached:
        return _refuse(f"--new {args.new} must be <= --cached {args.cached}")
    if args.decode_netns is not None and (args.decode_host in LOOPBACK or args.prefill_host in LOOPBACK):
        return _refuse(
            (
                f"--decode-netns {args.decode_netns} puts the decode server on another host: give --decode-host "
                f"and --prefill-host the two hosts' addresses (got {args.decode_host}, {args.prefill_host})"
            )
        )
    if args.decode_netns is None and args.decode_host not in LOOPBACK:
        return _refuse(
            (
                f"--decode-host {args.decode_host} needs --decode-netns: without it both servers run on this "
                "host's loopback"
            )
        )
    cfg = VllmBenchConfig(
        sessions=args.sessions,
        turns=args.turns,
        cached_tokens=args.cached,
        new_tokens=args.new,
        output_tokens=args.output,
        model=model,
        layer_groups=args.layer_groups,
        max_num_batched_tokens=args.chunk,
        configs=args.configs or CONFIGS,
        link_mbit=args.link_mbit,
        workdir=args.workdir,
        decode_netns=args.decode_netns,
        decode_host=args.decode_host,
        prefill_host=args.prefill_host,
        scrape=args.scrape,
        transfer_threads=args.transfer_threads,
        receive_steering=args.receive_steering,
        router=args.router,
    )
    try:
        placement(cfg)  # before minutes of setup: a placement the box cannot give is refused now
    except InvalidArgumentError as err:
        return _refuse(f"--transfer-threads {args.transfer_threads}: {err}")
    result = run_vllm_bench(cfg, progress=progress_to_stderr)
    if args.json:  # first: a run of many minutes keeps its figures whatever comes next
        write_json(result, args.json)
    print(format_vllm_bench(result))
    if args.png:
        draw_timeline(result, args.png)
        print(f"timeline: {args.png}")
    return 0


def _fraction(text: str) -> float:
    value = _rate(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _cmd_bench_tiers(args: argparse.Namespace) -> int:
    from kvferry.bench.tiers import TiersConfig, format_tiers, progress_to_stderr, run_tiers

    if _cuda_missing(args.device):
        return 2
    on_gpu = args.device == "cuda"
    transport = args.transport or ("staging" if on_gpu else "in-process")
    registry.check(transport, device=args.device, argument="--transport", device_argument="--device")
    cfg = TiersConfig(
        device=args.device,
        blocks=args.blocks,
        host_fraction=args.host_fraction,
        layers=args.layers or (32 if on_gpu else 8),
        block_kib=args.block_kib or (128 if on_gpu else 32),
        transport=transport,
        link_gbps=args.link_gbps or None,
        host_gbps=args.host_gbps or None,
        reps=args.reps,
    )
    # The sender's device pool (prefix, last block, onboarding room), its host tier and the
    # receiver's pool.
    pool = cfg.block_kib * 1024 * cfg.layers
    if _too_big(
        args.device,
        (2 * cfg.blocks + 2 + cfg.host_blocks) * pool,
        "the device pool and the receiver's pool need at least",
        "--blocks/--layers/--block-kib",
    ):
        return 2
    if _too_big(
        "cpu", cfg.host_blocks * pool, "the host tier needs at least", "--blocks/--host-fraction/--layers/--block-kib"
    ):
        return 2
    result = run_tiers(cfg, progress=progress_to_stderr)
    print(format_tiers(result))
    _write_json(args.json, result)
    return 0


def _cmd_bench_fanout(args: argparse.Namespace) -> int:
    from kvferry.bench.fanout import FanoutConfig, format_fanout, progress_to_stderr, run_fanout

    refused = _device_refused(args)
    if refused is not None:
        return refused
    cfg = FanoutConfig(
        device=args.device,
        requests=args.requests,
        prefix_tokens=args.prefix,
        suffix_tokens=args.suffix,
        output_tokens=args.output,
        tokens_per_block=args.tokens_per_block,
        chunk_size=args.chunk,
        transport=args.transport,
        link_gbps=args.link_gbps or None,
    )
    result = run_fanout(cfg, progress=progress_to_stderr)
    print(format_fanout(result))
    _write_json(args.json, result)
    return 0


def _device_refused(args: argparse.Namespace) -> Optional[int]:
    """The exit status for a ``--device``/``--transport`` pair this machine cannot run."""
    if _cuda_missing(args.device):
        return 2
    registry.check(args.transport, device=args.device, argument="--transport", device_argument="--device")
    return None


def _write_json(path: Optional[str], result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def _cmd_bench_agentic(args: argparse.Namespace) -> int:
    from kvferry.bench.agentic import AgenticConfig, draw_timeline, format_agentic, progress_to_stderr, run_agentic

    refused = _device_refused(args)
    if refused is not None:
        return refused
    if _across_hosts(args):
        if not registry.spec(args.transport).has_endpoint:
            return _refuse(
                (
                    f"--transport {args.transport} keeps the generation worker in this process: "
                    "--listen/--receiver-netns need one with an endpoint"
                )
            )
        _check_reach([args.transport])
    model = _geometry(args)
    if isinstance(model, str):
        return _refuse(model)
    if args.new > args.cached:
        return _refuse(
            (
                f"--new {args.new} must be <= --cached {args.cached} (the cached conversation includes one turn of "
                "new tokens)"
            )
        )
    layer_groups = args.layers if args.layerwise == 0 else args.layerwise
    if layer_groups is not None and layer_groups > args.layers:
        return _refuse(
            f"--layerwise {layer_groups} must be <= --layers {args.layers} (a layer group holds at least one layer)"
        )
    cfg = AgenticConfig(
        device=args.device,
        sessions=args.sessions,
        turns=args.turns,
        cached_tokens=args.cached,
        new_tokens=args.new,
        output_tokens=args.output,
        tokens_per_block=args.tokens_per_block,
        chunk_size=args.chunk,
        transport=args.transport,
        link_gbps=args.link_gbps or None,
        model=model,
        check_kv=args.check_kv,
        aware=args.aware,
        layer_groups=layer_groups,
        listen=args.listen,
        receiver_netns=args.receiver_netns,
        ring_bytes=None if args.ring_mib is None else args.ring_mib << 20,
    )
    if args.ring_mib is not None and args.transport != "staging":
        return _refuse(f"--ring-mib {args.ring_mib} is for --transport staging, not {args.transport!r}")
    if _too_big(
        args.device,
        _agentic_bytes(cfg),
        "the model and its KV pools need at least",
        "--layers/--hidden/--ffn/--vocab/--sessions/--cached",
    ):
        return 2
    if args.png:  # checked before the run, not after it
        require("matplotlib", "the timeline PNG (--png; --png '' skips it)")
    result = run_agentic(cfg, progress=progress_to_stderr)
    print(format_agentic(result))
    _write_json(args.json, result)
    if args.png:
        draw_timeline(result, args.png)
        print(f"timeline: {args.png}")
    return 0


def _names(text: str) -> tuple[str, ...]:
    from kvferry.bench.copy import names as bench_names

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in bench_names()]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown transport {bad or text!r}: choose from {', '.join(bench_names())}")
    return names


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(_positive(part) for part in text.split(","))


def _refuse(message: str) -> int:
    print(f"kvferry bench: error: {message}", file=sys.stderr)
    return 2


def _memory_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _too_big(device: str, need: int, what: str, options: str) -> bool:
    """Reports (and returns True) when a run needs more memory than the device has: refused
    up front, instead of a raw allocator error (or the OOM killer) minutes into the run."""
    have = _memory_bytes(device)
    if need <= have:
        return False
    _refuse(f"{what} {_size(need)}, more than the {_size(have)} of {device} memory here: lower {options}")
    return True


def _agentic_bytes(cfg: AgenticConfig) -> int:
    """A lower bound of what `kvferry bench agentic` allocates: one model's weights and the
    context and generation KV pools of every mode (activations and the reference run come on
    top)."""

    from kvferry.bench.agentic import _pool_blocks

    m = cfg.model_config()
    weights = m.geometry.weight_elements() * m.element_size
    # Every mode's engine lives through the run (the modes take turns): a context and a
    # generation pool each.
    return weights + 2 * len(cfg.modes) * _pool_blocks(cfg) * cfg.tokens_per_block * m.kv_bytes_per_token


def _cuda_missing(device: str) -> bool:
    """Reports (and returns True) when --device cuda was asked for on a machine without one."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("kvferry bench: error: --device cuda: no CUDA device is visible", file=sys.stderr)
        return True
    return False


def _receiver_device_problem(value: str, device: str, transports: Sequence[str]) -> Optional[str]:
    """Why ``--receiver-device value`` cannot run, or None."""
    if device != "cuda":
        return f"a second GPU is for --device cuda, not {device!r}"
    movable = [t for t in registry.names() if registry.spec(t).peer_gpu]
    others = sorted(set(transports) - set(movable) - {"copy", "torch"})
    if others:
        return f"only the {' and '.join(movable)} transports' receivers move there; drop --transport {','.join(others)}"
    index = value.removeprefix("cuda:")
    if not value.startswith("cuda:") or not index.isdigit():
        return "must be cuda:N"
    count = _cuda_count()
    if int(index) >= count:
        return f"this machine has {count} CUDA device(s)"
    if int(index) == 0:
        return "cuda:0 is the sender's GPU (the default); name another"
    return None


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def _cmd_bench_copy(args: argparse.Namespace) -> int:
    from kvferry.bench.copy import CopyBenchConfig, format_table, progress_to_stderr, run_copy_bench

    if _cuda_missing(args.device):
        return 2
    on_gpu = args.device == "cuda"
    from kvferry.bench.copy import COPIES, default_transports

    for name in args.transport or ():
        if name not in COPIES:
            registry.check(name, device=args.device, argument="--transport", device_argument="--device")
    transports = args.transport or default_transports(args.device)
    if _across_hosts(args):
        if args.transport is None:  # the defaults that reach another host
            transports = tuple(
                n
                for n in transports
                if n not in registry.names()
                or not registry.spec(n).has_endpoint
                or registry.spec(n).reach >= registry.Reach.NETWORK
            )
        _check_reach(transports)
    cfg = CopyBenchConfig(
        listen=args.listen,
        receiver_netns=args.receiver_netns,
        device=args.device,
        transports=transports,
        blocks=args.blocks,
        layers=args.layers or (32 if on_gpu else 8),
        block_kib=args.block_kib or (128 if on_gpu else 64),
        reps=args.reps,
        write_bytes=None if args.write_mib is None else args.write_mib << 20,
        ring_bytes=None if args.ring_mib is None else args.ring_mib << 20,
        receiver_device=args.receiver_device,
        contiguous=args.contiguous,
        checksum=None if args.checksum is None else args.checksum == "on",
    )
    if args.receiver_device is not None:
        why = _receiver_device_problem(args.receiver_device, args.device, transports)
        if why is not None:
            return _refuse(f"invalid --receiver-device={args.receiver_device!r}: {why}")
    try:
        cfg.ring_blocks()  # the config's own check: at least one block of every layer
    except InvalidArgumentError:
        return _refuse(
            f"invalid --ring-mib={args.ring_mib}: less than one block of every layer "
            f"({cfg.layers} x {cfg.block_kib} KiB); raise it or lower --layers/--block-kib"
        )
    # A lower bound of the peak: the source pool and one destination pool (or the two
    # buffers of the ceiling copy), each sized to the largest batch plus 64 blocks as in
    # run_copy_bench.
    pool = (max(cfg.blocks) + 64) * cfg.block_kib * 1024 * cfg.layers
    if _too_big(
        args.device, 2 * pool, "a source and a destination pool need at least", "--blocks/--layers/--block-kib"
    ):
        return 2
    result = run_copy_bench(cfg, progress=progress_to_stderr)
    print(format_table(result))
    _write_json(args.json, result)
    return 0


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of ``parser``'s subcommand ``name``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    raise KeyError(name)


def _list_commands(parser: argparse.ArgumentParser) -> int:
    """A bare ``kvferry`` or ``kvferry bench``: its help, which lists the commands, as a usage
    error (on stderr, exit status 2) rather than argparse's "arguments are required"."""
    parser.print_help(sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        return _list_commands(parser)
    if args.command == "bench" and args.bench is None:
        return _list_commands(_subcommand(parser, "bench"))
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader went away (`kvferry doctor | head -1`): what it did not read is dropped
        # without a traceback, and stdout points at /dev/null so that the interpreter's own
        # flush at exit does not fail again (the recipe of Python's signal module docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KvFerryError as err:
        print(f"kvferry {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # an invalid option value found past argument parsing
        print(f"kvferry {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
