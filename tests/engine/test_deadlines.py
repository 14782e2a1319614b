"""Deadlines hold between a step's passes: a request ends with `deadline`
within one pass of its deadline, not a whole (long) step later."""

import time

from completer.engine.request import Finished, Request, SamplingParams
from support.engine_harness import make_core, prompts, run


def test_a_long_prefill_does_not_carry_a_decoding_request_past_its_deadline(models, tokenizer):
    core = make_core(models, tokenizer)
    short, long_prompt = prompts(2, seed=4)
    run(core, [Request("warm-up", short, SamplingParams(max_tokens=4, mode="free"))])  # first passes are slow
    core.add(Request("typing", short, SamplingParams(max_tokens=50, mode="free", deadline_s=0.5)))
    core.step()  # its prefill and first token: it is decoding now
    prefill = core.executor.prefill

    def slow_prefill(plan):  # a prefill that takes longer than the other's deadline
        time.sleep(0.8)
        return prefill(plan)

    core.executor.prefill = slow_prefill
    core.add(Request("open-file", long_prompt, SamplingParams(max_tokens=4, mode="free")))
    events = core.step()
    ended = {e.id: e.reason for e in events if isinstance(e, Finished)}
    assert ended.get("typing") == "deadline"  # in this step, before the decode pass it would overrun
    assert "typing" not in core.scheduler.requests
