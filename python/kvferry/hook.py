"""The executor hook: what an engine's scheduler loop calls around its context forwards.

```
plain loop:     before_forward(batch) -> forward(batch) -> after_forward(batch, chunks)
overlap loop:   on_batch_queued(batch n+1) while batch n runs -> ... -> after_forward(n+1)
layer-wise:     forward(batch): layer 0 .. after_layer(batch, chunks, 0) .. layer L-1 ..
                after_layer(batch, chunks, L-1) -> after_forward(batch, chunks)
```
``before_forward`` / ``on_batch_queued`` send the complete reused-prefix blocks of every
eligible request of the batch (context-only, not cancelled, first chunk, a complete reused
block, pipelined transfer on); ``after_forward`` sends what each finished chunk completed.
``after_layer`` (layer-wise streaming, a sender with ``layer_groups > 1``) sends, during the
last chunk's forward, each layer group's layers of the chunk's blocks as soon as the group's
last layer wrote its K and V. None of them waits on earlier transfers, on room in the
transport or on the network: copies are queued (or kept in the sender's backlog while a
staging ring is full), and each one's notices are posted once it landed (by the sender's
announcer thread; with ``KVSender(progress=False)`` by `poll`). A `cancel` with
``timeout=0`` revokes at once (its backlogged writes dropped) and raises only while a copy
already running still reads the request's blocks.

Leases: a request's source blocks belong to the transfer from `add_request` until `finish`
or `cancel` returns (`leased` says so); the engine keeps its references to them (so that no
prefix-cache eviction or reallocation can take them) until then. Its destination blocks are
leased under the ``epoch`` the generation side's `KVReceiver.expect` issued.

Host tier: with ``KVSender(..., host_pool=...)`` a request's source block ids may name host-tier
blocks (``pool.num_blocks + host id``), read straight from host memory; `order_after` tells the
hook about the tier's own copies (onboards, offloads) still writing blocks a send will read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

from kvferry._core import RequestSpec, TransferLedger
from kvferry.errors import InvalidArgumentError, UnknownRequestError
from kvferry.layout import block_id_array
from kvferry.notice import Notice
from kvferry.sender import KVSender, as_table, request_spec
from kvferry.tiers import Signal

if TYPE_CHECKING:
    from kvferry.peers import MultiPeerSender

__all__ = ["TransferHook"]


class TransferHook:
    """Owned by the executor thread, next to the engine's scheduler."""

    def __init__(self, sender: Union[KVSender, "MultiPeerSender"]) -> None:
        """``sender``: a `KVSender` (one receiver) or a `kvferry.peers.MultiPeerSender`
        (several: each request names its peer in `add_request`)."""
        self.sender = sender
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._prompt_len: dict[int, int] = {}
        # The last layer of each layer group -> the group: its layers are done after it.
        pool, groups = sender.pool, sender.layer_groups
        self._group_ending_at = {pool.group_layers(g, groups)[1] - 1: g for g in range(groups)}

    def add_request(
        self,
        request_id: int,
        spec: Union[RequestSpec, int, None] = None,
        *,
        src_blocks: npt.ArrayLike,
        dst_blocks: npt.ArrayLike,
        peer: Optional[Hashable] = None,
        **fields: Any,
    ) -> None:
        """A request admitted on the context worker (``spec`` and ``fields`` as in
        `KVSender.add`: a `RequestSpec`, or its prompt length and fields), with its source blocks and the
        destination blocks the generation worker allocated for it (one id per block of the
        prompt, in order; for ``held`` blocks, those it already holds) under ``epoch``, the
        lease its `KVReceiver.expect` returned. A source id at or past the device pool's
        ``num_blocks`` names a host-tier block (see `KVSender`). Nothing is registered if any
        argument is refused. ``peer``: the generation worker it goes to, with a
        `MultiPeerSender` (required there; refused with a `KVSender`)."""
        # A throwaway ledger refuses a bad prompt with the book's own messages and gives the
        # block count, before the sender learns of the request.
        spec = request_spec(spec, fields)
        blocks = TransferLedger(
            self.sender.pool.tokens_per_block, spec.prompt_len, reused_len=spec.reused_len, window=spec.window
        ).num_blocks
        rows = (_block_ids("src_blocks", src_blocks, blocks), _block_ids("dst_blocks", dst_blocks, blocks))
        if isinstance(self.sender, KVSender):
            if peer is not None:
                raise InvalidArgumentError(
                    f"invalid peer={peer!r}: this hook's KVSender has one receiver; a MultiPeerSender routes by peer"
                )
            self.sender.add(request_id, spec)
        else:
            self.sender.add(request_id, spec, peer=peer)
        self._blocks[request_id] = rows
        self._prompt_len[request_id] = spec.prompt_len

    def update_src_blocks(self, request_id: int, src_blocks: npt.ArrayLike) -> None:
        """The request's source block table so far, for an engine that allocates a prompt's
        blocks chunk by chunk (vLLM): ``src_blocks`` names its first blocks in order; the
        rest stay -1 until a later call names them (a send never plans a block before the
        chunk that writes it, so it never reads a -1)."""
        if request_id not in self._blocks:
            self._raise_unknown(int(request_id))
        src, dst = self._blocks[request_id]
        ids = block_id_array("src_blocks", src_blocks)
        if ids.size > src.size:
            raise InvalidArgumentError(f"invalid src_blocks=<{ids.size} ids>: the prompt has {src.size} blocks")
        row = np.full(src.size, -1, dtype=np.int64)
        row[: ids.size] = ids
        self._blocks[request_id] = (row, dst)

    def _known(self, request_ids: Sequence[int]) -> list[int]:
        """The batch's ids, each one a request of this hook; refused before anything is sent."""
        ids = list(request_ids)
        for r in ids:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
                raise TypeError(f"request_ids must hold ints, got {type(r).__name__} {r!r}")
            if r not in self._blocks:
                self._raise_unknown(int(r))
        return ids

    def _raise_unknown(self, request_id: int) -> None:
        raise UnknownRequestError(
            f"unknown request_id={request_id}: never added to the hook, or already finished or cancelled"
        )

    def __len__(self) -> int:
        """Requests added and not yet finished or cancelled."""
        return len(self._blocks)

    def _tables(self, request_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        rows = [self._blocks[r] for r in request_ids]
        width = max((max(len(s), len(d)) for s, d in rows), default=0)
        return as_table([s for s, _ in rows], width), as_table([d for _, d in rows], width)

    def before_forward(self, request_ids: Sequence[int]) -> list[Notice]:
        """Plain loop: right before the batch's context forward."""
        ids = self._known(request_ids)
        src, dst = self._tables(ids)
        return self.sender.send_early(np.asarray(ids, dtype=np.int64), src, dst)

    def on_batch_queued(self, request_ids: Sequence[int]) -> list[Notice]:
        """Overlap loop: when batch n+1 is queued while batch n still runs. Sends the same
        early slices as `before_forward`; it never waits on batch n's transfers."""
        return self.before_forward(request_ids)

    def after_forward(
        self, request_ids: Sequence[int], chunk_starts: Sequence[int], chunk_ends: Sequence[int]
    ) -> list[Notice]:
        """After the batch's context forward: each request finished ``[start, end)``."""
        ids = self._known(request_ids)
        src, dst = self._tables(ids)
        # The chunk bounds go to the book as given: it refuses a float or ragged one by name,
        # where np.asarray here would truncate or raise numpy's own error.
        return self.sender.send_chunks(np.asarray(ids, dtype=np.int64), chunk_starts, chunk_ends, src, dst)

    def after_layer(
        self, request_ids: Sequence[int], chunk_starts: Sequence[int], chunk_ends: Sequence[int], layer: int
    ) -> list[Notice]:
        """During the batch's context forward, right after layer ``layer`` wrote the chunk's
        K and V (on CUDA: once that write is queued on the current stream; the copy is
        ordered after it). When ``layer`` is the last of its layer group, sends that group's
        layers of the blocks each chunk completes, for the requests whose chunk ends the
        prompt (the last chunk: earlier chunks' blocks leave after their forward and overlap
        the next one). The chunk's `after_forward` then sends only what no group sent."""
        ids = self._known(request_ids)
        starts, ends = list(chunk_starts), list(chunk_ends)
        for name, values in (("chunk_starts", starts), ("chunk_ends", ends)):
            if len(values) != len(ids):
                raise InvalidArgumentError(
                    f"invalid {name}=<{len(values)} values>: must hold one per request ({len(ids)})"
                )
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__} {layer!r}")
        num_layers = self.sender.pool.num_layers
        if not 0 <= layer < num_layers:
            raise InvalidArgumentError(f"invalid layer={layer}: must be in [0, {num_layers})")
        group = self._group_ending_at.get(int(layer))
        last = [i for i, r in enumerate(ids) if ends[i] == self._prompt_len[r]]
        if group is None or not last:
            return []
        ids = [ids[i] for i in last]
        src, dst = self._tables(ids)
        picked = np.asarray(ids, dtype=np.int64)
        return self.sender.send_layers(picked, [starts[i] for i in last], [ends[i] for i in last], group, src, dst)

    def order_after(self, src_ids: npt.ArrayLike, signal: Signal) -> None:
        """The engine's tier is writing source blocks ``src_ids`` (an onboard into device
        blocks, an offload into host blocks) until ``signal`` completes: copies queued from
        now on that read them wait for it (see `KVSender.order_after`). Call it when the tier
        copy is queued, before the batch that reads the blocks is sent."""
        self.sender.order_after(src_ids, signal)

    def poll(self) -> list[Notice]:
        """Once per scheduler step: raises what went wrong since the last call (a failed
        write, a copy past the sender's timeout, the receiver's cancellation) and posts the
        notices of finished copies the announcer has not posted yet (all of them with
        ``KVSender(progress=False)``). Cheap when there is nothing to do."""
        return self.sender.poll()

    def finish(self, request_id: int, timeout: Optional[float] = None) -> None:
        """After the request's last chunk: waits for its copies, then forgets it; its source
        blocks may be freed once this returns."""
        if request_id not in self._blocks:
            self._raise_unknown(request_id)
        while self.sender.in_flight(request_id):
            self.sender.flush(timeout)
        self.sender.remove(request_id)
        del self._blocks[request_id], self._prompt_len[request_id]

    def cancel(self, request_id: int, timeout: Optional[float] = 5.0) -> None:
        """Revokes the request; once this returns its source blocks may be freed. Raises
        `TransferTimeoutError` while a copy still reads them (the request stays revoked and
        leased: call again)."""
        if request_id not in self._blocks:
            self._raise_unknown(request_id)
        self.sender.cancel(request_id, timeout)
        del self._blocks[request_id], self._prompt_len[request_id]

    def leased(self, request_id: int) -> bool:
        """Whether the request's source blocks are still leased to the transfer (see
        `KVSender.leased`): while true the engine must not free, evict or reuse them."""
        return self.sender.leased(request_id)


def _block_ids(name: str, ids: npt.ArrayLike, blocks: int) -> np.ndarray:
    """One request's block ids as int64 (see `block_id_array`), refusing too few ids too."""
    array = block_id_array(name, ids)
    if array.size < blocks:
        raise InvalidArgumentError(f"invalid {name}=<{array.size} ids>: must name all {blocks} blocks of the prompt")
    return array
