"""``kvferry bench vllm``: the agentic workload served by real vLLM servers (prefill and decode
servers behind ``kvferry proxy``), in every KV-connector configuration, in one run.

Configurations (:func:`configurations`): vLLM's NixlConnector (pull: the decode server READs)
and NixlPushConnector (push: the prefill server WRITEs); KvferryConnector with early send off
(its baseline: every block leaves after the forward that computed it); early send; early send
with decode-side awareness; early send with awareness and layer groups. Decode-side awareness
is the decode server's prefix cache: with it, blocks the decode server holds never cross;
without it (``--no-enable-prefix-caching`` on the decode server) every block crosses. Both NIXL
connectors run with it (they too skip what the decode server holds).

Two cases, each with its own figures (/work/shared/notes/vllm-on-cpu.md, "fair side-by-side"):
- ``decode-warm``: a session's next turn lands on the decode server that served the last one
  and still caches the conversation;
- ``decode-cold``: the decode server does not hold the conversation (its prefix cache is reset
  before each measured turn, and a reset that does not happen fails the turn) while the prefill
  server does: the old prefix must cross, which is where early send pays.

Interleaving: every configuration's servers are up together, and the configurations take
turns, one turn each in a slot (a case, turn and session), in an order that reverses from slot
to slot (`vllm_figures.order`); the servers whose turn it is not are paused (SIGSTOP: an idle
NIXL engine's progress thread spins). Configurations whose servers would be configured alike
share them (the prefill server of early send and of early send + awareness; the decode server
of the baseline and early send; the decode server of awareness and layer groups), so each
configuration has its own conversations, of the same lengths: a slot's prefill is the same
computation in every configuration.

The link (placement across two hosts): sized from the run itself unless fixed by hand. The
plain reference server first computes every conversation (whose answers are the reference
outputs); its prefill of a measured turn (new tokens after a prefix-cache hit) is timed, and the
veth is shaped so that the reused prefix of the middle measured turn crosses in about that time
(kvferry.bench.link); then one raw TCP stream measures the link's rate. On one host the link is
a memory copy, timed in this process.

Per turn: client TTFT (streaming, through the proxy); KV-ready (from the proxy's arrival until
the decode server holds the whole KV: the proxy's ``decode-start`` plus the decode server's
queue time, which vLLM ends once an async KV load has finished); the prefill server's queue and
prefill time and the decode server's first step (vLLM's per-request histograms); the bytes the
connector moved; and the ideal bound with the losses against it (kvferry.bench.vllm_figures).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kvferry.bench import vllm_figures as vf
from kvferry.bench.util import stderr_progress
from kvferry.bench.vllm_figures import BLOCK_TOKENS, CASES, annotate, summaries, targets
from kvferry.bench.vllm_report import draw_timeline, format_vllm_bench, write_json  # noqa: F401 (re-exported)
from kvferry.errors import InvalidArgumentError
from kvferry.geometry import VLLM_BENCH_MODEL, Geometry


@dataclass(frozen=True)
class Configuration:
    name: str
    connector: str  # the proxy's flow: nixl (both NIXL connectors) or kvferry
    extra: dict[str, Any] = field(default_factory=dict)  # KvferryConnector's kv_connector_extra_config
    note: str = ""
    aware: bool = True  # decode-side awareness: the decode server keeps a prefix cache
    nixl_connector: str = "NixlConnector"  # the NIXL connector's class name (connector "nixl")

    @property
    def early(self) -> bool:
        """Whether bytes leave during the prefill's forward (then the prefill shares its core)."""
        return self.connector == "kvferry" and bool(self.extra.get("early", True))

    def prefill_key(self) -> tuple[Any, ...]:
        """Configurations with equal keys share one prefill server."""
        return ("prefill", self.connector, self.nixl_connector, tuple(sorted(self.extra.items())))

    def decode_key(self) -> tuple[Any, ...]:
        return ("decode", self.connector, self.nixl_connector, self.aware)

    def server_configs(self, cross_host: Optional[str] = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The prefill and decode servers' kv-transfer-configs; ``cross_host``: the decode
        server's address on another host (KvferryConnector then listens there on tcp:// and
        moves the bytes over NIXL)."""
        from kvferry.vllm.testbed import kvferry_config, nixl_config, url_host

        if self.connector == "nixl":
            return (
                nixl_config("kv_producer", connector=self.nixl_connector),
                nixl_config("kv_consumer", connector=self.nixl_connector),
            )
        if cross_host is None:
            return kvferry_config("kv_producer", **self.extra), kvferry_config("kv_consumer")
        return kvferry_config("kv_producer", transport="nixl", **self.extra), kvferry_config(
            "kv_consumer", transport="nixl", listen=f"tcp://{url_host(cross_host)}:0"
        )


def configurations(layer_groups: int) -> list[Configuration]:
    return [
        Configuration("nixl", "nixl", note="vLLM's NixlConnector: the decode server READs after the prefill (pull)"),
        Configuration(
            "nixl-push",
            "nixl",
            note="vLLM's NixlPushConnector: the prefill server WRITEs after the prefill (push)",
            nixl_connector="NixlPushConnector",
        ),
        Configuration(
            "kvferry-baseline", "kvferry", {"early": False}, "early send off, no decode-side awareness", aware=False
        ),
        Configuration("kvferry-early", "kvferry", {"early": True}, "early send, no decode-side awareness", aware=False),
        Configuration("kvferry-aware", "kvferry", {"early": True}, "early send + decode-side awareness"),
        Configuration(
            "kvferry-layers",
            "kvferry",
            {"early": True, "layer_groups": layer_groups},
            f"early send + awareness + {layer_groups} layer groups",
        ),
    ]


CONFIGS = tuple(c.name for c in configurations(4))


@dataclass(frozen=True)
class VllmBenchConfig:
    sessions: int = 3
    turns: int = 4  # measured turns per session: sessions x turns per configuration and case
    cached_tokens: int = 2048
    new_tokens: int = 128
    output_tokens: int = 8
    model: Geometry = VLLM_BENCH_MODEL
    layer_groups: int = 4
    max_num_batched_tokens: int = 512
    kv_cache_memory_bytes: Optional[int] = None  # per server; None: what the run's conversations need
    configs: tuple[str, ...] = CONFIGS
    workdir: Optional[str] = None
    decode_netns: Optional[str] = None  # the decode server's network namespace (another host)
    decode_host: str = "127.0.0.1"  # its address there
    prefill_host: str = "127.0.0.1"  # the prefill server's address (this process's namespace)
    # Two hosts: the veth's tbf rate in Mbit/s; None: sized from the run's own prefill.
    link_mbit: Optional[float] = None
    scrape: Optional[str] = None  # append the servers' /metrics, read around each turn, here (bench/dashboard.py)
    bootstrap_reps: int = 2000
    # Where a prefill server's transfer threads run (kvferry's and every NIXL agent's alike):
    # "with-engine", on the prefill's own core; "apart", off the core its forward computes on
    # (as a GPU's copy engines move bytes beside its forward): a third core, or on one host
    # with two cores the decode servers' (`transfer_core`).
    transfer_threads: str = "with-engine"
    # Two hosts: each namespace's veth receives on its own host's core (prefill servers' core
    # for the first, decode servers' for the second; `link.steer_receive`); False: on the
    # sending core, as a veth does by itself (every run before 2026-12-05).
    receive_steering: bool = True
    # What sends each request's two legs: "kvferry-proxy" (each connector's own flow), or
    # "vllm-router" (--kv-connector nixl: both connectors in NixlConnector's protocol). Under
    # vllm-router no Server-Timing says when the decode leg left: a turn's KV-ready counts
    # from the prefill's end for NIXL (the router waits for its answer) and from the arrival
    # for kvferry (push: the router sends both legs at once), plus the decode server's queue.
    router: str = "kvferry-proxy"


TRANSFER_THREADS = ("with-engine", "apart")
ROUTERS = ("kvferry-proxy", "vllm-router")


def transfer_core(cfg: VllmBenchConfig, cores: Sequence[int]) -> Optional[int]:
    """The core a prefill server's transfer threads run on with ``--transfer-threads apart``
    (None: with the engine). Across two hosts on a two-core box there is none: the decode
    servers' core would hold NIXL's progress threads of both sides, which poll without pause,
    and the decode servers' transfers stalled there (100 % system time, requests timed out;
    measured 2026-12-05), so that is refused by name."""
    if cfg.transfer_threads not in TRANSFER_THREADS:
        raise InvalidArgumentError(
            f"invalid transfer_threads={cfg.transfer_threads!r}: choose from {', '.join(TRANSFER_THREADS)}"
        )
    if cfg.transfer_threads == "with-engine" or len(cores) < 2:
        return None
    if len(cores) >= 3:
        return cores[2]
    if cfg.decode_netns is not None:
        raise InvalidArgumentError(
            f"invalid transfer_threads={cfg.transfer_threads!r} across two hosts on {len(cores)} cores: it needs a "
            "third core (on the decode servers' core, the two sides' NIXL progress threads stall its transfers)"
        )
    return cores[1]


@dataclass(frozen=True)
class Placement:
    """Where the run's servers compute: all prefill servers on one core and all decode
    servers on another where the box has two (only one configuration runs at a time, the
    others are paused), and where a prefill server's transfer threads run (None: with it)."""

    prefill: list[int]
    decode: list[int]
    transfer: Optional[int]

    @property
    def apart(self) -> bool:
        """Whether prefill and decode servers have cores of their own."""
        return self.prefill != self.decode

    def describe(self) -> str:
        if not self.apart:
            return f"every server on core {self.prefill[0]}"
        where = (
            "their transfer threads with them"
            if self.transfer is None
            else f"their transfer threads (kvferry's and NIXL's alike) on core {self.transfer}"
        )
        return f"prefill servers compute on core {self.prefill[0]}, {where}; decode servers on core {self.decode[0]}"


