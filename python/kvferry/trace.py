"""Per-request traces: one JSON line per stage of each transfer, on both servers, under the
transfer id the proxy gave both halves; `merge` puts the two servers' lines into one timeline
per transfer (``kvferry trace FILES...``, docs/vllm.md "Tracing a request").

```
prefill server (trace file A)                      decode server (trace file B)
plan            prompt, reused, blocks, held        plan         blocks expected, held
early_issued    before the first forward
early_landed    blocks [s, e), bytes, issued_t  --> (the writes land in the decode pool)
chunk_issued    chunk n, tokens [s, e)
chunk_landed    chunk n, blocks, bytes, issued_t
layer_landed    group g of G, blocks, bytes
tail_landed     the last write landed               tail_landed  every block arrived
freed           vLLM may free the blocks            freed        the request's blocks released
failed          reason                              failed       reason
```
A line is ``{"kvferry_trace": 1, "t": <unix seconds>, "side": "prefill"|"decode", "engine":
<kvferry engine id>, "transfer": <id>, "req": <vLLM request id>, "stage": <stage>, ...}``;
the fields past ``stage`` are the stage's own (SCHEMA below). Times are each server's wall
clock: across hosts, the merged timeline is as good as the two clocks' agreement (NTP: about
a millisecond). A trace line never carries key material or KV bytes; tracing is off unless
``kv_connector_extra_config.trace`` names a file.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from kvferry.errors import InvalidArgumentError

__all__ = ["SCHEMA", "STAGES", "Timeline", "Tracer", "draw", "format_timelines", "merge", "read", "save_with_legend"]

VERSION = 1
# stage -> the fields it carries beyond the common ones (docs/vllm.md lists them too).
SCHEMA: dict[str, tuple[str, ...]] = {
    "plan": ("prompt", "reused", "blocks", "held"),
    "early_issued": ("blocks",),
    "early_landed": ("start", "end", "bytes", "issued_t"),
    "chunk_issued": ("chunk", "tokens"),
    "chunk_landed": ("chunk", "start", "end", "bytes", "issued_t"),
    "layer_landed": ("group", "groups", "start", "end", "bytes", "issued_t"),
    "tail_landed": ("bytes",),
    "freed": (),
    "failed": ("reason",),
}
STAGES = tuple(SCHEMA)
COMMON = ("kvferry_trace", "t", "side", "engine", "transfer", "req", "stage")
SIDES = ("prefill", "decode")


class Tracer:
    """Appends trace lines to ``path`` (0600: made so, or an existing file of ours made so),
    or does nothing when ``path`` is None. One `os.write` per line on an O_APPEND descriptor:
    the processes of one server (or both servers) may share a file and their lines never
    interleave."""

    def __init__(self, path: Optional[str], *, engine: str) -> None:
        self.engine = engine
        self.path = None if path is None else os.path.expanduser(path)
        self._fd: Optional[int] = None
        if self.path is not None:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
                # A file that was there already keeps its mode on open: trace lines name every
                # transfer and request, so one of ours readable by others is made 0600 too.
                st = os.fstat(self._fd)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
                    os.fchmod(self._fd, 0o600)
            except OSError as err:
                if self._fd is not None:
                    os.close(self._fd)
                raise InvalidArgumentError(
                    f"invalid kv_connector_extra_config trace={path!r}: cannot open it for appending: {err.strerror}"
                ) from err
        # Writes carry monotonic times (the sender's records); this turns them into wall time.
        self._offset = time.time() - time.monotonic()
        # (transfer, stage) -> chunks counted so far: chunk n of a transfer, for its live ones.
        self._chunks: dict[tuple[str, str], int] = {}

    @property
    def on(self) -> bool:
        return self._fd is not None

    def wall(self, monotonic: float) -> float:
        """The wall-clock time of a `time.monotonic` reading of this process."""
        return self._offset + monotonic

    def event(
        self, side: str, stage: str, transfer: str, req: str, *, t: Optional[float] = None, **fields: Any
    ) -> None:
        """One line: ``stage`` of ``transfer`` (vLLM request ``req``) on this server's ``side``,
        at ``t`` (wall seconds; now when omitted), with the stage's ``fields``."""
        if self._fd is None:
            return
        assert side in SIDES and set(fields) == set(SCHEMA[stage]), (side, stage, sorted(fields))
        row = {
            "kvferry_trace": VERSION,
            "t": round(time.time() if t is None else t, 6),
            "side": side,
            "engine": self.engine,
            "transfer": transfer,
            "req": req,
            "stage": stage,
        }
        row.update(fields)
        try:
            os.write(self._fd, (json.dumps(row, separators=(",", ":")) + "\n").encode())
        except OSError:  # a full disk must not fail a transfer: the trace has a gap instead
            pass

    def chunk(self, side: str, transfer: str, req: str, start: int, end: int) -> None:
        """``chunk_issued``: the forward of prompt tokens [start, end) ended (chunk n: counted here)."""
        if self._fd is not None:
            self.event(
                side,
                "chunk_issued",
                transfer,
                req,
                chunk=self._count(transfer, "chunk_issued"),
                tokens=[int(start), int(end)],
            )

    def write(
        self, side: str, transfer: str, req: str, kind: str, notice: Any, nbytes: int, submitted: float, finished: float
    ) -> None:
        """``<kind>_landed`` for one write record's ``notice`` (kvferry.sender.TransferRecord:
        ``kind`` early, chunk or layer, monotonic ``submitted``/``finished``)."""
        if self._fd is None:
            return
        fields: dict[str, Any] = {
            "start": int(notice.start),
            "end": int(notice.end),
            "bytes": int(nbytes),
            "issued_t": round(self.wall(submitted), 6),
        }
        if kind == "chunk":
            fields["chunk"] = self._count(transfer, "chunk_landed")
        elif kind == "layer":
            fields.update(group=int(notice.group), groups=int(notice.groups))
        self.event(side, f"{kind}_landed", transfer, req, t=self.wall(finished), **fields)

    def ended(
        self,
        side: str,
        transfer: str,
        req: str,
        reason: Optional[str] = None,
        *,
        nbytes: int = 0,
        t: Optional[float] = None,
    ) -> None:
        """How ``transfer`` ended on ``side``: ``tail_landed`` (at ``t``, ``nbytes`` in all) or
        ``failed`` with ``reason``, then ``freed`` (its blocks go back to vLLM)."""
        if self._fd is None:
            return
        if reason is None:
            self.event(side, "tail_landed", transfer, req, t=t, bytes=int(nbytes))
        else:
            self.event(side, "failed", transfer, req, reason=reason)
        self.event(side, "freed", transfer, req)
        self._chunks.pop((transfer, "chunk_issued"), None)
        self._chunks.pop((transfer, "chunk_landed"), None)

    def _count(self, transfer: str, stage: str) -> int:
        n = self._chunks[(transfer, stage)] = self._chunks.get((transfer, stage), 0) + 1
        return n

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Every trace line in ``paths``, in file order. A line that is not a kvferry trace line
    (a server log may hold both) is skipped; a trace line of another version, or one missing
    a field, raises `InvalidArgumentError` naming the file and line."""
    rows = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
        except OSError as err:
            raise InvalidArgumentError(f"invalid trace file {path!r}: {err.strerror}") from err
        for n, line in enumerate(lines, start=1):
            at = line.find('{"kvferry_trace"')
            if at < 0:
                continue
            try:
                row = json.loads(line[at:])
            except ValueError as err:
                raise InvalidArgumentError(f"invalid trace line {path}:{n}: not JSON ({err})") from None
            version = row.get("kvferry_trace") if isinstance(row, dict) else None
            if version != VERSION:
                raise InvalidArgumentError(
                    f"invalid trace line {path}:{n}: kvferry_trace={version!r}, this kvferry reads version {VERSION}"
                )
            stage = row.get("stage")
            missing = [k for k in (*COMMON, *SCHEMA.get(stage, ())) if k not in row]
            if stage not in SCHEMA or missing:
                raise InvalidArgumentError(
                    f"invalid trace line {path}:{n}: stage={stage!r}" + (f", missing {missing}" if missing else "")
                )
            rows.append(row)
    return rows


@dataclass
class Timeline:
    """One transfer's lines from both servers, in time order."""

    transfer: str
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def start(self) -> float:
        return min(r["t"] for r in self.rows)

    @property
    def sides(self) -> set[str]:
        return {r["side"] for r in self.rows}

    def ended(self, side: str) -> Optional[str]:
        """How ``side`` ended it: "tail_landed", "failed" or None (still open in the trace)."""
        stages = [r["stage"] for r in self.rows if r["side"] == side]
        return "failed" if "failed" in stages else "tail_landed" if "tail_landed" in stages else None


