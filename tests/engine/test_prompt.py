"""FIM prompt templates and window fitting, on a small byte-level BPE trained here."""

import pytest
from tokenizers import Tokenizer

from completer.prompt import TEMPLATES, PromptBuilder, Snippet, Window, anchored, get_template
from completer.tokenizer import TextTokenizer, train_bpe
from completer.training.corpus import read_python_files, stdlib_root

FAMILY_TOKENS = {
    "default": [],
    "qwen2.5-coder": ["<|fim_pad|>", "<|repo_name|>", "<|im_end|>"],
    "starcoder": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"],
    "codellama": ["<PRE>", "<SUF>", "<MID>", "<EOT>", "</s>"],
    "codegemma": ["<|file_separator|>", "<eos>", "<end_of_turn>"],
    "deepseek-coder": ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<｜end▁of▁sentence｜>", "<|EOT|>"],
}
P, S = "def f(x):\n    return x", " + 1\n\nprint(f(2))\n"


@pytest.fixture(scope="session")
def files():
    root = stdlib_root()
    return read_python_files(root / "json")[:5], read_python_files(root / "email")


@pytest.fixture(scope="session")
def toks(files, tmp_path_factory):
    base = train_bpe([f.text for f in files[0] + files[1][:5]], vocab_size=600,
                     out_dir=tmp_path_factory.mktemp("tok"))
    out = {}
    for family, extra in FAMILY_TOKENS.items():
        copy = Tokenizer.from_str(base.tokenizer.to_str())
        copy.add_special_tokens(extra)
        out[family] = TextTokenizer(copy)
    return out


@pytest.fixture(scope="session")
def doc(files):
    """3000 lines of real code; the cursor sits mid-line 1500."""
    lines = "".join(f.text for f in files[1]).splitlines(keepends=True)[:3000]
    cursor = sum(map(len, lines[:1500])) + 9
    text = "".join(lines)
    return text[:cursor], text[cursor:]


def builder(toks, name, budget=256, order=None, **kw):
    return PromptBuilder(toks[name], get_template(name, order), budget, **kw)


def parts(b, prompt):
    """(prefix ids, suffix ids) of a prompt without context, in either order."""
    t, toks = b.template, prompt.tokens
    sp = len(b.tok.encode(" ")) if t.marker_space else 0  # CodeLlama's spaces
    suf, mid = toks.index(b._special[t.suffix]), toks.index(b._special[t.middle])
    pre_ids = toks[len(toks) - prompt.prefix_tokens:] if t.order == "spm" else \
        toks[toks.index(b._special[t.prefix]) + 1 + sp: suf - sp]
    return pre_ids, toks[suf + 1: mid - sp]


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


FIM_TEMPLATES = [name for name, t in TEMPLATES.items() if t.order != "prefix"]


@pytest.mark.parametrize("name", FIM_TEMPLATES)
def test_layout_per_template(toks, name):
    tk, t = toks[name], TEMPLATES[name]
    pre, suf, mid = (tk.token_id(m) for m in (t.prefix, t.suffix, t.middle))
    assert len({pre, suf, mid}) == 3 and None not in (pre, suf, mid)
    enc, sp = tk.encode, tk.encode(" ")
    expected = {
        "default": [pre, suf] + enc(S) + [mid] + enc(P),
        "qwen2.5-coder": [pre] + enc(P) + [suf] + enc(S) + [mid],
        "starcoder": [pre, suf] + enc(S) + [mid] + enc(P),
        "codellama": [pre] + sp + enc(P) + sp + [suf] + enc(S) + sp + [mid],
        "codegemma": [pre] + enc(P) + [suf] + enc(S) + [mid],
        "deepseek-coder": [pre] + enc(P) + [suf] + enc(S) + [mid],
    }[name]
    b = builder(toks, name)
    prompt = b.build(P, S)
    assert prompt.tokens == expected
    assert prompt.window == Window(0, len(S)) and prompt.prefix_tokens == len(enc(P))
    assert b.stop_ids == [tk.token_id(s) for s in t.stop_tokens]
    if name == "codellama":
        assert tk.decode(prompt.tokens) == f"<PRE> {P} <SUF>{S} <MID>"
        spm = builder(toks, name, order="spm").build(P, S)
        assert tk.decode(spm.tokens) == f"<PRE> <SUF>{S} <MID> {P}"


