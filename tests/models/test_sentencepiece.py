"""SentencePiece-style tokenizers (Llama 2, CodeLlama, Mistral): without the
dummy prefix, separately encoded chunks join without extra spaces; pieces
spell their bytes ("\u2581" a space, <0xNN> a byte), so streamed text and token
healing see the real text; CodeLlama's markers carry their own spaces."""

import pytest
import torch

from completer.document import DocumentPrompt
from completer.config import EngineConfig, SpecConfig
from completer.engine.core import EngineCore
from completer.engine.request import Finished, Request, SamplingParams
from completer.healing import TokenHealer
from completer.model import Transformer
from support.tiny import tiny_config
from completer.prompt import PromptBuilder, get_template
from completer.tokenizer import TextTokenizer
from support.sp_tokenizer import llama2_style_tokenizer

CODE = "def area(r):\n    return 3.14 * r * r  # résumé\n\nclass Point:\n    x: int = 0\n" * 20
TEXTS = ["def f", " def f", "x = '🚀'\n    return", "naïve → ok", "\n\n    ", ""]


@pytest.fixture(scope="module")
def tk():
    return TextTokenizer(llama2_style_tokenizer([CODE], 400))


def test_chunks_encode_without_a_dummy_space_and_pieces_spell_bytes(tk):
    assert tk.sentencepiece_style and tk.bos_ids() == [tk.token_id("<s>")]
    for text in TEXTS:
        ids = tk.encode(text)
        assert tk.decode(ids) == text
        assert b"".join(tk.token_bytes(i) for i in ids) == text.encode()
    # Two chunks spell their concatenation: no space appears at the seam.
    assert tk.decode(tk.encode("def area(r):") + tk.encode("\n    return")) == "def area(r):\n    return"
    assert tk.tokenizer.id_to_token(tk.encode(" return")[0]).startswith("\u2581")
    healer = TokenHealer(tk)
    assert healer.vocab[tk.encode("\n")[0]] == b"\n"


@pytest.mark.parametrize("order", ["psm", "spm"])
def test_document_prompt_spells_the_window(tk, order):
    builder = PromptBuilder(tk, get_template("codellama", order), 160, step_lines=4)
    pre, suf, mid = (tk.token_id("\u2581" + m) for m in ("<PRE>", "<SUF>", "<MID>"))
    doc = DocumentPrompt(builder)
    prefix, suffix = CODE[:700], CODE[700:]
    for ch in "    value = area(2)  # ok→":
        prefix += ch
        prompt = doc.update(prefix, suffix)
        assert prompt.tokens[:2] == [tk.token_id("<s>"), pre] and len(prompt.tokens) <= 160
        window = prefix[prompt.window.prefix_start:]
        shown = suffix[: prompt.window.suffix_end]
        if order == "spm":
            assert prompt.tokens[2] == suf
            assert tk.decode(prompt.tokens[3:]) == f"{shown} <MID> {window}"
        else:
            assert tk.decode(prompt.tokens[2:]) == f" {window} <SUF>{shown} <MID>"
        assert mid in prompt.tokens


def test_engine_streams_the_text_of_its_tokens(tk):
    cfg = tiny_config(vocab_size=tk.vocab_size, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    model.init_weights(0.3)
    core = EngineCore.build(model, None, tk, [], EngineConfig(block_size=16),
                            SpecConfig(ngram=False, draft_model=False), num_blocks={"target": 64})
    prompt = tk.encode(CODE[:200])
    core.add(Request("r", prompt, SamplingParams(max_tokens=40, mode="free")))
    seq, streamed, done = core.scheduler.requests["r"], "", None
    while core.has_work:
        for event in core.step():
            if isinstance(event, Finished):
                done = event
            else:
                streamed += event.text
    spelled = b"".join(tk.token_bytes(t) for t in seq.generated)
    assert done.text == streamed == spelled.decode("utf-8", errors="replace")
    assert " " in done.text and "\n" in done.text  # "\u2581" and newline pieces came out as text
    if "\ufffd" not in done.text:  # random weights may emit invalid UTF-8, replaced differently
        assert done.text == tk.decode(seq.generated)
