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

from completer import checkpoint
from completer.checkpoint import CheckpointError, gguf_cpu_precision, load_checkpoint, load_model, resolve_precision
from completer.cpu_quant import MIXED, Int4Linear, Int8Linear
from completer.gguf_checkpoint import GgufFile
from completer.loading import load
from support.gguf_files import SHIPPED_TOKENIZER, write_pair

ROOT = Path(__file__).resolve().parents[2]
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


# -- K-quants and Q8_0 on the CPU fast paths (docs/models.md) -----------------

# A Q4_K_M-like file: Q4_K, with Q6_K for one layer's attn_v and the other's ffn_down.
Q4_K_M = dict(qtype=Q.Q4_K, tensor_types={"blk.0.attn_v": Q.Q6_K, "blk.1.ffn_down": Q.Q6_K})


def projections(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (Int4Linear, Int8Linear))}


def served_weight(linear) -> torch.Tensor:
    if isinstance(linear, Int4Linear):
        return linear.dequantized()
    q, scale = linear.int8_weight()
    return q.float() * scale[:, None]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda t: t.name)
def test_int4_groups_are_the_files_weights_bit_for_bit(tmp_path, qtype):
    """The file's own groups, unpacked: q * scale + minimum is what the gguf
    reader (llama.cpp's math) dequantizes, to the bit, for every matrix."""
    path, _ = write_pair(tmp_path, "qwen2", qtype)
    gguf = GgufFile(path)
    matrices = 0
    for name, t in gguf.tensors.items():
        groups = gguf.int4_groups(name)
        if len(t.shape) != 2:
            assert groups is None
            continue
        q, scale, low = groups
        N, K = q.shape
        assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == low.shape == (N, K // 32)
        ours = (q.float().view(N, -1, 32) * scale[..., None] + low[..., None]).view(N, K)
        assert torch.equal(ours, gguf.tensor(name)), name
        matrices += 1
    assert matrices == 2 * 7 + 2  # (token_embd and output: 2-D, in the same type)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K], ids=lambda t: t.name)
def test_int4_serves_the_files_4bit_weights_exactly(tmp_path, arch, qtype):
    """At int4 every fused projection of a Q4_1 or Q4_K file holds the file's
    weights exactly (llama's permuted Q/K rows and fusing included)."""
    path, _ = write_pair(tmp_path, arch, qtype)
    reference = dict(load_model(path, "fp32", fuse=True).named_modules())
    served = projections(load_model(path, "int4", fuse=True))
    assert sum(isinstance(m, Int4Linear) for m in served.values()) == 2 * 4
    for name, linear in served.items():
        if isinstance(linear, Int4Linear):
            assert torch.equal(linear.dequantized(), reference[name].weight.detach()), name


def test_q4_k_m_mixed_file_int4_and_int4_int8(tmp_path):
    """A Q4_K_M-like file: at int4+int8 a projection whose parts are all Q4_K
    is int4 (exact), one with a Q6_K part int8; at int4 the Q4_K rows of a
    mixed projection are exact and the Q6_K rows requantized."""
    path, _ = write_pair(tmp_path, "llama", **Q4_K_M)
    reference = {name: m.weight.detach() for name, m in load_model(path, "fp32", fuse=True).named_modules()
                 if isinstance(m, torch.nn.Linear)}
    mixed = projections(load_model(path, MIXED, fuse=True))
    int8 = {name for name, m in mixed.items() if isinstance(m, Int8Linear)}
    assert int8 == {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj", "lm_head"}
    for name, linear in mixed.items():
        w, ref = served_weight(linear), reference[name]
        if name in int8:  # 7 bits a row: within half a step of the row's scale
            assert (w - ref).abs().max() <= ref.abs().amax() / 63 / 2 * 1.001
        else:
            assert torch.equal(w, ref), name
    qkv = load_model(path, "int4", fuse=True).model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear)
    w, ref = qkv.dequantized(), reference["model.layers.0.self_attn.qkv_proj"]
    qk_rows = (4 + 2) * 64  # HEADS + KV_HEADS heads of 64
    assert torch.equal(w[:qk_rows], ref[:qk_rows])
    assert 0 < (w[qk_rows:] - ref[qk_rows:]).abs().max() <= ref[qk_rows:].abs().max() / 15 * 1.001


@pytest.mark.parametrize("written, vnni, fallback", [
    (dict(qtype=Q.Q4_0), "int4", "int4"),
    (dict(qtype=Q.Q4_1), "int4", "int4"),
    (dict(qtype=Q.Q4_K), "int4", "int4"),
    (Q4_K_M, MIXED, "int4"),
    (dict(qtype=Q.Q5_0), "int8", None),
    (dict(qtype=Q.Q5_1), "int8", None),
    (dict(qtype=Q.Q5_K), "int8", None),
    (dict(qtype=Q.Q6_K), "int8", None),
    (dict(qtype=Q.Q8_0), "int8", None),
    (dict(qtype=Q.Q6_K, tensor_types={"blk.0.ffn_down": Q.Q4_K}), MIXED, None),
    (dict(qtype=Q.F16), None, None),
], ids=["Q4_0", "Q4_1", "Q4_K", "Q4_K_M", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q6_K+Q4_K", "F16"])
def test_auto_precision_by_stored_type(tmp_path, monkeypatch, written, vnni, fallback):
    """`auto` on a CPU, per GGUF type: where int8 runs in the fused layer
    (AVX512-VNNI) and where it does not; None: the float precision as before."""
    path, _ = write_pair(tmp_path, "qwen2", **written)
    float_precision = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    for here, want in ((True, vnni), (False, fallback)):
        monkeypatch.setattr(checkpoint, "int8_fused_here", lambda: here)
        assert resolve_precision("auto", "cpu", path) == (want or float_precision)
        assert resolve_precision("auto", "cuda", path) == "bf16"
        assert resolve_precision("int8", "cpu", path) == "int8"


def test_gguf_cpu_precision_counts():
    assert gguf_cpu_precision({"Q4_K": 150, "Q6_K": 46}, True) == MIXED
    assert gguf_cpu_precision({"Q4_K": 150, "Q6_K": 46}, False) == "int4"
    assert gguf_cpu_precision({"Q5_0": 164, "Q8_0": 14, "Q4_K": 16, "Q6_K": 14}, False) is None
    assert gguf_cpu_precision({"Q4_K": 150, "F16": 10}, True) == "int4"  # mostly 4-bit: int4
    assert gguf_cpu_precision({"Q8_0": 10, "F16": 10}, True) is None
    assert gguf_cpu_precision({}, True) is None


def test_default_model_auto_is_int4_exact(default_model):
    """The default file (Q4_1): int4, its groups taken from the file as they are."""
    assert resolve_precision("auto", "cpu", default_model) == "int4"
    gguf = GgufFile(default_model)
    groups = gguf.int4_groups("blk.3.ffn_down.weight")
    assert torch.equal((groups[0].float().view(576, -1, 32) * groups[1][..., None] + groups[2][..., None])
                       .view(576, -1), gguf.tensor("blk.3.ffn_down.weight"))


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


@pytest.mark.parametrize("written", [dict(qtype=Q.Q4_K), Q4_K_M], ids=["Q4_K", "Q4_K_M"])
async def test_serve_serves_a_gguf_the_user_has(tmp_path, written):
    """`completer serve --model X.gguf`: ready at the precision `auto` picks
    for its types (K-quants on the int4 / int8 paths), through the fused
    CPU layer where it is built, and completions stream."""
    from completer.cpu_quant import int8_fused_here
    from latency_bench.harness import collect, complete_msg, connect, running_server

    path, _ = write_pair(tmp_path, "qwen2", **written)
    want = MIXED if "tensor_types" in written and int8_fused_here() else "int4"
    with running_server("engine.threads=1", model=str(path)) as server:
        assert any("model.gguf" in line for line in server.log)
        assert any(f"precision {want}; ready" in line for line in server.log), server.log
        assert not any("fused CPU layer is not used" in line for line in server.log), server.log
        async with connect(server) as ws:
            await ws.send(complete_msg("g", "def f(x):\n    return ", mode="free", max_tokens=5))
            deltas, done = await collect(ws, "g")
    assert done["type"] == "done" and done["text"] == "".join(deltas)
    assert done["timings"]["generated_tokens"] > 0
