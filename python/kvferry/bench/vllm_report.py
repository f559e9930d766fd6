"""The table and the timeline picture of ``kvferry bench vllm`` (python/kvferry/bench/vllm.py),
from its result (the JSON it writes)."""

from __future__ import annotations

import json
from typing import Any, Optional

from kvferry.bench.vllm_figures import CASES

__all__ = ["draw_timeline", "format_vllm_bench", "write_json"]


def _ratio(r: Optional[dict[str, Any]]) -> str:
    if r is None:
        return "-"
    return f"{r['ratio']:.2f} [{r['lo']:.2f}-{r['hi']:.2f}]"


def format_vllm_bench(result: dict[str, Any]) -> str:
    cfg = result["config"]
    cross = cfg.get("decode_netns") is not None
    link = result["link"]
    n = cfg["sessions"] * cfg["turns"]
    lines = [
        f"kvferry bench vllm: {len(result['configs'])} configurations taking turns, {cfg['sessions']} sessions x "
        f"{cfg['turns']} measured turns = {n} per configuration and case (+1 warm-up turn each); "
        f"{cfg['cached_tokens']} cached + {cfg['new_tokens']} new tokens per turn, {cfg['output_tokens']} output; "
        f"{cfg['model']['layers']} layers x {cfg['model']['kv_heads']} KV heads x {cfg['model']['head_dim']} "
        f"({result['kv_bytes_per_token']} KV bytes/token)",
        f"{result['machine']}, {result['date']}; load average {result['load_average']['before'][0]:.1f} before, "
        f"{result['load_average']['after'][0]:.1f} after",
        f"placement: {result['placement']}; legs sent by {result.get('router', 'kvferry-proxy')}"
        + (
            " (KV-ready from the prefill's end for NIXL, from the arrival for kvferry: no Server-Timing)"
            if result.get("router") == "vllm-router"
            else ""
        ),
        f"link: {link['how']}: {link['bytes_per_s'] / 1e6:.1f} MB/s measured"
        + (f" (tbf {link['mbit']:.0f} Mbit/s)" if cross else "")
        + (
            "; each veth receives on " + ", ".join(f"{dev}: core {core}" for dev, core in link["receive_cores"].items())
            if link.get("receive_cores")
            else ""
        ),
    ]
    for case in CASES:
        info = result["cases"][case]
        best = info["best_nixl"] or "-"
        lines += [
            "",
            f"[{case}] TTFT and KV-ready p50 over {n} turns; ratios are ratios of medians with a 95% bootstrap "
            f"interval over the slots; vs nixl: against {best} (the better NIXL connector here)",
        ]
        header = (f"{'configuration':<17} {'TTFT':>7} {'vs nixl':>17} {'KV-ready':>9} {'ideal':>7} "
                  f"{'KV/ideal':>17} {'prefill':>8} {'link/turn':>10} {'early/turn':>10} {'held':>5}"
                  + (f" {'veth/turn':>10}" if cross else "") + f" {'equal':>6}")  # fmt: skip
        lines += [header, "-" * len(header)]
        for name, c in result["configs"].items():
            f = c[case]
            held = "-" if f["held_blocks_per_turn"] is None else f"{f['held_blocks_per_turn']:.0f}"
            wire = f" {f['wire_tx_bytes_per_turn'] / 2**20:>6.2f} MiB" if cross else ""
            lines.append(
                f"{name:<17} {f['ttft_ms_p50']:>4.0f} ms {_ratio(f['ttft_vs_nixl']):>17} "
                f"{f['kv_ready_ms_p50']:>6.0f} ms {f['ideal_kv_ready_ms_p50']:>4.0f} ms "
                f"{_ratio(f['kv_over_ideal']):>17} {f['prefill_ms_p50']:>5.0f} ms "
                f"{f['link_bytes_per_turn'] / 2**20:>6.2f} MiB {f['early_bytes_per_turn'] / 2**20:>6.2f} MiB "
                f"{held:>5}{wire} {str(f['outputs_equal']):>6}"
            )
        lines += ["", f"[{case}] where KV-ready lost time against the ideal (median ms per turn; see the notes)"]
        header = (
            f"{'configuration':<17} {'admission':>10} {'prefill slowed':>15} {'after prefill':>14} {'first token':>12}"
        )
        lines += [header, "-" * len(header)]
        for name, c in result["configs"].items():
            loss = c[case]["losses_ms_p50"]
            lines.append(
                f"{name:<17} {loss['admission']:>10.0f} {loss['prefill_slowed']:>15.0f} "
                f"{loss['after_prefill']:>14.0f} {loss['first_token']:>12.0f}"
            )
        load = info["load"]
        if not load["slots"]:
            lines.append("load: no verdict (it needs two sessions)")
            continue
        lines.append(
            ("WARNING: the machine was too busy for these figures to mean anything: " if load["busy"] else "load: ")
            + f"the same prefill, computed once per session by one engine ({', '.join(info['verdict_configs'])}), "
            "agreed within a median "
            f"{load['prefill_spread']:.2f}x (worst {load['worst_spread']:.2f}x; above {load['threshold']:.2f}x the "
            "figures would not mean anything)"
        )
    # The project's own targets (result["targets"], in the JSON) are not printed: they are the
    # developers' yardstick, and the tables above already say where time was lost.
    lines += [
        "",
        "TTFT: client-side through the proxy (streaming). KV-ready: from the proxy's arrival until the decode server "
        "holds the whole KV.",
        "ideal: max(the slot's clean prefill, the prefix at the measured link rate) + the tail at that rate; a slot's "
        "clean prefill and",
        "decode step are the fastest of the configurations' (the same computation). prefill: the prefill server's, "
        "as run.",
        "losses: admission + prefill slowed + after prefill = KV-ready - ideal (per turn); first token: TTFT - "
        "KV-ready - the decode step.",
        "link: bytes the connector moved (NIXL: bytes transferred; kvferry: early + chunk + layer bytes); held: "
        "blocks per turn not sent.",
    ]
    if cross:
        lines.append("veth: bytes the prefill side's namespace sent on the veth per turn (KV and HTTP).")
    lines.append("equal: every output equals the plain single server's, token for token.")
    left = {name: n for name, n in result["kv_blocks_left"].items() if n}
    lines.append(f"KV blocks left allocated at the end: {left or 'none'}")
    return "\n".join(lines)


