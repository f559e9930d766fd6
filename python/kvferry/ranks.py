"""Which prefill rank sends which KV heads to which decode rank, under tensor parallelism.

A tensor-parallel engine splits a model's ``K`` KV heads over its ``T`` ranks the way vLLM
does: ``K >= T``: rank ``r`` holds heads ``[r K/T, (r+1) K/T)``; ``K < T``: each head is
replicated on ``T/K`` consecutive ranks, rank ``r`` holding head ``r K // T``. MLA's one
latent head is on every rank. Prefill and decode may split differently (``P != D``):

```
K = 8, P = 2, D = 4          prefill rank 0: heads 0-3      prefill rank 1: heads 4-7
                             |  d0: 0-1  |  d1: 2-3  |      |  d2: 4-5  |  d3: 6-7  |
links (p -> d, src -> dst):  0->0 [0,2)->[0,2)   0->1 [2,4)->[0,2)   1->2 ...   1->3 ...
K = 8, P = 4, D = 1          d0: heads 0-7, from p0 [0,2)->[0,2), p1 [0,2)->[2,4), p2, p3
K = 2, P = 4, D = 2          p0, p1 hold head 0; p2, p3 head 1: d0 <- p0, d1 <- p2 (one each)
MLA,   P = 2, D = 4          every rank holds the latent head: d0..d3 <- p0 (the lowest)
```
Each decode rank's every head comes from exactly one prefill rank, the lowest that holds
it (a replicated head is never sent twice), so a block crosses exactly once per (block,
decode rank). When both sides hold as many heads per rank, a link moves whole blocks of
both pools (``whole``); else each moves a head slice (`kvferry.layout.PagedKV.heads`).

Pipeline parallelism on the prefill side (``S`` stages, `staged_links`): stage ``s`` holds a
contiguous run of the model's layers, and its ranks are vLLM's global ranks ``s T + r``. Each
stage has the links above over its own layers; a decode rank receives each stage's part into
the run of its pool's layers that stage holds (`stage_slices`):
```
T = 1, S = 2, D = 1, 4 layers    d0 layers 0-1 <- p0 (stage 0)    d0 layers 2-3 <- p1 (stage 1)
```
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from kvferry.errors import InvalidArgumentError

__all__ = ["Link", "contributors", "feeds", "links", "rank_heads", "stage_slices", "staged_links"]


@dataclass(frozen=True)
class Link:
    """Prefill rank ``prefill_rank`` sends its local heads ``src_heads`` into decode rank
    ``decode_rank``'s local heads ``dst_heads`` (``[lo, hi)`` each, the same width);
    ``whole``: both are the whole of each rank's heads, and the blocks move whole. Under
    pipeline parallelism `staged_links` makes ``prefill_rank`` vLLM's global rank and names
    the ``stage`` whose layers the link moves."""

    prefill_rank: int
    decode_rank: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]
    whole: bool
    stage: int = 0


def _check_tp(name: str, tp: object) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InvalidArgumentError(f"invalid {name}={tp!r}: must be an int >= 1")
    return tp


def _check_heads(num_kv_heads: object, tp: int, name: str) -> int:
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise InvalidArgumentError(f"invalid num_kv_heads={num_kv_heads!r}: must be an int >= 1")
    if (num_kv_heads >= tp and num_kv_heads % tp) or (num_kv_heads < tp and tp % num_kv_heads):
        raise InvalidArgumentError(
            f"invalid {name}={tp} for num_kv_heads={num_kv_heads}: one must divide the other (as vLLM splits heads)"
        )
    return num_kv_heads


def rank_heads(rank: int, tp: int, num_kv_heads: int) -> tuple[int, int]:
    """The global heads ``[lo, hi)`` rank ``rank`` of ``tp`` holds (one head when they are
    replicated)."""
    _check_tp("tp", tp)
    _check_heads(num_kv_heads, tp, "tp")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise InvalidArgumentError(f"invalid rank={rank!r}: must be in [0, {tp})")
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return rank * per, (rank + 1) * per
    head = rank * num_kv_heads // tp
    return head, head + 1


def links(prefill_tp: int, decode_tp: int, num_kv_heads: int, *, mla: bool = False) -> tuple[Link, ...]:
    """Every (prefill rank, decode rank) pair that moves heads, by decode rank then prefill
    rank (the module doc has the rule and examples). ``mla``: one latent head on every rank
    (``num_kv_heads`` is then ignored)."""
    _check_tp("prefill_tp", prefill_tp)
    _check_tp("decode_tp", decode_tp)
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise InvalidArgumentError(
            f"invalid tensor parallel sizes prefill_tp={prefill_tp}, decode_tp={decode_tp}: one must divide the other"
        )
    if mla:
        return tuple(Link(0, d, (0, 1), (0, 1), True) for d in range(decode_tp))
    _check_heads(num_kv_heads, prefill_tp, "prefill_tp")
    _check_heads(num_kv_heads, decode_tp, "decode_tp")
    out: list[Link] = []
    for d in range(decode_tp):
        dlo, dhi = rank_heads(d, decode_tp, num_kv_heads)
        pieces: list[tuple[int, int, int]] = []  # (p, first global head, end)
        for g in range(dlo, dhi):
            p = g * prefill_tp // num_kv_heads  # the lowest prefill rank holding head g
            if pieces and pieces[-1][0] == p and pieces[-1][2] == g:
                pieces[-1] = (p, pieces[-1][1], g + 1)
            else:
                pieces.append((p, g, g + 1))
        for p, lo, hi in pieces:
            plo, phi = rank_heads(p, prefill_tp, num_kv_heads)
            whole = (plo, phi) == (dlo, dhi)
            out.append(Link(p, d, (lo - plo, hi - plo), (lo - dlo, hi - dlo), whole))
    return tuple(out)


def staged_links(
    prefill_tp: int, prefill_pp: int, decode_tp: int, num_kv_heads: int, *, mla: bool = False
) -> tuple[Link, ...]:
    """`links` once per pipeline stage of the prefill side, by stage: stage ``s``'s links
    carry ``stage=s`` and prefill rank ``s * prefill_tp + r`` (vLLM's global rank) for
    tensor-parallel rank ``r``. One stage: `links` itself."""
    _check_tp("prefill_pp", prefill_pp)
    one = links(prefill_tp, decode_tp, num_kv_heads, mla=mla)
    return tuple(
        replace(link, prefill_rank=s * prefill_tp + link.prefill_rank, stage=s)
        for s in range(prefill_pp)
        for link in one
    )


def stage_slices(layer_ids: Sequence[int], stages: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pool layers ``[lo, hi)`` each prefill stage writes, in stage order: ``stages``
    are the model's layers ``[first, end)`` each stage holds (vLLM's partition), ``layer_ids``
    the model's layer index of each pool layer, in pool order. Refuses a partition that does
    not cut the pool into contiguous runs, in order, covering it."""
    out: list[tuple[int, int]] = []
    at = 0
    ids = list(layer_ids)
    for stage, (first, end) in enumerate(stages):
        held = [i for i, layer in enumerate(ids) if first <= layer < end]
        if not held or held != list(range(at, at + len(held))):
            raise InvalidArgumentError(
                f"invalid stages={list(stages)}: stage {stage} holds the model's layers [{first}, {end}), "
                f"not the next contiguous run of the pool's layers {ids} (from pool layer {at})"
            )
        out.append((at, at + len(held)))
        at += len(held)
    if at != len(ids):
        raise InvalidArgumentError(
            f"invalid stages={list(stages)}: they hold {at} of the pool's {len(ids)} layers {ids}"
        )
    return out


def feeds(prefill_rank: int, all_links: tuple[Link, ...]) -> tuple[Link, ...]:
    """The links prefill rank ``prefill_rank`` sends on (possibly none: a replicated head
    is sent by its lowest rank only)."""
    return tuple(link for link in all_links if link.prefill_rank == prefill_rank)


def contributors(decode_rank: int, all_links: tuple[Link, ...]) -> tuple[Link, ...]:
    """The links decode rank ``decode_rank`` receives on: its request has arrived once
    every block of each of them landed."""
    return tuple(link for link in all_links if link.decode_rank == decode_rank)