def placement(cfg: VllmBenchConfig) -> Placement:
    """The run's `Placement` on the cores this process may use (`transfer_core` refuses a
    ``transfer_threads`` the box cannot give, by name)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return Placement(cores, cores, None)
    return Placement(cores[:1], cores[1:2], transfer_core(cfg, cores))


def _steer_receive(cfg: VllmBenchConfig, where: Placement) -> Optional[dict[str, int]]:
    """Across two hosts, each namespace's veth receives on its own servers' core
    (``receive_steering``, with two cores or more); returns device -> core, or None where
    the kernel's default stays."""
    from kvferry.bench import link

    if cfg.decode_netns is None or not cfg.receive_steering or not where.apart:
        return None
    devices = {None: link.veth_of(None), cfg.decode_netns: link.veth_of(cfg.decode_netns)}
    placed = {}
    for (netns, dev), core in zip(devices.items(), (where.prefill[0], where.decode[0])):
        link.steer_receive(netns, dev, core)
        placed[dev] = core
    return placed


def longest_tokens(cfg: VllmBenchConfig) -> int:
    """A conversation's longest request: the cached prompt, every measured turn's new and
    output tokens, and the last turn's output."""
    return cfg.cached_tokens + cfg.turns * (cfg.new_tokens + cfg.output_tokens) + cfg.output_tokens


