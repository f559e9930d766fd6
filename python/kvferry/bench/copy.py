"""`kvferry bench copy`: bandwidth of copy_blocks and of each transport for several batch
sizes, next to the copy ceiling measured in the same run.

Every figure is payload: bytes of KV blocks moved per second (each byte counted once). The
ceiling is one large contiguous copy on the same device(s), also counted once, so a perfect
block copy reaches 100% of it.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import secrets
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvferry.bench.util import enter_netns, machine, stderr_progress, tcp_stream_gbps
from kvferry.copy import copy_blocks, copy_blocks_torch
from kvferry.errors import InvalidArgumentError
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports import registry
from kvferry.transports.base import Transport

# Bare copies measured next to the transports (which the registry lists).
COPIES = ("torch", "copy")
# The staging path crosses PCIe twice: its ceiling is a pinned host<->device copy.
HOST_LINK = ("staging",)


@dataclass(frozen=True)
class CopyBenchConfig:
    device: str = "cpu"
    transports: tuple[str, ...] = field(default_factory=lambda: default_transports("cpu"))
    blocks: tuple[int, ...] = (8, 64, 1024, 4096)
    layers: int = 8
    block_kib: int = 64
    reps: int = 5
    seed: int = 0
    # Staging: the most bytes one write carries (None: the transport's default).
    write_bytes: Optional[int] = None
    # Staging: the ring's bytes per connected sender, a whole number of blocks (None: the
    # receiver's pool, so no write ever waits for room).
    ring_bytes: Optional[int] = None
    # Staging and CUDA IPC on CUDA: the receiver's pool on this device ("cuda:N") instead of the
    # sender's: each staging leg crosses its own GPU's link, and CUDA IPC's copy kernel writes
    # into a peer GPU (None: the sender's device).
    receiver_device: Optional[str] = None
    # Transports: each transfer's blocks consecutive on both sides (a run at a random start)
    # instead of random blocks.
    contiguous: bool = False
    # Where a receiver in another process listens (`registry.serve`'s ``address``) and the
    # network namespace it runs in (None: this one): a second host on one machine.
    listen: str = "unix://"
    receiver_netns: Optional[str] = None
    # Transports: whether the sender sums each block for the receiver to check
    # (kvferry.checksum; None: the library's default).
    checksum: Optional[bool] = None

    def ring_blocks(self) -> Optional[int]:
        """The staging ring's capacity in blocks (every layer) for `ring_bytes`, None for the
        default; a ring smaller than one block is refused by name."""
        if self.ring_bytes is None:
            return None
        block = self.block_kib * 1024 * self.layers
        if self.ring_bytes < block:
            raise InvalidArgumentError(
                f"invalid ring_bytes={self.ring_bytes}: less than one block of every layer ({block} bytes)"
            )
        return self.ring_bytes // block

    def tcp_host(self) -> Optional[str]:
        """The receiver's host when it listens on tcp:// (then a raw TCP stream to it is the
        link's ceiling), else None."""
        if not self.listen.startswith("tcp://"):
            return None
        from kvferry.transports.wire import parse_address

        return parse_address(self.listen, "listen").host


@dataclass
class Row:
    transport: str
    blocks: int
    payload_bytes: int
    seconds: float  # median
    gbps: float
    share_of_ceiling: float


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device.startswith("cuda:"):
        torch.cuda.synchronize(device)


def _median_seconds(
    fn: Callable[[], object], reps: int, device: str, setup: Optional[Callable[[], None]] = None
) -> float:
    """Median wall time of ``fn`` (device synchronised before and after), after one warm-up."""
    times = []
    for i in range(reps + 1):
        if setup is not None:
            setup()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i:  # the first call warms caches, allocators and kernels
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pinned_link_gbps(nbytes: int, reps: int, device: str = "cuda") -> float:
    """A large pinned host-to-``device`` copy (bytes copied per second)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _median_seconds(lambda: dev.copy_(host, non_blocking=True), reps, device) / 1e9


def duplex_link_gbps(nbytes: int, reps: int, up_device: str = "cuda") -> float:
    """A pinned device-to-host copy (from the current device) and a pinned host-to-device copy
    (into ``up_device``) of ``nbytes`` each, at once on two streams (bytes per second in each
    direction): what the staging path's two legs can move together, both across one GPU's link
    when sender and receiver share a GPU, or each across its own when ``up_device`` is
    another."""
    up_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    up_src.fill_(7)
    up_dst = torch.empty(nbytes, dtype=torch.uint8, device=up_device)
    down_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    down_src.fill_(9)
    down_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    streams = (torch.cuda.Stream() if up_device == "cuda" else torch.cuda.Stream(up_device), torch.cuda.Stream())

    def both() -> None:
        start = torch.cuda.current_stream()
        for stream in streams:
            stream.wait_stream(start)
        with torch.cuda.stream(streams[0]):
            up_dst.copy_(up_src, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            down_dst.copy_(down_src, non_blocking=True)
        for stream in streams:
            start.wait_stream(stream)

    return nbytes / _median_seconds(both, reps, "cuda") / 1e9


def ceiling_gbps(device: str, nbytes: int, reps: int) -> float:
    """One large contiguous copy: memcpy on CPU, device-to-device on CUDA (bytes copied/s)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    a.random_(0, 256) if device == "cpu" else a.fill_(7)
    b = torch.empty_like(a)
    return nbytes / _median_seconds(lambda: b.copy_(a), reps, device) / 1e9


