"""The training corpus: every .py file of the training interpreter's standard
library, in sorted order, so the corpus is reproducible from the Python version."""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path

import msgspec


class SourceFile(msgspec.Struct, frozen=True):
    path: str  # relative to its root, used as the file header in prompts
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_python_files(root: Path, exclude_dirs: tuple[str, ...] = ()) -> list[SourceFile]:
    """All readable UTF-8 .py files under `root`, sorted by path."""
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in exclude_dirs for part in rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(SourceFile(str(rel), text))
    return files


def stdlib_corpus() -> list[SourceFile]:
    # site-packages holds third-party code (and our evaluation set), not stdlib.
    return read_python_files(stdlib_root(), exclude_dirs=("site-packages", "__pycache__"))


def pip_sources() -> tuple[Path, str]:
    """The installed pip's package directory and version, from its metadata:
    importing pip, or even finding it through the import system, makes
    setuptools' distutils shim stand down for good (its rule for pip), and
    torch.compile's C++ build, which imports setuptools, then fails."""
    try:
        dist = importlib.metadata.distribution("pip")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("the held-out code is pip's sources, and pip is not installed") from None
    return Path(dist.locate_file("pip")), dist.version