def draw_timeline(result: dict[str, Any], path: str) -> None:
    """Per case, per configuration: each measured turn as a bar from its start, dark up to the
    first token and light to the last (the configurations take turns: their bars interleave)."""
    from kvferry._optional import require

    matplotlib = require("matplotlib", "the timeline PNG (--png)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    fig, axes = plt.subplots(len(CASES), 1, figsize=(12, 1.0 + 0.6 * len(names) * len(CASES)), squeeze=False)
    colors = ["#4c72b0", "#937860", "#dd8452", "#55a868", "#8172b3", "#c44e52"]
    for ax, case in zip(axes[:, 0], CASES):
        t0 = min(r["start_s"] for n in names for r in result["configs"][n][case]["turns"])
        for y, name in enumerate(names):
            f = result["configs"][name][case]
            for r in f["turns"]:
                start = r["start_s"] - t0
                color = colors[y % len(colors)]
                ax.broken_barh([(start, r["ttft_ms"] / 1e3)], (y - 0.35, 0.7), color=color)
                ax.broken_barh([(start + r["ttft_ms"] / 1e3, (r["total_ms"] - r["ttft_ms"]) / 1e3)], (y - 0.35, 0.7),
                               color=color, alpha=0.35)  # fmt: skip
        labels = [f"{n}\nTTFT p50 {result['configs'][n][case]['ttft_ms_p50']:.0f} ms" for n in names]
        ax.set_yticks(range(len(names)), labels, fontsize=7)
        ax.set_title(f"{case}: measured turns (dark: to first token, light: the rest of the answer)", fontsize=9)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("s since the case's first measured turn")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
