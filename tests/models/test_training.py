"""The trainer is seeded and resumable: an interrupted run that resumes ends
with exactly the weights of an unbroken one; the drafter distils from a teacher."""

import msgspec
import torch
from safetensors.torch import load_file

from completer.checkpoint import load_model
from completer.tokenizer import train_bpe
from completer.training.corpus import read_python_files, stdlib_root
from completer.training.trainer import DRAFT, TARGET, TrainSpec, train

TINY = msgspec.structs.replace(TARGET, vocab_size=400, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8)


def tokenizer_dir(tmp_path):
    texts = [f.text for f in read_python_files(stdlib_root() / "json")]
    train_bpe(texts, 400, tmp_path / "tok")
    return tmp_path / "tok"


def test_resume_matches_unbroken_run(tmp_path):
    tok = tokenizer_dir(tmp_path)
    spec = TrainSpec(model=TINY, steps=6, rows=2, seq_len=64, warmup=2)
    train(tmp_path / "unbroken", spec, tok, log=lambda *_: None)
    train(tmp_path / "broken", spec, tok, log=lambda *_: None, stop_after=3)
    paused = load_file(tmp_path / "broken" / "hf" / "model.safetensors")
    train(tmp_path / "broken", spec, tok, log=lambda *_: None)
    a = load_file(tmp_path / "unbroken" / "hf" / "model.safetensors")
    b = load_file(tmp_path / "broken" / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    assert any(not torch.equal(paused[k], b[k]) for k in a), "resume did not train"
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_distillation_lowers_kl_to_teacher(tmp_path):
    tok = tokenizer_dir(tmp_path)
    teacher = train(tmp_path / "teacher", TrainSpec(model=TINY, steps=8, rows=2, seq_len=64, warmup=2),
                    tok, log=lambda *_: None)
    small = msgspec.structs.replace(TINY, hidden_size=16, num_attention_heads=2,
                                    num_key_value_heads=1, num_hidden_layers=1)
    logs = []
    train(tmp_path / "draft", TrainSpec(model=small, steps=20, rows=2, seq_len=64, warmup=2,
                                         lr=1e-2, teacher=str(teacher)), tok, log=logs.append)
    losses = [float(line.split("loss ")[1].split()[0]) for line in logs if line.startswith("step")]
    assert losses[-1] < losses[0]
    assert load_model(tmp_path / "draft" / "hf").config.hidden_size == 16
    assert DRAFT.num_parameters() * 8 <= TARGET.num_parameters()


def test_init_from_starts_from_those_weights(tmp_path):
    tok = tokenizer_dir(tmp_path)
    first = train(tmp_path / "first", TrainSpec(model=TINY, steps=3, rows=2, seq_len=64, warmup=1),
                  tok, log=lambda *_: None)
    # One step at learning rate 0: the weights must be exactly the ones started from.
    logs = []
    again = train(tmp_path / "again", TrainSpec(model=TINY, steps=1, rows=2, seq_len=64, warmup=1, lr=0.0,
                                                 seed=1, init_from=str(first)), tok, log=logs.append)
    assert any("starting from the weights of" in line for line in logs)
    a, b = load_file(first / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
