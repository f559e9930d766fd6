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

from kvferry.bench.util import emulated_link, machine, percentile, stderr_progress, tcp_stream_gbps
from kvferry.refengine.model import ModelConfig, TinyLlama
from kvferry.refengine.serving import Aggregated, Disaggregated, Turn, TurnResult
from kvferry.notice import Notice
from kvferry.sender import TransferRecord

__all__ = ["AgenticConfig", "run_agentic", "format_agentic", "draw_timeline"]


@dataclass(frozen=True)
class AgenticConfig:
    device: str = "cpu"
    sessions: int = 3
    turns: int = 2  # measured turns, after one warm-up turn that fills the prefix cache
    cached_tokens: int = 3072  # the conversation before the first measured turn
    new_tokens: int = 256
    output_tokens: int = 8
    tokens_per_block: int = 32
    chunk_size: Optional[int] = None
    transport: str = "in-process"  # any of kvferry.transports.registry.names(device=device)
    # CPU pools: an emulated link rate (None: raw copies). 0.5 GB/s gives the CPU run the
    # proportions of a GPU node (prefix transfer about a third of the batch prefill).
    link_gbps: Optional[float] = 0.5
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    ffn: int = 1024
    vocab: int = 512
    seed: int = 0
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

    @property
    def modes(self) -> tuple[str, ...]:
        """The disaggregated runs, in order."""
        return ("baseline", "early") + (("aware",) if self.aware else ()) + (("layerwise",) if self.layer_groups is not None else ())

    def model_config(self) -> ModelConfig:
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        return ModelConfig(self.vocab, self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim, self.ffn, seed=self.seed, dtype=dtype)


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


def _conversations(cfg: AgenticConfig, advance: Callable[[str], None]) -> tuple[list[list[Turn]], dict[int, TurnResult]]:
    """Runs the whole workload aggregated: the turns (prompts) and the reference results."""
    rng = random.Random(cfg.seed)
    model = TinyLlama(cfg.model_config(), cfg.device)
    agg = Aggregated(model, num_blocks=_pool_blocks(cfg), tokens_per_block=cfg.tokens_per_block, chunk_size=cfg.chunk_size)
    convs = [[rng.randrange(cfg.vocab) for _ in range(cfg.cached_tokens - cfg.new_tokens)] for _ in range(cfg.sessions)]
    all_turns, outputs, rid = [], {}, 0
    for _ in range(cfg.turns + 1):
        turns = []
        for s in range(cfg.sessions):
            convs[s] += [rng.randrange(cfg.vocab) for _ in range(cfg.new_tokens)]
            rid += 1
            turns.append(Turn(rid, tuple(convs[s]), cfg.output_tokens))
        got = agg.run(turns, check_kv=cfg.check_kv)
        for s, turn in enumerate(turns):
            outputs[turn.request_id] = got[turn.request_id]
            convs[s] += got[turn.request_id].outputs
        all_turns.append(turns)
        advance(f"reference turn {len(all_turns) - 1}")
    return all_turns, outputs


