"""Bookkeeping of a paged KV pool: block tables, reference counts, prefix cache.

A block holds the K/V of `block_size` consecutive tokens. Once a block is full
and its K/V computed, it is registered under a chained hash (hash of the
parent block's hash and its own tokens), so any later sequence that starts
with the same tokens reuses it (vLLM's automatic prefix caching). A block
nobody references stays cached on an LRU list and is only recycled when a new
block is needed and no never-used block is left: each editor session's last
prompt stays warm until memory runs short.

The bookkeeping is plain Python over block ids; the K/V tensors live in
`paged_kv.KVPool`. Block 0 is reserved as a scratch slot for padding.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    """The pool has no free block left (every block is referenced)."""


def chain_hashes(tokens: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """The chained hash of each full block of `tokens`."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start: start + block_size])))
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (block 0 is scratch)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # chained hash -> block id
        # Unreferenced blocks, least recently used first. Never-used blocks come
        # first of all, so cached K/V is recycled only when nothing else is left.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold reusable K/V."""
        return sum(1 for b in self.free if self.block_hash[b] is not None)

    def usage(self) -> float:
        """Share of usable blocks referenced by running sequences."""
        return 1 - len(self.free) / (self.num_blocks - 1)

    def _take_free(self) -> int:
        if not self.free:
            raise OutOfBlocks("KV cache full: every block is in use")
        block, _ = self.free.popitem(last=False)
        if (h := self.block_hash[block]) is not None:  # evict its cached content
            del self.cached[h]
            self.block_hash[block] = None
        self.ref_count[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Take references on the cached blocks that start `tokens`. The last
        token is never matched, so its logits are always computed (and no
        shared block is ever written)."""
        if not self.prefix_cache:
            return []
        table = []
        for h in chain_hashes(tokens[: len(tokens) - 1], self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            self._ref(block)
            table.append(block)
        return table

    def blocks_needed(self, table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(table))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(table, num_tokens) <= len(self.free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks so `table` can hold `num_tokens` tokens."""
        needed = self.blocks_needed(table, num_tokens)
        if needed > len(self.free):
            raise OutOfBlocks(f"KV cache full: need {needed} blocks, {len(self.free)} free")
        for _ in range(needed):
            table.append(self._take_free())

    def register(self, table: list[int], tokens: list[int], num_computed: int) -> None:
        """Publish the full blocks whose K/V is computed (of tokens[:num_computed])."""
        full = num_computed // self.block_size
        self.register_hashes(table, chain_hashes(tokens[: full * self.block_size], self.block_size))

    def register_hashes(self, table: list[int], hashes: list[int]) -> None:
        """Publish table[i] under hashes[i] (its chained hash), unless already cached."""
        if not self.prefix_cache:
            return
        for block, h in zip(table, hashes):
            if self.block_hash[block] is not None or h in self.cached:
                continue  # already published, or the same content computed twice
            self.block_hash[block] = h
            self.cached[h] = block

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Drop the blocks past `num_tokens` tokens (rejected speculation)."""
        keep = -(-num_tokens // self.block_size)
        self.release(table[keep:])
        del table[keep:]

    def release(self, table: list[int]) -> None:
        """Drop references. Cached blocks go to the LRU's recent end; blocks
        without reusable content go to its front, to be recycled first."""
        for block in reversed(table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)
