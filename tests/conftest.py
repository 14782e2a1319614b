"""Set before anything imports triton (transformers may, at import): on these
CPU machines every Triton kernel runs under the interpreter. Triton fixes the
mode of each @jit function, its own standard library's included, when it is
defined, so a later setting would come too late."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