@pytest.mark.parametrize("name", ["qwen2.5-coder", "codegemma", "deepseek-coder"])
def test_family_is_detected_from_its_special_tokens(toks, name):
    from completer.loading import detect_template

    assert detect_template(toks[name]) == name


def test_order_override_and_errors(toks):
    qwen = TEMPLATES["qwen2.5-coder"]
    spm = get_template("qwen2.5-coder", order="spm")
    assert spm.order == "spm" and qwen.order == "psm" and get_template("default", "psm").order == "psm"
    tk = toks["qwen2.5-coder"]
    ids = PromptBuilder(tk, spm, 256).build(P, S).tokens
    assert ids == [tk.token_id(qwen.prefix), tk.token_id(qwen.suffix)] + tk.encode(S) + \
        [tk.token_id(qwen.middle)] + tk.encode(P)
    with pytest.raises(ValueError, match="no-such-model"):
        get_template("no-such-model")
    with pytest.raises(ValueError, match="'pms'"):
        get_template("default", order="pms")
    with pytest.raises(ValueError, match="<fim_prefix>"):
        PromptBuilder(toks["default"], TEMPLATES["starcoder"], 256)
    with pytest.raises(ValueError, match="<PRE>"):
        PromptBuilder(toks["default"], TEMPLATES["codellama"], 256)


def check_window(b, prompt, prefix, suffix):
    """The prompt is within budget and its texts are exactly the window's texts."""
    assert len(prompt.tokens) <= b.budget
    pre_ids, suf_ids = parts(b, prompt)
    w = prompt.window
    assert b.tok.decode(pre_ids) == prefix[w.prefix_start:]
    assert b.tok.decode(suf_ids) == suffix[:w.suffix_end]
    assert len(suf_ids) <= b.suffix_budget
    return pre_ids, suf_ids


@pytest.mark.parametrize("name", ["default", "qwen2.5-coder"])
def test_window_on_long_document(toks, doc, name):
    prefix, suffix = doc
    b = builder(toks, name, step_lines=8)
    prompt = b.build(prefix, suffix)
    pre_ids, suf_ids = check_window(b, prompt, prefix, suffix)
    w = prompt.window
    # Prefix: the tail from a line start on the step grid, as far back as fits.
    assert 0 < w.prefix_start < len(prefix) and prefix[w.prefix_start - 1] == "\n"
    assert anchored(prefix, w.prefix_start, 8) and prefix.count("\n", 0, w.prefix_start) > 1400
    prefix_budget = b.budget - len(suf_ids) - len(b.assemble([], [], []))
    earlier = prefix.rfind("\n", 0, w.prefix_start - 1) + 1
    while not anchored(prefix, earlier, 8):  # the start on the grid before it
        earlier = prefix.rfind("\n", 0, earlier - 1) + 1
    assert len(b.tok.encode(prefix[earlier:])) > prefix_budget
    # Suffix: the head, whole lines, as many as fit.
    assert 0 < w.suffix_end < len(suffix) and suffix[w.suffix_end - 1] == "\n"
    next_end = suffix.find("\n", w.suffix_end) + 1
    assert len(b.tok.encode(suffix[:next_end])) > b.suffix_budget
    assert len(prompt.tokens) > 0.8 * b.budget


