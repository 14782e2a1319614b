"""Gemma 3 270M, the second real model (sliding and global layers with two
RoPE bases, q/k norms, a 262,144-token SentencePiece vocabulary, no FIM
tokens): its logits on the real Q4_K_M file equal transformers' own GGUF
loader's, and through the real server it completes code over the protocol
and both compatible HTTP APIs."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from latency_bench.harness import RULES_OFF, TOKEN, collect, complete_msg, connect, running_server

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n" * 6


def test_logits_on_the_real_file_equal_transformers(gemma3_model):
    from transformers import AutoModelForCausalLM

    from completer.checkpoint import load_checkpoint

    ours, tokenizer = load_checkpoint(gemma3_model, "fp32")
    ids = tokenizer.bos_ids() + tokenizer.encode(CODE)  # (test_gguf.py: the same ids as transformers')
    reference = AutoModelForCausalLM.from_pretrained(gemma3_model.parent, gguf_file=gemma3_model.name,
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits
        got = ours(torch.tensor([ids]))
    assert len(ids) > 100
    assert (got - expected).abs().max().item() <= 1e-3 * expected.abs().max().item()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.fixture(scope="module")
def server(gemma3_model):
    with running_server(*RULES_OFF, "engine.threads=2", model=str(gemma3_model), timeout=600) as s:
        yield s


def post(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{server.compat}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        assert reply.status == 200
        return json.loads(reply.read())


PREFIX = "import math\n\n\ndef circle_area(radius):\n    return "


async def test_serves_completions_over_the_protocol(server):
    assert any("gemma-3-270m-q4_k_m.gguf" in line for line in server.log)
    async with connect(server) as ws:
        await ws.send(json.dumps({"type": "hello", "client": "test/1", "protocol": 1}))
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready" and ready["model"]["target"].startswith("gemma-3-270m")
        await ws.send(complete_msg("g", PREFIX, mode="line", max_tokens=16))
        deltas, done = await collect(ws, "g")
    assert done["type"] == "done" and done["text"] == "".join(deltas)
    assert "math.pi" in done["text"] and "radius" in done["text"], done["text"]


def test_serves_llama_cpp_infill_and_openai_completions(server):
    infill = post(server, "/infill", {"input_prefix": "import math\n\n\ndef circle_area(radius):\n",
                                      "prompt": "    return ", "input_suffix": "\n", "n_predict": 16,
                                      "stop": ["\n"]})
    assert "math.pi" in infill["content"], infill
    openai = post(server, "/v1/completions", {"model": "gemma3-270m", "prompt": PREFIX, "suffix": "\n",
                                              "max_tokens": 16, "temperature": 0, "stop": ["\n"]})
    text = openai["choices"][0]["text"]
    assert "math.pi" in text and "radius" in text, openai
