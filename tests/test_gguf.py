"""GGUF checkpoints: the same logits as the same weights from safetensors and
as transformers' own GGUF loading, for both architectures and every supported
quantization type; the tokenizer built from the file gives transformers' ids;
each loading error is one line naming the file."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from completer.checkpoint import CheckpointError, load_checkpoint, load_model
from completer.loading import load
from gguf_files import SHIPPED_TOKENIZER, write_pair

ROOT = Path(__file__).resolve().parents[1]
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def transformers_auto():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM, AutoTokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_logits_match_safetensors_and_transformers(tmp_path, arch, qtype, transformers_auto):
    path, hf = write_pair(tmp_path, arch, qtype)
    ours = load_model(path, "fp32")
    same_weights = load_model(hf, "fp32")
    theirs = transformers_auto[0].from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert ours.config.architecture == same_weights.config.architecture
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(ids)
        assert logits.std() > 0.1  # not a degenerate model that any loader would match
        assert (logits - same_weights(ids)).abs().max() <= 1e-4
        assert (logits - theirs(ids).logits).abs().max() <= 1e-3


def test_gguf_tied_embeddings_share_one_tensor(tmp_path):
    path, _ = write_pair(tmp_path, "llama", Q.Q8_0)
    model = load_model(path, "fp32")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gguf_serving_precision_and_template(tmp_path):
    path, _ = write_pair(tmp_path, "qwen2", Q.Q4_K)
    loaded = load(path, "bf16")
    assert loaded.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert loaded.template.name == "default"  # the shipped vocabulary has FIM tokens
    assert loaded.name == "model.gguf"


def corpus() -> list[str]:
    """A few hundred KB of code and text: stdlib sources, unicode, digits, odd spacing."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8") for p in sorted((lib / "json").glob("*.py"))]
    texts += [p.read_text(encoding="utf-8") for p in sorted((lib / "email").glob("*.py"))][:12]
    texts += [p.read_text(encoding="utf-8") for p in (lib / "textwrap.py", lib / "difflib.py", lib / "ast.py")]
    texts += ["Grüße aus Zürich — naïve café, 東京 and Москва 🙂👍🏽\n\tx = 12345 + 0.5e-3\n",
              "  leading spaces\n\n\n   trailing   \r\nwindows\r\nline 2024-12-01 12:34:56",
              "<|endoftext|> special text stays text <|fim_prefix|>", "don't they're we'll I'M 'S",
              "a" * 300 + " " * 40 + "\u00a0nbsp\u2003em space"]
    assert sum(map(len, texts)) > 300_000
    return texts


def test_gguf_tokenizer_ids_equal_transformers_and_the_original(tmp_path, transformers_auto):
    from completer.tokenizer import TextTokenizer

    path, _ = write_pair(tmp_path, "llama", Q.Q8_0)
    ours = load_checkpoint(path, "fp32")[1]
    theirs = transformers_auto[1].from_pretrained(tmp_path, gguf_file=path.name)
    original = TextTokenizer.from_file(SHIPPED_TOKENIZER)
    for text in corpus():
        ids = ours.encode(text)
        # Document text that spells a special token stays text (both sides told so).
        assert ids == theirs.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ids == original.encode(text)
        assert ours.decode(ids) == text
    assert ours.special_ids == original.special_ids


def test_real_default_model_tokenizer_equals_transformers(default_model, transformers_auto):
    """SmolLM2's own vocabulary. Its pre-tokenizer `smollm` isolates every digit
    before the GPT-2 split (llama.cpp does so; transformers' GGUF converter
    skips that step): the reference is transformers' BPE applied to the pieces
    between digits, each digit a piece of its own."""
    import regex

    from completer.gguf_checkpoint import GgufFile

    ours = GgufFile(default_model).tokenizer()
    theirs = transformers_auto[1].from_pretrained(default_model.parent, gguf_file=default_model.name)
    for text in corpus():
        reference = [i for piece in regex.split(r"(\p{N})", text) if piece
                     for i in theirs.encode(piece, add_special_tokens=False, split_special_tokens=True)]
        assert ours.encode(text) == reference
    assert ours.token_id("<file_sep>") in ours.special_ids
    assert ours.bos_ids() == []  # tokenizer.ggml.add_bos_token is false


