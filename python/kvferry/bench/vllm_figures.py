"""The arithmetic of ``kvferry bench vllm`` (python/kvferry/bench/vllm.py), kept apart from the
servers so that it is tested without vLLM: which configuration takes which turn, the bytes a
turn must move, the ideal bound, where a turn lost time against it, ratios of medians with a
bootstrap interval, and the quiet-machine verdict.

A *slot* is one (case, turn, session): every configuration runs its own conversation's turn of
that slot back to back (the conversations differ, their lengths do not), so a slot's prefill
is the same computation in every configuration.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from kvferry.bench.agentic import BUSY_SPREAD
from kvferry.bench.util import percentile

CASES = ("decode-warm", "decode-cold")
BLOCK_TOKENS = 32  # testbed.EngineSettings.block_size

# The project's targets for this bench (in its JSON, not its table): (case, configuration, figure, at most).
TARGETS = (
    ("decode-cold", "kvferry-early", "ttft_vs_nixl", 0.6),
    ("decode-cold", "kvferry-early", "kv_over_ideal", 1.1),
    ("decode-warm", "kvferry-aware", "ttft_vs_nixl", 0.9),
    ("decode-warm", "kvferry-layers", "ttft_vs_nixl", 0.9),
)

__all__ = [
    "BUSY_SPREAD",
    "TurnBytes",
    "annotate",
    "busy_verdict",
    "same_prefill_groups",
    "ideal",
    "losses",
    "order",
    "ratio_of_medians",
    "summaries",
    "targets",
    "turn_bytes",
]


def order(names: Sequence[str], slot: int) -> list[str]:
    """The configurations' order in slot ``slot``: as listed in even slots, reversed in odd ones,
    so a machine that grows busy for a while slows every configuration alike instead of the
    one that happened to run then (``bench agentic`` alternates its modes the same way)."""
    return list(names) if slot % 2 == 0 else list(names)[::-1]


@dataclass(frozen=True)
class TurnBytes:
    """What one turn must move over the link, in bytes:

    ```
    prompt:   |<------ previous prompt ------>|out|<-- new -->|
    prefill:  [ its prefix cache: hit blocks  )               the prefill server computed these
    decode:   [ held blocks (decode-warm, aware) ...)         the decode server keeps these
    prefix:   [held ........ hit)                             can leave before the prefill's forward
    tail:                        [max(hit, held) ..... end)   exists only once the forward ran
    ```
    """

    prefix: int
    tail: int


def turn_bytes(prompt_tokens: int, hit_tokens: int, held_tokens: int, block_tokens: int, block_bytes: int) -> TurnBytes:
    """The prefix and tail bytes of a turn (see `TurnBytes`): ``hit_tokens`` the prefill
    server's prefix-cache hit, ``held_tokens`` what the decode server already holds."""
    for name, value in (
        ("prompt_tokens", prompt_tokens),
        ("hit_tokens", hit_tokens),
        ("held_tokens", held_tokens),
        ("block_tokens", block_tokens),
        ("block_bytes", block_bytes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"invalid {name}={value!r}: must be an int >= 0")
    if block_tokens == 0:
        raise ValueError("invalid block_tokens=0: must be > 0")
    hit, held = hit_tokens // block_tokens, held_tokens // block_tokens
    blocks = -(-prompt_tokens // block_tokens)
    return TurnBytes(prefix=max(0, hit - held) * block_bytes, tail=max(0, blocks - max(hit, held)) * block_bytes)


def ideal(prefill_ms: float, moved: TurnBytes, link_bytes_per_s: float) -> tuple[float, float, float]:
    """The earliest the decode server could hold a turn's KV, from the run's own measurements:
    the prefix crosses while the prefill computes (whichever is longer), then the tail crosses
    at the link's measured rate. Returns (ideal KV-ready ms, prefix transfer ms, tail ms)."""
    if not link_bytes_per_s > 0:
        raise ValueError(f"invalid link_bytes_per_s={link_bytes_per_s!r}: must be > 0")
    x, t = 1e3 * moved.prefix / link_bytes_per_s, 1e3 * moved.tail / link_bytes_per_s
    return max(prefill_ms, x) + t, x, t


def losses(
    *,
    kv_ready_ms: float,
    ttft_ms: float,
    prefill_end_ms: float,
    prefill_ms: float,
    clean_prefill_ms: float,
    prefix_ms: float,
    tail_ms: float,
    decode_step_ms: float,
) -> dict[str, float]:
    """Where a turn lost time against its ideal bound, in ms; the first three add up to
    KV-ready minus the ideal KV-ready:

    ```
    achieved: |admission|==== prefill (as run) ====|... transfer after the prefill ...|KV|step|
    ideal:    |==== clean prefill ====|  or the prefix, if longer  |tail|KV|step|
    ```
    - ``admission``: from the request's arrival to the prefill's start and its answer back
      (queues, the proxy, HTTP), i.e. the prefill leg's end minus the prefill as run;
    - ``prefill_slowed``: the prefill as run minus the slot's clean prefill (the same
      computation's fastest run in the slot: what sharing the core with transfers cost);
    - ``after_prefill``: the wait for bytes after the prefill ended, beyond what the link
      needs then (the tail, and the part of the prefix longer than the clean prefill);
    - ``first_token``: TTFT minus KV-ready minus the slot's fastest decode step (not part of
      the KV-ready sum: the decode server's first step and the stream back).
    """
    after = kv_ready_ms - prefill_end_ms - (tail_ms + max(0.0, prefix_ms - clean_prefill_ms))
    return {
        "admission": prefill_end_ms - prefill_ms,
        "prefill_slowed": prefill_ms - clean_prefill_ms,
        "after_prefill": after,
        "first_token": ttft_ms - kv_ready_ms - decode_step_ms,
    }


def _median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def ratio_of_medians(
    a: Sequence[float], b: Sequence[float], reps: int = 2000, seed: int = 0, level: float = 0.95
) -> dict[str, Any]:
    """median(a) / median(b) and a paired bootstrap interval: ``a[i]`` and ``b[i]`` come from
    the same slot, so slots are resampled together (the slot-to-slot variation of the
    prompts and of the machine cancels in each draw). A fixed ``seed``: the same figures give
    the same interval."""
    if len(a) != len(b) or not a:
        raise ValueError(f"invalid samples: {len(a)} and {len(b)} values, need the same number, at least one")
    if min(b) <= 0:
        raise ValueError("invalid b: every value must be > 0")
    rng = random.Random(seed)
    n = len(a)
    draws = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        draws.append(_median_ratio([a[i] for i in idx], [b[i] for i in idx]))
    draws.sort()
    tail = (1 - level) / 2
    lo = draws[min(reps - 1, max(0, math.floor(tail * reps)))]
    hi = draws[min(reps - 1, max(0, math.ceil((1 - tail) * reps) - 1))]
    return {"ratio": _median_ratio(a, b), "lo": lo, "hi": hi, "n": n, "level": level}


def busy_verdict(groups: Sequence[dict[Any, float]], threshold: float = BUSY_SPREAD) -> dict[str, Any]:
    """Whether the run's own figures say the machine was too busy: within each group the same
    engine computed the same prefill (one configuration's turns of one prompt length, one per
    session, at different times), so on a quiet machine their prefill times agree within a
    few percent. The verdict is the median over groups of each group's spread (slowest over
    fastest), as ``bench agentic`` has it; ``groups``: one mapping per group, label ->
    prefill ms. (Not across configurations: a connector's own per-step work slows its
    engine's forward, which is the connector's cost, not the machine's load.)"""
    spreads = [max(v) / min(v) for v in ([x for x in s.values() if x > 0] for s in groups) if len(v) > 1]
    spread = statistics.median(spreads) if spreads else 1.0
    worst = max(range(len(spreads)), key=spreads.__getitem__) if spreads else None
    return {
        "busy": spread > threshold,
        "prefill_spread": spread,
        "worst_group": worst,
        "worst_spread": spreads[worst] if worst is not None else 1.0,
        "threshold": threshold,
        "slots": len(spreads),
    }


def same_prefill_groups(rows: Sequence[dict[str, Any]], case: str, configs: Sequence[str]) -> list[dict[Any, float]]:
    """The verdict's groups: each of ``configs``' turns of one index in ``case`` (every
    session's prompt has the same length there), session -> prefill ms."""
    groups: dict[tuple[str, int], dict[Any, float]] = {}
    for r in rows:
        if r["case"] == case and r["config"] in configs:
            groups.setdefault((r["config"], r["turn"]), {})[r["session"]] = r["prefill_ms"]
    return list(groups.values())


def median_of(rows: Sequence[dict[str, Any]], key: str | Callable[[dict[str, Any]], float]) -> Optional[float]:
    values = [key(r) if callable(key) else r[key] for r in rows]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def annotate(rows: list[dict[str, Any]], confs: dict[str, Any], scripts: dict[tuple[str, str], list[list[Any]]],
             kv_bytes_per_token: int, rate: float) -> None:  # fmt: skip
    """Adds each measured turn's bytes to move, ideal bound and losses (vllm_figures)."""
    by_slot: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_slot.setdefault(r["slot"], []).append(r)
    block_bytes = kv_bytes_per_token * BLOCK_TOKENS
    for slot_rows in by_slot.values():
        clean = min(r["prefill_ms"] for r in slot_rows)
        step = min(r["decode_step_ms"] for r in slot_rows)
        for r in slot_rows:
            conf = confs[r["config"]]
            previous = scripts[(r["config"], r["case"])][r["session"]][r["turn"] - 1]
            hit = len(previous.prompt)  # the prefill server computed the previous prompt
            # The decode server computed the previous prompt and every output token but the
            # last; it keeps them only with awareness, and decode-cold resets them.
            held = len(previous.prompt) + len(previous.want) - 1 if conf.aware and r["case"] == "decode-warm" else 0
            moved = turn_bytes(r["prompt_tokens"], hit, held, BLOCK_TOKENS, block_bytes)
            ideal_kv, x, t = ideal(clean, moved, rate)
            prefill_end = (
                r["prefill_leg_ms"] if r["prefill_leg_ms"] is not None else r["prefill_queue_ms"] + r["prefill_ms"]
            )
            r.update(
                prefix_bytes=moved.prefix,
                tail_bytes=moved.tail,
                clean_prefill_ms=clean,
                clean_decode_step_ms=step,
                prefix_xfer_ms=x,
                tail_xfer_ms=t,
                ideal_kv_ready_ms=ideal_kv,
                ideal_ttft_ms=ideal_kv + step,
                losses=losses(
                    kv_ready_ms=r["kv_ready_ms"],
                    ttft_ms=r["ttft_ms"],
                    prefill_end_ms=prefill_end,
                    prefill_ms=r["prefill_ms"],
                    clean_prefill_ms=clean,
                    prefix_ms=x,
                    tail_ms=t,
                    decode_step_ms=step,
                ),  # fmt: skip
            )


def summaries(rows: list[dict[str, Any]], confs: list[Any], reps: int) -> dict[str, Any]:
    """Per case and configuration: medians, ratios of medians (bootstrap intervals) against the
    better NIXL connector and against the ideal bound, the median losses; and the verdicts."""
    out: dict[str, Any] = {}
    for case in CASES:
        mine = {
            c.name: sorted((r for r in rows if r["case"] == case and r["config"] == c.name), key=lambda r: r["slot"])
            for c in confs
        }
        figures: dict[str, Any] = {}
        for c in confs:
            rs = mine[c.name]
            n = len(rs)
            held = [r["held_blocks"] for r in rs if r["held_blocks"] is not None]
            figures[c.name] = {
                "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in rs),
                "ttft_ms_p90": percentile([r["ttft_ms"] for r in rs], 0.9),
                "kv_ready_ms_p50": statistics.median(r["kv_ready_ms"] for r in rs),
                "kv_ready_ms_p90": percentile([r["kv_ready_ms"] for r in rs], 0.9),
                "ideal_kv_ready_ms_p50": statistics.median(r["ideal_kv_ready_ms"] for r in rs),
                "ideal_ttft_ms_p50": statistics.median(r["ideal_ttft_ms"] for r in rs),
                "prefill_ms_p50": statistics.median(r["prefill_ms"] for r in rs),
                "kv_over_ideal": ratio_of_medians(
                    [r["kv_ready_ms"] for r in rs], [r["ideal_kv_ready_ms"] for r in rs], reps
                ),
                "ttft_over_ideal": ratio_of_medians([r["ttft_ms"] for r in rs], [r["ideal_ttft_ms"] for r in rs], reps),
                "losses_ms_p50": {k: statistics.median(r["losses"][k] for r in rs) for k in rs[0]["losses"]},
                "link_bytes_per_turn": sum(r["link_bytes"] for r in rs) / n,
                "needed_bytes_per_turn": sum(r["prefix_bytes"] + r["tail_bytes"] for r in rs) / n,
                "early_bytes_per_turn": sum(r["early_bytes"] for r in rs) / n,
                "held_blocks_per_turn": sum(held) / n if held else None,
                "duplicates": sum(r["duplicates"] for r in rs) if c.connector == "kvferry" else None,
                "wire_tx_bytes_per_turn": sum(r["wire_tx_bytes"] for r in rs) / n,
                "outputs_equal": all(r["equal"] for r in rs),
                "turns": rs,
            }
        nixl = [c.name for c in confs if c.connector == "nixl"]
        best = min(nixl, key=lambda n: figures[n]["ttft_ms_p50"]) if nixl else None
        for c in confs:
            if best is not None:
                a, b = [r["ttft_ms"] for r in mine[c.name]], [r["ttft_ms"] for r in mine[best]]
                figures[c.name]["ttft_vs_nixl"] = ratio_of_medians(a, b, reps) if len(a) == len(b) else None
            else:
                figures[c.name]["ttft_vs_nixl"] = None
        # The quiet-machine verdict: each configuration whose prefill runs alone (no early send)
        # computed the same prefill once per session at each turn (prompts of one length).
        alone = [c.name for c in confs if not c.early] or [c.name for c in confs]
        groups = same_prefill_groups(rows, case, alone)
        out[case] = {"configs": figures, "best_nixl": best, "load": busy_verdict(groups), "verdict_configs": alone}
    return out


LOSS_NAMES = {
    "admission": "admission (queues, proxy, HTTP before the prefill's answer)",
    "prefill_slowed": "prefill slowed (against the slot's clean prefill)",
    "after_prefill": "transfer after the prefill (beyond what the link needs)",
}


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for case, name, figure, limit in TARGETS:
        f = summary.get(case, {}).get("configs", {}).get(name)
        if f is None or f.get(figure) is None:
            continue
        value = f[figure]["ratio"]
        row: dict[str, Any] = {"case": case, "config": name, "figure": figure, "limit": limit, "value": value,
                               "met": value <= limit}  # fmt: skip
        if value > limit:
            losses = {k: v for k, v in f["losses_ms_p50"].items() if k in LOSS_NAMES}
            worst = max(losses, key=losses.__getitem__)
            row["largest_loss"] = {"name": worst, "ms": losses[worst]}
        out.append(row)
    return out
