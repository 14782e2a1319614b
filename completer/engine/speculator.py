"""Per step and sequence: which proposer, and how many tokens (the policy's
call, from measured acceptance and pass costs); then the proposals, batched
per proposer. Above `spec.max_batch` running sequences decoding is plain."""

from __future__ import annotations

from completer.engine.proposers import Proposal, Proposer
from completer.engine.sequence import Sequence
from completer.engine.spec_policy import SpecPolicy


class Speculator:
    def __init__(self, proposers: list[Proposer], policy: SpecPolicy, max_batch: int):
        self.proposers = proposers  # in order of preference (n-gram first: it costs no pass)
        self.policy = policy
        self.max_batch = max_batch

    def propose(self, seqs: list[Sequence]) -> dict[str, Proposal]:
        if len(seqs) > self.max_batch or not self.proposers:
            return {}
        picks = []
        for seq in seqs:
            budget = seq.params.max_tokens - seq.num_generated - 1
            if budget <= 0 or seq.output.heal:  # no drafts until healing is done
                continue
            limit = min(self.policy.k_max, budget)
            offers = {p.source: n for p in self.proposers if (n := p.offer(seq, limit))}
            source, k = self.policy.choose(seq.spec, len(seqs), offers, budget)
            if source is not None:
                picks.append((seq, source, k))
        if not picks or not self.policy.batch_pays([(s.spec, src, k) for s, src, k in picks], len(seqs)):
            return {}
        proposals: dict[str, Proposal] = {}
        for proposer in self.proposers:
            work = [(seq, k) for seq, source, k in picks if source == proposer.source]
            if work:
                proposals.update(proposer.propose(work))
        return proposals

    def observe(self, seq: Sequence, proposal: Proposal, accepted: int) -> None:
        """`accepted` of the proposal's tokens were kept."""
        t = seq.timings
        t.draft_proposed += len(proposal.tokens)
        t.draft_accepted += accepted
        t.draft_rounds += 1
        self.policy.observe(seq.spec, proposal.source, len(proposal.tokens), accepted)
