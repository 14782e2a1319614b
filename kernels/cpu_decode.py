"""The fused CPU layer (cpu_decode.cpp), built once per machine (its weight
layouts: cpu_packing.py).

A pass of a few new tokens on a CPU (decode, verify, a keystroke's short
prefill) runs each decoder layer as one C++ call instead of ~15 torch ops.

The extension is compiled per feature level (cpu_levels.py: scalar, avx2,
avx512, each with its explicit flags; the highest this CPU runs, or
$COMPLETER_CPU_LEVEL's) into the completer cache (a folder per level, keyed
by the source, torch, Python, the level and this CPU's flags), so the first
start on a machine spends some seconds in the C++ compiler; without one, or
with a level this CPU cannot run, `extension()` raises FusedUnavailable and
the engine runs torch's ops. A build's `tiles_available()` says whether it
takes weights in tiles; at each load it must match its level's `tiles`.

The cache is code this process runs, so it is checked before anything in it
is loaded (issue #43):
- its folders are made 0700; one owned by another user, writable by group or
  others, or a symbolic link is refused (a warning names it) and the layer is
  built in a fresh private folder (mkdtemp) instead;
- builders take `build.lock` (flock, so a holder that died holds nothing; the
  file names its pid and start) before touching the folder; a wait ends after
  $COMPLETER_KERNEL_BUILD_TIMEOUT_S (default 600 s, counted from the
  holder's start), then the layer is built in a private folder; a torch
  `lock` left by a killed build is removed; `stop_waiting()` (the server's
  SIGTERM) ends a wait at once;
- the built .so's size and sha256 go to a sidecar (`completer_cpu_decode_LEVEL.so.sha256`,
  written atomically after the build) and are compared before every load: a
  .so that does not match (truncated, damaged, swapped) is deleted with the
  build's other outputs and rebuilt, never loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from completer_kernels.cpu_levels import CpuLevel, CpuLevelError, cpu_flags, runnable_levels, selected_level

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
HEADERS = tuple(Path(__file__).with_name(h) for h in ("cpu_gemm.h", "cpu_attention.h", "cpu_workers.h"))

MODULE = "completer_cpu_decode"  # a level's module: MODULE_LEVEL (each its own name, in one process too)
LOCK_NAME = "build.lock"
TORCH_BATON = "lock"  # torch.utils.cpp_extension's own lock file (it waits on it without end)
DEFAULT_BUILD_TIMEOUT_S = 600.0

log = logging.getLogger("completer.kernels")
_lock = threading.Lock()
_built: dict[str, object] = {}  # per level's name: its module, or why it cannot run (a str)
_stopping = threading.Event()


class FusedUnavailable(RuntimeError):
    """The fused layer cannot be built or used here (one line: why)."""


class StoppedWaiting(FusedUnavailable):
    """A wait for another process's build ended by `stop_waiting()` or the caller's `cancel` (not remembered)."""


def so_name(level: CpuLevel) -> str:
    return f"{MODULE}_{level.name}.so"


def record_name(level: CpuLevel) -> str:
    """The sidecar: {"size": bytes, "sha256": hex} of the level's .so built beside it."""
    return f"{so_name(level)}.sha256"


def build_directory(level: CpuLevel | None = None) -> Path:
    """The level's folder in the cache (by default the level this machine runs)."""
    from completer.model_store import cache_dir

    level = level or selected_level()
    key = hashlib.sha256(b"\0".join(x.encode() for x in (
        SOURCE.read_text(), *(h.read_text() for h in HEADERS), torch.__version__, sys.version, platform.machine(),
        " ".join(sorted(cpu_flags())) or platform.processor(), level.name, " ".join(level.cflags())))).hexdigest()[:16]
    return cache_dir() / "kernels" / f"cpu_decode-{level.name}-{key}"


def build_timeout_s() -> float:
    """How long a start waits for another process's build ($COMPLETER_KERNEL_BUILD_TIMEOUT_S)."""
    try:
        return max(0.0, float(os.environ.get("COMPLETER_KERNEL_BUILD_TIMEOUT_S", DEFAULT_BUILD_TIMEOUT_S)))
    except ValueError:
        return DEFAULT_BUILD_TIMEOUT_S


