"""``kvferry bench vllm``: the agentic workload served by real vLLM servers (a prefill and a
decode server behind ``kvferry proxy``), once per KV-connector configuration, in one run.

Configurations (:data:`CONFIGS`): vLLM's NixlConnector; KvferryConnector with early send off
(the baseline: every block leaves after the forward that computed it); early send; early send
with decode-side awareness; early send with awareness and layer groups. Decode-side awareness
is the decode server's prefix cache: with it, blocks the decode server holds never cross
(KvferryConnector counts them as held); without it (``--no-enable-prefix-caching`` on the
decode server, as the reference engine's ``aware=False``) the decode server holds nothing and
every block crosses. NixlConnector always runs with it (it too skips what the decode server
holds).

Placement: by default every server on this host's loopback (KvferryConnector over
``staging``). Across two hosts (``decode_netns``: the decode server in that network
namespace, reached at ``decode_host``; this process, the proxy and the prefill server at
``prefill_host`` in its own): KvferryConnector's control plane on tcp:// and its bytes over
NIXL, and NixlConnector's side channel on the servers' addresses; UCX's settings
(``UCX_TLS=tcp``, ``UCX_NET_DEVICES``) come from the environment. benches/python/two_hosts.py
makes the namespaces, shapes the veth and runs this inside one of them.

Two cases, each with its own figures (/work/shared/notes/vllm-on-cpu.md, "fair side-by-side"):
- ``decode-warm``: a session's next turn lands on the decode server that served the last one
  and still caches the conversation: neither connector moves the old prefix.
- ``decode-cold``: the decode server does not hold the conversation (its prefix cache is reset
  before each measured turn, as after eviction or on another decode server) while the prefill
  server does: the old prefix must cross, and that is where early send pays.

Each session: a conversation of ``cached`` tokens (turn 0, a warm-up that fills the prefill
server's cache), then ``turns`` measured turns of ``new`` tokens and ``output`` greedy tokens.
The prompts are fixed up front from a plain single server's answers, so every configuration
sees the same prompts, and every configuration's outputs are checked against the plain one's.
Figures per configuration and case: client-side TTFT p50/p90 (through the proxy, streaming);
KV-ready p50/p90, from the client's send until the decode server holds the request's whole KV
(when the proxy sent the decode leg, from its Server-Timing header, plus the decode server's
queue time, which vLLM ends only once an async KV load has finished); bytes over the link per
turn, early bytes, blocks held (not sent); whether every output equals the plain server's.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from kvferry.bench.dashboard import Scraper
from kvferry.bench.util import percentile, stderr_progress
from kvferry.geometry import VLLM_BENCH_MODEL, Geometry

CASES = ("decode-warm", "decode-cold")


@dataclass(frozen=True)
class Configuration:
    name: str
    connector: str  # the proxy's flow
    extra: dict[str, Any] = field(default_factory=dict)  # KvferryConnector's kv_connector_extra_config
    note: str = ""
    aware: bool = True  # decode-side awareness: the decode server keeps a prefix cache

    def server_configs(self, cross_host: Optional[str] = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The prefill and decode servers' kv-transfer-configs; ``cross_host``: the decode
        server's address on another host (KvferryConnector then listens there on tcp:// and
        moves the bytes over NIXL)."""
        from kvferry.vllm.testbed import kvferry_config, nixl_config, url_host

        if self.connector == "nixl":
            return nixl_config("kv_producer"), nixl_config("kv_consumer")
        if cross_host is None:
            return kvferry_config("kv_producer", **self.extra), kvferry_config("kv_consumer")
        return kvferry_config("kv_producer", transport="nixl", **self.extra), kvferry_config(
            "kv_consumer", transport="nixl", listen=f"tcp://{url_host(cross_host)}:0"
        )


