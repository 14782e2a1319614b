"""The engine tests' fixtures: a small byte-level tokenizer and small random
models (support/engine_harness.py builds them)."""

import pytest


@pytest.fixture(scope="module")
def tokenizer(code_tok):
    """The engine tests' tokenizer: the session's code tokenizer."""
    return code_tok


@pytest.fixture(scope="module")
def models():
    """The engine tests' small random target and drafters (support/engine_harness.py's build_models)."""
    from support.engine_harness import build_models

    return build_models()