def make_pool(cfg: CopyBenchConfig, num_blocks: int, *, fill: bool, device: Optional[str] = None) -> PagedKV:
    """``layers`` tensors of ``(num_blocks, block_kib * 256)`` fp32 (``block_kib`` KiB per
    block and layer): random bits when ``fill``, else zeros. Either way every page is touched
    up front, as an engine's pool is, so no timed copy pays for first-touch page faults."""
    words = cfg.block_kib * 256
    device = device or cfg.device
    layers = []
    for _ in range(cfg.layers):
        t = torch.empty((num_blocks, words), dtype=torch.int32, device=device)
        t.random_() if fill else t.zero_()
        layers.append(t.view(torch.float32))
    return PagedKV(tuple(layers), tokens_per_block=16)


def names() -> tuple[str, ...]:
    """What ``--transport`` may name: the bare copies, then every transport."""
    return COPIES + registry.names()


def default_transports(device: str) -> tuple[str, ...]:
    """The bare copies and every transport serving ``device`` pools, but NIXL on CUDA."""
    return COPIES + tuple(n for n in registry.names(device=device) if not (device == "cuda" and n == "nixl"))


class _RemoteReceiver:
    """A receiver in a child process, served by transport ``kind`` (`registry.serve`)."""

    def __init__(self, kind: str, cfg: CopyBenchConfig, num_blocks: int) -> None:
        ctx = mp.get_context("spawn")
        self.kind = kind
        self._conn, child = ctx.Pipe()
        self._authkey = secrets.token_bytes(32)
        self._proc = ctx.Process(
            target=_remote_receiver_main,
            args=(
                child,
                kind,
                self._authkey,
                cfg.layers,
                num_blocks,
                cfg.block_kib,
                cfg.listen,
                cfg.receiver_netns,
                cfg.ring_blocks() if kind == "staging" else None,
                cfg.receiver_device if registry.spec(kind).peer_gpu and cfg.receiver_device else cfg.device,
            ),
            daemon=True,
        )
        self._proc.start()
        reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        self.url: str = reply

    def transport(self, src: PagedKV, host_src: Optional[PagedKV] = None, **options: Any) -> Transport:
        """A transport to this receiver from ``src`` (and its host tier ``host_src``, which
        NIXL registers too); ``options`` as `registry.connect` takes them."""
        return registry.connect(self.url, authkey=self._authkey, src=src, host_src=host_src, **options)

    def expect(self, request_id: int, prompt_len: int) -> None:
        self._call("expect", request_id, prompt_len)

    def wait(self, request_id: int) -> None:
        self._call("wait", request_id, 0)

    def _call(self, op: str, request_id: int, prompt_len: int) -> None:
        self._conn.send((op, request_id, prompt_len))
        reply = self._conn.recv()
        if reply != "ok":
            raise RuntimeError(f"receiver process: {reply}")

    def close(self) -> None:
        self._conn.send(("stop", 0, 0))
        self._proc.join(timeout=30)


