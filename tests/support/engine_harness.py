"""The engine on small random models, for the engine tests: a core built
around a target (and maybe a drafter), requests run to their end, and the
plain greedy reference to compare with."""

from __future__ import annotations

import asyncio
import copy

import msgspec
import torch

from completer.config import EngineConfig, SpecConfig
from completer.engine.core import EngineCore
from completer.engine.engine import Engine
from completer.engine.request import Finished, Request, SamplingParams
from completer.model import Transformer
from support.tiny import tiny_config

CFG = tiny_config(hidden_size=48, intermediate_size=96, head_dim=12, max_position_embeddings=1024)
SMALL = tiny_config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                    max_position_embeddings=1024)


def build_models():
    torch.manual_seed(0)
    target = Transformer(CFG).eval()
    target.init_weights(0.3)  # peaky distributions: greedy paths that repeat
    other = Transformer(SMALL).eval()
    other.init_weights(0.3)
    return target, other


def make_core(models, tokenizer, draft="other", blocks=400, config=None, spec=None, bs=4, kernel=False):
    target, other = models
    config = config or EngineConfig(block_size=bs, prefill_chunk=64)
    if kernel:
        config = msgspec.structs.replace(config, paged_attention="triton")
    spec = spec or SpecConfig()
    drafter = {"other": other, "same": copy.deepcopy(target), "cut": cut_drafter(target), None: None}[draft]
    return EngineCore.build(target, drafter, tokenizer, [0], config, spec,
                            num_blocks={"target": blocks, "draft": blocks})


class StepLoop:
    """The engine loop's part of a step (core.EngineLoop), played by a test:
    `between` takes the events sent mid-step and returns the ids cancelled
    meanwhile; `cancel` says whether cancels wait for all these ids."""

    def __init__(self, between=lambda events: [], cancel=lambda ids: False):
        self.between, self.cancel = between, cancel

    def between_passes(self, events):
        return self.between(events)

    def cancel_waiting(self, request_ids):
        return self.cancel(request_ids)

    def arrivals(self):
        return []


def usage(core, role="target"):
    return core.kv.pools[role].usage()


def cut_drafter(target):
    """The target's first layer with an output layer over 100 of its tokens
    (`completer train draft-from-target`'s starting point)."""
    from completer.training.trainer import drafter_from_teacher

    cfg = msgspec.structs.replace(CFG, num_hidden_layers=1, head_vocab_size=100, embedding_from_target=True)
    drafter = Transformer(cfg).eval()
    drafter_from_teacher(drafter, target, torch.arange(0, 320, 3)[:100])
    return drafter


def prompts(n, seed=0, length=(20, 60)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        size = int(torch.randint(*length, (1,), generator=g))
        base = torch.randint(5, 320, (8,), generator=g).tolist()
        out.append((base * 10)[:size])  # repetitive: n-gram proposals fire
    return out


def run(core, requests):
    for r in requests:
        core.add(r)
    done = {}
    texts = {r.id: "" for r in requests}
    while core.has_work:
        for e in core.step():
            if isinstance(e, Finished):
                done[e.id] = e
            else:
                texts[e.id] += e.text
    for rid, f in done.items():
        assert f.text == texts[rid], "deltas must concatenate to the final text"
    return done


def free_mode(n=24):
    return SamplingParams(max_tokens=n, mode="free")


def greedy_reference(models, prompt, n):
    target = models[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(target(torch.tensor([ids]))[0, -1].argmax())
            if nxt == 0:
                break
            ids.append(nxt)
    return ids[len(prompt):]


def served_greedy_text(loaded, prompt: str, config: EngineConfig, spec: SpecConfig, n: int) -> str:
    """Greedy `free`-mode text of a loaded model through the engine as the
    server runs it (Engine.start compiles where `config.compile`)."""
    async def go():
        engine = Engine.build(loaded, None, config, spec)
        engine.start()
        try:
            stream = engine.submit(Request("r", loaded.tokenizer.encode(prompt),
                                           SamplingParams(max_tokens=n, mode="free")))
            return (await stream.finished()).text
        finally:
            engine.stop()
    return asyncio.run(go())
