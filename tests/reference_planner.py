"""A small pure-Python planner: the oracle the Rust planner is checked against, and the
baseline the benchmarks compare with. Written straight from the semantics in docs/design.md,
favouring obviousness over speed. Ranges are ``(start, end)`` tuples or ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

Range = Optional[tuple[int, int]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def early_prefix_blocks(tpb: int, reused_len: int) -> Range:
    n = reused_len // tpb
    return (0, n) if n > 0 else None


def live_window(tpb: int, prompt_len: int, window: Optional[int]) -> tuple[int, int]:
    """Blocks the decoder needs: all, or those the window still covers."""
    if window is None or window >= prompt_len:
        return (0, cdiv(prompt_len, tpb))
    return (max(0, (prompt_len + 1 - window) // tpb), cdiv(prompt_len, tpb))


def chunk_blocks(
    tpb: int,
    prompt_len: int,
    start: int,
    end: int,
    *,
    reused_len: int = 0,
    prefix_sent: bool = False,
    window: Optional[int] = None,
) -> Range:
    assert reused_len <= start < end <= prompt_len
    last = end == prompt_len
    if window is not None and window < prompt_len:
        lo, hi = live_window(tpb, prompt_len, window)
        # W = 1 on a block boundary needs no prompt KV: nothing to send.
        return (lo, hi) if last and hi > lo else None
    first = start == reused_len
    lo = 0 if (first and not prefix_sent) else start // tpb
    hi = cdiv(end, tpb) if last else end // tpb
    if hi <= lo:
        return None
    return (lo, hi)


class DuplicateClaim(Exception):
    pass


@dataclass
class RefLedger:
    tpb: int
    prompt_len: int
    reused_len: int = 0
    window: Optional[int] = None
    claimed: set[int] = field(default_factory=set)
    prefix_sent: bool = False
    forward_started: bool = False

    @property
    def num_blocks(self) -> int:
        return cdiv(self.prompt_len, self.tpb)

    def full_attention(self) -> bool:
        return self.window is None or self.window >= self.prompt_len

    def claim(self, r: tuple[int, int]) -> None:
        blocks = set(range(*r))
        if blocks & self.claimed:
            raise DuplicateClaim(min(blocks & self.claimed))
        self.claimed |= blocks

    def early_candidate(self) -> Range:
        if self.forward_started or not self.full_attention():
            return None
        return early_prefix_blocks(self.tpb, self.reused_len)

    def send_early(self) -> Range:
        r = self.early_candidate()
        if r is not None:
            self.claim(r)
            self.prefix_sent = True
        return r

    def send_chunk(self, start: int, end: int) -> Range:
        r = chunk_blocks(
            self.tpb,
            self.prompt_len,
            start,
            end,
            reused_len=self.reused_len,
            prefix_sent=self.prefix_sent,
            window=self.window,
        )
        if r is not None:
            self.claim(r)
        self.forward_started = True
        return r

    def missing(self) -> list[tuple[int, int]]:
        lo, hi = live_window(self.tpb, self.prompt_len, self.window)
        runs: list[tuple[int, int]] = []
        for b in range(lo, hi):
            if b in self.claimed:
                continue
            if runs and runs[-1][1] == b:
                runs[-1] = (runs[-1][0], b + 1)
            else:
                runs.append((b, b + 1))
        return runs

    def is_complete(self) -> bool:
        return not self.missing()


@dataclass
class RefBook:
    """Per-request dict of ledgers; one Python call per request, as a pure-Python executor
    would do it."""

    tpb: int
    pipelined: bool = True
    ledgers: dict[int, RefLedger] = field(default_factory=dict)
    context_only: dict[int, bool] = field(default_factory=dict)
    cancelled: set[int] = field(default_factory=set)

    def add(self, rid: int, prompt_len: int, *, reused_len: int = 0, window=None, context_only=True) -> None:
        self.ledgers[rid] = RefLedger(self.tpb, prompt_len, reused_len, window)
        self.context_only[rid] = context_only

    def plan_early(self, ids) -> list[tuple[int, int, int, int]]:
        """(batch index, request id, start, end) per early slice."""
        out: list[tuple[int, int, int, int]] = []
        if not self.pipelined:
            return out
        for i, rid in enumerate(ids):
            led = self.ledgers[rid]
            if not self.context_only[rid] or rid in self.cancelled or led.prefix_sent:
                continue
            r = led.send_early()
            if r is not None:
                out.append((i, rid, r[0], r[1]))
        return out

    def plan_chunks(self, ids, starts, ends) -> list[tuple[int, int, int, int]]:
        out: list[tuple[int, int, int, int]] = []
        for i, rid in enumerate(ids):
            r = self.ledgers[rid].send_chunk(int(starts[i]), int(ends[i]))
            if r is not None:
                out.append((i, rid, r[0], r[1]))
        return out


def block_pairs(slices, src_table, dst_table) -> tuple[list[int], list[int]]:
    """Physical (src, dst) ids for (batch index, request id, start, end) slices."""
    src: list[int] = []
    dst: list[int] = []
    for i, _rid, s, e in slices:
        for b in range(s, e):
            src.append(int(src_table[i][b]))
            dst.append(int(dst_table[i][b]))
    return src, dst


def block_runs(slices, src_table, dst_table) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs, never crossing a slice."""
    runs: list[tuple[int, int, int]] = []
    for i, _rid, s, e in slices:
        first = len(runs)
        for b in range(s, e):
            ps, pd = int(src_table[i][b]), int(dst_table[i][b])
            if len(runs) > first:
                rs, rd, n = runs[-1]
                if ps == rs + n and pd == rd + n:
                    runs[-1] = (rs, rd, n + 1)
                    continue
            runs.append((ps, pd, 1))
    return runs
