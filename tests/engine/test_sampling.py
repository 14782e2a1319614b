"""Sampling is total: any temperature the protocol lets through gives a token,
never NaN probabilities that fail the step (and every request in it)."""

import torch

from completer.engine.request import Request, SamplingParams
from completer.engine.sampler import softmax_at
from support.engine_harness import make_core, prompts, run


def test_a_tiny_temperature_is_greedy_and_fails_no_other_request(models, tokenizer):
    core = make_core(models, tokenizer, spec=None)
    p = prompts(1, seed=5)[0]
    temperatures = {"t0": 0.0, "t1e-40": 1e-40, "t5e-324": 5e-324, "t1e-6": 1e-6, "t0.7": 0.7}
    done = run(core, [Request(name, p, SamplingParams(max_tokens=12, mode="free", temperature=t, seed=1))
                      for name, t in temperatures.items()])
    assert {name: f.reason for name, f in done.items()} == {name: "length" for name in temperatures}
    for name in ("t1e-40", "t5e-324", "t1e-6"):
        assert done[name].text == done["t0"].text, name


def test_softmax_at_a_small_temperature_is_a_point_mass_not_nan():
    logits = torch.tensor([[1.0, 3.0, -2.0, float("-inf")], [0.5, 0.5, 0.0, 0.0]])
    for t in (1e-40, 1e-30, 1e-5):
        p = softmax_at(logits, t)
        assert torch.isfinite(p).all()
        assert torch.allclose(p[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
        assert torch.allclose(p[1], torch.tensor([0.5, 0.5, 0.0, 0.0]))  # a tie stays a tie