def merge(rows: Iterable[dict[str, Any]], transfers: Optional[Sequence[str]] = None) -> list[Timeline]:
    """One `Timeline` per transfer id (only ``transfers`` when given), ordered by their first
    line; lines of one time keep their file order (a stable sort)."""
    by: dict[str, Timeline] = {}
    for row in rows:
        if transfers is None or row["transfer"] in transfers:
            by.setdefault(row["transfer"], Timeline(row["transfer"])).rows.append(row)
    for tl in by.values():
        tl.rows.sort(key=lambda r: r["t"])
    return sorted(by.values(), key=lambda tl: tl.start)


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def _what(row: dict[str, Any]) -> str:
    s = row["stage"]
    if s == "plan":
        held = f"{row['held']} held by the decode side"
        return f"prompt {row['prompt']} tokens, {row['reused']} reused, {row['blocks']} blocks, {held}"
    if s == "early_issued":
        return f"early send of the prefix asked ({row['blocks']} blocks)"
    if s == "chunk_issued":
        return f"chunk {row['chunk']} computed, tokens [{row['tokens'][0]}, {row['tokens'][1]})"
    if s.endswith("_landed") and s != "tail_landed":
        what = {
            "early_landed": "early",
            "chunk_landed": f"chunk {row.get('chunk')}",
            "layer_landed": f"layer group {row.get('group')}/{row.get('groups')}",
        }[s]
        took = (row["t"] - row["issued_t"]) * 1e3
        return f"{what} landed: blocks [{row['start']}, {row['end']}), {_size(row['bytes'])} in {took:.2f} ms"
    if s == "tail_landed":
        return f"every block landed ({_size(row['bytes'])})" if row["side"] == "prefill" else "every block arrived"
    if s == "failed":
        return f"FAILED: {row['reason']}"
    return "blocks freed" if row["side"] == "prefill" else "blocks released to vLLM"


