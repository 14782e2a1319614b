"""Bookkeeping of one paged KV pool: block tables, reference counts, prefix cache.

A block holds the K/V of `block_size` consecutive tokens. Once a block is full
and its K/V computed, it is published under its key: (the identity of the
block before it, its own tokens), so a later sequence that starts with the
same tokens reuses it (vLLM's automatic prefix caching). The key is looked up
by a 64-bit digest, and every hit is checked against the stored key, so a
digest collision can never serve another prompt's K/V. The identity of a
published block is a serial number, never reused: blocks computed after a
parent that was since evicted can no longer be matched. A chain may start
from a salt instead of 0 (vLLM's cache_salt): prompts under different salts
never share blocks, so one user cannot time another's cache hits.

A block nobody references stays cached on an LRU list and is only recycled
when a new block is needed and no never-used block is left: each editor
session's last prompt stays warm until memory runs short.

Plain Python over block ids; the K/V tensors live in `paged_kv.KVPool`.
Block 0 is reserved as a scratch slot for padding.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

BlockKey = tuple[int | str, tuple[int, ...]]  # (parent block's serial, or for the first the salt; its tokens)


class OutOfBlocks(RuntimeError):
    """The pool has no free block left (every block is referenced)."""


def block_digest(key: BlockKey) -> int:
    return hash(key)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (block 0 is scratch)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.ref_count = [0] * num_blocks
        self.key: list[BlockKey | None] = [None] * num_blocks  # of a published block
        self.serial = [0] * num_blocks
        self.next_serial = 1
        self.cached: dict[int, int] = {}  # digest of a key -> block id
        # Unreferenced blocks, least recently used first. Never-used blocks come
        # first of all, so cached K/V is recycled only when nothing else is left.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold reusable K/V."""
        return sum(1 for b in self.free if self.key[b] is not None)

    def usage(self) -> float:
        """Share of usable blocks referenced by running sequences."""
        return 1 - len(self.free) / (self.num_blocks - 1)

    def _take_free(self) -> int:
        if not self.free:
            raise OutOfBlocks("KV cache full: every block is in use")
        block, _ = self.free.popitem(last=False)
        if (key := self.key[block]) is not None:  # evict its cached content
            del self.cached[block_digest(key)]
            self.key[block], self.serial[block] = None, 0
        self.ref_count[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def _lookup(self, key: BlockKey) -> int | None:
        """The block published under exactly `key` (a digest hit with another key is refused)."""
        block = self.cached.get(block_digest(key))
        return block if block is not None and self.key[block] == key else None

    def _key(self, tokens: list[int], index: int, chain: list[int], salt: str) -> BlockKey:
        bs = self.block_size
        return (chain[index - 1] if index else salt or 0, tuple(tokens[index * bs: (index + 1) * bs]))

    def match_prefix(self, tokens: list[int], salt: str = "") -> tuple[list[int], list[int]]:
        """Take references on the cached blocks that start `tokens`; returns
        their table and chain. The last token is never matched, so its logits
        are always computed (and no shared block is ever written)."""
        table: list[int] = []
        chain: list[int] = []
        for block in self._cached_blocks(tokens, salt, chain):
            self._ref(block)
            table.append(block)
        return table, chain

    def cached_tokens(self, tokens: list[int], salt: str = "") -> int:
        """How many tokens `match_prefix` would find cached (no reference taken)."""
        return sum(1 for _ in self._cached_blocks(tokens, salt, [])) * self.block_size

    def _cached_blocks(self, tokens: list[int], salt: str, chain: list[int]) -> Iterator[int]:
        """The cached blocks that start `tokens`, their identities appended to `chain`."""
        if not self.prefix_cache:
            return
        for index in range((len(tokens) - 1) // self.block_size):
            block = self._lookup(self._key(tokens, index, chain, salt))
            if block is None:
                return
            chain.append(self.serial[block])
            yield block

    def blocks_needed(self, table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(table))

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks so `table` can hold `num_tokens` tokens."""
        needed = self.blocks_needed(table, num_tokens)
        if needed > len(self.free):
            raise OutOfBlocks(f"KV cache full: need {needed} blocks, {len(self.free)} free")
        for _ in range(needed):
            table.append(self._take_after(table[-1]) if table else self._take_free())

    def _take_after(self, block: int) -> int:
        """The block right after `block` if it is free and holds nothing
        reusable, else the LRU's first: a sequence on consecutive blocks is
        read by attention as one slice of the pool, without a gather copy (a
        keystroke's request regrows onto the blocks its predecessor freed)."""
        after = block + 1
        if after < self.num_blocks and after in self.free and self.key[after] is None:
            del self.free[after]
            self.ref_count[after] = 1
            return after
        return self._take_free()

    def publish(self, table: list[int], chain: list[int], tokens: list[int], num_computed: int,
                salt: str = "") -> None:
        """Publish the full blocks of tokens[:num_computed] (their K/V computed)
        not yet in `chain`, extending it. A block whose content is already
        cached elsewhere continues the chain from that copy."""
        if not self.prefix_cache:
            return
        for index in range(len(chain), num_computed // self.block_size):
            key = self._key(tokens, index, chain, salt)
            found = self._lookup(key)
            if found is None:
                if block_digest(key) in self.cached:
                    return  # another key holds this digest: the chain stops here
                block = table[index]
                self.key[block], self.serial[block] = key, self.next_serial
                self.next_serial += 1
                self.cached[block_digest(key)] = block
                found = block
            chain.append(self.serial[found])

    def release(self, table: list[int]) -> None:
        """Drop references. Cached blocks go to the LRU's recent end; blocks
        without reusable content go to its front, to be recycled first."""
        for block in reversed(table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.key[block] is None:
                    self.free.move_to_end(block, last=False)