def _pool_blocks(cfg: AgenticConfig) -> int:
    """Each session holds its cached previous prompt plus the blocks of its running turn
    that are not shared with it: about one and a half prompts."""
    longest = cfg.cached_tokens + cfg.turns * (cfg.new_tokens + cfg.output_tokens) + cfg.output_tokens
    return (3 * cfg.sessions * (-(-longest // cfg.tokens_per_block))) // 2 + 64


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
        # The ideal bound: the copies that can only start once the forward ended (whole
        # blocks after it, the last layer group's slices) follow prefill; the prefix and the
        # other groups' slices could all hide under it.
        last_group = [rec for rec in layer if any(n.request_id == rid and n.group == n.groups - 1 for n in rec.notices)]
        after_copy_s = sum(rec.finished - rec.started for rec in tail if rec.kind == "chunk") + sum(rec.finished - rec.started for rec in last_group)
        overlappable_s = prefix_s + sum(rec.finished - rec.started for rec in layer if all(rec is not x for x in last_group))
        # Prefill as the decode side sees it: until the batch forward holding the last chunk ended.
        prefill_s = r.step_done - r.prefill_start
        per_block = lambda rec: rec.nbytes / max(1, sum(n.end - n.start for n in rec.notices))  # noqa: E731
        own_bytes = lambda recs: int(sum(per_block(rec) * sum(n.end - n.start for n in rec.notices if n.request_id == rid) for rec in recs))  # noqa: E731
        figures.append(
            RequestFigures(
                mode, turn, rid, r.prompt_len, r.reused_len,
                prefill_ms=prefill_s * 1e3,
                prefix_transfer_ms=prefix_s * 1e3,
                tail_transfer_ms=tail_s * 1e3,
                kv_ready_ms=(r.kv_ready - r.admitted) * 1e3,
                ttft_gen_ms=(r.first_token_at_gen - r.admitted) * 1e3 if r.first_token_at_gen else float("nan"),
                ideal_kv_ready_ms=((r.prefill_start - r.admitted) + max(prefill_s, overlappable_s) + after_copy_s) * 1e3,
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

    progress(f"reference: aggregated serving of {cfg.sessions} sessions x {cfg.turns + 1} turns")
    turns, reference = _conversations(cfg, advance)
    model = TinyLlama(cfg.model_config(), cfg.device)
    per_request: list[RequestFigures] = []
    outputs_match = True
    kv_mismatch_blocks = prefill_mismatch_blocks = reuse_mismatches = 0
    divergences: list[dict[str, Any]] = []
    modes = cfg.modes
    hidden = {mode: [0.0, 0.0] for mode in modes}
    for mode in modes:
        engine = Disaggregated(
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
        )
        records = engine.hook.sender.records
        assert records is not None
        for t, batch in enumerate(turns):
            records.clear()
            results = engine.run(batch, check_kv=cfg.check_kv)
            advance(f"{mode} turn {t}" + (" (warm-up)" if t == 0 else ""))
            for turn in batch:
                ref = reference[turn.request_id]
                got, want = results[turn.request_id].outputs, ref.outputs
                kv_mismatch_blocks += results[turn.request_id].kv_mismatch_blocks
                if cfg.check_kv:  # the context worker's prefill against the aggregated one's
                    prefill_mismatch_blocks += sum(a != b for a, b in zip(results[turn.request_id].digests, ref.digests))
                    reuse_mismatches += results[turn.request_id].reused_len != ref.reused_len
                if got != want:
                    outputs_match = False
                    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    divergences.append({"mode": mode, "turn": t, "request_id": turn.request_id, "first_token": at, "got": got, "want": want})
            if t == 0:
                continue
            figures, hid, total = _figures(mode, t, results, list(records), cfg.layers)
            per_request += figures
            hidden[mode][0] += hid
            hidden[mode][1] += total
        engine.close()

    def fraction(mode: str) -> float:
        return hidden[mode][0] / hidden[mode][1] if hidden[mode][1] else 0.0

    def summary(mode: str, key: str) -> dict[str, float]:
        values = [getattr(f, key) for f in per_request if f.mode == mode]
        return {f"{key}_p50": statistics.median(values), f"{key}_p90": percentile(values, 0.9), f"{key}_mean": statistics.fmean(values)}

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
        "tcp_link_gbps": _tcp_link(cfg),
        "requests": [asdict(f) for f in per_request],
    }
    for mode in modes:
        mode_summary: dict[str, float] = {}
        for key in ("kv_ready_ms", "ttft_gen_ms", "prefill_ms", "prefix_transfer_ms", "tail_transfer_ms", "ideal_kv_ready_ms"):
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


def format_agentic(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"{result['machine']}, {result['date']}: {cfg['sessions']} sessions x {cfg['turns']} turns, "
        f"{cfg['cached_tokens']}+ cached / {cfg['new_tokens']} new / {cfg['output_tokens']} output tokens, "
        f"tpb {cfg['tokens_per_block']}, transport {cfg['transport']}"
        + (f", emulated link {cfg['link_gbps']} GB/s" if cfg["link_gbps"] and emulated_link(cfg["device"], cfg["transport"]) else ""),
        f"{'mode':<9} {'turn':>4} {'req':>4} {'prompt':>7} {'reused':>7} {'prefill':>8} {'prefix':>8} {'tail':>7} {'KV-ready':>9} {'ideal':>7} {'TTFT@gen':>9} {'early MB':>9} {'after MB':>9} {'layer MB':>9}",
    ]
    for f in result["requests"]:
        lines.append(
            f"{f['mode']:<9} {f['turn']:>4} {f['request_id']:>4} {f['prompt_len']:>7} {f['reused_len']:>7} "
            f"{f['prefill_ms']:>7.1f}m {f['prefix_transfer_ms']:>7.1f}m {f['tail_transfer_ms']:>6.1f}m {f['kv_ready_ms']:>8.1f}m "
            f"{f['ideal_kv_ready_ms']:>6.1f}m {f['ttft_gen_ms']:>8.1f}m {f['early_bytes'] / 1e6:>9.1f} {f['after_bytes'] / 1e6:>9.1f} {f['layer_bytes'] / 1e6:>9.1f}"
        )
    b, e, i = result["baseline"], result["early"], result["ideal"]
    lines += [
        "",
        f"KV-ready p50/p90 ms: baseline {b['kv_ready_ms_p50']:.1f}/{b['kv_ready_ms_p90']:.1f}, "
        f"early {e['kv_ready_ms_p50']:.1f}/{e['kv_ready_ms_p90']:.1f}, ideal {i['kv_ready_ms_p50']:.1f}/{i['kv_ready_ms_p90']:.1f} "
        f"(early/baseline {e['kv_ready_ms_p50'] / b['kv_ready_ms_p50']:.2f}, early/ideal {e['kv_ready_ms_p50'] / i['kv_ready_ms_p50']:.2f})",
        f"TTFT at the generation worker p50 ms: baseline {b['ttft_gen_ms_p50']:.1f}, early {e['ttft_gen_ms_p50']:.1f}",
        f"bytes sent early {e['early_bytes'] / 1e6:.1f} MB, after prefill {e['after_bytes'] / 1e6:.1f} MB (baseline: all {b['after_bytes'] / 1e6:.1f} MB after)",
        f"hidden fraction {result['hidden_fraction']:.2f}; duplicate blocks {result['duplicate_blocks']}; outputs match aggregated: {result['outputs_match']}",
    ]
    if result.get("tcp_link_gbps"):
        lines.append(f"link: one raw TCP stream to the generation worker {result['tcp_link_gbps']:.3f} GB/s (same run)")
    if "aware" in result:
        w = result["aware"]
        lines.insert(
            -1,
            f"with receiver prefix awareness: KV-ready p50/p90 {w['kv_ready_ms_p50']:.1f}/{w['kv_ready_ms_p90']:.1f} ms, "
            f"TTFT@gen p50 {w['ttft_gen_ms_p50']:.1f} ms, sent {w['early_bytes'] / 1e6:.1f} MB early + {w['after_bytes'] / 1e6:.1f} MB after prefill",
        )
    if "layerwise" in result:
        w = result["layerwise"]
        lines.insert(
            -1,
            f"layer-wise ({w['layer_groups']} layer groups): KV-ready p50/p90 {w['kv_ready_ms_p50']:.1f}/{w['kv_ready_ms_p90']:.1f} ms "
            f"(early {e['kv_ready_ms_p50']:.1f}/{e['kv_ready_ms_p90']:.1f}, layer-wise/early {w['kv_ready_ms_p50'] / e['kv_ready_ms_p50']:.2f}), "
            f"its ideal {w['ideal_kv_ready_ms_p50']:.1f}/{w['ideal_kv_ready_ms_p90']:.1f}; post-prefill tail p50/p90 "
            f"{w['tail_transfer_ms_p50']:.1f}/{w['tail_transfer_ms_p90']:.1f} ms (early {e['tail_transfer_ms_p50']:.1f}/{e['tail_transfer_ms_p90']:.1f}); "
            f"TTFT@gen p50 {w['ttft_gen_ms_p50']:.1f} ms; sent {w['early_bytes'] / 1e6:.1f} MB early + {w['layer_bytes'] / 1e6:.1f} MB in layer slices "
            f"+ {w['after_bytes'] / 1e6:.1f} MB after the forward; hidden fraction {w['hidden_fraction']:.2f}",
        )
    if result.get("kv_mismatch_blocks") is not None:
        lines.append(
            f"KV checked block by block: {result['kv_mismatch_blocks']} blocks differ between the workers, "
            f"{result['prefill_mismatch_blocks']} between the context worker's prefill and aggregated serving's "
            f"({result['reuse_mismatches']} requests reused a different length)"
        )
    for d in result.get("output_divergences", []):
        lines.append(f"  {d['mode']} turn {d['turn']} request {d['request_id']}: outputs diverge at token {d['first_token']}")
    return "\n".join(lines)


def draw_timeline(result: dict[str, Any], path: str) -> None:
    """Per request of the last turn: prefill, transfers and decode start; baseline above
    early (above layer-wise, when it ran), one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(f["turn"] for f in result["requests"])
    modes = [m for m in ("baseline", "early", "layerwise") if m in result]
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 2.75 * len(modes)), sharex=True)
    for ax, mode in zip(axes, modes):
        rows = [f for f in result["requests"] if f["mode"] == mode and f["turn"] == last]
        for y, f in enumerate(rows):
            bars = f["bars"]
            p0, p1 = bars["prefill"]
            ax.broken_barh([(p0, p1 - p0)], (y - 0.35, 0.3), color="#4c72b0", label="prefill" if y == 0 else None)
            for kind, color in (("early", "#dd8452"), ("chunk", "#55a868"), ("layer", "#8172b3")):
                spans = [(a, max(b - a, 0.05)) for a, b in bars.get(kind, ())]
                if spans:
                    ax.broken_barh(spans, (y + 0.05, 0.3), color=color, label=f"{kind} transfer" if y == 0 else None)
            ax.plot([bars["kv_ready"]], [y + 0.2], marker="|", color="black", markersize=14, label="KV ready" if y == 0 else None)
            ax.plot([bars["decode"]], [y], marker=">", color="#c44e52", label="decode starts" if y == 0 else None)
        ax.set_yticks(range(len(rows)), [f"req {f['request_id']}" for f in rows])
        m = result[mode]
        ax.set_title(f"{mode}: KV-ready p50 {m['kv_ready_ms_p50']:.1f} ms, post-prefill tail p50 {m['tail_transfer_ms_p50']:.1f} ms")
        ax.legend(loc="lower right", fontsize=7)
    axes[-1].set_xlabel("ms since the turn's requests were admitted")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


progress_to_stderr = stderr_progress("bench agentic")