def stop_waiting() -> None:
    """End a wait for another process's build now (the server is stopping):
    that `extension()` raises FusedUnavailable. For the rest of the process."""
    _stopping.set()


def folder_problem(path: Path) -> str | None:
    """Why `path` may not hold code this process loads, or None: it must be a
    directory (not a symbolic link) this user owns that neither group nor
    others can write."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_folder(path: Path) -> str | None:
    """`path` and the folder above it made 0700 where missing (the cache's
    own folders above as usual), then checked: None, or the problem."""
    for folder in (path.parent, path):
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        if problem := folder_problem(folder):
            return f"{folder} {problem}"
    return None


def _sha256(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def so_problem(folder: Path, level: CpuLevel) -> str | None:
    """Why the level's .so in `folder` may not be loaded, or None: it must be a
    regular file whose size and sha256 are the sidecar's."""
    so, record = folder / so_name(level), folder / record_name(level)
    try:
        st = os.lstat(so)
        if not stat.S_ISREG(st.st_mode):
            return f"{so} is not a regular file"
        try:
            want = json.loads(record.read_text())
            size, digest = int(want["size"]), str(want["sha256"])
        except FileNotFoundError:
            return f"{so} has no record of its build ({record.name})"
        except (ValueError, KeyError, TypeError):
            return f"{record} is damaged"
        if st.st_size != size:
            return f"{so} is {st.st_size} bytes, {size} when built"
        if _sha256(so)[1] != digest:
            return f"{so}'s sha256 is not its build's"
    except FileNotFoundError:
        return f"{so} is missing"
    except OSError as e:
        return f"{so} cannot be read ({e.strerror or e})"
    return None


