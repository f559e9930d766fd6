"""``kvferry bench vllm --stress``: KvferryConnector under serving load. Many
concurrent multi-turn sessions stream through ``kvferry proxy`` onto one prefill and one
decode vLLM server whose KV pools are small (so vLLM preempts on both sides), and some
clients hang up mid-stream.

Each session: a first prompt of ``first_prompt`` tokens, then ``turns`` turns; each turn's
prompt is the last prompt, its output (when the client read it whole) and ``new`` tokens.
A turn is streamed; with probability ``hangup`` its client closes the connection after a
few events. Afterwards every completed turn is asked of a plain single server (no
connector): its greedy output must be the same. Then both servers must drain within
``drain_s`` (no request running or waiting, ``vllm:kv_cache_usage_perc`` 0: no leak) and
still serve a request.

Figures: turns completed, failed (by reason, the proxy's error text with ids and numbers
blanked), hung up; client TTFT p50/p99 of completed turns; mismatches against the plain
server; preemptions per server (``vllm:num_preemptions``); blocks still used after the
drain (leaks); wall time.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from kvferry.bench.util import percentile

COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class StressConfig:
    sessions: int = 48
    turns: int = 3
    first_prompt: tuple[int, int] = (200, 280)  # tokens, drawn per session in [lo, hi]
    new: int = 40  # tokens added per turn
    output: int = 96  # greedy tokens per turn
    hangup: float = 0.15  # fraction of turns whose client hangs up mid-stream
    # KV pools (blocks of 32 tokens): small enough that vLLM preempts on both servers.
    prefill_blocks: int = 28
    decode_blocks: int = 48
    max_num_seqs: int = 16
    chunk: int = 128  # max_num_batched_tokens
    request_timeout_s: float = 600.0  # a turn that takes longer counts as failed ("timeout")
    drain_s: float = 120.0  # both servers must hold nothing this long after the last turn
    seed: int = 0
    workdir: Optional[str] = None
    # The prefill server's late_host_bytes (docs/vllm.md): None its default (off); > 0 parks
    # prompts computed before their destination in that much host memory (the A/B).
    late_host_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        from kvferry.errors import InvalidArgumentError

        for name in ("sessions", "turns", "new", "output", "prefill_blocks", "decode_blocks", "max_num_seqs", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"invalid {name}={value!r}: must be a positive integer")
        lo, hi = self.first_prompt
        if not 1 <= lo <= hi:
            raise InvalidArgumentError(
                f"invalid first_prompt={self.first_prompt!r}: must be (lo, hi) with 1 <= lo <= hi"
            )
        if not 0.0 <= self.hangup <= 1.0:
            raise InvalidArgumentError(f"invalid hangup={self.hangup!r}: must be a fraction in [0, 1]")


@dataclass
class _Turn:
    session: int
    turn: int
    prompt: list[int]
    outcome: str = ""  # "done", "failed", "hung_up"
    tokens: Optional[list[int]] = None
    ttft_s: Optional[float] = None
    error: Optional[str] = None


def _reason(text: str) -> str:
    """An error's text with what differs per request blanked, so failures group by cause."""
    text = re.sub(r"\b[0-9a-f]{16,}\b", "<id>", text)
    text = re.sub(r"\d+(\.\d+)?", "<n>", text)
    return text[:200]


