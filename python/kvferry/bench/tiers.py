"""`kvferry bench tiers`: the early send of a reused prefix split across the device pool and
the host tier, sent two ways in the same run.

```
direct:            send issued |== link: device blocks + host blocks (from host memory) ==| ready
onboard-then-send: send issued |== host -> device ==|== link: every block, device pool ==| ready
```
* **direct**: `KVSender(..., host_pool=...)` reads device-resident blocks from the device
  pool and host-resident ones straight from the host pool (pinned, read in place on CUDA).
* **onboard-then-send**: the host blocks are first copied into free device blocks (the
  engine's onboarding; on CUDA the same copy kernel reading the pinned pool, on a side
  stream), and the send, queued at once, is ordered after that copy with
  `KVSender.order_after` (the best case for this path: no host round trip before the send).

KV-ready: from the send being issued to every block of the request resident at the receiver
(the prefix plus one last block, sent right after as the prefill's final chunk, the same in
both modes). On CPU the link is emulated (`ThreadCopyEngine(link_gbps)`, in-process and shm)
and so is the host-to-device leg of the onboarding (``host_gbps``); both default to one rate,
as on a GPU node whose PCIe link and NIC move about the same bytes per second.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvferry.bench.copy import CopyBenchConfig, _RemoteReceiver, make_pool
from kvferry.bench.util import emulated_link, machine, stderr_progress
from kvferry.copy import copy_blocks
from kvferry.engine import CopyEngine, ThreadCopyEngine
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.tiers import Signal, tiered_source
from kvferry.transports import registry
from kvferry.transports.base import Transport

__all__ = ["MODES", "TiersConfig", "format_tiers", "run_tiers"]

MODES = ("direct", "onboard_then_send")


@dataclass(frozen=True)
class TiersConfig:
    device: str = "cpu"
    blocks: int = 512  # blocks of the reused prefix
    host_fraction: float = 0.5  # of them, resident in the host tier
    layers: int = 8
    block_kib: int = 32  # per block and layer
    transport: str = "in-process"
    # CPU: the emulated link (in-process, shm) and host-to-device leg (None: raw copies).
    link_gbps: Optional[float] = 0.5
    host_gbps: Optional[float] = 0.5
    reps: int = 5
    seed: int = 0

    @property
    def host_blocks(self) -> int:
        return round(self.blocks * self.host_fraction)

    @property
    def tokens_per_block(self) -> int:
        return 16  # make_pool's


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _Onboarder:
    """The engine's onboarding of host blocks into device blocks: returns the signal the
    send is ordered after. CPU: a thread copying at ``host_gbps`` (None: raw); CUDA: the copy kernel
    reading the pinned host pool in place, on a side stream, then an event."""

    def __init__(self, device_pool: PagedKV, host_pool: PagedKV, host_gbps: Optional[float]) -> None:
        self.host_gbps = host_gbps
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._view = tiered_source(device_pool, host_pool).host_view
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-bench-onboard")
        self._stream = torch.cuda.Stream(device_pool.device) if device_pool.device.type == "cuda" else None

    def start(self, host_ids: np.ndarray, device_ids: np.ndarray) -> Signal:
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
            with torch.cuda.stream(self._stream):
                copy_blocks(self._view, self.device_pool, host_ids, device_ids)
                return self._stream.record_event()
        nbytes = len(host_ids) * self.host_pool.block_bytes * self.host_pool.num_layers
        rate = self.host_gbps

        def onboard() -> None:
            start = time.monotonic()
            copy_blocks(self.host_pool, self.device_pool, host_ids, device_ids)
            if rate:
                time.sleep(max(0.0, start + nbytes / (rate * 1e9) - time.monotonic()))

        return self._thread.submit(onboard)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def _digest(blocks: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for b in blocks:
        h.update(b.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_tiers(cfg: TiersConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    spec = registry.check(cfg.transport, device=cfg.device)
    if not 0 <= cfg.host_fraction <= 1:
        raise ValueError(f"invalid host_fraction={cfg.host_fraction}: must be in [0, 1]")
    n, h = cfg.blocks, cfg.host_blocks
    tpb = cfg.tokens_per_block
    pool_cfg = CopyBenchConfig(device=cfg.device, layers=cfg.layers, block_kib=cfg.block_kib)
    # Device pool: the prefix's device-resident blocks, the last block, and h free blocks the
    # onboarding fills; host pool: the h host-resident blocks. Random physical placement.
    device_pool = make_pool(pool_cfg, n + 1 + h, fill=True)
    host_pool = make_pool(pool_cfg, max(h, 1), fill=True, device="cpu")
    if cfg.device == "cuda":
        host_pool = PagedKV(tuple(t.pin_memory() for t in host_pool.layers), host_pool.tokens_per_block)
    block_bytes = device_pool.block_bytes * device_pool.num_layers
    emulated = emulated_link(cfg.device, cfg.transport)
    engine: Optional[CopyEngine] = ThreadCopyEngine(cfg.link_gbps) if emulated and cfg.link_gbps else None
    receiver: Optional[KVReceiver] = None
    remote: Optional[_RemoteReceiver] = None
    if not spec.has_endpoint:
        receiver = KVReceiver(make_pool(pool_cfg, n + 1, fill=False))
        transport: Transport = registry.connect(cfg.transport, receiver=receiver)
    else:
        remote = _RemoteReceiver(cfg.transport, pool_cfg, n + 1)
        transport = remote.transport(device_pool, host_src=host_pool)  # NIXL registers both
    # The progress thread posts each write's notices as it lands (the staging receiver
    # applies a write only then), so KV-ready is the receiver's own moment of completion.
    sender = KVSender(device_pool, transport, engine=engine, host_pool=host_pool, progress=True)
    # Emulated legs on CPU go together: the onboarding too only where the link is emulated.
    onboarder = _Onboarder(device_pool, host_pool, cfg.host_gbps if emulated else None)
    rng = np.random.default_rng(cfg.seed)
    ids = itertools.count(1)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    checked: dict[str, Optional[bool]] = {mode: None for mode in MODES}
    progress(
        f"{n}-block prefix ({n * block_bytes / 2**20:.0f} MiB), {h} blocks in the host tier, over {cfg.transport}"
        + (
            f" (link emulated at {cfg.link_gbps} GB/s, host->device at {cfg.host_gbps or 'raw'} GB/s)"
            if emulated
            else ""
        )
    )
    try:
        for rep in range(cfg.reps + 1):  # rep 0 warms allocators, kernels and connections
            for mode in MODES if rep % 2 else MODES[::-1]:  # alternate which goes first
                rid = next(ids)
                on_host = np.zeros(n, dtype=bool)
                on_host[rng.permutation(n)[:h]] = True
                device_blocks = rng.permutation(n + 1 + h)
                resident = device_blocks[: n + 1]  # the prefix's device blocks and the last block
                spare = device_blocks[n + 1 :]  # free blocks the onboarding fills
                host_ids = rng.permutation(max(h, 1))[:h]
                src = resident.copy()
                src[:n][on_host] = n + 1 + h + host_ids  # combined ids: the host tier's blocks
                dst = rng.permutation(n + 1)
                if receiver is not None:
                    receiver.expect(rid, n * tpb + 1)
                else:
                    assert remote is not None
                    remote.expect(rid, n * tpb + 1)
                sender.add(rid, n * tpb + 1, reused_len=n * tpb)
                _sync(cfg.device)
                start = time.perf_counter()
                if mode == "onboard_then_send" and h:
                    signal = onboarder.start(host_ids, spare)
                    src[:n][on_host] = spare
                    sender.order_after(spare, signal)
                sender.send_early([rid], src[None, :], dst[None, :])
                sender.send_chunks([rid], [n * tpb], [n * tpb + 1], src[None, :], dst[None, :])
                if receiver is not None:
                    receiver.wait(rid, timeout=600)
                else:
                    assert remote is not None
                    remote.wait(rid)
                seconds = time.perf_counter() - start
                sender.flush()
                if receiver is not None and checked[mode] is None:  # once per mode: bit exact
                    expected = [
                        block_of(device_pool, host_pool, n + 1 + h, int(b), layer)
                        for layer in range(cfg.layers)
                        for b in src
                    ]
                    got = [receiver.pool.layers[layer][int(d)] for layer in range(cfg.layers) for d in dst]
                    checked[mode] = _digest(expected) == _digest(got)
                if receiver is not None:
                    receiver.release(rid)
                sender.remove(rid)
                if rep:
                    times[mode].append(seconds * 1e3)
            progress(
                f"rep {rep}/{cfg.reps}"
                + (
                    " (warm-up)"
                    if not rep
                    else (
                        f": direct {times['direct'][-1]:.1f} ms, onboard-then-send "
                        f"{times['onboard_then_send'][-1]:.1f} ms"
                    )
                )
            )
    finally:
        sender.close()
        onboarder.close()
        if remote is not None:
            remote.close()
    link = (n + 1) * block_bytes
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "machine": machine(cfg.device),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host_blocks": h,
        "block_bytes": block_bytes,
        "emulated": emulated,
    }
    for mode in MODES:
        result[mode] = {
            "kv_ready_ms": times[mode],
            "kv_ready_ms_median": statistics.median(times[mode]),
            "link_bytes": link,
            "link_bytes_from_host": h * block_bytes if mode == "direct" else 0,
            "host_to_device_bytes": h * block_bytes if mode == "onboard_then_send" else 0,
            "kv_bit_exact": checked[mode],
        }
    result["ratio"] = result["onboard_then_send"]["kv_ready_ms_median"] / result["direct"]["kv_ready_ms_median"]
    return result


def block_of(device_pool: PagedKV, host_pool: PagedKV, first_host: int, combined: int, layer: int) -> torch.Tensor:
    """One layer of block ``combined`` (host ids from ``first_host``: the sender's pool size)."""
    if combined < first_host:
        return device_pool.layers[layer][combined]
    return host_pool.layers[layer][combined - first_host]


def format_tiers(result: dict[str, Any]) -> str:
    cfg = result["config"]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    lines = [
        f"{result['machine']}, {result['date']}: {cfg['blocks']}-block reused prefix "
        f"({mib(cfg['blocks'] * result['block_bytes'])}), "
        f"{result['host_blocks']} blocks ({100 * cfg['host_fraction']:.0f}%) in the host tier, {cfg['layers']} "
        f"layers x {cfg['block_kib']} KiB, "
        f"transport {cfg['transport']}"
        + (
            f", link emulated at {cfg['link_gbps']} GB/s, host->device at {cfg['host_gbps'] or 'raw'} GB/s"
            if result["emulated"]
            else ""
        ),
        (
            f"{'mode':<18} {'KV-ready median':>16} {'reps (ms)':<40} {'link':>11} {'of it from host':>16} "
            f"{'host->device':>13} {'bit exact':>9}"
        ),
    ]
    for mode in MODES:
        m = result[mode]
        reps = ", ".join(f"{t:.1f}" for t in m["kv_ready_ms"])
        exact = "-" if m["kv_bit_exact"] is None else str(m["kv_bit_exact"])
        lines.append(
            f"{mode.replace('_', '-'):<18} {m['kv_ready_ms_median']:>13.1f} ms {reps:<40} {mib(m['link_bytes']):>11} "
            f"{mib(m['link_bytes_from_host']):>16} {mib(m['host_to_device_bytes']):>13} {exact:>9}"
        )
    lines.append(f"onboard-then-send / direct: {result['ratio']:.2f}x KV-ready time")
    return "\n".join(lines)


progress_to_stderr = stderr_progress("bench tiers")