def format_timelines(timelines: Sequence[Timeline]) -> str:
    """The text timeline: per transfer, each line's time since the transfer's first line."""
    out = []
    for tl in timelines:
        t0 = tl.start
        span = (max(r["t"] for r in tl.rows) - t0) * 1e3
        ends = ", ".join(f"{side} {tl.ended(side) or 'open'}" for side in SIDES if side in tl.sides)
        out.append(f"transfer {tl.transfer}  ({span:.2f} ms, {ends})")
        for r in tl.rows:
            out.append(f"  {(r['t'] - t0) * 1e3:+10.2f} ms  {r['side']:<7}  {r['stage']:<13} {_what(r)}")
        out.append("")
    return "\n".join(out)


def save_with_legend(fig: Any, handles: dict[str, Any], order: Sequence[str], path: str) -> None:
    """Writes a timeline figure to the PNG ``path`` with its legend right of the lanes: the
    entries of ``handles`` in ``order`` (those drawn), then closes it (``bench agentic``'s
    timeline and `draw` share the look)."""
    import matplotlib.pyplot as plt

    names = [n for n in order if n in handles]
    fig.legend(
        [handles[n] for n in names], names, loc="center left", bbox_to_anchor=(0.82, 0.5), fontsize=8, frameon=False
    )
    fig.tight_layout(rect=(0, 0, 0.81, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(timelines: Sequence[Timeline], path: str) -> None:
    """One row per transfer: the prefill side's writes as bars from issued to landed (early,
    chunk, layer colours as in ``bench agentic``'s timeline), its stage marks above, the
    decode side's below; time since each transfer's first line."""
    from kvferry._optional import require

    matplotlib = require("matplotlib", "the trace PNG (--png)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"early_landed": "#dd8452", "chunk_landed": "#55a868", "layer_landed": "#8172b3"}
    marks = {
        "plan": ("o", "#4c72b0"),
        "tail_landed": ("|", "black"),
        "freed": ("x", "#777777"),
        "failed": ("X", "#c44e52"),
    }
    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.75 * len(timelines)))
    handles: dict[str, Any] = {}
    for y, tl in enumerate(timelines):
        t0 = tl.start
        for r in tl.rows:
            x = (r["t"] - t0) * 1e3
            dy = -0.2 if r["side"] == "prefill" else 0.2
            if r["stage"] in colors:
                a = (r["issued_t"] - t0) * 1e3
                label = r["stage"].replace("_landed", " write")
                handles[label] = ax.broken_barh([(a, max(x - a, 0.02))], (y - 0.35, 0.3), color=colors[r["stage"]])
            elif r["stage"] in marks:
                marker, color = marks[r["stage"]]
                (handles[f"{r['stage']}"],) = ax.plot(
                    [x], [y + dy], marker=marker, color=color, markersize=9, linestyle="none"
                )
            if r["stage"] == "tail_landed" and r["side"] == "decode":
                (handles["decode: all arrived"],) = ax.plot(
                    [x], [y + 0.25], marker="v", color="#c44e52", markersize=9, linestyle="none"
                )
    ax.set_yticks(range(len(timelines)), [tl.transfer[:12] for tl in timelines])
    ax.set_ylim(-0.7, len(timelines) - 0.3)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the transfer's first trace line (prefill marks above each row's bars, decode marks below)")
    ax.set_title("kvferry trace: per transfer, both servers (kvferry trace)", fontsize=9)
    order = [
        "plan",
        "early write",
        "chunk write",
        "layer write",
        "tail_landed",
        "decode: all arrived",
        "freed",
        "failed",
    ]
    save_with_legend(fig, handles, order, path)
