"""The one-shot greedy loop, and the `completer complete` command on the shipped models."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from completer.generate import complete, line_mode_end
from completer.model import ModelConfig, Transformer
from completer.prompt import PromptBuilder, get_template
from completer.tokenizer import train_bpe

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, end", [
    ("return x\n    y", 8), ("\n    return 1\nfoo", 13), ("  \n\n", None), ("abc", None)])
def test_line_mode_end(text, end):
    assert line_mode_end(text) == end


def test_cached_greedy_equals_recomputed_greedy(tmp_path):
    tok = train_bpe(["def add(a, b):\n    return a + b\n" * 40], 320, tmp_path)
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=tok.vocab_size, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    torch.manual_seed(1)
    model = Transformer(cfg).eval()
    builder = PromptBuilder(tok, get_template("default"), budget=128)
    result = complete(model, builder, "def add(a, b):\n    ret", "\n", max_tokens=12, mode="free")
    # The same greedy continuation, recomputed from scratch at every step.
    ids = builder.build("def add(a, b):\n    ret", "\n").tokens
    out = []
    with torch.no_grad():
        for _ in range(result.generated_tokens):
            out.append(int(model(torch.tensor([ids + out]))[0, -1].argmax()))
    assert tok.decode(out) == result.text
    assert result.prompt_tokens == len(ids)


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "completer.cli", *args], capture_output=True,
                          text=True, input=stdin, cwd=ROOT, timeout=300)


def test_complete_command_on_shipped_models():
    done = run_cli("complete", "--model", "embedded", "examples/shapes.py:27:9")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "empty completion"
    assert "prompt" in done.stderr and "ttft" in done.stderr and "generated" in done.stderr


def test_complete_command_default_model_suggests_the_perimeter(default_model):
    """The README's example on the real default target (SmolLM2-135M)."""
    done = run_cli("complete", "examples/shapes.py:27:9")
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[0]
    assert line.startswith("return") and "self.width" in line and "self.height" in line, line
    assert "SmolLM2" in done.stderr


def test_complete_command_from_stdin():
    done = run_cli("complete", "--model", "embedded", "--prefix", "-", "--suffix", "\n",
                   stdin="import os\n\ndef main():\n    ")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_complete_command_bad_model_dir(tmp_path):
    done = run_cli("complete", "--model", str(tmp_path / "nope"), "--prefix", "x")
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "nope" in done.stderr


def test_complete_command_cursor_outside_file():
    done = run_cli("complete", "examples/shapes.py:999:1")
    assert done.returncode != 0 and "outside the file" in done.stderr