def pool_bytes(cfg: VllmBenchConfig, sharing: int, kv_bytes_per_token: int) -> int:
    """A server's KV pool: `VllmBenchConfig.kv_cache_memory_bytes` where the run sets one; else
    every conversation of the configurations sharing it at its longest (the prefix caches must
    keep them all between their turns), half again, and 16 MiB."""
    if cfg.kv_cache_memory_bytes:
        return cfg.kv_cache_memory_bytes
    blocks = sharing * cfg.sessions * (-(-longest_tokens(cfg) // BLOCK_TOKENS) + 2)
    return int(1.5 * blocks * BLOCK_TOKENS * kv_bytes_per_token) + (16 << 20)


# A vLLM 0.32 CPU server's own memory beside its KV pool (API server and engine core): one
# plain server's anonymous RSS after a request was 1.15 GiB with the default 8-layer model and
# 1.4 GiB with --realistic's 32 layers; the nine servers of a --realistic run (NIXL's among
# them) held 1.5 GiB each beside their pools at their peak (2-core AMD EPYC, 2026-12-05).
SERVER_OVERHEAD_BYTES = int(1.5 * 2**30)


def server_plan(
    cfg: VllmBenchConfig, confs: Sequence[Configuration], prefill_transfer_cores: Sequence[int] = ()
) -> dict[tuple[Any, ...], tuple[str, dict[str, Any], list[str]]]:
    """The servers a run starts: key -> (side, kv-transfer-config, the configurations it
    serves), configurations with equal keys sharing a server."""
    cross = cfg.decode_netns is not None
    plan: dict[tuple[Any, ...], tuple[str, dict[str, Any], list[str]]] = {}
    for conf in confs:
        prefill_config, decode_config = conf.server_configs(cfg.decode_host if cross else None)
        if conf.connector == "kvferry" and prefill_transfer_cores:  # its writes start there too (handoff)
            extra = dict(
                prefill_config.get("kv_connector_extra_config", {}), transfer_cores=list(prefill_transfer_cores)
            )
            prefill_config = dict(prefill_config, kv_connector_extra_config=extra)
        for key, kv_config in ((conf.prefill_key(), prefill_config), (conf.decode_key(), decode_config)):
            plan.setdefault(key, (key[0], kv_config, []))[2].append(conf.name)
    return plan


def fleet_bytes(cfg: VllmBenchConfig, confs: Sequence[Configuration], kv_bytes_per_token: int) -> int:
    """About the memory a run's servers hold at once: every KV pool and each server's own."""
    plan = server_plan(cfg, confs)
    return sum(pool_bytes(cfg, len(users), kv_bytes_per_token) + SERVER_OVERHEAD_BYTES for _, _, users in plan.values())


def check_memory(cfg: VllmBenchConfig, confs: Sequence[Configuration], kv_bytes_per_token: int, have: int) -> None:
    """Refuses, before minutes of setup, a run whose servers need more memory than ``have``
    (the host's): past it the kernel's OOM killer ends an engine mid-start."""
    need = fleet_bytes(cfg, confs, kv_bytes_per_token)
    if need > have:
        servers = len(server_plan(cfg, confs))
        raise InvalidArgumentError(
            f"invalid bench vllm size: its {servers} servers need about {need / 2**30:.1f} GiB (KV pools for "
            f"--sessions {cfg.sessions} x {longest_tokens(cfg)} "
            f"tokens at {kv_bytes_per_token} bytes a token, and {SERVER_OVERHEAD_BYTES / 2**30:.1f} GiB of vLLM's own "
            f"each), more than this host's {have / 2**30:.1f} GiB: lower --sessions, --cached or --turns, or run "
            "fewer --configs"
        )


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _metrics(conf: Configuration) -> dict[str, tuple[str, str]]:
    """The connector's counters: metric -> (server, name). NIXL counts its bytes where the
    transfer is posted: the decode server READs (pull), the prefill server WRITEs (push)."""
    if conf.connector == "nixl":
        side = "prefill" if conf.nixl_connector == "NixlPushConnector" else "decode"
        return {"bytes": (side, "vllm:nixl_bytes_transferred_sum")}
    return METRICS[conf.connector]


# KvferryConnector: metric -> (server, name), read around each turn.
METRICS = {
    "kvferry": {
        "early_bytes": ("prefill", "vllm:kvferry_early_issued_bytes_total"),
        "chunk_bytes": ("prefill", "vllm:kvferry_chunk_bytes_total"),
        "layer_bytes": ("prefill", "vllm:kvferry_layer_bytes_total"),
        "held_blocks": ("prefill", "vllm:kvferry_held_blocks_total"),
        "duplicates": ("decode", "vllm:kvferry_duplicates_refused_total"),
    },
}
# vLLM's per-request histograms (seconds), published when a request finishes.
HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds"}


def _wire_tx_bytes() -> int:
    """Bytes this network namespace sent on its interfaces other than loopback (/proc/net/dev):
    across two hosts, everything the prefill side sent over the veth (KV and HTTP)."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() != "lo":
                total += int(fields.split()[8])
    return total


@dataclass
class _Sample:
    """One server's /metrics at one moment: the request histograms' counts and sums."""

    text: str
    count: float
    sums: dict[str, float]

    @classmethod
    def of(cls, server: Any, timeout_s: float = 120.0) -> _Sample:
        """Reads the server's /metrics, asking again when an answer is late (on a machine
        loaded by other work an API server has been seen to take over 10 s), up to
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                text = server.metrics(timeout_s=30.0)
                break
            except (TimeoutError, urllib.error.URLError) as err:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{server.name}: /metrics did not answer within {timeout_s:.0f} s: {err}"
                    ) from err
        return cls(
            text,
            _metric_sum(text, HISTOGRAMS["prefill"] + "_count"),
            {k: _metric_sum(text, v + "_sum") for k, v in HISTOGRAMS.items()},
        )