def _stream(
    base: str, prompt: list[int], output: int, hang_after: Optional[int], timeout_s: float
) -> tuple[str, Any, Optional[float]]:
    """One streamed turn through the proxy: ("done", tokens, ttft), ("failed", reason, ttft)
    or ("hung_up", None, ttft) after ``hang_after`` events."""
    from kvferry.vllm.testbed import sse_events

    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": output,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft: Optional[float] = None
    try:
        conn.request("POST", COMPLETIONS, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raw = r.read().decode(errors="replace")
            try:
                raw = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            return "failed", f"HTTP {r.status}: {raw}", None
        ids: list[int] = []
        events = 0
        for event in sse_events(r):
            if "error" in event:
                return "failed", f"stream error: {event['error'].get('message')}", ttft
            for choice in event.get("choices") or ():
                got = list(choice.get("token_ids") or [])
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += got
            events += 1
            if hang_after is not None and events >= hang_after:
                assert conn.sock is not None
                conn.sock.shutdown(socket.SHUT_RDWR)
                return "hung_up", None, ttft
        if len(ids) != output:
            return "failed", f"stream ended after {len(ids)} of {output} tokens", ttft
        return "done", ids, ttft
    except (OSError, http.client.HTTPException) as err:
        return "failed", f"{type(err).__name__}: {err}", ttft
    finally:
        conn.close()


def _session(cfg: StressConfig, base: str, index: int, out: list[_Turn], lock: threading.Lock) -> None:
    rng = random.Random(cfg.seed * 1_000_003 + index)
    prompt = [rng.randrange(1, 500) for _ in range(rng.randint(*cfg.first_prompt))]
    for t in range(cfg.turns):
        hang = rng.randint(1, 4) if rng.random() < cfg.hangup else None
        turn = _Turn(index, t, list(prompt))
        turn.outcome, got, turn.ttft_s = _stream(base, prompt, cfg.output, hang, cfg.request_timeout_s)
        if turn.outcome == "done":
            turn.tokens = got
            prompt = prompt + got
        elif turn.outcome == "failed":
            turn.error = got
        with lock:
            out.append(turn)
        prompt = prompt + [rng.randrange(1, 500) for _ in range(cfg.new)]


def _counter(text: str, name: str, label: str = "") -> float:
    """The sum of metric ``name``'s samples in ``text`` (those whose labels hold ``label``)."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line.split(" ", 1)[0]:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _drained(server: Any) -> bool:
    text = server.metrics()
    return (
        _counter(text, "vllm:num_requests_running") == 0
        and _counter(text, "vllm:num_requests_waiting") == 0
        and server.kv_blocks()[0] == 0
    )


def run_stress(cfg: StressConfig, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    from kvferry.vllm import testbed
    from kvferry.vllm.testbed import EngineSettings, Testbed, kvferry_config, single_server

    work = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="kvferry-stress-"))
    model = testbed.build_tiny_llama(work)
    block_bytes = 32 * testbed.RandomLlama().kv_bytes_per_token()
    need = cfg.first_prompt[1] + cfg.turns * (cfg.output + cfg.new)  # a session's longest request
    max_len = -(-(need + 1) // 32) * 32

    def engine(blocks: int) -> EngineSettings:
        # Admitted by their first chunk, several prefills growing together (32 tokens each
        # per step): running requests outgrow the pool and vLLM preempts.
        return EngineSettings(
            kv_cache_memory_bytes=blocks * block_bytes,
            max_num_batched_tokens=cfg.chunk,
            max_model_len=max_len,
            max_num_seqs=cfg.max_num_seqs,
            reserve_full_prompt=False,
            long_prefill_tokens=32,
        )

    if min(cfg.prefill_blocks, cfg.decode_blocks) * 32 < max_len:
        from kvferry.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"invalid stress geometry: sessions grow to {need} tokens and each pool must hold one "
            f"{max_len}-token request (prefill_blocks={cfg.prefill_blocks}, "
            f"decode_blocks={cfg.decode_blocks} blocks of 32)"
        )
    bed = Testbed(
        model,
        work,
        kvferry_config(
            "kv_producer", **({} if cfg.late_host_bytes is None else {"late_host_bytes": cfg.late_host_bytes})
        ),
        kvferry_config("kv_consumer"),
        engine=engine(cfg.prefill_blocks),
        decode_engine=engine(cfg.decode_blocks),
        proxy_connector="kvferry",
    )
    turns: list[_Turn] = []
    progress(
        f"starting a prefill ({cfg.prefill_blocks} blocks) and a decode server ({cfg.decode_blocks} blocks)"
        " behind kvferry proxy"
    )
    with bed:
        lock = threading.Lock()
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=_session, args=(cfg, bed.url, i, turns, lock), daemon=True)
            for i in range(cfg.sessions)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        progress(f"{len(turns)} turns in {wall:.1f} s; draining")
        deadline = time.monotonic() + cfg.drain_s
        while not all(_drained(s) for s in bed.servers()) and time.monotonic() < deadline:
            time.sleep(0.5)  # a polling interval, bounded by drain_s: the metrics decide
        leaks = {s.name: s.kv_blocks()[0] for s in bed.servers()}
        preemptions = {s.name: _counter(s.metrics(), "vllm:num_preemptions_total") for s in bed.servers()}
        parked = sum(_counter(s.metrics(), "vllm:kvferry_parked_prompts_total") for s in bed.servers())
        gave_up = 'reason="prefill_gave_up"'
        recomputed = sum(_counter(s.metrics(), "vllm:kvferry_unhonoured_total", gave_up) for s in bed.servers())
        still = _stream(bed.url, [7] * 90, 4, None, cfg.request_timeout_s)
    done = [t for t in turns if t.outcome == "done"]
    progress(f"checking {len(done)} completed turns against a plain server")
    mismatches = 0
    with single_server(model, work, EngineSettings(max_model_len=max_len)) as plain:
        for t in done:
            want = testbed.call(
                plain.url,
                COMPLETIONS,
                {"model": "tiny", "prompt": t.prompt, "max_tokens": cfg.output, "temperature": 0, "ignore_eos": True},
            )
            mismatches += want.token_ids != t.tokens
        still_ok = (
            still[0] == "done"
            and testbed.call(
                plain.url,
                COMPLETIONS,
                {"model": "tiny", "prompt": [7] * 90, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            ).token_ids
            == still[1]
        )
    ttfts = sorted(t.ttft_s for t in done if t.ttft_s is not None)
    return {
        "config": asdict(cfg),
        "turns": len(turns),
        "completed": len(done),
        "hung_up": sum(t.outcome == "hung_up" for t in turns),
        "failed": dict(Counter(_reason(t.error or "") for t in turns if t.outcome == "failed")),
        "ttft_p50_s": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
        "mismatches": mismatches,
        "preemptions": preemptions,
        "parked_prompts": parked,
        "computed_on_decode": recomputed,
        "leaked_blocks": leaks,
        "serves_after": still_ok,
        "wall_s": wall,
    }


def format_stress(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"kvferry bench vllm --stress: {cfg['sessions']} sessions x {cfg['turns']} turns, "
        f"{cfg['output']} output tokens, pools {cfg['prefill_blocks']}/{cfg['decode_blocks']} blocks (prefill/decode), "
        f"hang-ups {cfg['hangup']:.0%}"
        + ("" if cfg.get("late_host_bytes") is None else f", prefill late_host_bytes {cfg['late_host_bytes']}"),
        f"turns {result['turns']}: completed {result['completed']}, hung up {result['hung_up']}, "
        f"failed {sum(result['failed'].values())}",
    ]
    for reason, n in sorted(result["failed"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  failed x{n}: {reason}")
    p50, p99 = result["ttft_p50_s"], result["ttft_p99_s"]
    if p50 is not None:
        lines.append(f"TTFT p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms (completed turns, through the proxy)")
    lines.append(f"outputs differing from a plain server: {result['mismatches']}")
    lines.append("preemptions: " + ", ".join(f"{k} {v:.0f}" for k, v in result["preemptions"].items()))
    lines.append(f"prompts parked in host memory (computed before their destination): {result['parked_prompts']:.0f}")
    lines.append(
        "prompts the decode server computed (the prefill side gave them up before it admitted them): "
        f"{result['computed_on_decode']:.0f}"
    )
    lines.append(
        "blocks held after the drain (leaks): " + ", ".join(f"{k} {v}" for k, v in result["leaked_blocks"].items())
    )
    lines.append(f"serves a request afterwards: {result['serves_after']}; wall {result['wall_s']:.1f} s")
    return "\n".join(lines)