def _remote_receiver_main(
    conn: Any,
    kind: str,
    authkey: bytes,
    layers: int,
    num_blocks: int,
    block_kib: int,
    listen: str = "unix://",
    netns: Optional[str] = None,
    ring_blocks: Optional[int] = None,
    device: str = "cpu",
) -> None:
    try:
        enter_netns(netns)  # first: the endpoint's sockets and NIXL's threads then live there
        if device.startswith("cuda:"):
            torch.cuda.set_device(device)  # the receiver's copies and streams on its own GPU
        # make_pool's geometry, zeroed (in shared memory where the transport maps it).
        pool = registry.receiver_pool(
            kind,
            num_layers=layers,
            shape=(num_blocks, block_kib * 256),
            dtype=torch.float32,
            tokens_per_block=16,
            device=device,
        )
        receiver = KVReceiver(pool.pool)
        options = dict(pool.serve_options)
        if ring_blocks is not None:
            options["capacity_blocks"] = ring_blocks
        served = registry.serve(kind, receiver, authkey=authkey, address=listen, **options)
    except Exception as err:  # reported to the parent, which raises it
        conn.send(err)
        return
    conn.send(served.url)
    while True:
        op, request_id, prompt_len = conn.recv()
        if op == "stop":
            break
        try:
            if op == "expect":
                receiver.expect(request_id, prompt_len)
            else:
                receiver.wait(request_id, timeout=120)
                receiver.release(request_id)
            conn.send("ok")
        except Exception as err:  # reported to the parent, which raises it
            conn.send(repr(err))
    served.close()
    receiver = None  # type: ignore[assignment]
    pool.close()


def _sender_rows(
    cfg: CopyBenchConfig,
    name: str,
    src: PagedKV,
    tx: Transport,
    expect: Callable[[int, int], object],
    wait: Callable[[int], None],
    pool_blocks: int,
    ceiling: float,
) -> list[Row]:
    """End to end through a KVSender: plan, copy, notice, receiver complete."""
    sender = KVSender(src, tx, checksum=cfg.checksum)
    rng = np.random.default_rng(cfg.seed)
    ids = itertools.count(1)
    rows = []
    try:
        for n in cfg.blocks:
            tpb = src.tokens_per_block
            state: dict[str, Any] = {}

            def setup() -> None:
                rid = next(ids)
                state["rid"] = rid
                if cfg.contiguous:
                    a, b = rng.integers(0, pool_blocks - n + 1, size=2)
                    state["tables"] = (np.arange(a, a + n)[None, :], np.arange(b, b + n)[None, :])
                else:
                    src_row, dst_row = rng.permutation(pool_blocks)[:n], rng.permutation(pool_blocks)[:n]
                    state["tables"] = (src_row[None, :], dst_row[None, :])
                sender.add(rid, n * tpb)
                expect(rid, n * tpb)

            def run() -> None:
                rid, (s, d) = state["rid"], state["tables"]
                sender.send_chunks([rid], [0], [n * tpb], s, d)
                sender.flush()
                wait(rid)
                sender.remove(rid)

            seconds = _median_seconds(run, cfg.reps, cfg.device, setup)
            payload = n * src.block_bytes * src.num_layers
            rows.append(Row(name, n, payload, seconds, payload / seconds / 1e9, payload / seconds / 1e9 / ceiling))
    finally:
        sender.close()
    return rows