def _finished(server: Any, before: _Sample, timeout_s: float = 120.0) -> tuple[_Sample, dict[str, float]]:
    """The server's sample once the request sent since ``before`` has finished (vLLM publishes
    its histograms then), and that request's queue and prefill ms. vLLM records a request as
    scheduled only once its KV has arrived (an async load keeps it waiting), so a decode
    server's queue time is its wait for the KV and its prefill time its first step."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = _Sample.of(server)
        if now.count >= before.count + 1:
            return now, {k: 1e3 * (now.sums[k] - before.sums[k]) for k in HISTOGRAMS}
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} published no finished request for the turn within {timeout_s:.0f} s")
        time.sleep(0.02)  # polling the metrics endpoint for a value to appear (no event to wait on)


def _reset_prefix_cache(decode: Any, timeout_s: float = 30.0) -> None:
    """Empties the decode server's prefix cache before a decode-cold turn. vLLM refuses
    (``{"success": false}``) while any block is still held, e.g. by the previous turn's request
    until its blocks are freed: then this waits (bounded) for the server to hold none and asks
    again. A reset that never happens fails the turn: a warm cache would make it decode-warm."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(decode.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read() or b"{}")
        if answer.get("success") is True:
            return
        if time.monotonic() > deadline:
            used, _ = decode.kv_blocks()
            raise RuntimeError(
                (
                    f"{decode.url}/reset_prefix_cache answered {answer} for {timeout_s:.0f} s ({used} KV blocks "
                    "still held): the decode-cold turn would run warm"
                )
            )
        time.sleep(0.05)  # polling the server until its last blocks are freed (no event to wait on)