# Code as an editor sends it, for a SentencePiece vocabulary's corners: runs of
# spaces, tabs and newlines (Gemma stores them as tokens of their own), digits,
# unicode and bytes outside it (byte fallback), CRLF, the text of special and
# user-defined tokens.
GEMMA_SNIPPETS = [
    "def area(r):\n    return 3.14159 * r ** 2  # résumé\n\n\nclass Point:\n    x: int = 0\n",
    "\tif (a && b) {\n\t\treturn 42;\n\t}\n\t \t mixed\n",
    " " * 45 + "deep = 1\n" + "\n" * 40 + "end",
    "#include <stdio.h>\r\nint main(void) {\r\n    printf(\"%d\\n\", 1234567890);\r\n}\r\n",
    "x = '東京' + \"Москва\" + 'naïve' + '🚀👍🏽' + '\u00a0\u2003\u200b'",
    "<start_of_turn>user\n<bos><eos><pad><mask><unk><unused7> [multimodal] <s>strike</s> <code>x</code><end_of_turn>",
    "<0x41> \x00\x01\x7f control bytes \ufffd",
    "0.5e-3 == 1_000_000 and 2024-12-06T06:00:00Z; 0xDEADBEEF 1e100",
    "   leading and trailing   ", "", " ", "\n", "a",
]


def test_real_gemma3_tokenizer_equals_transformers(gemma3_model, transformers_auto):
    """Gemma 3 270M's SentencePiece vocabulary: our ids are transformers' from
    the same GGUF (both with special-token text kept as text, as documents
    are encoded, and both matching it, as transformers does by default), and
    every text decodes back, token by token too (streaming)."""
    import time

    from completer.gguf_checkpoint import GgufFile
    from completer.loading import detect_template

    gguf = GgufFile(gemma3_model)
    started = time.perf_counter()
    ours = gguf.tokenizer()
    built = time.perf_counter() - started
    theirs = transformers_auto[1].from_pretrained(gemma3_model.parent, gguf_file=gemma3_model.name)
    texts = GEMMA_SNIPPETS + corpus()
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False, split_special_tokens=True), text[:80]
        assert ours.decode(ids) == text
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()
    ours.tokenizer.encode_special_tokens = False  # as transformers' default: special-token text matched whole
    try:
        for text in texts:
            assert ours.tokenizer.encode(text).ids == theirs.encode(text), text[:80]
    finally:
        ours.tokenizer.encode_special_tokens = True
    assert ours.sentencepiece_style and ours.vocab_size == 262_144 and ours.bos_ids() == [2]
    assert {ours.token_id(t) for t in ("<eos>", "<start_of_turn>", "<end_of_turn>")} <= ours.special_ids
    assert ours.encode("    return") == [ours.token_id("\u2581" * 4), ours.token_id("return")]
    assert detect_template(ours) == "prefix"  # Gemma 3 has no fill-in-the-middle tokens
    assert built < 20, f"building the tokenizer took {built:.1f} s"  # ~2 s on 2 busy cores; transformers ~30 s


# -- errors: one line, naming the file and the cause ---------------------------

def one_line(excinfo, path) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and str(path) in message, message
    return message


@pytest.mark.parametrize("written, cause", [
    (dict(qtype=Q.F16, gguf_arch="mamba"), "unsupported architecture 'mamba'"),
    (dict(qtype=Q.Q8_1), "is Q8_1, which the gguf reader cannot dequantize"),
    (dict(qtype=Q.F16, tokenizer_model="llama"), "tokenizer model 'llama' is not supported"),
], ids=["architecture", "quantization", "tokenizer"])
def test_gguf_refused_in_one_line(tmp_path, written, cause):
    path, _ = write_pair(tmp_path, "llama", **written)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert cause in one_line(e, path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 100])
def test_gguf_truncated_file(tmp_path, keep):
    path, _ = write_pair(tmp_path, "llama", Q.Q4_0)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    message = one_line(e, path)
    assert "truncated" in message or "not a readable GGUF file" in message


def test_gguf_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert "file not found" in one_line(e, path)


def test_serve_stops_at_start_on_a_bad_gguf(tmp_path):
    """`completer serve --model X.gguf` with a broken file: one line, exit 1."""
    path, _ = write_pair(tmp_path, "qwen2", Q.Q8_0)
    path.write_bytes(path.read_bytes()[:5000])
    done = subprocess.run([sys.executable, "-m", "completer.cli", "serve", "--model", str(path), "--port", "0",
                           "--token", "t"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(path) in errors[0], done.stderr


async def test_serve_serves_a_gguf_the_user_has(tmp_path):
    """`completer serve --model X.gguf`: ready, and completions stream."""
    from latency_bench.harness import collect, complete_msg, connect, running_server

    path, _ = write_pair(tmp_path, "qwen2", Q.Q4_K)
    with running_server("engine.threads=1", model=str(path)) as server:
        assert any("model.gguf" in line for line in server.log)
        async with connect(server) as ws:
            await ws.send(complete_msg("g", "def f(x):\n    return ", mode="free", max_tokens=5))
            deltas, done = await collect(ws, "g")
    assert done["type"] == "done" and done["text"] == "".join(deltas)
    assert done["timings"]["generated_tokens"] > 0
