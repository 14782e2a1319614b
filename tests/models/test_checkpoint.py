"""Loading errors name the file and the cause; our exports load in transformers."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from completer.checkpoint import CheckpointError, load_model, save_model
from completer.loading import load
from completer.model import Transformer
from completer.tokenizer import train_bpe
from support.tiny import tiny_config

TINY = tiny_config(vocab_size=300, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    tok = train_bpe(["def f(x):\n    return x + 1\n" * 50, "class A:\n    pass\n" * 50], 300, root / "tok")
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights()
    save_model(model, root / "model", tok, dtype=torch.float32)
    return root / "model"


def copy(saved, tmp_path, **config):
    """The saved checkpoint copied, `config.json` changed by `config`."""
    d = shutil.copytree(saved, tmp_path / "m")
    if config:
        path = d / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return d


def test_export_loads_in_transformers_with_same_logits(saved):
    ours = load_model(saved)
    theirs = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    ids = torch.randint(0, TINY.vocab_size, (1, 20))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() <= 1e-4


def test_load_bundle_detects_default_template(saved):
    loaded = load(saved)
    assert loaded.template.name == "default"
    assert loaded.model.config.num_hidden_layers == 2


def test_missing_weights_file(saved, tmp_path):
    d = copy(saved, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: file not found"):
        load_model(d)


def test_missing_shard(saved, tmp_path):
    d = copy(saved, tmp_path)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: shard listed"):
        load_model(d)


def test_wrong_architecture(saved, tmp_path):
    d = copy(saved, tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_model(d)


def test_mismatched_shape(saved, tmp_path):
    d = copy(saved, tmp_path, intermediate_size=48)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' "
                                              r"has shape \(\d+, \d+\), the config implies"):
        load_model(d)


def test_missing_tensor(saved, tmp_path):
    d = copy(saved, tmp_path)
    state = load_file(d / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' missing"):
        load_model(d)


def test_missing_config_and_tokenizer(saved, tmp_path):
    d = copy(saved, tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        load(d)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model(d)


def test_sentencepiece_tokenizer_loads_with_codellama_markers(saved, tmp_path):
    """A Llama-2 / CodeLlama-style tokenizer.json ("\u2581" pieces, dummy prefix,
    byte fallback, <s> first, markers spelled "\u2581<PRE>") loads with the
    codellama template, BOS in front and the markers' own spaces."""
    from support.sp_tokenizer import llama2_style_tokenizer

    d = copy(saved, tmp_path)
    llama2_style_tokenizer(["def f(x):\n    return x\n"] * 20, 300).save(str(d / "tokenizer.json"))
    lm = load(d)
    tk = lm.tokenizer
    assert lm.template.name == "codellama" and tk.sentencepiece_style
    pre, suf, mid = (tk.token_id("\u2581" + m) for m in ("<PRE>", "<SUF>", "<MID>"))
    b = lm.prompt_builder(256)
    P, S = "def f(x):\n    return", " x\n"
    assert b.build(P, S).tokens == [1, pre] + tk.encode(" ") + tk.encode(P) + [suf] + tk.encode(S) + [mid]
    assert tk.decode(b.build(P, S).tokens).endswith(f" <PRE> {P} <SUF>{S} <MID>")
    assert b.stop_ids == [tk.token_id("\u2581<EOT>"), tk.token_id("</s>")]


def test_error_is_one_line(saved, tmp_path):
    d = copy(saved, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as info:
        load_model(d)
    assert "\n" not in str(info.value) and "config.json" in str(info.value)


def test_drafter_reads_its_targets_embeddings_and_proposes_from_its_head(saved, tmp_path):
    """A drafter cut from its target (`completer train draft-from-target`)
    ships without the embeddings it shares, and its logits cover its head's
    tokens only (-inf elsewhere)."""
    import msgspec

    from completer.training.trainer import drafter_from_teacher

    target = load(saved, fuse=False)  # as training reads it: HF's projection names
    cfg = msgspec.structs.replace(TINY, num_hidden_layers=1, head_vocab_size=50, embedding_from_target=True,
                                  tie_word_embeddings=False)
    drafter = Transformer(cfg).eval()
    head = torch.arange(50) * 3
    drafter_from_teacher(drafter, target.model, head)
    save_model(drafter, tmp_path / "d", target.tokenizer, dtype=torch.float32)
    assert "model.embed_tokens.weight" not in load_file(tmp_path / "d" / "model.safetensors")
    loaded = load(tmp_path / "d", target=target)
    assert loaded.model.model.embed_tokens.weight is target.model.model.embed_tokens.weight
    ids = torch.randint(0, TINY.vocab_size, (1, 12))
    with torch.no_grad():
        logits, reference = loaded.model(ids), drafter(ids)
    assert torch.isinf(logits[..., 1]).all() and torch.isfinite(logits[..., head]).all()
    assert torch.allclose(logits[..., head], reference[..., head], atol=1e-5)
    with pytest.raises(CheckpointError, match=r"config\.json: a drafter that reads its target's embeddings"):
        load_model(tmp_path / "d")
