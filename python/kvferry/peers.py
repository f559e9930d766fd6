r"""`MultiPeerSender`: one context (prefill) worker sending to many generation (decode)
workers at once.

```
                       MultiPeerSender (executor thread, one call per step)
  add(rid, ..., peer=p)    |  send_early / send_chunks / send_layers (the whole batch)
                           |  split by peer: rows of the batch's tables, one plan per peer
           +---------------+----------------+
      KVSender "a"     KVSender "b"     KVSender "c"      one book, ledger and transport each
           \               |               /
            +------ one copy engine ------+                (each sender borrows it)
                           |
        transport a    transport b    transport c  --> receivers a, b, c
```
Each request names its peer when it is added; its blocks, notices and fence go to that peer
only. Every peer has its own `KVSender` (book, transport, failures) over the same source
pool, and all borrow one copy engine, so the copies of every peer queue on one stream (or
thread) in submission order, as they would for one peer. A peer that dies fails only its own
requests: the others keep sending and posting; the step call or `poll` that found the loss
raises a `TransferError` naming just those requests, after every other peer's part was
dispatched or posted.

The peers are fixed at construction: a tier copy declared with `order_after` applies to
every peer (a request of any peer may read the blocks).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence, Union

import numpy as np

from kvferry._core import RequestSpec, TransferLedger
from kvferry.engine import CopyEngine, Pending, engine_for
from kvferry.errors import InvalidArgumentError, TransferError, UnknownRequestError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.sender import IntArray, KVSender, TransferRecord, request_spec
from kvferry.tiers import Signal
from kvferry.transports.base import Transport

__all__ = ["MultiPeerSender"]


class _LentEngine(CopyEngine):
    """One peer's view of the shared engine: submits to it, and at `close` waits only for
    the copies this peer queued (they read its source blocks and write its receiver's pool)
    instead of closing the engine every peer uses."""

    def __init__(self, engine: CopyEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._pending: list[Pending] = []

    def _keep(self, pending: Pending) -> Pending:
        with self._lock:
            self._pending = [p for p in self._pending if not p.done()]
            self._pending.append(pending)
        return pending

    def submit(
        self,
        src: PagedKV,
        dst: PagedKV,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        *,
        after: Sequence[Signal] = (),
        before: Optional[Callable[[], None]] = None,
    ) -> Pending:
        return self._keep(self._engine.submit(src, dst, src_ids, dst_ids, after=after, before=before))

    def submit_call(self, work: Callable[[], None], *, after: Sequence[Signal] = (), nbytes: int = 0) -> Pending:
        return self._keep(self._engine.submit_call(work, after=after, nbytes=nbytes))

    def close(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for p in pending:
            p.wait(None)


class MultiPeerSender:
    """Owned by the executor thread: the `KVSender` interface over several receivers.
    ``transports`` maps each peer's name to its transport (`kvferry.transports.registry
    .connect`); the other keyword arguments are `KVSender`'s, applied to every peer. The
    copy engine (``engine``, default the pool's) is shared and closed by `close`."""

    def __init__(
        self,
        pool: PagedKV,
        transports: Mapping[Hashable, Transport],
        *,
        engine: Optional[CopyEngine] = None,
        **options: object,
    ) -> None:
        if not transports:
            raise InvalidArgumentError("invalid transports={}: name at least one peer")
        self.pool = pool
        self.engine = engine if engine is not None else engine_for(pool)
        self.peers: dict[Hashable, KVSender] = {}
        try:
            for name, transport in transports.items():
                self.peers[name] = KVSender(pool, transport, engine=_LentEngine(self.engine), **options)  # type: ignore[arg-type]
        except BaseException:
            for sender in self.peers.values():
                sender.close()
            self.engine.close()
            raise
        first = next(iter(self.peers.values()))
        self.layer_groups = first.layer_groups
        self.host_pool = first.host_pool
        self._peer_of: dict[int, Hashable] = {}

    @property
    def records(self) -> Optional[list[TransferRecord]]:
        """Every peer's finished writes (``record=True``), in order of their submission."""
        lists = [s.records for s in self.peers.values()]
        if any(r is None for r in lists):
            return None
        return sorted((r for rs in lists for r in rs or ()), key=lambda r: r.submitted)

    def peer_of(self, request_id: int) -> Hashable:
        """The peer a registered request goes to."""
        try:
            return self._peer_of[request_id]
        except KeyError:
            raise UnknownRequestError(f"unknown request_id={request_id}: never added or already removed") from None

    def add(
        self, request_id: int, spec: Union[RequestSpec, int, None] = None, *, peer: Hashable, **fields: Any
    ) -> None:
        """Registers a request bound for ``peer`` (``spec`` and ``fields`` as in
        `KVSender.add`): request ids are unique across peers."""
        spec = request_spec(spec, fields)
        if peer not in self.peers:
            raise InvalidArgumentError(
                f"invalid peer={peer!r}: not one of this sender's peers ({', '.join(map(repr, self.peers))})"
            )
        if request_id in self._peer_of:
            raise InvalidArgumentError(
                f"invalid request_id={request_id}: already registered for peer {self._peer_of[request_id]!r}"
            )
        self.peers[peer].add(request_id, spec)
        self._peer_of[int(request_id)] = peer

    def _split(
        self, request_ids: IntArray, columns: Sequence[tuple[str, IntArray]]
    ) -> list[tuple[Hashable, np.ndarray]]:
        """The batch's rows, grouped by peer (in the peers' order), after checking that every
        id is registered and every per-request argument holds one entry per request."""
        ids = np.asarray(request_ids)
        if ids.ndim != 1:
            raise InvalidArgumentError(f"invalid request_ids=<shape {ids.shape}>: must be one-dimensional")
        for name, values in columns:
            n = len(np.asarray(values))
            if n != len(ids):
                raise InvalidArgumentError(f"invalid {name}=<{n} rows>: must hold one per request ({len(ids)})")
        peer_rows: dict[Hashable, list[int]] = {}
        for row, rid in enumerate(ids.tolist()):
            peer_rows.setdefault(self.peer_of(rid), []).append(row)
        return [(p, np.asarray(peer_rows[p], dtype=np.int64)) for p in self.peers if p in peer_rows]

    def _each(
        self, parts: list[tuple[Hashable, np.ndarray]], call: Callable[[KVSender, np.ndarray], list[Notice]]
    ) -> list[Notice]:
        """Runs ``call`` for every peer's rows. A peer that is lost (or whose write failed)
        does not stop the others: their parts go out, then its error is raised. A refused
        argument is raised at once (the peers before it were dispatched)."""
        notices: list[Notice] = []
        errors: list[TransferError] = []
        for peer, rows in parts:
            try:
                notices += call(self.peers[peer], rows)
            except TransferError as err:
                errors.append(err)
        if errors:
            raise _combined(errors)
        return notices

    def _by_peer(self, send: Callable[..., list[Notice]], request_ids: IntArray, **columns: IntArray) -> list[Notice]:
        """``send(sender, ids, **rows)`` for every peer's sender, with that peer's request ids
        and its rows of each per-request argument in ``columns`` (checked by `_split`)."""
        ids = np.asarray(request_ids)
        arrays = {name: np.asarray(values) for name, values in columns.items()}
        parts = self._split(ids, tuple(arrays.items()))
        return self._each(parts, lambda s, rows: send(s, ids[rows], **{n: a[rows] for n, a in arrays.items()}))

    def send_early(self, request_ids: IntArray, src_block_table: IntArray, dst_block_table: IntArray) -> list[Notice]:
        """Before the context forward: the complete reused blocks of the eligible requests,
        each to its own peer (`KVSender.send_early`)."""
        return self._by_peer(
            KVSender.send_early, request_ids, src_block_table=src_block_table, dst_block_table=dst_block_table
        )

    def send_chunks(
        self,
        request_ids: IntArray,
        chunk_starts: IntArray,
        chunk_ends: IntArray,
        src_block_table: IntArray,
        dst_block_table: IntArray,
    ) -> list[Notice]:
        """After a context forward: the blocks each finished chunk completed (`KVSender.send_chunks`)."""
        return self._by_peer(
            KVSender.send_chunks,
            request_ids,
            chunk_starts=chunk_starts,
            chunk_ends=chunk_ends,
            src_block_table=src_block_table,
            dst_block_table=dst_block_table,
        )

    def send_layers(
        self,
        request_ids: IntArray,
        chunk_starts: IntArray,
        chunk_ends: IntArray,
        group: int,
        src_block_table: IntArray,
        dst_block_table: IntArray,
    ) -> list[Notice]:
        """During a context forward: layer group ``group`` of the blocks each chunk completes
        (`KVSender.send_layers`)."""
        return self._by_peer(
            lambda sender, ids, **rows: sender.send_layers(ids, group=group, **rows),
            request_ids,
            chunk_starts=chunk_starts,
            chunk_ends=chunk_ends,
            src_block_table=src_block_table,
            dst_block_table=dst_block_table,
        )

    def order_after(self, src_ids: IntArray, signal: Signal) -> None:
        """The tier is writing source blocks ``src_ids`` until ``signal``: every peer's later
        copies that read them wait for it (`KVSender.order_after`)."""
        for sender in self.peers.values():
            sender.order_after(src_ids, signal)

    def poll(self) -> list[Notice]:
        """Posts every peer's finished copies; a lost peer's error is raised once the others posted."""
        return self._each([(p, np.empty(0, dtype=np.int64)) for p in self.peers], lambda s, _: s.poll())

    def flush(self, timeout: Optional[float] = None) -> list[Notice]:
        """Waits for every peer's queued copies (``timeout`` for each peer) and posts them."""
        return self._each([(p, np.empty(0, dtype=np.int64)) for p in self.peers], lambda s, _: s.flush(timeout))

    def in_flight(self, request_id: int) -> bool:
        return self.peers[self.peer_of(request_id)].in_flight(request_id)

    def leased(self, request_id: int) -> bool:
        """See `KVSender.leased`; false for a request no peer knows (removed or never added)."""
        peer = self._peer_of.get(request_id)
        return peer is not None and self.peers[peer].leased(request_id)

    def failures(self) -> dict[int, TransferError]:
        """Every peer's unacknowledged failures (`KVSender.failures`)."""
        out: dict[int, TransferError] = {}
        for sender in self.peers.values():
            out.update(sender.failures())
        return out

    def cancel(self, request_id: int, timeout: Optional[float] = 5.0) -> TransferLedger:
        """See `KVSender.cancel`; the request is forgotten once it returns."""
        ledger = self.peers[self.peer_of(request_id)].cancel(request_id, timeout)
        del self._peer_of[request_id]
        return ledger

    def remove(self, request_id: int) -> TransferLedger:
        """See `KVSender.remove`."""
        ledger = self.peers[self.peer_of(request_id)].remove(request_id)
        del self._peer_of[request_id]
        return ledger

    def close(self) -> None:
        """Closes every peer's sender (each finishes or aborts its copies, posts its fences,
        closes its transport), then the shared engine. The first error is raised after all
        were closed."""
        first: Optional[BaseException] = None
        for sender in self.peers.values():
            try:
                sender.close()
            except BaseException as err:  # the others still close
                first = first or err
        self.engine.close()
        if first is not None:
            raise first


def _combined(errors: list[TransferError]) -> TransferError:
    """One error for a call that lost several peers: every failed request, every peer."""
    if len(errors) == 1:
        return errors[0]
    ids = sorted({r for e in errors for r in e.request_ids})
    peers = "; ".join(str(e.peer) for e in errors)
    return TransferError(
        f"{len(errors)} peers failed: " + " | ".join(str(e) for e in errors), request_ids=ids, peer=peers
    )