def _write_record(folder: Path, level: CpuLevel) -> None:
    """The sidecar, atomically: a temporary file beside it, fsynced, renamed."""
    size, digest = _sha256(folder / so_name(level))
    fd, temp = tempfile.mkstemp(dir=folder, prefix=f".{record_name(level)}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"size": size, "sha256": digest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, folder / record_name(level))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _clear(folder: Path, level: CpuLevel) -> None:
    """The build's outputs gone (the record first: a .so without one is never loaded); the lock stays."""
    for name in (record_name(level), *sorted(os.listdir(folder))):
        if name == LOCK_NAME:
            continue
        path = folder / name
        with contextlib.suppress(FileNotFoundError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def _holder(path: Path) -> str:
    """The lock's holder as its file says: 'pid N (for S s)'."""
    try:
        pid, since = path.read_text().split()[:2]
        return f"pid {int(pid)} (for {time.time() - float(since):.0f} s)"
    except (OSError, ValueError):
        return "another process"


@contextlib.contextmanager
def _build_lock(folder: Path, cancel: threading.Event | None) -> Iterator[bool]:
    """`folder`'s build lock held meanwhile (True), or False once the wait
    passed `build_timeout_s()`, counted from the holder's start as its lock
    file says (a holder that died holds nothing: the lock is an flock). Polls,
    so `cancel` or `stop_waiting()` ends the wait (FusedUnavailable)."""
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        bound, began, said = build_timeout_s(), time.time(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            try:
                since = float(path.read_text().split()[1])
            except (OSError, ValueError, IndexError):
                since = began
            now = time.time()
            if now - since >= bound or now - began >= bound:  # a holder hung, or past our own bound
                log.warning("the fused CPU layer's build lock %s has been held by %s, past the %.0f s bound",
                            path, _holder(path), bound)
                yield False
                return
            if not said:
                log.info("waiting for %s to finish building the fused CPU layer in %s", _holder(path), folder)
                said = True
            if _stopping.wait(0.1) or (cancel is not None and cancel.wait(0.1)):
                raise StoppedWaiting("stopped while waiting for another process's build of the fused CPU layer")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {time.time():.3f}\n".encode(), 0)
        yield True
    finally:
        os.close(fd)


def _import(folder: Path, level: CpuLevel):
    spec = importlib.util.spec_from_file_location(f"{MODULE}_{level.name}", folder / so_name(level))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_and_load(folder: Path, level: CpuLevel):
    """The level's .so checked and loaded from `folder`, built there first when
    it is missing or does not match its record; the caller holds the lock."""
    if (problem := so_problem(folder, level)) is None:
        return _import(folder, level)
    if (folder / so_name(level)).exists() or (folder / record_name(level)).exists():
        log.warning("the fused CPU layer: %s; rebuilding it", problem)
    _clear(folder, level)  # (with a torch baton a killed build left: every builder holds the lock)
    from torch.utils import cpp_extension

    # (torch renames a second build in one process `_v1`: this one is always so_name(level).)
    name = f"{MODULE}_{level.name}"
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
    module = cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(folder),
                                extra_cflags=["-O3", *level.cflags(), "-fopenmp"],
                                verbose=bool(os.environ.get("COMPLETER_VERBOSE_BUILD")))
    _write_record(folder, level)
    return module


def _load(cancel: threading.Event | None, level: CpuLevel):
    folder = build_directory(level)
    if (problem := _private_folder(folder)) is not None:
        private = Path(tempfile.mkdtemp(prefix="completer-kernels-"))
        log.warning("the kernel cache %s: nothing is loaded from it; building the fused CPU layer in %s "
                    "(make it 0700 and yours, or remove it)", problem, private)
        return _load_private(private, level)
    with _build_lock(folder, cancel) as held:
        if held:
            return _build_and_load(folder, level)
    private = Path(tempfile.mkdtemp(prefix="completer-kernels-"))
    log.warning("building the fused CPU layer in %s instead", private)
    return _load_private(private, level)


def _load_private(private: Path, level: CpuLevel):
    try:
        return _build_and_load(private, level)
    finally:  # (the module stays mapped)
        shutil.rmtree(private, ignore_errors=True)


def _level(level: CpuLevel | None) -> CpuLevel:
    """`level`, or the one this machine runs; FusedUnavailable (one line) where this CPU cannot run it."""
    try:
        chosen = level or selected_level()
    except CpuLevelError as e:
        raise FusedUnavailable(str(e)) from None
    if chosen not in runnable_levels():
        raise FusedUnavailable(f"this CPU cannot run the {chosen.name} build of the fused CPU layer")
    return chosen


def built(level: CpuLevel | None = None) -> bool:
    """Whether this machine already has the level's compiled module (by default
    the level it runs), checked (a start then loads it in a moment)."""
    try:
        level = _level(level)
        if not isinstance(_built.get(level.name, ""), str):
            return True
        folder = build_directory(level)
        return folder_problem(folder.parent) is None and folder_problem(folder) is None and \
            so_problem(folder, level) is None
    except (OSError, FusedUnavailable):
        return False


def extension(cancel: threading.Event | None = None, level: CpuLevel | None = None):
    """The compiled module of `level` (by default the one this machine runs;
    cached in-process and on disk, checked before it is loaded). `cancel`:
    set, a wait for another process's build ends."""
    with _lock:
        level = _level(level)
        known = _built.get(level.name)
        if isinstance(known, str):
            raise FusedUnavailable(known)
        if known is not None:
            return known
        try:
            module = _load(cancel, level)
            if (module.simd(), module.tiles_available()) != (level.simd, level.tiles):
                raise FusedUnavailable(f"the {level.name} build of the fused CPU layer is {module.simd()} with tiles "
                                       f"{module.tiles_available()}, not its level's {level.simd} with {level.tiles}")
        except StoppedWaiting:
            raise
        except FusedUnavailable as e:
            _built[level.name] = str(e)
            raise
        except Exception as e:  # no compiler, no ninja, a compile error: the torch path serves
            text = f"{e}\n{e.__cause__ or ''}".strip().splitlines() or [type(e).__name__]
            first = next((line for line in text if "error:" in line), text[-1])
            _built[level.name] = f"the fused CPU layer could not be built ({type(e).__name__}: {first[:200]})"
            raise FusedUnavailable(_built[level.name]) from e
        _built[level.name] = module
        return module
