"""The executor hook: what an engine's scheduler loop calls around its context forwards.

```
plain loop:     before_forward(batch) -> forward(batch) -> after_forward(batch, chunks)
overlap loop:   on_batch_queued(batch n+1) while batch n runs -> ... -> after_forward(n+1)
```
``before_forward`` / ``on_batch_queued`` send the complete reused-prefix blocks of every
eligible request of the batch (context-only, not cancelled, first chunk, a complete reused
block, pipelined transfer on); ``after_forward`` sends what each finished chunk completed.
Neither waits on earlier transfers: copies are queued and their notices posted by `poll`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import numpy.typing as npt

from kvferry.notice import Notice
from kvferry.sender import KVSender, as_table

__all__ = ["TransferHook"]


class TransferHook:
    """Owned by the executor thread, next to the engine's scheduler."""

    def __init__(self, sender: KVSender) -> None:
        self.sender = sender
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def add_request(
        self,
        request_id: int,
        prompt_len: int,
        *,
        reused_len: int,
        src_blocks: npt.ArrayLike,
        dst_blocks: npt.ArrayLike,
        window: Optional[int] = None,
        context_only: bool = True,
    ) -> None:
        """A request admitted on the context worker, with its source blocks and the
        destination blocks the generation worker allocated for it."""
        self.sender.add(request_id, prompt_len, reused_len=reused_len, window=window, context_only=context_only)
        self._blocks[request_id] = (np.asarray(src_blocks, dtype=np.int64), np.asarray(dst_blocks, dtype=np.int64))

    def _tables(self, request_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        rows = [self._blocks[r] for r in request_ids]
        width = max((len(s) for s, _ in rows), default=0)
        return as_table([s for s, _ in rows], width), as_table([d for _, d in rows], width)

    def before_forward(self, request_ids: Sequence[int]) -> list[Notice]:
        """Plain loop: right before the batch's context forward."""
        src, dst = self._tables(request_ids)
        return self.sender.send_early(np.asarray(request_ids, dtype=np.int64), src, dst)

    def on_batch_queued(self, request_ids: Sequence[int]) -> list[Notice]:
        """Overlap loop: when batch n+1 is queued while batch n still runs. Sends the same
        early slices as `before_forward`; it never waits on batch n's transfers."""
        return self.before_forward(request_ids)

    def after_forward(self, request_ids: Sequence[int], chunk_starts: Sequence[int], chunk_ends: Sequence[int]) -> list[Notice]:
        """After the batch's context forward: each request finished ``[start, end)``."""
        src, dst = self._tables(request_ids)
        ids = np.asarray(request_ids, dtype=np.int64)
        return self.sender.send_chunks(ids, np.asarray(chunk_starts), np.asarray(chunk_ends), src, dst)

    def poll(self) -> list[Notice]:
        """Posts the notices of finished copies (call once per scheduler step)."""
        return self.sender.poll()

    def finish(self, request_id: int, timeout: Optional[float] = None) -> None:
        """After the request's last chunk: waits for its copies, then forgets it; its source
        blocks may be freed once this returns."""
        while self.sender.in_flight(request_id):
            self.sender.flush(timeout)
        self.sender.remove(request_id)
        del self._blocks[request_id]

    def cancel(self, request_id: int, timeout: Optional[float] = 5.0) -> None:
        self.sender.cancel(request_id, timeout)
        del self._blocks[request_id]
