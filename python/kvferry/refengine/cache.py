"""Block allocation and a prefix cache keyed by chained block hashes.

```
prompt:  [ block 0 ][ block 1 ][ block 2 ][ part ]
hash:      h0=H(0,t0) h1=H(h0,t1) h2=H(h1,t2)   partial child of h2, reused token by token
```
A full block is found by its chain hash; the last, partial block of a cached prompt is kept
as a child of its parent's hash, and a new prompt that shares some of its tokens reuses them
by copying the block (copy-on-write), so reuse can end mid-block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["BlockAllocator", "PrefixCache", "PrefixHit"]


class BlockAllocator:
    """Reference-counted blocks. Blocks that drop to zero references stay cached (and
    reusable) until space is needed; the least recently released are evicted first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced
        self.on_evict = lambda block: None

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free) + len(self._idle):
            raise MemoryError(f"KV pool exhausted: {n} blocks wanted, {len(self._free) + len(self._idle)} available")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._idle.popitem(last=False)
                self.on_evict(block)
            self.refs[block] = 1
            out.append(block)
        return out

    def ref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.refs[b] == 0:
                self._idle.pop(b, None)
            self.refs[b] += 1

    def release(self, blocks: Sequence[int], cached: Sequence[bool]) -> None:
        for b, keep in zip(blocks, cached):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if keep:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    @property
    def available(self) -> int:
        return len(self._free) + len(self._idle)

    def free_ids(self) -> list[int]:
        """Blocks with no reference and no cached content (for audits)."""
        return list(self._free)

    def idle_ids(self) -> list[int]:
        """Cached blocks with no reference, least recently released first (for audits)."""
        return list(self._idle)


@dataclass
class PrefixHit:
    """The reusable part of a prompt: full blocks, then maybe a partial block to copy."""

    blocks: list[int] = field(default_factory=list)
    partial_block: Optional[int] = None
    partial_tokens: int = 0

    def reused_len(self, tokens_per_block: int) -> int:
        return len(self.blocks) * tokens_per_block + self.partial_tokens


class PrefixCache:
    def __init__(self, tokens_per_block: int, allocator: BlockAllocator) -> None:
        self.tpb = tokens_per_block
        self.alloc = allocator
        self._full: dict[int, int] = {}  # chain hash -> full block
        self._children: dict[int, dict[int, tuple[int, ...]]] = {}  # parent hash -> block -> tokens
        self._owner: dict[int, tuple[int, Optional[int]]] = {}  # block -> (parent hash, own hash)
        allocator.on_evict = self._forget

    @staticmethod
    def chain(parent: int, tokens: Sequence[int]) -> int:
        return hash((parent, tuple(tokens)))

    def is_cached(self, block: int) -> bool:
        return block in self._owner

    @property
    def index_entries(self) -> int:
        """Entries of the lookup index (hashes, owners, parents): zero once every cached
        block was evicted."""
        return len(self._full) + len(self._owner) + len(self._children)

    def lookup(self, tokens: Sequence[int], max_reuse: int) -> PrefixHit:
        """The longest cached prefix of ``tokens``, at most ``max_reuse`` tokens long."""
        hit = PrefixHit()
        parent = 0
        while (len(hit.blocks) + 1) * self.tpb <= max_reuse:
            i = len(hit.blocks) * self.tpb
            h = self.chain(parent, tokens[i : i + self.tpb])
            block = self._full.get(h)
            if block is None:
                break
            hit.blocks.append(block)
            parent = h
        start = len(hit.blocks) * self.tpb
        budget = max_reuse - start
        best: tuple[int, Optional[int]] = (0, None)
        # Any cached child of the matched chain, full or partial, may share leading tokens.
        for block, cached in self._children.get(parent, {}).items():
            common = 0
            for a, b in zip(cached, tokens[start : start + min(budget, self.tpb)]):
                if a != b:
                    break
                common += 1
            if common > best[0]:
                best = (common, block)
        if best[1] is not None:
            hit.partial_block, hit.partial_tokens = best[1], best[0]
        return hit

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Registers the blocks holding ``tokens`` (full blocks by chain hash, a last partial
        block as a child of its parent), unless already cached."""
        parent = 0
        for i, block in enumerate(blocks):
            chunk = tuple(tokens[i * self.tpb : (i + 1) * self.tpb])
            if not chunk:
                break
            if block in self._owner:  # cached by an earlier turn of the same session
                if len(chunk) < self.tpb:
                    break
                parent = self.chain(parent, chunk)
                continue
            own = self.chain(parent, chunk) if len(chunk) == self.tpb else None
            if own is not None and own in self._full:
                parent = own  # the same content is cached in another block already
                continue
            self._children.setdefault(parent, {})[block] = chunk
            self._owner[block] = (parent, own)
            if own is not None:
                self._full[own] = block
                parent = own
            else:
                break  # a partial block ends the prompt

    def _forget(self, block: int) -> None:
        parent, own = self._owner.pop(block, (0, None))
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.pop(block, None)
            if not siblings:  # else every prefix ever cached leaves an empty dict behind
                del self._children[parent]
        if own is not None and self._full.get(own) == block:
            del self._full[own]
