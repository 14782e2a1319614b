"""K/V of text that moved: a jump within a file is not a cold start.

The prefix cache finds a prompt's K/V only from its first token on. When the
cursor jumps within a file, the window's start moves, and every block misses,
though most of the window's text was computed a moment ago, by the request
before, at other positions. Here the engine remembers the last prompts it
computed (`Donors`, by window), finds in a new prompt the longest run of
tokens that one of them holds (`longest_shared_run`), and copies that run's
K/V to its new positions, re-rotating the keys by the shift (RoPE is a
rotation by position: R(p + d) = R(d) R(p)), as llama.cpp's `--cache-reuse`
shifts cached chunks. The run's tokens attended to other text before them
when they were computed: an approximation every later token then reads, the
one llama.cpp makes; `engine.reuse_moved_kv` turns it off.

Torch-free: block ids and tokens (the copy itself is the model runner's).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from completer.engine.block_manager import BlockManager

KGRAM = 8  # tokens that anchor a match


class Donor(NamedTuple):
    """A computed prompt's published part: its tokens and their blocks' chain."""

    salt: str
    tokens: list[int]
    chain: list[int]


class MovedRun(NamedTuple):
    """Tokens [at, at + length) of a new prompt are the donor's [at - shift, ...),
    whose K/V sit in `src_slots`; `blocks` are referenced until the copy."""

    at: int
    length: int
    shift: int
    src_slots: list[int]
    blocks: list[int]


def longest_shared_run(new: list[int], start: int, end: int, donor: list[int]) -> tuple[int, int, int]:
    """(i, j, n): new[i:i+n] == donor[j:j+n], i in [start, end), i + n <= end, n largest
    among runs anchored on a KGRAM-token match."""
    first: dict[tuple[int, ...], int] = {}
    for j in range(len(donor) - KGRAM + 1):
        first.setdefault(tuple(donor[j: j + KGRAM]), j)
    best = (start, 0, 0)
    i = start
    while i + KGRAM <= end:
        j = first.get(tuple(new[i: i + KGRAM]))
        if j is None:
            i += 1
            continue
        n = KGRAM
        while i + n < end and j + n < len(donor) and new[i + n] == donor[j + n]:
            n += 1
        if n > best[2]:
            best = (i, j, n)
        i += n
    return best


class Donors:
    """The last computed prompt of each recent window (keyed by its first
    block), most recent last; a donor's blocks are checked on use, since the
    prefix cache may have recycled them meanwhile."""

    def __init__(self, pool: BlockManager, kept: int = 8, min_tokens: int = 64):
        self.pool = pool
        self.kept = kept
        self.min_tokens = min_tokens  # shorter runs are recomputed (a copy per layer is not free)
        self.by_window: OrderedDict[tuple[str, int], Donor] = OrderedDict()

    def remember(self, salt: str, tokens: list[int], chain: list[int]) -> None:
        if len(chain) * self.pool.block_size < self.min_tokens:
            return
        key = (salt, chain[0])
        self.by_window.pop(key, None)
        self.by_window[key] = Donor(salt, tokens[: len(chain) * self.pool.block_size], list(chain))
        while len(self.by_window) > self.kept:
            self.by_window.popitem(last=False)

    def plan(self, tokens: list[int], computed: int, salt: str, spare_blocks: int) -> MovedRun | None:
        """The longest run of tokens[computed:-1] (the last prompt token is
        always computed: its logits are wanted) whose K/V a donor still holds,
        if at least `min_tokens` long; its source blocks are referenced."""
        end = len(tokens) - 1
        if end - computed < self.min_tokens or not self.pool.prefix_cache:
            return None
        best: tuple[int, int, int, Donor] | None = None
        for donor in reversed(self.by_window.values()):
            if donor.salt != salt:
                continue
            i, j, n = longest_shared_run(tokens, computed, end, donor.tokens)
            if n >= self.min_tokens and (best is None or n > best[2]):
                best = (i, j, n, donor)
        if best is None:
            return None
        i, j, n, donor = best
        bs = self.pool.block_size
        blocks = []
        for index in range(j // bs, -(-(j + n) // bs)):  # each still holds the donor's block `index`?
            parent = donor.chain[index - 1] if index else donor.salt or 0
            block = self.pool._lookup((parent, tuple(donor.tokens[index * bs: (index + 1) * bs])))
            if block is None:
                break
            blocks.append(block)
        n = min(n, (j // bs + len(blocks)) * bs - j)
        taken = sum(1 for b in blocks if self.pool.ref_count[b] == 0)
        if n < self.min_tokens or taken > spare_blocks:
            return None
        blocks = blocks[: -(-(j + n) // bs) - j // bs]
        for block in blocks:
            self.pool._ref(block)
        first = j // bs
        slots = [blocks[(j + t) // bs - first] * bs + (j + t) % bs for t in range(n)]
        return MovedRun(i, n, i - j, slots, blocks)
