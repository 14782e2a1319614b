"""A request's extra completions (`SamplingParams.n`), for an editor to cycle
through.

Each candidate begins with one of the 2nd..nth most likely first tokens (the
first completion took the most likely one, or its draw) and then goes on as
the request does (greedy, or drawn at its temperature) as a sequence of its
own in the decode batch. Its prompt is the request's, whose full blocks the
request's prefill has just published to the prefix cache: a candidate
prefills at most the last partial block, and then costs a row in each decode
pass. They are built when the request chooses its first token and join
running at the scheduler's next plan (`Scheduler.fork`, the plan's `forks`),
only where that is cheap: nothing waits for admission, the running batch
stays within `engine.candidates_max_batch`, the blocks of their worst case
fit, and the prompt's target K/V is still cached; else fewer come back, or
none.

Candidates stream nothing. The request's `Finished` waits until they have
ended and carries their texts, most likely first token first, each text once:
none empty, none equal to the first completion's, none cut by a deadline or
a cancel.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from completer.engine.request import Finished, FinishReason, Request
from completer.engine.scheduler import Scheduler
from completer.engine.sequence import CandidateGroup, Sequence, Status

CANDIDATE_ID_SEPARATOR = "\x00candidate-"  # no editor names a request so; a clash skips the candidate


class Candidates:
    def __init__(self, scheduler: Scheduler, new_sequence: Callable[[Request], Sequence]):
        """new_sequence: how the core builds one. Candidates join the scheduler's registry as requests do."""
        self.scheduler = scheduler
        self.new_sequence = new_sequence

    def build(self, seq: Sequence, first_tokens: list[int]) -> list[Sequence]:
        """`seq`'s candidates, one per first token (the most likely after the one
        it took, healing's constraint applied), not yet admitted: the
        scheduler's next plan decides which join (`Scheduler.fork`)."""
        if seq.params.n <= 1 or not first_tokens:
            return []
        seq.candidates = CandidateGroup()
        candidates = []
        for rank, token in enumerate(first_tokens, 1):
            request = msgspec.structs.replace(seq.request, id=f"{seq.id}{CANDIDATE_ID_SEPARATOR}{rank}",
                                              params=msgspec.structs.replace(seq.params, n=1))
            candidate = self.new_sequence(request)
            candidate.candidate_of, candidate.candidate_rank, candidate.first_token = seq, rank, token
            candidates.append(candidate)
        return candidates

    def first_ended(self, seq: Sequence, finished: Finished) -> Finished | None:
        """The request `seq` ended: its `Finished` now, or None while its candidates run."""
        group = seq.candidates
        if group is None:
            return finished
        group.first = finished
        return group.result()

    def candidate_ended(self, seq: Sequence, reason: FinishReason, text: str) -> Finished | None:
        """A candidate ended: its request's `Finished`, if that was all it waited for."""
        parent = seq.candidate_of
        group = parent.candidates
        group.candidate_ended(seq, reason, text)
        return group.result()

    def of_ended(self, request_id: str) -> list[Sequence]:
        """The running candidates of a request that has ended itself (to cancel them with it)."""
        return [s for s in self.scheduler.running if s.candidate_of is not None and s.candidate_of.id == request_id
                and s.candidate_of.status is Status.FINISHED]