def test_the_line_number_grid_switch_starts_windows_on_multiples_of_the_step(toks, doc):
    """model.window_grid = "lines": the grid before the content-drawn one,
    kept to measure it against: the same text sent from another origin (two
    lines fewer above) starts its window elsewhere, on the content grid not."""
    prefix, suffix = doc
    for grid in ("lines", "content"):
        b = builder(toks, "default", step_lines=8, grid=grid)
        start = b.build(prefix, suffix).window.prefix_start
        line = prefix.count("\n", 0, start)
        cut = prefix.find("\n", prefix.find("\n") + 1) + 1  # two lines fewer above
        again = b.build(prefix[cut:], suffix).window.prefix_start + cut
        if grid == "lines":
            assert line % 8 == 0 and again != start
        else:
            assert anchored(prefix, start, 8) and again == start


def test_typing_keeps_the_window_and_the_tokens_before_the_cursor(toks, doc, files):
    prefix, suffix = doc
    typed = files[1][7].text[5000:5200]  # 200 chars of real code, newlines included
    runs = {}
    for name, order in (("default", "spm"), ("qwen2.5-coder", "psm")):
        b = builder(toks, name, order=order, step_lines=32)
        prompts = [b.build(prefix + typed[:k], suffix) for k in range(len(typed) + 1)]
        for k, p in enumerate(prompts):
            check_window(b, p, prefix + typed[:k], suffix)
            assert len(p.tokens) > 0.5 * b.budget
            assert anchored(prefix, p.window.prefix_start, 4)  # a coarse grid even when 32 lines do not fit
        starts = [p.window.prefix_start for p in prompts]
        assert starts == sorted(starts)  # the window only ever moves forward
        changes = sum(a != c for a, c in zip(starts, starts[1:]))
        assert changes <= 3, (name, changes)
        steady = [(a, c) for a, c in zip(prompts, prompts[1:]) if a.window == c.window]
        assert len(steady) >= len(typed) - 3
        runs[name] = [len(c.tokens) - lcp(a.tokens, c.tokens) for a, c in steady]
        if order == "spm":
            # Only the last word before the cursor is re-tokenized.
            assert all(lcp(a.tokens, c.tokens) >= len(a.tokens) - 6 for a, c in steady)
        else:
            # PSM: the whole suffix follows the edit, so every keystroke re-prefills it.
            for a, c in steady:
                assert len(c.tokens) - lcp(a.tokens, c.tokens) > len(parts(b, c)[1])
    assert sum(runs["qwen2.5-coder"]) > 10 * sum(runs["default"])


@pytest.mark.parametrize("name", ["default", "starcoder", "codellama"])
def test_context_snippets(toks, name):
    b = builder(toks, name)  # context_budget = 64
    tk, t = b.tok, b.template
    snips = [Snippet("a.py", "A = 1\n"), Snippet("b.py", "def b():\n    pass\n"),
             Snippet("c.py", "import os\n" * 40), Snippet("d.py", "D = 4\n")]
    prompt = b.build(P, S, path="m.py", snippets=snips)
    text = tk.decode(prompt.tokens)
    if t.file_sep:
        head = f"{t.file_sep}a.py\nA = 1\n{t.file_sep}b.py\ndef b():\n    pass\n{t.file_sep}m.py\n"
    else:
        head = "# a.py\nA = 1\n\n# b.py\ndef b():\n    pass\n\n"
    assert text.startswith(head + t.prefix)
    assert "import os" not in text and "c.py" not in text  # dropped whole, not cut
    ctx = b.context_tokens(snips)
    assert len(ctx) <= b.context_budget and prompt.tokens[:len(ctx)] == ctx
    assert len(prompt.tokens) <= b.budget
    if t.file_sep:  # file separators are single special ids
        assert prompt.tokens.count(tk.token_id(t.file_sep)) == 3
    # A snippet over the budget on its own is not truncated either.
    assert b.context_tokens([snips[2]]) == []