def run_copy_bench(cfg: CopyBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    unknown = set(cfg.transports) - set(names())
    if unknown:
        raise ValueError(f"invalid transport={sorted(unknown)}: choose from {', '.join(names())}")
    pool_blocks = max(cfg.blocks) + 64
    block_bytes = cfg.block_kib * 1024
    progress(
        f"ceiling: one contiguous copy of {pool_blocks * block_bytes * cfg.layers / 2**30:.1f} GiB on {cfg.device}"
    )
    ceiling = ceiling_gbps(cfg.device, pool_blocks * block_bytes * cfg.layers, cfg.reps)
    host_link = duplex = None
    if cfg.device == "cuda" and any(t in HOST_LINK for t in cfg.transports):
        progress("ceiling of the host link: one pinned host-to-device copy of 1 GiB")
        host_link = pinned_link_gbps(1 << 30, cfg.reps)
        down = "cuda"  # where the receiver's leg lands: its link carries the other direction
        if cfg.receiver_device:
            down = cfg.receiver_device
            progress(f"ceiling of {down}'s host link: one pinned host-to-device copy of 1 GiB")
            host_link = min(host_link, pinned_link_gbps(1 << 30, cfg.reps, down))
        progress(f"the host link both ways: 1 GiB cuda-to-host and 1 GiB host-to-{down} at once")
        duplex = duplex_link_gbps(1 << 30, cfg.reps, down)
    tcp_link = None
    host = cfg.tcp_host()
    if host is not None:
        progress(
            f"ceiling of the link: a raw TCP stream of 256 MiB to {host}"
            + (f" (namespace {cfg.receiver_netns})" if cfg.receiver_netns else "")
        )
        tcp_link = tcp_stream_gbps(host, 256 << 20, netns=cfg.receiver_netns, reps=cfg.reps)
    src = make_pool(cfg, pool_blocks, fill=True)
    rows: list[Row] = []
    rng = np.random.default_rng(cfg.seed)
    for name in cfg.transports:
        progress(f"{name}: {', '.join(map(str, cfg.blocks))} blocks")
        if name in COPIES:
            dst = make_pool(cfg, pool_blocks, fill=False)
            fn = copy_blocks_torch if name == "torch" else copy_blocks
            for n in cfg.blocks:
                s, d = rng.permutation(pool_blocks)[:n], rng.permutation(pool_blocks)[:n]
                seconds = _median_seconds(lambda: fn(src, dst, s, d), cfg.reps, cfg.device)
                payload = n * block_bytes * cfg.layers
                rows.append(Row(name, n, payload, seconds, payload / seconds / 1e9, payload / seconds / 1e9 / ceiling))
            del dst
        elif cfg.device not in registry.spec(name).devices:
            progress(f"{name}: not for {cfg.device} pools, skipped")
        elif not registry.spec(name).has_endpoint:  # the receiver in this process
            receiver = KVReceiver(make_pool(cfg, pool_blocks, fill=False))

            def arrived(request_id: int) -> None:
                receiver.wait(request_id, timeout=120)
                receiver.release(request_id)

            rows += _sender_rows(
                cfg,
                name,
                src,
                registry.connect(name, receiver=receiver),
                receiver.expect,
                arrived,
                pool_blocks,
                ceiling,
            )
        else:  # a receiver in another process
            remote = _RemoteReceiver(name, cfg, pool_blocks)
            try:
                limit = tcp_link or (host_link if name in HOST_LINK and host_link else ceiling)
                options: dict[str, Any] = {}
                if name == "staging" and cfg.write_bytes is not None:
                    options["write_bytes"] = cfg.write_bytes
                tx = remote.transport(src, **options)
                rows += _sender_rows(cfg, name, src, tx, remote.expect, remote.wait, pool_blocks, limit)
            finally:
                remote.close()
    return {
        "config": asdict(cfg),
        "machine": machine(cfg.device),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "ceiling_gbps": ceiling,
        "host_link_gbps": host_link,
        "duplex_link_gbps": duplex,
        "tcp_link_gbps": tcp_link,
        "rows": [asdict(r) for r in rows],
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        (
            f"{result['machine']}, {result['date']}: ceiling {result['ceiling_gbps']:.1f} GB/s (one contiguous "
            "copy, bytes copied per second)"
        ),
        f"{'transport':<12} {'blocks':>7} {'payload':>10} {'median':>10} {'GB/s':>8} {'of ceiling':>10}",
    ]
    if result.get("tcp_link_gbps"):
        lines.insert(
            1,
            (
                f"link: one raw TCP stream to the receiver {result['tcp_link_gbps']:.3f} GB/s (the ceiling of "
                "every transport to another process here)"
            ),
        )
    if result.get("host_link_gbps"):
        lines.insert(
            1,
            (
                f"host link: pinned host-to-device copy {result['host_link_gbps']:.1f} GB/s (the ceiling of: "
                f"{', '.join(HOST_LINK)})"
            ),
        )
    duplex = result.get("duplex_link_gbps")
    if duplex:
        lines.insert(
            2,
            (
                f"host link both ways at once: {duplex:.1f} GB/s each way (device-to-host and host-to-device on two "
                "streams: the ceiling of the staging legs when both cross one GPU's link)"
            ),
        )
    for r in result["rows"]:
        line = (
            f"{r['transport']:<12} {r['blocks']:>7} {r['payload_bytes'] / 2**20:>8.1f} MiB "
            f"{r['seconds'] * 1e3:>7.2f} ms "
            f"{r['gbps']:>8.2f} {100 * r['share_of_ceiling']:>9.0f}%"
        )
        if duplex and r["transport"] in HOST_LINK:
            line += f"  ({100 * r['gbps'] / duplex:.0f}% of both ways)"
        config = result.get("config", {})  # (a result written before these two were recorded has none)
        ring, receiver = config.get("ring_bytes"), config.get("receiver_device")
        if ring and r["transport"] == "staging":
            line += f"  (ring {ring / 2**20:.0f} MiB)"
        if receiver and r["transport"] == "staging":
            line += f"  (receiver on {receiver})"
        lines.append(line)
    return "\n".join(lines)


progress_to_stderr = stderr_progress("bench copy")