@dataclass
class _Turn:
    session: int
    turn: int
    prompt: list[int]
    want: list[int] = field(default_factory=list)


def _body(prompt: list[int], output: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": output,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _scripts(cfg: VllmBenchConfig, plain: Any, seed: int, prefill_ms: list[float]) -> list[list[_Turn]]:
    """Each session's prompts, built from the plain server's answers (which are the reference);
    the plain server's prefill of each measured turn is appended to ``prefill_ms``."""
    from kvferry.vllm.testbed import call

    out = []
    for s in range(cfg.sessions):
        rng = random.Random(seed * 1000 + s)
        prompt = [rng.randrange(3, cfg.model.vocab) for _ in range(cfg.cached_tokens)]
        turns = []
        for t in range(cfg.turns + 1):
            before = _Sample.of(plain)
            a = call(plain.url, "/v1/completions", _body(prompt, cfg.output_tokens, stream=False))
            if a.status != 200:
                raise RuntimeError(f"plain server: HTTP {a.status}: {a.body}")
            _, took = _finished(plain, before)
            if t:
                prefill_ms.append(took["prefill"])
            turns.append(_Turn(s, t, prompt, a.token_ids))
            prompt = prompt + a.token_ids + [rng.randrange(3, cfg.model.vocab) for _ in range(cfg.new_tokens)]
        out.append(turns)
    return out


def _sizing_prefill(cfg: VllmBenchConfig, fleet: Fleet, conf: Configuration, sessions: int = 3) -> list[float]:
    """A measured turn's prefill as the run's servers compute it (ms), on ``conf``'s prefill
    server: ``sessions`` throwaway conversations of the run's lengths, each a first turn and one
    more. Not the plain server's: there the prefill had its core alone, while a connector's own
    threads (NIXL's progress thread) share the prefill server's core in the run (measured: 43
    against about 300 ms on a loaded machine)."""
    from kvferry.vllm.testbed import call

    fleet.run_only(conf)
    prefill = fleet.prefill(conf)
    out = []
    for s in range(sessions):
        rng = random.Random(-1 - s)  # conversations of their own: no script's prefix is cached
        prompt = [rng.randrange(3, cfg.model.vocab) for _ in range(cfg.cached_tokens)]
        for turn in range(2):
            before = _Sample.of(prefill)
            a = call(fleet.proxies[conf.name].url, "/v1/completions", _body(prompt, cfg.output_tokens, stream=False))
            if a.status != 200:
                raise RuntimeError(f"{conf.name}: sizing turn: HTTP {a.status}: {a.body}")
            _, took = _finished(prefill, before)
            if turn:
                out.append(took["prefill"])
            prompt = prompt + a.token_ids + [rng.randrange(3, cfg.model.vocab) for _ in range(cfg.new_tokens)]
    return out


def _memcpy_bytes_per_s(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """One host's link: a memory copy of ``nbytes`` (the staging ring's two copies run on the
    two servers' cores, one after the other per slot), median of ``reps``."""
    import numpy as np

    src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def _link(
    cfg: VllmBenchConfig, sizing_prefix: int, prefill_ms: float, progress: Callable[[str], None]
) -> dict[str, Any]:
    """The link the run measures against: across two hosts, the veth shaped (to ``link_mbit``,
    or so that ``sizing_prefix`` bytes cross in ``prefill_ms``) and measured with a raw TCP
    stream; on one host, a memory copy."""
    if cfg.decode_netns is None:
        rate = _memcpy_bytes_per_s()
        progress(f"link: one host, a memory copy runs at {rate / 1e9:.2f} GB/s")
        return {"how": "one host: a memory copy in this process", "bytes_per_s": rate}
    from kvferry.bench import link
    from kvferry.bench.util import tcp_stream_gbps

    devices = {None: link.veth_of(None), cfg.decode_netns: link.veth_of(cfg.decode_netns)}
    sized = cfg.link_mbit is None
    want = sizing_prefix / (prefill_ms / 1e3)
    mbit = link.mbit_for(sizing_prefix, prefill_ms / 1e3) if sized else float(cfg.link_mbit)  # type: ignore[arg-type]
    measure_bytes = max(16 << 20, min(256 << 20, sizing_prefix * 4))
    steps = []
    for attempt in range(3):
        for netns, dev in devices.items():
            link.shape(netns, dev, mbit)
        got = 1e9 * tcp_stream_gbps(cfg.decode_host, measure_bytes, netns=cfg.decode_netns)
        steps.append({"mbit": mbit, "tcp_bytes_per_s": got})
        progress(f"link: veth shaped to {mbit:.0f} Mbit/s, one TCP stream {got / 1e6:.1f} MB/s")
        if not sized or abs(got / want - 1) < 0.1 or attempt == 2:
            break
        mbit = link.corrected_mbit(mbit, want, got)
    return {
        "how": (
            f"veth shaped with tc tbf so the middle measured turn's prefix ({sizing_prefix / 2**20:.1f} MiB) "
            f"crosses in a turn's prefill as the run's servers compute it ({prefill_ms:.0f} ms)"
            if sized
            else f"veth shaped with tc tbf to {mbit:g} Mbit/s (fixed by hand)"
        ),
        "sized": sized,
        "mbit": mbit,
        "bytes_per_s": steps[-1]["tcp_bytes_per_s"],
        "want_bytes_per_s": want if sized else None,
        "steps": steps,
    }


class Fleet:
    """Every configuration's servers, up together (configurations whose servers would be
    configured alike share them), one proxy per configuration, and the pausing of the servers
    whose turn it is not."""

    def __init__(
        self,
        cfg: VllmBenchConfig,
        confs: list[Configuration],
        model: Path,
        work: Path,
        engine: Any,
        kv_bytes_per_token: int,
        where: Placement,
    ) -> None:
        self.cfg, self.confs, self.model, self.work, self.engine = cfg, confs, model, work, engine
        self.kv_bytes_per_token, self.where = kv_bytes_per_token, where
        self.servers: dict[tuple[Any, ...], Any] = {}
        self.proxies: dict[str, Any] = {}
        self.pool_bytes: dict[str, int] = {}
        self.seen: dict[str, str] = {}  # server name -> its /metrics after its last turn

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        from kvferry.vllm import testbed
        from kvferry.vllm.proxy import ProxyThread

        cfg = self.cfg
        where = self.where
        places = {"prefill": where.prefill, "decode": where.decode}
        transfer = {"prefill": [where.transfer] if where.transfer is not None else [], "decode": []}
        plan = server_plan(cfg, self.confs, transfer["prefill"])
        for i, (key, (side, kv_config, users)) in enumerate(plan.items()):
            pool = pool_bytes(cfg, len(users), self.kv_bytes_per_token)
            engine = replace(self.engine, kv_cache_memory_bytes=pool)
            if side == "decode":
                engine = replace(engine, prefix_caching=key[3])
            name = f"{side}{i}-" + "+".join(users)
            self.pool_bytes[name] = pool
            self.servers[key] = testbed.start_server(
                name, self.model, self.work, kv_transfer_config=kv_config, engine=engine, cores=places[side],
                transfer_cores=transfer[side],
                env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache for the decode-cold case
                host=cfg.prefill_host if side == "prefill" else cfg.decode_host,
                netns=cfg.decode_netns if side == "decode" else None,
            )  # fmt: skip
        testbed.wait_ready(list(self.servers.values()), timeout_s=600)
        for conf in self.confs:
            prefills, decodes = [self.prefill(conf).url], [self.decode(conf).url]
            if cfg.router == "vllm-router":  # paused servers must not count as failed: no health verdicts
                self.proxies[conf.name] = testbed.start_router(prefills, decodes, self.work / conf.name, quiet=True)
                continue
            proxy = ProxyThread(prefills, decodes, connector=conf.connector)
            proxy.start()
            self.proxies[conf.name] = proxy

    def prefill(self, conf: Configuration) -> Any:
        return self.servers[conf.prefill_key()]

    def decode(self, conf: Configuration) -> Any:
        return self.servers[conf.decode_key()]

    def run_only(self, conf: Optional[Configuration]) -> None:
        """Resumes ``conf``'s servers and pauses every other one (None: resumes all)."""
        mine = {id(self.prefill(conf)), id(self.decode(conf))} if conf is not None else None
        for s in self.servers.values():
            if mine is None or id(s) in mine:
                s.resume()
            else:
                s.pause()

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()
        self.proxies = {}
        for s in self.servers.values():
            s.stop()


def _turn(cfg: VllmBenchConfig, fleet: Fleet, conf: Configuration, case: str, step: _Turn, t0: float) -> dict[str, Any]:
    """One turn of ``conf`` through its proxy, with its servers' figures around it."""
    from kvferry.vllm.proxy import SESSION_HEADER
    from kvferry.vllm.testbed import call

    prefill, decode = fleet.prefill(conf), fleet.decode(conf)
    fleet.run_only(conf)
    if step.turn >= 1 and case == "decode-cold":
        _reset_prefix_cache(decode)
    p0, d0, wire0 = _Sample.of(prefill), _Sample.of(decode), _wire_tx_bytes()
    start = time.perf_counter() - t0
    a = call(fleet.proxies[conf.name].url, "/v1/completions", _body(step.prompt, cfg.output_tokens, stream=True),
             headers={SESSION_HEADER: f"{case}-{conf.name}-{step.session}"})  # fmt: skip
    if a.status != 200:
        raise RuntimeError(f"{conf.name} {case} session {step.session} turn {step.turn}: HTTP {a.status}: {a.body}")
    p1, p = _finished(prefill, p0)
    d1, d = _finished(decode, d0)
    wire = _wire_tx_bytes() - wire0
    if cfg.scrape is not None:
        with open(cfg.scrape, "a", encoding="utf-8") as f:
            for server, sample in ((prefill, p1), (decode, d1)):
                f.write(json.dumps({"t": time.time(), "config": conf.name, "server": server.name, "text": sample.text}))
                f.write("\n")
    # Connector counters from the server's previous sample after a turn, not from before this
    # one: a count that lands between two turns (a NIXL push is counted when the prefill server
    # sees its WRITE done) goes to the next turn instead of being lost.
    texts = {
        "prefill": (fleet.seen.get(prefill.name, p0.text), p1.text),
        "decode": (fleet.seen.get(decode.name, d0.text), d1.text),
    }
    fleet.seen[prefill.name], fleet.seen[decode.name] = p1.text, d1.text
    moved = {
        k: _metric_sum(texts[side][1], name) - _metric_sum(texts[side][0], name)
        for k, (side, name) in _metrics(conf).items()
    }
    decode_start = a.timing.get("decode-start", 0.0)
    if cfg.router == "vllm-router":  # no Server-Timing: see VllmBenchConfig.router
        decode_start = p["queue"] + p["prefill"] if conf.connector == "nixl" else 0.0
    return {
        "config": conf.name,
        "case": case,
        "session": step.session,
        "turn": step.turn,
        "prompt_tokens": len(step.prompt),
        "start_s": start,
        "ttft_ms": 1e3 * a.ttft_s,
        "total_ms": 1e3 * a.total_s,
        "prefill_leg_ms": a.timing.get("prefill"),
        "decode_start_ms": decode_start,
        # KV-ready: from the proxy's arrival to the decode server holding the request's whole
        # KV = when the proxy sent the decode leg + the decode server's wait for it.
        "kv_ready_ms": decode_start + d["queue"],
        "prefill_queue_ms": p["queue"],
        "prefill_ms": p["prefill"],
        "decode_step_ms": d["prefill"],
        "link_bytes": moved.get(
            "bytes", moved.get("early_bytes", 0) + moved.get("chunk_bytes", 0) + moved.get("layer_bytes", 0)
        ),
        "early_bytes": moved.get("early_bytes", 0.0),
        "held_blocks": moved.get("held_blocks"),
        "duplicates": moved.get("duplicates"),
        "wire_tx_bytes": wire,
        "equal": a.token_ids == step.want,
    }


def run_vllm_bench(cfg: VllmBenchConfig, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    from kvferry.bench.util import machine
    from kvferry.vllm import testbed

    confs = [c for c in configurations(cfg.layer_groups) if c.name in cfg.configs]
    spec = testbed.RandomLlama(cfg.model, max_positions=max(8192, 2 * cfg.cached_tokens))
    kv_token = spec.kv_bytes_per_token()
    check_memory(cfg, confs, kv_token, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    work = Path(cfg.workdir or tempfile.mkdtemp(prefix="kvferry-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model = testbed.build_tiny_llama(work, spec)
    # The longest conversation, not the model's 8192 positions: vLLM refuses a pool that cannot
    # hold one request of max_model_len (2 GiB at --realistic's 256 KiB per token).
    max_len = min(spec.max_positions, (longest_tokens(cfg) // BLOCK_TOKENS + 2) * BLOCK_TOKENS)
    engine = testbed.EngineSettings(max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=max_len)
    load_before = os.getloadavg()
    progress(
        f"model: {cfg.model.layers} layers, {cfg.model.kv_heads} KV heads x {cfg.model.head_dim}, {kv_token} KV "
        f"bytes/token; the plain reference server computes {len(confs)} x {len(CASES)} x {cfg.sessions} conversations"
    )
    plain_prefill: list[float] = []
    scripts: dict[tuple[str, str], list[list[_Turn]]] = {}
    plain_engine = replace(engine, kv_cache_memory_bytes=pool_bytes(cfg, 1, kv_token))
    with testbed.single_server(model, work, plain_engine) as plain:
        for i, conf in enumerate(confs):
            for case in CASES:
                scripts[(conf.name, case)] = _scripts(cfg, plain, 2 * i + CASES.index(case), plain_prefill)
            progress(f"reference: {conf.name}'s conversations from the plain server")
    # The middle measured turn's reused prefix (complete blocks of the previous prompt).
    middle = scripts[(confs[0].name, "decode-cold")][0][(cfg.turns + 1) // 2]
    previous = scripts[(confs[0].name, "decode-cold")][0][(cfg.turns + 1) // 2 - 1]
    sizing_prefix = len(previous.prompt) // BLOCK_TOKENS * BLOCK_TOKENS * kv_token
    rows: list[dict[str, Any]] = []
    names = [c.name for c in confs]
    by_name = {c.name: c for c in confs}
    where = placement(cfg)
    receive = _steer_receive(cfg, where)  # before any server: every figure below is taken with it
    progress(f"starting the servers of {', '.join(names)}")
    with Fleet(cfg, confs, model, work, engine, kv_token, where) as fleet:
        for conf in confs:
            # One request first: the proxy's one-off work (kvferry's hello) and the connectors'
            # first-transfer setup (NIXL's handshake) stay out of the figures.
            fleet.run_only(conf)
            warm = testbed.call(fleet.proxies[conf.name].url, "/v1/completions", _body([5] * 100, 2, stream=False))
            if warm.status != 200:
                raise RuntimeError(f"{conf.name}: warm-up request: HTTP {warm.status}: {warm.body}")
        sizing = [c for c in confs if not c.early] or confs
        in_run = _sizing_prefill(cfg, fleet, sizing[0]) if cfg.decode_netns is not None else []
        link = _link(cfg, sizing_prefix, statistics.median(in_run or plain_prefill), progress)
        link.update(
            receive_cores=receive,
            sizing_prefix_bytes=sizing_prefix,
            sizing_turn_tokens=len(middle.prompt),
            plain_prefill_ms_p50=statistics.median(plain_prefill),
            in_run_prefill_ms=in_run,
            sizing_config=sizing[0].name if in_run else None,
        )
        t0 = time.perf_counter()
        slot = 0
        for case in CASES:
            for turn in range(cfg.turns + 1):
                for session in range(cfg.sessions):
                    for name in vf.order(names, slot):
                        step = scripts[(name, case)][session][turn]
                        row = _turn(cfg, fleet, by_name[name], case, step, t0)
                        if turn >= 1:
                            rows.append(dict(row, slot=slot))
                    if turn >= 1:
                        slot += 1
                progress(f"{case}: turn {turn} of {cfg.turns} done" + (" (warm-up)" if turn == 0 else ""))
        fleet.run_only(None)
        leaks = {s.name: _settled_blocks(s) for s in fleet.servers.values()}
        hellos = {n: getattr(getattr(getattr(p, "proxy", None), "flow", None), "hellos", None)
                  for n, p in fleet.proxies.items()}  # fmt: skip
        pools = dict(fleet.pool_bytes)
    annotate(rows, by_name, scripts, kv_token, link["bytes_per_s"])
    summary = summaries(rows, confs, cfg.bootstrap_reps)
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "machine": machine("cpu"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "kv_bytes_per_token": kv_token,
        "block_tokens": BLOCK_TOKENS,
        "link": link,
        "router": cfg.router,
        "placement": (
            f"decode servers in network namespace {cfg.decode_netns} at {cfg.decode_host}, prefill servers and "
            f"proxies at {cfg.prefill_host}"
            if cfg.decode_netns is not None
            else "one host, loopback"
        )
        + "; "
        + where.describe(),
        "pool_bytes": pools,
        "kv_blocks_left": leaks,
        "hellos": hellos,
        "cases": {case: {k: v for k, v in s.items() if k != "configs"} for case, s in summary.items()},
        "configs": {
            c.name: {
                "note": c.note,
                "connector": c.connector,
                "extra": c.extra,
                "aware": c.aware,
                **{case: summary[case]["configs"][c.name] for case in CASES},
            }
            for c in confs
        },  # fmt: skip
    }
    result["targets"] = targets(summary)
    return result


def _settled_blocks(server: Any, timeout_s: float = 30.0) -> int:
    """KV blocks the server still holds once it had time to free what its finished requests
    held (a paused server frees them when it runs again): bounded polling."""
    deadline = time.monotonic() + timeout_s
    while True:
        used, _ = server.kv_blocks()
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)  # polling a gauge (no event to wait on)


progress_to_stderr = stderr_progress("bench vllm")
