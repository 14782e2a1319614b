"""A request as the engine holds it: its tokens, its place in each KV pool,
its output text and its timings; and the group of its extra completions
(`n`), which `candidates` forks and collects."""

from __future__ import annotations

import enum

import msgspec
import torch

from completer.engine.request import Finished, FinishReason, Request, Timings
from completer.engine.spec_policy import SpecState
from completer.engine.stopping import OutputText


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    REMOTE = "remote"  # its target K/V is being prefilled by a worker
    DECODE = "decode"
    FINISHED = "finished"


class CacheState:
    """A sequence's place in one pool (its role: "target" or "draft")."""

    __slots__ = ("table", "computed", "chain")

    def __init__(self) -> None:
        self.table: list[int] = []  # block ids
        self.computed = 0  # tokens whose K/V is in the pool
        self.chain: list[int] = []  # prefix-cache identities of the full computed blocks


BULK_CATCH_UP = 256  # the longest catch-up the drafter makes for a bulk sequence


class Sequence:
    def __init__(self, request: Request, output: OutputText, roles: tuple[str, ...], spec: SpecState):
        self.request = request  # what its candidates (params.n > 1) are forked from
        self.id = request.id
        self.tokens = list(request.prompt)
        self.prompt_len = len(request.prompt)
        self.params = request.params
        self.cache_salt = request.cache_salt
        self.output = output
        self.status = Status.WAITING
        self.kv = {role: CacheState() for role in roles}
        self.arrival = request.arrival
        deadline_s = request.params.deadline_s
        self.deadline = None if deadline_s is None else self.arrival + deadline_s
        self.first_token_at: float | None = None
        self.timings = Timings(prompt_tokens=self.prompt_len)
        self.spec = spec  # acceptance per proposal source
        self.remote_job: int | None = None  # the worker job writing its target K/V
        self.moved = None  # moved_kv.MovedRun: K/V of this prompt's text computed elsewhere, to copy in
        self.bulk = False  # its prefill is bulk work, behind every keystroke's (set on admission: scheduler)
        self.target_passes = 0  # target passes this request was in (Timings.first_token_passes)
        self.ngram = None  # proposers.NgramIndex, built on first use
        self.generator: torch.Generator | None = None  # seeded sampling
        if request.params.seed is not None:
            self.generator = torch.Generator().manual_seed(request.params.seed)
        # A request's extra completions (`engine.candidates`): the request holds
        # their group; each candidate, the request it completes, its rank among
        # the first tokens, and the first token it must take.
        self.candidates: CandidateGroup | None = None
        self.candidate_of: Sequence | None = None
        self.candidate_rank = 0
        self.first_token: int | None = None

    def drafter_far_behind(self) -> bool:
        """A bulk sequence whose drafter has not seen its prompt (another
        editor's long file): its catch-up would be one pass over the whole
        prompt, and a keystroke would wait for all of it. The drafter proposes
        nothing for it (the n-gram proposer still does), and no drafter blocks
        are planned for it."""
        return "draft" in self.kv and self.bulk and self.prompt_len - self.kv["draft"].computed > BULK_CATCH_UP

    def local_roles(self) -> list[str]:
        """The pools this engine prefills itself."""
        return [r for r in self.kv if not (r == "target" and self.remote_job is not None)]

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill here, in the pool furthest behind."""
        return self.prompt_len - min((self.kv[r].computed for r in self.local_roles()), default=self.prompt_len)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class CandidateGroup:
    """The candidates of one request while any runs, and the request's
    `Finished` once it ended before them."""

    def __init__(self) -> None:
        self.running: list[Sequence] = []
        self.texts: dict[int, str] = {}  # rank (1: the second most likely first token) -> text
        self.first: Finished | None = None  # the request's own, held until the candidates end
        self.forking = True  # asked for, not yet joined (the scheduler's next plan forks them)
        self.cancelled = False  # the request was cancelled after it ended, before they joined
        self.answered = False  # its `Finished` went out

    @property
    def wanted(self) -> bool:
        """Whether candidates still have a point: the request was not
        cancelled, nor unsure of its very start (the confidence rules: its
        alternatives are less likely still)."""
        first = self.first
        return not self.cancelled and (first is None or first.reason != "cancelled" and first.cut != "first")

    def candidate_ended(self, seq: Sequence, reason: FinishReason, text: str) -> None:
        self.running.remove(seq)
        if reason not in ("cancelled", "deadline"):  # those were cut short: not a completion to offer
            self.texts[seq.candidate_rank] = text

    def result(self) -> Finished | None:
        """The request's `Finished` with the candidates' texts, once it and
        every candidate ended (at once when candidates have no point, even
        before they were planned); once."""
        if self.answered or self.first is None or self.running or (self.forking and self.wanted):
            return None
        self.answered = True
        if not self.wanted:
            return self.first
        unique: list[str] = []
        for _, text in sorted(self.texts.items()):
            if text.strip() and text != self.first.text and text not in unique:
                unique.append(text)
        return msgspec.structs.replace(self.first, candidates=tuple(unique))