def test_empty_prefix_and_suffix(toks):
    b = builder(toks, "default")
    tk, t = b.tok, b.template
    pre, suf, mid = (tk.token_id(m) for m in (t.prefix, t.suffix, t.middle))
    p = b.build("", S)
    assert p.tokens == [pre, suf] + tk.encode(S) + [mid] and p.prefix_tokens == 0
    assert p.window == Window(0, len(S))
    p = b.build(P, "")
    assert p.tokens == [pre, suf, mid] + tk.encode(P) and p.window == Window(0, 0)
    assert b.build("", "").tokens == [pre, suf, mid]
    cl = builder(toks, "codellama")
    assert cl.tok.decode(cl.build("", "").tokens) == "<PRE>  <SUF> <MID>"


@pytest.mark.parametrize("name", ["default", "qwen2.5-coder", "codellama"])
@pytest.mark.parametrize("alphabet", ["ascii", "unicode"])
def test_single_long_line(toks, name, alphabet):
    word = "value_%d, " if alphabet == "ascii" else "naïve_日本語_%d→🚀, "
    line = "x = [" + "".join(word % i for i in range(1500))
    b = builder(toks, name)
    prefix, suffix = line, "]" + line[5:] + "\n"
    prompt = b.build(prefix, suffix)
    pre_ids, suf_ids = check_window(b, prompt, prefix, suffix)
    assert prompt.window.prefix_start > 0 and prompt.window.suffix_end > 0
    assert len(prompt.tokens) > 0.6 * b.budget
    # Typing at the end of the long line moves the start rarely, never back.
    n = 120 if alphabet == "ascii" else 40  # about 50 and 100 tokens
    typed = "".join(word % i for i in range(1500, 1600))[:n]
    starts = [b.build(prefix + typed[:k], suffix).window.prefix_start for k in range(n + 1)]
    assert starts == sorted(starts) and len(set(starts)) <= 4, starts


def test_unicode_document(toks, doc):
    prefix, suffix = doc
    prefix = prefix.replace("e", "é").replace("#", "# 日本語 🚀")
    suffix = suffix.replace("a", "ä")
    for name in ("default", "codellama"):
        b = builder(toks, name, budget=200, step_lines=4)
        prompt = b.build(prefix, suffix)
        check_window(b, prompt, prefix, suffix)
        assert prefix[prompt.window.prefix_start - 1] == "\n"


def test_special_token_text_in_a_document_stays_text(toks):
    b = builder(toks, "default")
    prompt = b.build('s = "<|endoftext|>"\n', "")
    eot = toks["default"].token_id("<|endoftext|>")
    assert eot not in prompt.tokens
    assert "<|endoftext|>" in toks["default"].decode(prompt.tokens)


# -- the prefix template (models without FIM tokens) ---------------------------

