"""`kvferry bench agentic`: the main job. An agentic workload (cached prefix >> new turn
tokens >> output tokens; several sessions x several turns) served disaggregated twice,
baseline (the prefix leaves with the first chunk, after its forward) and early (the prefix
leaves before the first forward), against aggregated serving as the reference for outputs.
Optionally also "aware" (early with receiver prefix awareness) and "layerwise" (early, and
during the last chunk each layer group's blocks leave as soon as the forward wrote them).

Per request: prefill time, prefix-transfer time, post-prefill tail, KV-ready latency
(admitted -> every block resident at the generation worker), TTFT at the generation worker,
and the ideal bound max(prefill, transfer overlappable with it) + tail copy:

```
early:      |==== prefill ====|- turn KV -|          tail copy: the whole turn's KV
            |--- prefix KV ---|
layerwise:  |==== prefill ====|-|                    tail copy: the last layer group's part
            |--- prefix KV ---|groups 0..G-2 of the turn's KV (as the forward passes them)
```
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

from kvferry.bench.agentic_memory import check_device_memory, memory_estimate
from kvferry.bench.util import emulated_link, machine, percentile, stderr_progress, tcp_stream_gbps
from kvferry.geometry import AGENTIC_MODEL, Geometry
from kvferry.notice import Notice
from kvferry.refengine.generation import GenerationHost
from kvferry.refengine.model import ModelConfig, TinyLlama
from kvferry.refengine.serving import Aggregated, Disaggregated, Turn, TurnResult
from kvferry.sender import TransferRecord
from kvferry.trace import save_with_legend
from kvferry.transports import registry

__all__ = ["AgenticConfig", "run_agentic", "format_agentic", "draw_timeline"]


@dataclass(frozen=True)
class AgenticConfig:
    device: str = "cpu"
    sessions: int = 3
    turns: int = 4  # measured turns, after one warm-up turn that fills the prefix cache
    cached_tokens: int = 3072  # the conversation before the first measured turn
    new_tokens: int = 256
    output_tokens: int = 8
    tokens_per_block: int = 32
    chunk_size: Optional[int] = None
    transport: str = "in-process"  # any of kvferry.transports.registry.names(device=device)
    # CPU pools: an emulated link rate (None: raw copies). 0.5 GB/s gives the CPU run the
    # proportions of a GPU node (prefix transfer about a third of the batch prefill).
    link_gbps: Optional[float] = 0.5
    model: Geometry = AGENTIC_MODEL
    seed: int = 0  # the workload's (the model's weights have the geometry's own)
    # Hash every transferred block on both workers after each turn (slow at large
    # geometries) and report blocks whose bytes differ, to tell a transfer fault from
    # numerics when outputs diverge.
    check_kv: bool = False
    # Also run "aware": early transfer with receiver prefix awareness (the generation worker
    # keeps each session's prompt blocks and advertises them; they never cross again).
    aware: bool = False
    # Also run "layerwise": early transfer plus layer-wise streaming of the last prefill
    # chunk, with this many groups of consecutive layers (1 to layers); None: not run.
    layer_groups: Optional[int] = None
    # Where the generation worker's endpoint listens and the network namespace it runs in
    # (None: this one): a second host on one machine (see kvferry.bench.copy).
    listen: str = "unix://"
    receiver_netns: Optional[str] = None
    # Staging: the generation worker's ring in bytes, whole blocks of every layer (None: as
    # large as its pool, so no write waits for room; the vLLM connector's default is
    # kvferry.transports.staging.default_ring_bytes).
    ring_bytes: Optional[int] = None

    def ring_blocks(self) -> Optional[int]:
        """The staging ring's capacity in blocks for `ring_bytes` (at least one), or None."""
        if self.ring_bytes is None:
            return None
        block = self.model_config().kv_bytes_per_token * self.tokens_per_block
        return max(1, self.ring_bytes // block)

    @property
    def modes(self) -> tuple[str, ...]:
        """The disaggregated runs, in order."""
        return (
            ("baseline", "early")
            + (("aware",) if self.aware else ())
            + (("layerwise",) if self.layer_groups is not None else ())
        )

    def model_config(self) -> ModelConfig:
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        return ModelConfig(self.model, dtype=dtype)


@dataclass
class RequestFigures:
    mode: str
    turn: int
    request_id: int
    prompt_len: int
    reused_len: int
    prefill_ms: float
    prefix_transfer_ms: float
    tail_transfer_ms: float
    kv_ready_ms: float
    ttft_gen_ms: float
    ideal_kv_ready_ms: float
    early_bytes: int
    after_bytes: int  # whole blocks sent after a chunk's forward
    layer_bytes: int  # layer-group slices sent during the last chunk's forward
    duplicate_blocks: int
    # For the timeline: intervals relative to the turn's first admission (ms).
    bars: dict[str, Any] = field(default_factory=dict)


def _conversations(
    cfg: AgenticConfig, advance: Callable[[str], None]
) -> tuple[list[list[Turn]], dict[int, TurnResult]]:
    """Runs the whole workload aggregated: the turns (prompts) and the reference results."""
    rng = random.Random(cfg.seed)
    model = TinyLlama(cfg.model_config(), cfg.device)
    agg = Aggregated(
        model, num_blocks=_pool_blocks(cfg), tokens_per_block=cfg.tokens_per_block, chunk_size=cfg.chunk_size
    )
    convs = [
        [rng.randrange(cfg.model.vocab) for _ in range(cfg.cached_tokens - cfg.new_tokens)] for _ in range(cfg.sessions)
    ]
    all_turns, outputs, rid = [], {}, 0
    for _ in range(cfg.turns + 1):
        turns = []
        for s in range(cfg.sessions):
            convs[s] += [rng.randrange(cfg.model.vocab) for _ in range(cfg.new_tokens)]
            rid += 1
            turns.append(Turn(rid, tuple(convs[s]), cfg.output_tokens))
        got = agg.run(turns, check_kv=cfg.check_kv)
        for s, turn in enumerate(turns):
            outputs[turn.request_id] = got[turn.request_id]
            convs[s] += got[turn.request_id].outputs
        all_turns.append(turns)
        t = len(all_turns) - 1
        advance(f"reference turn {t}" + (" (warm-up)" if t == 0 else f" of {cfg.turns}"))
    return all_turns, outputs


def _pool_blocks(cfg: AgenticConfig) -> int:
    """What one worker's pool must hold at the run's last turn, per session: the running
    request's blocks (its prompt, which contains the previous prompt, so the reused prefix-
    cache blocks are among them, and its output), the previous prompt's last partial block
    (cached on its own) and one block of rounding; then `POOL_SLACK` blocks. The prefix cache
    evicts older blocks, which no turn reuses. (The 1.5 prompts per session of earlier
    versions came to 16 GB a pool at Llama-8B geometry, nine pools in all with four modes.)"""
    longest = cfg.cached_tokens + cfg.turns * (cfg.new_tokens + cfg.output_tokens) + cfg.output_tokens
    return cfg.sessions * (-(-longest // cfg.tokens_per_block) + 2) + POOL_SLACK


POOL_SLACK = 64


def pools_bytes(cfg: AgenticConfig) -> int:
    """Device bytes of the run's KV pools at their peak: a context and a generation pool
    per mode, all alive together (the reference's pool is freed before they are made)."""
    model = cfg.model_config()
    return 2 * len(cfg.modes) * _pool_blocks(cfg) * cfg.tokens_per_block * model.kv_bytes_per_token


def _generation_stats(stats: dict[str, Any]) -> str:
    return (
        f"{stats['models']} copy of the weights, {len(stats['pools'])} pools of "
        f"{', '.join(str(b) for b in stats['pools'].values())} blocks, {stats['pool_bytes'] / 1e9:.2f} GB"
    )


def _check_device_memory(cfg: AgenticConfig) -> None:
    """On CUDA: refuses, before anything is allocated, a run whose processes would hold more
    than the device's free memory at their peak (`kvferry.bench.agentic_memory`: weights,
    pools, staging scratch, the largest forward's transients, allocator slack and runtime),
    naming the figures, instead of an out-of-memory error minutes into the run."""
    if cfg.device != "cuda":
        return
    free, _ = torch.cuda.mem_get_info()
    check_device_memory(cfg, free)


def _device_peaks(device: str) -> Optional[dict[str, int]]:
    """This process's CUDA caching allocator peaks over the run (None off CUDA)."""
    if device != "cuda":
        return None
    return {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}


def _memory(
    cfg: AgenticConfig, context: Optional[dict[str, int]], generation: Optional[dict[str, Any]]
) -> dict[str, Any]:
    """Each process's estimate (`memory_estimate`) beside its measured peaks, where measured."""
    out: dict[str, Any] = {}
    peaks = {"context": context, "generation": generation, "context+generation": context}
    for p in memory_estimate(cfg):
        out[p.name] = {"estimate": p.terms(), "peak": peaks[p.name]}
    return out


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _layer_units(notice: Notice, layers: int) -> range:
    """The layers a notice covers (every layer of a whole-block notice)."""
    return range(notice.group * layers // notice.groups, (notice.group + 1) * layers // notice.groups)


def duplicate_blocks(notices: list[Notice], layers: int) -> int:
    """Blocks any layer of which crossed more than once (a block sent as layer-group slices
    crosses once when each of its layers did)."""
    seen: set[tuple[int, int]] = set()
    twice: set[int] = set()
    for n in notices:
        for block in range(n.start, n.end):
            for layer in _layer_units(n, layers):
                if (block, layer) in seen:
                    twice.add(block)
                seen.add((block, layer))
    return len(twice)


def _units(rec: TransferRecord, layers: int, request_id: Optional[int] = None) -> int:
    """(block, layer) units a record carries, of one request or of all."""
    return sum(
        (n.end - n.start) * len(_layer_units(n, layers))
        for n in rec.notices
        if request_id is None or n.request_id == request_id
    )


def ideal_bound(request_id: int, records: list[TransferRecord], layers: int, admitted: float) -> float:
    """The earliest the request's KV could have been ready (monotonic seconds), from this
    run's own measurements: its copies run one after another on one link (the copy engine's
    thread or stream), none starts before it was submitted (the prefix before the first
    forward, each chunk's blocks after the forward that wrote them, a layer group's slices
    after its last layer), and each takes at least the request's share of the time its copy
    took in this run. So for every submission time ``s`` the request's copies submitted at
    ``s`` or later cannot all have landed before ``s`` + their shares:

    ```
    link:    |--- prefix (shares of the batch's early copy) ---|     |- chunk share -|
    bound:   max over s of  s + sum of the shares submitted at s or later
             s = early submit -------------------------------------> s = after the forward
    ```

    Achieved KV-ready is at or after the request's last copy finished, which on a serial link
    is at or after every such sum: the bound never exceeds what the run achieved. (A request
    with nothing to send is bounded by its admission, ``admitted``.)"""
    shares = sorted(
        (rec.submitted, (rec.finished - rec.started) * _units(rec, layers, request_id) / max(1, _units(rec, layers)))
        for rec in records
        if _units(rec, layers, request_id)
    )
    bound, rest = admitted, sum(share for _, share in shares)
    for submitted, share in shares:
        bound = max(bound, submitted + rest)
        rest -= share
    return bound


def _figures(
    mode: str, turn: int, results: dict[int, TurnResult], records: list[TransferRecord], layers: int
) -> tuple[list[RequestFigures], float, float]:
    """Per-request figures of one turn, and the transfer time sent during prefill (early and
    layer slices) that prefill overlapped, out of its total."""
    t0 = min(r.admitted for r in results.values())
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    figures, hidden, during_total = [], 0.0, 0.0
    prefill_span = (min(r.prefill_start for r in results.values()), max(r.prefill_done for r in results.values()))
    for rec in records:
        if rec.kind in ("early", "layer"):
            during_total += rec.finished - rec.started
            hidden += _overlap((rec.started, rec.finished), prefill_span)
    for rid, r in results.items():
        mine = [rec for rec in records if any(n.request_id == rid for n in rec.notices)]
        early = [rec for rec in mine if rec.kind == "early"]
        layer = [rec for rec in mine if rec.kind == "layer"]
        # The tail: what was still to move once the step with the request's last chunk ended.
        tail = [rec for rec in mine if rec.kind in ("chunk", "layer") and rec.finished > r.step_done]
        prefix_s = sum(rec.finished - rec.started for rec in early)
        tail_s = (max(rec.finished for rec in tail) - r.step_done) if tail else 0.0
        # Prefill as the decode side sees it: until the batch forward holding the last chunk ended.
        prefill_s = r.step_done - r.prefill_start
        per_block = lambda rec: rec.nbytes / max(1, sum(n.end - n.start for n in rec.notices))  # noqa: E731
        own_bytes = lambda recs: int(  # noqa: E731
            sum(per_block(rec) * sum(n.end - n.start for n in rec.notices if n.request_id == rid) for rec in recs)
        )
        figures.append(
            RequestFigures(
                mode,
                turn,
                rid,
                r.prompt_len,
                r.reused_len,
                prefill_ms=prefill_s * 1e3,
                prefix_transfer_ms=prefix_s * 1e3,
                tail_transfer_ms=tail_s * 1e3,
                kv_ready_ms=(r.kv_ready - r.admitted) * 1e3,
                ttft_gen_ms=(r.first_token_at_gen - r.admitted) * 1e3 if r.first_token_at_gen else float("nan"),
                ideal_kv_ready_ms=(ideal_bound(rid, mine, layers, r.admitted) - r.admitted) * 1e3,
                early_bytes=own_bytes(early),
                after_bytes=own_bytes([rec for rec in mine if rec.kind == "chunk"]),
                layer_bytes=own_bytes(layer),
                duplicate_blocks=duplicate_blocks(r.notices, layers),
                bars={
                    "prefill": (ms(r.prefill_start), ms(r.prefill_done)),
                    "early": [(ms(rec.started), ms(rec.finished)) for rec in early],
                    "chunk": [(ms(rec.started), ms(rec.finished)) for rec in mine if rec.kind == "chunk"],
                    "layer": [(ms(rec.started), ms(rec.finished)) for rec in layer],
                    "kv_ready": ms(r.kv_ready),
                    "decode": ms(r.first_decode),
                },
            )
        )
    return figures, hidden, during_total


# Identical prefill work (one turn's batch, in every mode) that took more than this much longer
# in one mode than in another: the machine was busy with something else, unevenly.
BUSY_SPREAD = 1.25


def busy_verdict(per_turn: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the run's own measurements say the machine was too busy for its figures to
    mean anything: every mode computes the same prefill in a turn, so on a machine with
    nothing else running their prefill times agree within a few percent. The verdict takes
    each turn's spread (its slowest mode's prefill over its fastest's) and their median over
    the turns, as the headline ratio is a median over turns: one disturbed turn does not
    spoil the run, a median spread above `BUSY_SPREAD` does."""
    spreads = [max(v) / min(v) for v in ([x for x in p["prefill_ms"].values() if x > 0] for p in per_turn) if v]
    spread = statistics.median(spreads) if spreads else 1.0
    worst = max(range(len(spreads)), key=spreads.__getitem__) if spreads else None
    return {
        "busy": spread > BUSY_SPREAD,
        "prefill_spread": spread,
        "worst_turn": per_turn[worst]["turn"] if worst is not None else None,
        "worst_spread": spreads[worst] if worst is not None else 1.0,
        "threshold": BUSY_SPREAD,
    }


def _tcp_link(cfg: AgenticConfig) -> Optional[float]:
    """The same-run ceiling of a tcp:// link to the generation worker: a raw TCP stream."""
    if not cfg.listen.startswith("tcp://"):
        return None
    from kvferry.transports.wire import parse_address

    return tcp_stream_gbps(parse_address(cfg.listen, "listen").host, 256 << 20, netns=cfg.receiver_netns)


def run_agentic(cfg: AgenticConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    batches = (1 + len(cfg.modes)) * (cfg.turns + 1)  # turn batches: reference, then each mode
    done = 0

    def advance(what: str) -> None:
        nonlocal done
        done += 1
        width = 24
        filled = width * done // batches
        progress(f"[{'#' * filled}{'.' * (width - filled)}] {done}/{batches} {what}")

    _check_device_memory(cfg)
    progress(f"reference: aggregated serving of {turns_phrase(asdict(cfg))}, then {', '.join(cfg.modes)} taking turns")
    turns, reference = _conversations(cfg, advance)
    if cfg.device == "cuda":
        torch.cuda.empty_cache()  # the reference's pool and weights: freed for the modes' pools
    model = TinyLlama(cfg.model_config(), cfg.device)
    per_request: list[RequestFigures] = []
    outputs_match = True
    kv_mismatch_blocks = prefill_mismatch_blocks = reuse_mismatches = 0
    divergences: list[dict[str, Any]] = []
    modes = cfg.modes
    hidden = {mode: [0.0, 0.0] for mode in modes}
    # A generation worker in another process: every mode's lives in one process holding one
    # copy of the weights (one process per mode held one copy each: 16 GB apiece at Llama-8B
    # geometry, which with four modes did not fit a 140 GB GPU).
    host = (
        GenerationHost(cfg.model_config(), device=cfg.device, netns=cfg.receiver_netns)
        if registry.check(cfg.transport, device=cfg.device).has_endpoint
        else None
    )
    engines: dict[str, Disaggregated] = {}
    try:
        for mode in modes:
            engines[mode] = Disaggregated(
                model,
                num_blocks=_pool_blocks(cfg),
                tokens_per_block=cfg.tokens_per_block,
                chunk_size=cfg.chunk_size,
                early=mode != "baseline",
                aware=mode == "aware",
                layer_groups=cfg.layer_groups if mode == "layerwise" else None,
                transport=cfg.transport,
                link_gbps=cfg.link_gbps if emulated_link(cfg.device, cfg.transport) else None,
                record=True,
                listen=cfg.listen,
                netns=cfg.receiver_netns,
                generation_host=host,
                ring_blocks=cfg.ring_blocks() if cfg.transport == "staging" else None,
            )
        generation = host.stats() if host is not None else None
        if generation is not None:
            progress(f"generation workers: {len(engines)} in one process ({_generation_stats(generation)})")
        per_turn: list[dict[str, Any]] = []
        for t, batch in enumerate(turns):
            # The modes take turns, in an order that alternates from turn to turn: a machine
            # that grows busy for a while slows each mode alike instead of the one running then.
            spans: dict[str, float] = {}
            kv_ready: dict[str, float] = {}
            for mode in modes if t % 2 == 0 else modes[::-1]:
                engine = engines[mode]
                records = engine.hook.sender.records
                assert records is not None
                records.clear()
                results = engine.run(batch, check_kv=cfg.check_kv)
                advance(f"{mode} turn {t}" + (" (warm-up)" if t == 0 else f" of {cfg.turns}"))
                for turn in batch:
                    ref = reference[turn.request_id]
                    got, want = results[turn.request_id].outputs, ref.outputs
                    kv_mismatch_blocks += results[turn.request_id].kv_mismatch_blocks
                    if cfg.check_kv:  # the context worker's prefill against the aggregated one's
                        prefill_mismatch_blocks += sum(
                            a != b for a, b in zip(results[turn.request_id].digests, ref.digests)
                        )
                        reuse_mismatches += results[turn.request_id].reused_len != ref.reused_len
                    if got != want:
                        outputs_match = False
                        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                        divergences.append(
                            {
                                "mode": mode,
                                "turn": t,
                                "request_id": turn.request_id,
                                "first_token": at,
                                "got": got,
                                "want": want,
                            }
                        )
                if t == 0:
                    continue
                figures, hid, total = _figures(mode, t, results, list(records), cfg.model.layers)
                per_request += figures
                hidden[mode][0] += hid
                hidden[mode][1] += total
                # The batch's prefill: the same computation in every mode.
                spans[mode] = (
                    max(r.step_done for r in results.values()) - min(r.prefill_start for r in results.values())
                ) * 1e3
                kv_ready[mode] = statistics.median(f.kv_ready_ms for f in figures)
            if t:
                per_turn.append(
                    {
                        "turn": t,
                        "prefill_ms": spans,
                        "kv_ready_ms_p50": kv_ready,
                        "early_over_baseline": kv_ready["early"] / kv_ready["baseline"],
                    }
                )
        # Before anything is freed: each process's allocator peaks, against the estimate the
        # run was admitted on.
        memory = _memory(cfg, _device_peaks(cfg.device), host.stats()["peaks"] if host is not None else None)
    finally:
        for engine in engines.values():
            engine.close()
        if host is not None:
            host.close()

    def fraction(mode: str) -> float:
        return hidden[mode][0] / hidden[mode][1] if hidden[mode][1] else 0.0

    def summary(mode: str, key: str) -> dict[str, float]:
        values = [getattr(f, key) for f in per_request if f.mode == mode]
        return {
            f"{key}_p50": statistics.median(values),
            f"{key}_p90": percentile(values, 0.9),
            f"{key}_mean": statistics.fmean(values),
        }

    result: dict[str, Any] = {
        "config": {k: v for k, v in asdict(cfg).items()},
        "machine": machine(cfg.device),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "outputs_match": outputs_match,
        "output_divergences": divergences,
        "kv_mismatch_blocks": kv_mismatch_blocks if cfg.check_kv else None,
        "prefill_mismatch_blocks": prefill_mismatch_blocks if cfg.check_kv else None,
        "reuse_mismatches": reuse_mismatches if cfg.check_kv else None,
        "duplicate_blocks": sum(f.duplicate_blocks for f in per_request),
        "hidden_fraction": fraction("early"),
        "turns": per_turn,
        # The headline: the median over measured turns of each turn's median KV-ready ratio.
        "early_over_baseline": statistics.median(p["early_over_baseline"] for p in per_turn),
        "load": busy_verdict(per_turn),
        "tcp_link_gbps": _tcp_link(cfg),
        # The generation process, when the transport has one: copies of the weights and pools.
        "generation": generation,
        # Per process: the memory check's estimate (bytes, by term) and, on CUDA, the caching
        # allocator's peaks ("max_allocated", "max_reserved") at the end of the run.
        "memory": memory,
        "requests": [asdict(f) for f in per_request],
    }
    for mode in modes:
        mode_summary: dict[str, float] = {}
        for key in (
            "kv_ready_ms",
            "ttft_gen_ms",
            "prefill_ms",
            "prefix_transfer_ms",
            "tail_transfer_ms",
            "ideal_kv_ready_ms",
        ):
            mode_summary.update(summary(mode, key))
        for key in ("early_bytes", "after_bytes", "layer_bytes", "duplicate_blocks"):
            mode_summary[key] = sum(getattr(f, key) for f in per_request if f.mode == mode)
        # Transfer sent during prefill (early and layer slices) that prefill overlapped.
        mode_summary["hidden_fraction"] = fraction(mode)
        result[mode] = mode_summary
    if cfg.layer_groups is not None:
        result["layerwise"]["layer_groups"] = cfg.layer_groups
    ideal = [f.ideal_kv_ready_ms for f in per_request if f.mode == "early"]
    result["ideal"] = {"kv_ready_ms_p50": statistics.median(ideal), "kv_ready_ms_p90": percentile(ideal, 0.9)}
    return result


MIB = 1 << 20


def turns_phrase(cfg: dict[str, Any]) -> str:
    """How many sessions and turns run, the warm-up included: the header and progress agree."""
    return f"{cfg['sessions']} sessions x {cfg['turns'] + 1} turns (1 warm-up + {cfg['turns']} measured)"


def format_agentic(result: dict[str, Any]) -> str:
    cfg = result["config"]
    modes = [m for m in ("baseline", "early", "aware", "layerwise") if m in result]
    link = (
        f", emulated link {cfg['link_gbps']} GB/s"
        if cfg["link_gbps"] and emulated_link(cfg["device"], cfg["transport"])
        else ""
    )
    lines = [
        f"{result['machine']}, {result['date']}: {turns_phrase(cfg)}, "
        f"{cfg['cached_tokens']}+ cached / {cfg['new_tokens']} new / {cfg['output_tokens']} output tokens, "
        f"{cfg['tokens_per_block']} tokens/block, transport {cfg['transport']}{link}",
        f"{'mode':<9} {'turn':>4} {'req':>4} {'prompt':>7} {'reused':>7} {'prefill ms':>10} {'prefix ms':>9} "
        f"{'tail ms':>8} {'KV-ready ms':>11} "
        f"{'ideal ms':>8} {'TTFT@gen ms':>11} {'early MiB':>9} {'after MiB':>9} {'layer MiB':>9}",
    ]
    for f in sorted(result["requests"], key=lambda f: (modes.index(f["mode"]), f["turn"], f["request_id"])):
        lines.append(
            f"{f['mode']:<9} {f['turn']:>4} {f['request_id']:>4} {f['prompt_len']:>7} {f['reused_len']:>7} "
            f"{f['prefill_ms']:>10.1f} {f['prefix_transfer_ms']:>9.1f} {f['tail_transfer_ms']:>8.1f} "
            f"{f['kv_ready_ms']:>11.1f} "
            f"{f['ideal_kv_ready_ms']:>8.1f} {f['ttft_gen_ms']:>11.1f} {f['early_bytes'] / MIB:>9.1f} "
            f"{f['after_bytes'] / MIB:>9.1f} {f['layer_bytes'] / MIB:>9.1f}"
        )
    b, e, i = result["baseline"], result["early"], result["ideal"]
    per_turn = ", ".join(f"{p['early_over_baseline']:.2f}" for p in result["turns"])
    lines += [
        "",
        f"KV-ready p50/p90 ms: baseline {b['kv_ready_ms_p50']:.1f}/{b['kv_ready_ms_p90']:.1f}, "
        f"early {e['kv_ready_ms_p50']:.1f}/{e['kv_ready_ms_p90']:.1f}, early's ideal bound "
        f"{i['kv_ready_ms_p50']:.1f}/{i['kv_ready_ms_p90']:.1f} "
        f"(early/ideal {e['kv_ready_ms_p50'] / i['kv_ready_ms_p50']:.2f})",
        (
            f"early/baseline KV-ready {result['early_over_baseline']:.2f}: the median over {len(result['turns'])} "
            f"measured turns ({per_turn})"
        ),
        f"TTFT at the generation worker p50 ms: baseline {b['ttft_gen_ms_p50']:.1f}, early {e['ttft_gen_ms_p50']:.1f}",
        (
            f"sent early {e['early_bytes'] / MIB:.1f} MiB, after prefill {e['after_bytes'] / MIB:.1f} MiB "
            f"(baseline: all {b['after_bytes'] / MIB:.1f} MiB after)"
        ),
        (
            f"hidden fraction {result['hidden_fraction']:.2f}; duplicate blocks {result['duplicate_blocks']}; "
            f"outputs match aggregated: {result['outputs_match']}"
        ),
    ]
    if result.get("tcp_link_gbps"):
        lines.append(f"link: one raw TCP stream to the generation worker {result['tcp_link_gbps']:.3f} GB/s (same run)")
    if "aware" in result:
        w = result["aware"]
        lines.insert(
            -1,
            "with receiver prefix awareness: KV-ready p50/p90 "
            f"{w['kv_ready_ms_p50']:.1f}/{w['kv_ready_ms_p90']:.1f} ms, "
            f"TTFT@gen p50 {w['ttft_gen_ms_p50']:.1f} ms, sent {w['early_bytes'] / MIB:.1f} MiB early + "
            f"{w['after_bytes'] / MIB:.1f} MiB after prefill",
        )
    if "layerwise" in result:
        w = result["layerwise"]
        lines.insert(
            -1,
            f"layer-wise ({w['layer_groups']} layer groups): KV-ready p50/p90 "
            f"{w['kv_ready_ms_p50']:.1f}/{w['kv_ready_ms_p90']:.1f} ms "
            f"(early {e['kv_ready_ms_p50']:.1f}/{e['kv_ready_ms_p90']:.1f}, layer-wise/early "
            f"{w['kv_ready_ms_p50'] / e['kv_ready_ms_p50']:.2f}), "
            f"its ideal bound {w['ideal_kv_ready_ms_p50']:.1f}/{w['ideal_kv_ready_ms_p90']:.1f}; post-prefill "
            "tail p50/p90 "
            f"{w['tail_transfer_ms_p50']:.1f}/{w['tail_transfer_ms_p90']:.1f} ms (early "
            f"{e['tail_transfer_ms_p50']:.1f}/{e['tail_transfer_ms_p90']:.1f}); "
            f"TTFT@gen p50 {w['ttft_gen_ms_p50']:.1f} ms; sent {w['early_bytes'] / MIB:.1f} MiB early + "
            f"{w['layer_bytes'] / MIB:.1f} MiB in layer slices "
            f"+ {w['after_bytes'] / MIB:.1f} MiB after the forward; hidden fraction {w['hidden_fraction']:.2f}",
        )
    if result.get("kv_mismatch_blocks") is not None:
        lines.append(
            f"KV checked block by block: {result['kv_mismatch_blocks']} blocks differ between the workers, "
            f"{result['prefill_mismatch_blocks']} between the context worker's prefill and aggregated serving's "
            f"({result['reuse_mismatches']} requests reused a different length)"
        )
    for name, m in result.get("memory", {}).items():
        peak, estimate = m["peak"], m["estimate"]
        if peak is not None:
            lines.append(
                f"device memory, {name} process: peak {peak['max_allocated'] / 1e9:.2f} GB allocated, "
                f"{peak['max_reserved'] / 1e9:.2f} GB reserved; the memory check's estimate "
                f"{estimate['total'] / 1e9:.2f} GB (transients {estimate['transients'] / 1e9:.2f}, "
                f"slack {estimate['slack'] / 1e9:.2f}, runtime {estimate['runtime'] / 1e9:.2f})"
            )
    for d in result.get("output_divergences", []):
        lines.append(
            f"  {d['mode']} turn {d['turn']} request {d['request_id']}: outputs diverge at token {d['first_token']}"
        )
    load = result["load"]
    if load["busy"]:
        lines.append(
            "WARNING: the machine was too busy for these figures to mean anything: each turn's prefill, the "
            "same computation "
            f"in every mode, took a median {load['prefill_spread']:.2f}x longer in one mode than in another (up to "
            f"{load['worst_spread']:.2f}x in turn {load['worst_turn']}; above {load['threshold']:.2f}x "
            "something else took the cores); rerun on an idle machine"
        )
    else:
        lines.append(
            "load: the modes' prefill of a turn, the same computation, agreed within a median "
            f"{load['prefill_spread']:.2f}x "
            f"(worst {load['worst_spread']:.2f}x in turn {load['worst_turn']}; above {load['threshold']:.2f}x "
            "the figures would not mean anything)"
        )
    return "\n".join(lines)


def draw_timeline(result: dict[str, Any], path: str) -> None:
    """Per request of the last measured turn: prefill, transfers and decode start; baseline
    above early (above layer-wise, when it ran), one time axis; the legend sits right of the
    panels, clear of the bars."""
    from kvferry._optional import require

    matplotlib = require("matplotlib", "the timeline PNG (--png)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(f["turn"] for f in result["requests"])
    modes = [m for m in ("baseline", "early", "layerwise") if m in result]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 2.75 * len(modes)), sharex=True, squeeze=False)
    handles: dict[str, Any] = {}
    for ax, mode in zip(axes[:, 0], modes):
        rows = [f for f in result["requests"] if f["mode"] == mode and f["turn"] == last]
        for y, f in enumerate(rows):
            bars = f["bars"]
            p0, p1 = bars["prefill"]
            handles["prefill"] = ax.broken_barh([(p0, p1 - p0)], (y - 0.35, 0.3), color="#4c72b0")
            for kind, color in (("early", "#dd8452"), ("chunk", "#55a868"), ("layer", "#8172b3")):
                spans = [(a, max(b - a, 0.05)) for a, b in bars.get(kind, ())]
                if spans:
                    handles[f"{kind} transfer"] = ax.broken_barh(spans, (y + 0.05, 0.3), color=color)
            (handles["KV ready"],) = ax.plot(
                [bars["kv_ready"]], [y + 0.2], marker="|", color="black", markersize=14, linestyle="none"
            )
            (handles["decode starts"],) = ax.plot([bars["decode"]], [y], marker=">", color="#c44e52", linestyle="none")
        ax.set_yticks(range(len(rows)), [f"req {f['request_id']}" for f in rows])
        ax.set_ylim(-0.6, len(rows) - 0.4)
        m = result[mode]
        ax.set_title(
            f"{mode}, turn {last} of {result['config']['turns']} measured: KV-ready p50 {m['kv_ready_ms_p50']:.1f} ms, "
            f"post-prefill tail p50 {m['tail_transfer_ms_p50']:.1f} ms (p50s over all measured turns)",
            fontsize=9,
        )
    axes[-1, 0].set_xlabel(f"ms since turn {last}'s requests were admitted")
    order = ["prefill", "early transfer", "chunk transfer", "layer transfer", "KV ready", "decode starts"]
    save_with_legend(fig, handles, order, path)


progress_to_stderr = stderr_progress("bench agentic")
