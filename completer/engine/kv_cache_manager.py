"""The KV blocks of every sequence in every pool it uses ("target", and
"draft" when a drafter runs): prefix matching on admission, a worst-case
reservation so a running sequence never runs out of blocks, growth before
each pass, rollback of rejected drafts, publishing to the prefix cache, and
freeing. Torch-free: block ids only (the tensors are the runners')."""

from __future__ import annotations

from typing import Iterable

from completer.engine.block_manager import BlockManager
from completer.engine.moved_kv import Donors, MovedRun
from completer.engine.sequence import CacheState, Sequence


def advance(states: Iterable[CacheState], lens: Iterable[int]) -> None:
    """A pass wrote the K/V of `n` more tokens after each state's `computed`.
    (This module is the one place a `computed` changes: tests/docs/test_architecture_doc.py.)"""
    for state, n in zip(states, lens):
        state.computed += n


def restart(state: CacheState, computed: int) -> None:
    """`computed` set back (or on) over blocks the state already holds: a
    timed dummy sequence run again, a prefix matched by a worker."""
    state.computed = computed


class KVCacheManager:
    def __init__(self, pools: dict[str, BlockManager], lookahead: int, moved_kv: bool = False):
        """pools: role -> its block manager (one block size for all).
        lookahead: tokens past max_tokens a verify pass may write (k_max + 1).
        moved_kv: a prompt may take K/V the target computed for the same text
        at other positions (`moved_kv`; the drafter recomputes)."""
        self.pools = pools
        self.roles = tuple(pools)
        self.block_size = next(iter(pools.values())).block_size
        self.lookahead = lookahead
        self.donors = Donors(pools["target"]) if moved_kv else None

    def worst_case(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a sequence may hold at most (prompt, completion, a last verify pass)."""
        return -(-(prompt_len + max_tokens + self.lookahead) // self.block_size)

    def too_large(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request can never run (its worst case exceeds a whole pool), if so."""
        worst = self.worst_case(prompt_len, max_tokens)
        for role, pool in self.pools.items():
            if worst > pool.num_blocks - 1:
                return (f"prompt of {prompt_len} tokens does not fit the {role} KV cache "
                        f"({pool.num_blocks - 1} blocks)")
        return None

    def _reserved(self, role: str, running: Iterable[Sequence]) -> int:
        """Blocks the running sequences may still claim in a pool."""
        return sum(max(0, self.worst_case(s.prompt_len, s.params.max_tokens) - len(s.kv[role].table)) for s in running)

    def admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Reuse cached blocks of the prompt in every pool, if the sequence's
        worst case then fits beside the running ones'; else take nothing."""
        fits = True
        for role, pool in self.pools.items():
            state = seq.kv[role]
            state.table, state.chain = pool.match_prefix(seq.tokens, seq.cache_salt)
            state.computed = len(state.table) * self.block_size
            need = self.worst_case(seq.prompt_len, seq.params.max_tokens) - len(state.table)
            fits &= need <= pool.num_free - self._reserved(role, running)
        if not fits:
            self.free(seq)
            return False
        if self.donors is not None:
            pool, state = self.pools["target"], seq.kv["target"]
            spare = pool.num_free - self._reserved("target", running) - \
                (self.worst_case(seq.prompt_len, seq.params.max_tokens) - len(state.table))
            seq.moved = self.donors.plan(seq.tokens[: seq.prompt_len], state.computed, seq.cache_salt, spare)
        return True

    def moved_slots(self, seq: Sequence) -> tuple[MovedRun, list[int]]:
        """The sequence's moved run and its destination slots (blocks grown for them)."""
        run, state = seq.moved, seq.kv["target"]
        pool, bs = self.pools["target"], self.block_size
        pool.grow(state.table, run.at + run.length)
        return run, [state.table[p // bs] * bs + p % bs for p in range(run.at, run.at + run.length)]

    def moved_done(self, seq: Sequence) -> None:
        """The run's K/V are in place: they count as computed; the source blocks are let go."""
        run, seq.moved = seq.moved, None
        seq.kv["target"].computed += run.length
        self.pools["target"].release(run.blocks)
        self.publish(seq, "target")

    def grow(self, seq: Sequence, role: str, tokens: int) -> None:
        """Blocks for `tokens` tokens of the sequence in a pool (within its reservation)."""
        self.pools[role].grow(seq.kv[role].table, tokens)

    def prefilled(self, seq: Sequence, role: str, n: int) -> None:
        """A pass computed `n` more tokens of the sequence in a pool: they count, and full blocks of
        accepted tokens are offered to the prefix cache."""
        advance([seq.kv[role]], [n])
        self.publish(seq, role)

    def remote_done(self, seq: Sequence) -> None:
        """A worker wrote the target K/V of the whole prompt into the sequence's blocks."""
        seq.kv["target"].computed = seq.prompt_len
        self.publish(seq, "target")

    def detach(self, seq: Sequence, role: str) -> list[int]:
        """The sequence lets go of its blocks in a pool without releasing them: the caller now holds them."""
        state = seq.kv[role]
        table, state.table, state.computed, state.chain = state.table, [], 0, []
        return table

    def grow_ahead(self, seq: Sequence, starting: bool) -> None:
        """Blocks for what a decoding sequence's verify step may write (vLLM's
        lookahead slots), planned before the drafts exist: in the target its
        last token and up to k_max drafts, in the drafter its catch-up and its
        drafts; after the one or two first tokens this step's prefill chooses
        when `starting`. Within the reservation; the blocks stay the
        sequence's when drafts are rejected (`rollback`), for its next steps."""
        ahead = len(seq.tokens) + (2 if starting else 0) + self.lookahead - 1
        worst = seq.prompt_len + seq.params.max_tokens + self.lookahead
        for role in seq.local_roles():
            if not (role == "draft" and seq.drafter_far_behind()):
                self.grow(seq, role, min(ahead, worst))

    def check_room(self, role: str, seqs: list[Sequence], rows: list[list[int]]) -> None:
        """Each row's new tokens have blocks (the plan allocated them): else the
        pass would write them into the scratch block and read garbage back."""
        for seq, row in zip(seqs, rows):
            state = seq.kv[role]
            if len(state.table) * self.block_size < state.computed + len(row):
                raise RuntimeError(f"no blocks planned for {seq.id!r}'s {len(row)} tokens in the {role} pool")

    def rollback(self, seq: Sequence, role: str, computed: int) -> None:
        """Forget K/V past `computed` tokens (rejected drafts): the next pass
        writes over it. The blocks stay the sequence's (as vLLM's lookahead
        slots do): the plan allocated them for its verify steps (`grow_ahead`),
        and K/V past `computed` is never published."""
        state = seq.kv[role]
        state.computed = min(state.computed, computed)

    def publish(self, seq: Sequence, role: str) -> None:
        """seq.tokens[:computed] are accepted: offer their full blocks to the prefix cache.
        (K/V computed past seq.tokens, a draft riding a prefill pass, is not.)"""
        state = seq.kv[role]
        self.pools[role].publish(state.table, state.chain, seq.tokens, min(state.computed, len(seq.tokens)),
                                 seq.cache_salt)

    def free(self, seq: Sequence) -> None:
        if seq.moved is not None:
            self.pools["target"].release(seq.moved.blocks)
            seq.moved = None
        if self.donors is not None and seq.kv["target"].chain:
            self.donors.remember(seq.cache_salt, seq.tokens, seq.kv["target"].chain)
        for role, pool in self.pools.items():
            state = seq.kv[role]
            pool.release(state.table)
            state.table, state.computed, state.chain = [], 0, []

    def usage(self) -> float:
        return self.pools["target"].usage()