@pytest.fixture(scope="session")
def plain_tok(files):
    """A byte-level BPE with no FIM markers at all (as SmolLM2's)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([f.text for f in files[0] + files[1][:5]], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return TextTokenizer(tok)


def test_prefix_template_is_detected_and_lays_out_the_prefix_alone(plain_tok, doc):
    from completer.loading import detect_template

    assert detect_template(plain_tok) == "prefix"
    b = PromptBuilder(plain_tok, get_template("prefix"), 256)
    prompt = b.build(P, S)
    eot = plain_tok.token_id("<|endoftext|>")  # a document starts after one, as in pretraining
    assert prompt.tokens == [eot] + plain_tok.encode(P) and prompt.prefix_tokens == len(prompt.tokens) - 1
    assert prompt.window == Window(0, 0)  # the suffix is not in the prompt
    assert b.stop_ids == [eot]
    assert b.build("", S).tokens == [eot]  # never empty
    # The whole budget goes to the prefix; snippets still come first, as comments.
    prefix, suffix = doc
    long = b.build(prefix, suffix, snippets=[Snippet("a.py", "A = 1\n")])
    assert 0.5 * b.budget < len(long.tokens) <= b.budget  # the window start sits on a line grid
    assert plain_tok.decode(long.tokens).startswith("<|endoftext|># a.py\nA = 1\n\n")
    assert plain_tok.decode(long.tokens).endswith(prefix[long.window.prefix_start:])
    assert get_template("prefix", order="spm").order == "prefix"  # no order to choose


def test_prefix_template_keystrokes_keep_the_window_and_heal_the_cursor(plain_tok, doc, files):
    from completer.document import DocumentPrompt
    from completer.healing import back_off

    prefix, suffix = doc
    typed = files[1][7].text[5000:5200]
    b = PromptBuilder(plain_tok, get_template("prefix"), 256, step_lines=32)
    document = DocumentPrompt(b)
    prompts = [document.update(prefix + typed[:k], suffix) for k in range(len(typed) + 1)]
    starts = [p.window.prefix_start for p in prompts]
    assert starts == sorted(starts) and sum(a != c for a, c in zip(starts, starts[1:])) <= 3
    steady = [(a, c) for a, c in zip(prompts, prompts[1:]) if a.window == c.window]
    assert len(steady) >= len(typed) - 3
    assert all(lcp(a.tokens, c.tokens) >= len(a.tokens) - 6 for a, c in steady)  # only the tail changes
    for k in (0, 57, len(typed)):
        assert plain_tok.decode(prompts[k].tokens[1:]) == (prefix + typed[:k])[prompts[k].window.prefix_start:]
    # The prompt ends with the prefix: its last token is backed off and re-spelled.
    last = prompts[-1]
    tokens, heal = back_off(plain_tok, last.tokens, last.prefix_tokens)
    assert tokens == last.tokens[:-1] and heal == plain_tok.token_bytes(last.tokens[-1])


def test_healing_mask_is_every_token_that_agrees_with_the_backed_off_bytes(plain_tok):
    """The mask from the sorted vocabulary equals the definition checked token by token."""
    from completer.healing import TokenHealer

    healer = TokenHealer(plain_tok)
    for pending in (b" ", b"\n    ", b"def", b" self.", b"\xc3", b"zzzz", b" "):  # the last: from the cache
        want = [bool(b) and (b.startswith(pending) or pending.startswith(b)) for b in healer.vocab]
        assert healer.allowed(pending, plain_tok.vocab_size).tolist() == want, pending


@pytest.mark.parametrize("name", ["default", "starcoder", "qwen2.5-coder"])
def test_every_part_counts_toward_the_window_however_long_the_file_name(toks, name):
    """A 60,000-char URI once made a 15,009-token prompt for a 1,024 window."""
    b = builder(toks, name, budget=256)
    huge = "dir/" + "x" * 60_000 + ".py"
    assert 1 < len(b.header(huge)) <= 1 + 256 // 16  # the separator and the name
    prompt = b.build(P, S, huge, [Snippet(huge, "x = 1\n")] * 8)
    assert len(prompt.tokens) <= 256
    assert b.tok.decode(b.header(huge)).endswith("xx.py\n")  # the name's tail is what is kept


def test_a_budget_of_no_tokens_is_refused_not_looped_on(toks):
    """context_tokens below max_tokens made a negative budget, and fitting the suffix spun forever."""
    with pytest.raises(ValueError, match="context_tokens"):
        builder(toks, "default", budget=-76)
    b = builder(toks, "default", budget=1)
    assert b.fit_suffix("y" * 50 + "\n" + S) == (0, [])


def test_fitting_the_window_works_on_the_window_not_the_file(toks):
    """Fitting a 4 MB prefix once listed every line start of the file (180-300 ms
    on the event loop for a new 2 MB document); what it allocates now follows
    the window. Measured as memory, which does not depend on the machine's speed."""
    import tracemalloc

    b = builder(toks, "default", budget=256)
    small = P * 20
    large = "x = 1\n" * 700_000 + small  # 4.2 MB of short lines before the same tail
    peaks = []
    for prefix in (small, large):
        tracemalloc.start()
        fit = b.fit_prefix(prefix, 200)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert prefix[fit[0]:].endswith(P)
    assert peaks[1] < 4 * peaks[0] + 100_000, peaks