def configurations(layer_groups: int) -> list[Configuration]:
    return [
        Configuration(
            "nixl",
            "nixl",
            note="vLLM's NixlConnector: decode READs after the prefill (skips what the decode server holds)",
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
    turns: int = 2
    cached_tokens: int = 2048
    new_tokens: int = 128
    output_tokens: int = 8
    model: Geometry = VLLM_BENCH_MODEL
    layer_groups: int = 4
    max_num_batched_tokens: int = 512
    kv_cache_memory_bytes: int = 256 << 20
    configs: tuple[str, ...] = CONFIGS
    workdir: Optional[str] = None
    decode_netns: Optional[str] = None  # the decode server's network namespace (another host)
    decode_host: str = "127.0.0.1"  # its address there
    prefill_host: str = "127.0.0.1"  # the prefill server's address (this process's namespace)
    scrape: Optional[str] = None  # append every server's /metrics, sampled during the run, here (bench/dashboard.py)


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# Per connector: metric -> (server, name) read before and after each case.
METRICS = {
    "nixl": {
        "bytes": ("decode", "vllm:nixl_bytes_transferred_sum"),
        "kv_wait_s": ("decode", "vllm:nixl_xfer_time_seconds_sum"),
        "kv_wait_n": ("decode", "vllm:nixl_xfer_time_seconds_count"),
    },
    "kvferry": {
        "early_bytes": ("prefill", "vllm:kvferry_early_bytes_total"),
        "chunk_bytes": ("prefill", "vllm:kvferry_chunk_bytes_total"),
        "layer_bytes": ("prefill", "vllm:kvferry_layer_bytes_total"),
        "held_blocks": ("prefill", "vllm:kvferry_held_blocks_total"),
        "duplicates": ("decode", "vllm:kvferry_duplicates_refused_total"),
        "kv_wait_s": ("decode", "vllm:kvferry_recv_seconds_sum"),
        "kv_wait_n": ("decode", "vllm:kvferry_recv_seconds_count"),
    },
}


def _read(bed: Any, connector: str) -> dict[str, float]:
    texts = {"prefill": bed.prefills[0].metrics(), "decode": bed.decodes[0].metrics()}
    out = {k: _metric_sum(texts[side], name) for k, (side, name) in METRICS[connector].items()}
    out["wire_tx"] = float(_wire_tx_bytes())
    return out


def _wire_tx_bytes() -> int:
    """Bytes this network namespace sent on its interfaces other than loopback (/proc/net/dev):
    across two hosts, everything the prefill side sent over the veth (KV and HTTP); on one
    host, whatever else the machine sent (not a figure of the bench)."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() != "lo":
                total += int(fields.split()[8])
    return total


QUEUE_SUM, QUEUE_COUNT = "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count"


def _queue_time(decode: Any, count_before: float, sum_before: float) -> tuple[float, float, float]:
    """The decode server's queue time of the one request finished since (count_before,
    sum_before). vLLM records a request as scheduled only once its KV has arrived (an async
    load keeps it waiting), so this is its wait for the KV. Waits (bounded) for the request's
    stats to be published."""
    deadline = time.monotonic() + 30
    while True:
        text = decode.metrics()
        count, total = _metric_sum(text, QUEUE_COUNT), _metric_sum(text, QUEUE_SUM)
        if count >= count_before + 1:
            # More than one: the proxy's one-token hello went first (its queue time is ~0).
            return total - sum_before, count, total
        if time.monotonic() > deadline:
            raise RuntimeError("the decode server published no finished request for the turn within 30 s")
        time.sleep(0.05)  # polling the metrics endpoint for a value to appear


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


def _scripts(cfg: VllmBenchConfig, plain_url: str, case: str, progress: Callable[[str], None]) -> list[list[_Turn]]:
    """Each session's prompts, built from the plain server's answers (which are the reference)."""
    from kvferry.vllm.testbed import call

    seed = CASES.index(case) * 1000
    out = []
    for s in range(cfg.sessions):
        rng = random.Random(seed + s)
        prompt = [rng.randrange(3, cfg.model.vocab) for _ in range(cfg.cached_tokens)]
        turns = []
        for t in range(cfg.turns + 1):
            a = call(plain_url, "/v1/completions", _body(prompt, cfg.output_tokens, stream=False))
            if a.status != 200:
                raise RuntimeError(f"plain server: HTTP {a.status}: {a.body}")
            turns.append(_Turn(s, t, prompt, a.token_ids))
            prompt = prompt + a.token_ids + [rng.randrange(3, cfg.model.vocab) for _ in range(cfg.new_tokens)]
        out.append(turns)
        progress(f"{case}: reference session {s + 1}/{cfg.sessions} from the plain server")
    return out


def _body(prompt: list[int], output: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": output,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _run_case(
    cfg: VllmBenchConfig,
    conf: Configuration,
    bed: Any,
    case: str,
    script: list[list[_Turn]],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    from kvferry.vllm.proxy import SESSION_HEADER
    from kvferry.vllm.testbed import call

    rows: list[dict[str, Any]] = []
    equal = True
    before: Optional[dict[str, float]] = None
    t_case = time.perf_counter()
    text = bed.decodes[0].metrics()
    q_count, q_sum = _metric_sum(text, QUEUE_COUNT), _metric_sum(text, QUEUE_SUM)
    for turn in range(cfg.turns + 1):
        for session in script:  # sessions interleave turn by turn, as agents wait on tools
            step = session[turn]
            if turn == 1 and before is None:
                before = _read(bed, conf.connector)  # measured turns only
            if turn >= 1 and case == "decode-cold":
                _reset_prefix_cache(bed.decodes[0])
            start = time.perf_counter() - t_case
            a = call(bed.url, "/v1/completions", _body(step.prompt, cfg.output_tokens, stream=True),
                     headers={SESSION_HEADER: f"{case}-{step.session}"})  # fmt: skip
            if a.status != 200:
                raise RuntimeError(f"{conf.name} {case} session {step.session} turn {turn}: HTTP {a.status}: {a.body}")
            queued, q_count, q_sum = _queue_time(bed.decodes[0], q_count, q_sum)
            same = a.token_ids == step.want
            equal = equal and same
            if turn >= 1:
                # KV-ready: from the client's send to the decode server holding the request's
                # whole KV = when the proxy sent the decode leg + the decode server's wait.
                decode_start = a.timing.get("decode-start", 0.0)
                rows.append({"session": step.session, "turn": turn, "prompt_tokens": len(step.prompt),
                             "start_s": start, "ttft_ms": 1e3 * a.ttft_s, "total_ms": 1e3 * a.total_s,
                             "prefill_leg_ms": a.timing.get("prefill"), "decode_start_ms": decode_start,
                             "kv_ready_ms": decode_start + 1e3 * queued, "equal": same})  # fmt: skip
    # Connector metrics land when the transfer's last step is reported: the proxy has no
    # requests left in flight and the servers have stepped since.
    after = _read(bed, conf.connector)
    assert before is not None
    delta = {k: after[k] - before[k] for k in after}
    n = len(rows)
    ttft = [r["ttft_ms"] for r in rows]
    ready = [r["kv_ready_ms"] for r in rows]
    link = delta.get("bytes", delta.get("early_bytes", 0) + delta.get("chunk_bytes", 0) + delta.get("layer_bytes", 0))
    waits = delta.get("kv_wait_n", 0)
    out = {
        "ttft_ms_p50": percentile(ttft, 0.5),
        "ttft_ms_p90": percentile(ttft, 0.9),
        "kv_ready_ms_p50": percentile(ready, 0.5),
        "kv_ready_ms_p90": percentile(ready, 0.9),
        "connector_wait_ms_mean": 1e3 * delta["kv_wait_s"] / waits if waits else 0.0,
        "link_bytes_per_turn": link / n,
        "early_bytes_per_turn": delta.get("early_bytes", 0) / n,
        "held_blocks_per_turn": delta.get("held_blocks", 0) / n if "held_blocks" in delta else None,
        "duplicates": delta.get("duplicates"),
        "wire_tx_bytes_per_turn": delta["wire_tx"] / n,
        "outputs_equal": equal,
        "turns": rows,
    }
    progress(
        (
            f"{conf.name} {case}: TTFT p50 {out['ttft_ms_p50']:.0f} ms, link {link / n / 2**20:.1f} MiB/turn, "
            f"outputs equal: {equal}"
        )
    )
    return out


def run_vllm_bench(cfg: VllmBenchConfig, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    from kvferry.bench.util import machine
    from kvferry.vllm import testbed

    work = Path(cfg.workdir or tempfile.mkdtemp(prefix="kvferry-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = testbed.RandomLlama(cfg.model, max_positions=max(8192, 2 * cfg.cached_tokens))
    model = testbed.build_tiny_llama(work, spec)
    engine = testbed.EngineSettings(
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=spec.max_positions,
    )
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache for the decode-cold case (loopback only)
    progress(
        (
            f"model: {cfg.model.layers} layers, hidden {cfg.model.hidden}, {spec.kv_bytes_per_token()} KV "
            "bytes/token; plain reference server"
        )
    )
    with testbed.single_server(model, work, engine) as plain:
        scripts = {case: _scripts(cfg, plain.url, case, progress) for case in CASES}
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "machine": machine("cpu"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "kv_bytes_per_token": spec.kv_bytes_per_token(),
        "configs": {},
    }
    cross = cfg.decode_netns is not None
    result["placement"] = (
        (
            f"decode server in network namespace {cfg.decode_netns} at {cfg.decode_host}, prefill server and proxy "
            f"at {cfg.prefill_host}"
        )
        if cross
        else "one host, loopback"
    )
    for conf in configurations(cfg.layer_groups):
        if conf.name not in cfg.configs:
            continue
        prefill_config, decode_config = conf.server_configs(cfg.decode_host if cross else None)
        progress(f"{conf.name}: starting a prefill and a decode server ({conf.note})")
        decode_engine = replace(engine, prefix_caching=conf.aware)
        with testbed.Testbed(model, work / conf.name, prefill_config, decode_config, engine=engine,
                             proxy_connector=conf.connector, env=env, prefill_host=cfg.prefill_host,
                             decode_host=cfg.decode_host, decode_netns=cfg.decode_netns,
                             decode_engine=decode_engine) as bed:  # fmt: skip
            # One request first: the proxy's one-off work (kvferry's hello) and the connectors'
            # first-transfer setup (NIXL's handshake) stay out of the figures.
            warm = testbed.call(bed.url, "/v1/completions", _body([5] * 100, 2, stream=False))
            if warm.status != 200:
                raise RuntimeError(f"{conf.name}: warm-up request: HTTP {warm.status}: {warm.body}")
            with Scraper(bed.servers(), cfg.scrape, conf.name):
                figures = {case: _run_case(cfg, conf, bed, case, scripts[case], progress) for case in CASES}
            leaks = [s.kv_blocks()[0] for s in bed.servers()]
            hellos = getattr(bed.proxy.proxy.flow, "hellos", None) if bed.proxy is not None else None
        result["configs"][conf.name] = {
            "note": conf.note,
            "connector": conf.connector,
            "extra": conf.extra,
            "aware": conf.aware,
            **figures,
            "kv_blocks_left": leaks,
            "hellos": hellos,
        }
    return result


def format_vllm_bench(result: dict[str, Any]) -> str:
    cfg = result["config"]
    cross = cfg.get("decode_netns") is not None
    lines = [
        f"kvferry bench vllm: {cfg['sessions']} sessions x {cfg['turns']} measured turns, "
        f"{cfg['cached_tokens']} cached + "
        f"{cfg['new_tokens']} new tokens per turn, {cfg['output_tokens']} output; {cfg['model']['layers']} "
        f"layers, hidden {cfg['model']['hidden']} "
        f"({result['kv_bytes_per_token']} KV bytes/token); {result['machine']}, {result['date']}",
        f"placement: {result.get('placement', 'one host, loopback')}",
    ]
    base = {case: result["configs"].get("kvferry-baseline", {}).get(case) for case in CASES}
    nixl = {case: result["configs"].get("nixl", {}).get(case) for case in CASES}
    for case in CASES:
        lines.append("")
        lines.append(f"[{case}]")
        header = (f"{'configuration':<18} {'TTFT p50':>9} {'p90':>8} {'vs base':>8} {'vs nixl':>8} "
                  f"{'KV-ready p50':>12} {'p90':>8} {'link/turn':>10} {'early/turn':>10} {'held/turn':>9}"
                  + (f" {'veth/turn':>10}" if cross else "") + f" {'equal':>6}")  # fmt: skip
        lines.append(header)
        lines.append("-" * len(header))
        for name, c in result["configs"].items():
            f = c[case]
            ratio = f"{base[case]['ttft_ms_p50'] / f['ttft_ms_p50']:.2f}x" if base[case] else "-"
            vs_nixl = f"{f['ttft_ms_p50'] / nixl[case]['ttft_ms_p50']:.2f}" if nixl[case] else "-"
            held = "-" if f["held_blocks_per_turn"] is None else f"{f['held_blocks_per_turn']:.0f}"
            wire = f" {f['wire_tx_bytes_per_turn'] / 2**20:>6.2f} MiB" if cross else ""
            lines.append(
                f"{name:<18} {f['ttft_ms_p50']:>6.0f} ms {f['ttft_ms_p90']:>5.0f} ms {ratio:>8} {vs_nixl:>8} "
                f"{f['kv_ready_ms_p50']:>9.0f} ms {f['kv_ready_ms_p90']:>5.0f} ms "
                f"{f['link_bytes_per_turn'] / 2**20:>6.2f} MiB {f['early_bytes_per_turn'] / 2**20:>6.2f} MiB "
                f"{held:>9}{wire} {str(f['outputs_equal']):>6}"
            )
    lines.append("")
    lines.append(
        (
            "TTFT: client-side through the proxy (streaming); vs base: kvferry-baseline's p50 over this one's "
            "(higher is faster);"
        )
    )
    lines.append("vs nixl: this one's TTFT p50 over NixlConnector's (lower is faster).")
    lines.append(
        (
            "KV-ready: from the client's send until the decode server holds the whole KV (the proxy's decode-start "
            "+ the decode server's queue time)."
        )
    )
    lines.append(
        (
            "link: bytes the connector moved (NIXL: bytes READ; kvferry: early + chunk + layer bytes); held: "
            "blocks not sent, the decode server had them."
        )
    )
    if cross:
        lines.append(
            "veth: bytes the prefill side's namespace sent on the veth per turn (KV and HTTP), from /proc/net/dev."
        )
    lines.append("equal: every output equals the plain single server's, token for token.")
    lines.append(
        (
            "Decode-side awareness (the decode server's prefix cache) is off in kvferry-baseline and "
            "kvferry-early, on in the other rows."
        )
    )
    left = {n: c["kv_blocks_left"] for n, c in result["configs"].items() if any(c["kv_blocks_left"])}
    lines.append(f"KV blocks left allocated after each run: {left or 'none'}")
    return "\n".join(lines)


def draw_timeline(result: dict[str, Any], path: str) -> None:
    """Per case, per configuration: each measured turn as a bar from its start, dark up to the
    first token and light to the last."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    fig, axes = plt.subplots(len(CASES), 1, figsize=(11, 1.0 + 0.9 * len(names) * len(CASES)), squeeze=False)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52"]
    for ax, case in zip(axes[:, 0], CASES):
        for y, name in enumerate(names):
            f = result["configs"][name][case]
            t0 = f["turns"][0]["start_s"]
            for k, r in enumerate(f["turns"]):
                start = 1e3 * (r["start_s"] - t0)
                ax.broken_barh([(start, r["ttft_ms"])], (y - 0.35, 0.7), color=colors[y % len(colors)])
                ax.broken_barh(
                    [(start + r["ttft_ms"], r["total_ms"] - r["ttft_ms"])],
                    (y - 0.35, 0.7),
                    color=colors[y % len(colors)],
                    alpha=0.35,
                )
        ax.set_yticks(
            range(len(names)),
            [f"{n}\nTTFT p50 {result['configs'][n][case]['ttft_ms_p50']:.0f} ms" for n in names],
            fontsize=7,
        )
        ax.set_title(f"{case}: measured turns (dark: to first token, light: the rest of the answer)", fontsize=9)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("ms since the first measured turn")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


progress_to_stderr = stderr_progress("bench vllm")
