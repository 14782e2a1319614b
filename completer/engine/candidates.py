"""A request's extra completions (`SamplingParams.n`), for an editor to cycle
through.

Each candidate begins with one of the 2nd..nth most likely first tokens (the
first completion took the most likely one, or its draw) and then goes on as
the request does (greedy, or drawn at its temperature) as a sequence of its
own in the decode batch. Its prompt is the request's, whose full blocks the
request's prefill has just published to the prefix cache: a candidate
prefills at most the last partial block, and then costs a row in each decode
pass. So candidates are forked only where that is cheap: nothing waits for
admission, the running batch stays within `engine.candidates_max_batch`, the
blocks of their worst case fit, and the prompt's K/V is still cached in every
pool; else fewer come back, or none.

Candidates stream nothing. The request's `Finished` waits until they have
ended and carries their texts, most likely first token first, each text once:
none empty, none equal to the first completion's, none cut by a deadline or
a cancel.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from completer.engine.kv_cache_manager import KVCacheManager
from completer.engine.request import Finished, FinishReason, Request
from completer.engine.scheduler import Scheduler
from completer.engine.sequence import CandidateGroup, Sequence

CANDIDATE_ID_SEPARATOR = "\x00candidate-"  # no editor names a request so; a clash skips the candidate


class Candidates:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, stop_ids: set[int], max_batch: int,
                 by_id: dict[str, Sequence], new_sequence: Callable[[Request], Sequence]):
        """by_id: the core's sequences by id (candidates join it); new_sequence: how the core builds one."""
        self.kv, self.scheduler, self.stop_ids = kv, scheduler, stop_ids
        self.max_batch = max_batch
        self.by_id = by_id
        self.new_sequence = new_sequence
        self.ended_first: dict[str, CandidateGroup] = {}  # request id -> its group, while only candidates run

    def fork(self, seq: Sequence, logits: torch.Tensor, chosen: int) -> None:
        """Start `seq`'s candidates, as many as the engine can afford now.
        logits: its first token's, healing's constraint applied; chosen: the token it took."""
        running = self.scheduler.running
        room = min(self.max_batch, self.scheduler.config.max_running) - len(running)
        if seq.params.n <= 1 or room <= 0 or any(not s.request.warm for s in self.scheduler.waiting):
            return
        group = seq.candidates = CandidateGroup()
        for rank, token in enumerate(self._first_tokens(logits, chosen, min(seq.params.n - 1, room)), 1):
            request = msgspec.structs.replace(seq.request, id=f"{seq.id}{CANDIDATE_ID_SEPARATOR}{rank}",
                                              params=msgspec.structs.replace(seq.params, n=1))
            if request.id in self.by_id:
                continue
            candidate = self.new_sequence(request)
            if not self.kv.admit(candidate, running):
                break  # the rest would not fit either
            # The target's K/V of the prompt left the cache: no longer cheap. (The drafter's may
            # not be there yet: it takes the prompt in when it first drafts, spec.defer_draft_prefill.)
            if candidate.prompt_len - candidate.kv["target"].computed > self.kv.block_size:
                self.kv.free(candidate)
                break
            candidate.candidate_of, candidate.candidate_rank, candidate.first_token = seq, rank, token
            candidate.timings.queue_ms = seq.timings.queue_ms
            self.scheduler.add_forked(candidate)
            self.by_id[request.id] = candidate
            group.running.append(candidate)

    def _first_tokens(self, logits: torch.Tensor, chosen: int, count: int) -> list[int]:
        """The `count` most likely first tokens after `chosen`'s: allowed (healing) and not an end of text."""
        ranked = torch.topk(logits.float(), min(logits.shape[-1], count + 1 + len(self.stop_ids)))
        tokens = [int(t) for v, t in zip(ranked.values.tolist(), ranked.indices.tolist())
                  if v != float("-inf") and t != chosen and t not in self.stop_ids]
        return tokens[:count]

    def first_ended(self, seq: Sequence, finished: Finished) -> Finished | None:
        """The request `seq` ended: its `Finished` now, or None while its candidates run."""
        group = seq.candidates
        if group is None:
            return finished
        group.first = finished
        if group.running:
            self.ended_first[seq.id] = group
        return group.result()

    def candidate_ended(self, seq: Sequence, reason: FinishReason, text: str) -> Finished | None:
        """A candidate ended: its request's `Finished`, if that was all it waited for."""
        parent = seq.candidate_of
        group = parent.candidates
        group.candidate_ended(seq, reason, text)
        done = group.result()
        if done is not None:
            self.ended_first.pop(parent.id, None)
        return done

    def of_ended(self, request_id: str) -> list[Sequence]:
        """The running candidates of a request that has ended itself (to cancel them with it)."""
        group = self.ended_first.get(request_id)
        return list(group.running) if group is not None else []
