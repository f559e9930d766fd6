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
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.errors import InvalidArgumentError

__all__ = ["Link", "contributors", "feeds", "links", "rank_heads"]


@dataclass(frozen=True)
class Link:
    """Prefill rank ``prefill_rank`` sends its local heads ``src_heads`` into decode rank
    ``decode_rank``'s local heads ``dst_heads`` (``[lo, hi)`` each, the same width);
    ``whole``: both are the whole of each rank's heads, and the blocks move whole."""

    prefill_rank: int
    decode_rank: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]
    whole: bool


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


def feeds(prefill_rank: int, all_links: tuple[Link, ...]) -> tuple[Link, ...]:
    """The links prefill rank ``prefill_rank`` sends on (possibly none: a replicated head
    is sent by its lowest rank only)."""
    return tuple(link for link in all_links if link.prefill_rank == prefill_rank)


def contributors(decode_rank: int, all_links: tuple[Link, ...]) -> tuple[Link, ...]:
    """The links decode rank ``decode_rank`` receives on: its request has arrived once
    every block of each of them landed."""
    return tuple(link for link in all_links if link.decode_rank == decode_rank)
