"""The fused CPU layer's kernel cache (kernels/cpu_decode.py) is code the
server runs, so it is checked before anything in it is loaded (issue #43
item 4): a folder another user owns or can write is refused, a build lock a
killed build left is taken over and a live one waited on for a bounded time
(SIGTERM ends the wait), a .so that is not its build's (truncated) is rebuilt,
never loaded, and a fallback to torch's ops is said at WARNING and in
/metrics.

Each start here is a fresh process (a server start): the module is built once
for the file (`built`, a private cache under tmp) and each test copies that
folder. Two tests compile again (a rebuild is what they check), ~30 s each."""

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from completer_kernels import cpu_decode
from completer_kernels.cpu_levels import selected_level

LEVEL = selected_level()  # each start below builds the level this machine runs (every level's folder is alike)
ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
START = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
from completer_kernels import cpu_decode
try:
    m = cpu_decode.extension()
except cpu_decode.FusedUnavailable as e:
    print(json.dumps({"unavailable": str(e)}))
else:
    print(json.dumps({"file": m.__file__, "simd": m.simd()}))
"""


def start(cache: Path, timeout: float = 240, **env) -> tuple[dict, str, float]:
    """`extension()` in a fresh process with COMPLETER_CACHE=cache: (its
    answer, its stderr, seconds taken). A hang fails at `timeout`."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", START], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COMPLETER_CACHE": str(cache), **env})
    assert done.returncode == 0, f"the start died (rc {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr, time.monotonic() - began


def key_folder(cache: Path) -> Path:
    return cache / "kernels" / cpu_decode.build_directory(LEVEL).name


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A cache holding one checked build (the folder)."""
    cache = tmp_path_factory.mktemp("kernel-cache")
    answer, log, _ = start(cache, timeout=600)
    folder = key_folder(cache)
    assert answer["file"] == str(folder / cpu_decode.so_name(LEVEL)), (answer, log)
    assert cpu_decode.so_problem(folder, LEVEL) is None
    for f in (cache / "kernels", folder):
        assert f.stat().st_mode & 0o777 == 0o700
    return folder


def copy_of(built: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a cache, its key folder) holding a copy of the build."""
    cache = tmp_path / "cache"
    folder = key_folder(cache)
    folder.parent.mkdir(parents=True, mode=0o700)
    shutil.copytree(built, folder, symlinks=True)
    folder.chmod(0o700)
    return cache, folder


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_kernel_planted_in_a_folder_another_user_owns_and_anyone_can_write_is_not_loaded(built, tmp_path):
    """The probe's case: a complete build folder (so ninja has nothing to do)
    whose .so, and its record, are someone else's. It is refused, one warning
    names it, and the layer is built and loaded from a private folder."""
    cache, folder = copy_of(built, tmp_path)
    marker = tmp_path / "planted-ran"
    src = tmp_path / "planted.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    so = folder / cpu_decode.so_name(LEVEL)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    os.utime(so, (time.time() + 60, time.time() + 60))  # newer than the .o: up to date for ninja
    size, digest = cpu_decode._sha256(so)
    (folder / cpu_decode.record_name(LEVEL)).write_text(json.dumps({"size": size, "sha256": digest}))
    for f in (folder.parent, folder):
        os.chown(f, NOBODY, NOBODY)
        f.chmod(0o777)
    for f in folder.iterdir():
        os.chown(f, NOBODY, NOBODY)

    answer, log, _ = start(cache)
    assert not marker.exists(), "the planted .so ran"
    assert "file" in answer and not answer["file"].startswith(str(cache)), answer
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and f"{folder.parent} is owned by uid {NOBODY}" in warnings[0], log
    assert so.stat().st_size == size  # left as it was: nothing written there either


def test_a_folder_of_this_user_that_others_can_write_is_refused(tmp_path):
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True)
    (cache / "kernels").chmod(0o775)
    assert cpu_decode.folder_problem(cache / "kernels") == "is writable by group (mode 775)"
    assert cpu_decode._private_folder(key_folder(cache)) == f"{cache / 'kernels'} is writable by group (mode 775)"
    (cache / "kernels").chmod(0o700)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    key_folder(cache).symlink_to(tmp_path / "elsewhere")
    assert cpu_decode._private_folder(key_folder(cache)) == f"{key_folder(cache)} is a symbolic link"


def test_a_truncated_kernel_is_rebuilt_not_loaded(built, tmp_path):
    """A .so cut short (a full disk, a killed copy) once killed every start
    with a bus error: now its size and sha256 are not its build's record, so
    it is rebuilt (the warning says why), then loaded."""
    cache, folder = copy_of(built, tmp_path)
    so = folder / cpu_decode.so_name(LEVEL)
    whole = so.stat().st_size
    with open(so, "r+b") as f:
        f.truncate(whole // 3)
    answer, log, _ = start(cache)
    assert answer["file"] == str(so), (answer, log)
    assert re.search(rf"WARNING .*{re.escape(str(so))} is {whole // 3} bytes, {whole} when built; rebuilding", log)
    assert cpu_decode.so_problem(folder, LEVEL) is None and so.stat().st_size == whole


def test_a_damaged_kernel_of_the_same_size_or_without_record_is_not_loadable(built, tmp_path):
    _, folder = copy_of(built, tmp_path)
    so = folder / cpu_decode.so_name(LEVEL)
    with open(so, "r+b") as f:
        f.seek(so.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cpu_decode.so_problem(folder, LEVEL) == f"{so}'s sha256 is not its build's"
    (folder / cpu_decode.record_name(LEVEL)).unlink()
    assert "has no record of its build" in cpu_decode.so_problem(folder, LEVEL)


def dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_a_lock_left_by_a_killed_build_is_taken_over_within_a_bound(built, tmp_path):
    """A build killed midway left torch's `lock` (every later start then waited
    on it forever) and our `build.lock` naming a pid that is gone: the next
    start takes both over and loads the checked build within seconds."""
    cache, folder = copy_of(built, tmp_path)
    (folder / "lock").write_text("")  # torch.utils.cpp_extension's baton
    (folder / cpu_decode.LOCK_NAME).write_text(f"{dead_pid()} {time.time() - 5:.3f}\n")
    answer, log, took = start(cache, timeout=90)
    assert answer["file"] == str(folder / cpu_decode.so_name(LEVEL)), (answer, log)
    assert took < 60, took


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0); os.write(fd, f"{os.getpid()} {time.time():.3f}\\n".encode())
print("held", flush=True)
time.sleep(600)
"""


def holding(lock: Path) -> subprocess.Popen:
    """A live process holding `lock` (a build that hangs)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_wait_for_a_live_holder_ends_at_its_bound(built, tmp_path):
    """A holder that is alive but never finishes is waited on for
    $COMPLETER_KERNEL_BUILD_TIMEOUT_S, then the start builds in a private
    folder (here with no compiler, so it ends with the torch path at once)."""
    cache, folder = copy_of(built, tmp_path)
    holder = holding(folder / cpu_decode.LOCK_NAME)
    try:
        answer, log, took = start(cache, timeout=90, COMPLETER_KERNEL_BUILD_TIMEOUT_S="3", CXX="/bin/false")
    finally:
        holder.kill()
        holder.wait()
    assert "could not be built" in answer["unavailable"], (answer, log)
    assert f"held by pid {holder.pid}" in log and "past the 3 s bound" in log, log
    assert 3 <= took < 45, took


def test_sigterm_ends_a_server_waiting_for_another_build_promptly(built, tmp_path):
    """A server start waiting on a build lock ('compiling the fused CPU layer',
    /healthz 503) once ignored SIGTERM: it now exits 0 within seconds. (The
    folder's build is whole here: its start says 'loading' and still waits.)"""
    cache, folder = copy_of(built, tmp_path)
    holder = holding(folder / cpu_decode.LOCK_NAME)
    cmd = [sys.executable, "-m", "completer.cli", "serve", "--model", "embedded", "--port", "0", "--token", "t" * 32,
           "--set", "compat.port=0", "--set", 'model.precision="int4"']
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "COMPLETER_CACHE": str(cache), "PYTHONUNBUFFERED": "1"})
    try:
        port = None
        for line in server.stdout:
            if m := re.search(r"completer starting on port (\d+)", line):
                port = int(m.group(1))
                break
        assert port, "the server did not bind"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
                raise AssertionError("ready without the lock")
            except urllib.error.HTTPError as e:
                health = json.loads(e.read())
            if "fused CPU layer" in health["message"]:
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        time.sleep(1)  # in the wait
        server.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert server.wait(timeout=20) == 0
        assert time.monotonic() - began < 10
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        holder.kill()
        holder.wait()


def metric(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_a_fallback_to_torch_is_said_at_warning_and_in_metrics(tmp_path, monkeypatch, caplog):
    """No compiler: the server serves through torch's ops (~10x slower
    keystrokes), says so once at WARNING (the console's level) and
    /metrics has completer_fused_cpu_active 0."""
    from completer.engine import fused_cpu
    from latency_bench.harness import TOKEN, in_process_server

    monkeypatch.setenv("COMPLETER_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setattr(cpu_decode, "_built", {})
    monkeypatch.setattr(fused_cpu, "_warned", set())
    with caplog.at_level(logging.WARNING):
        async with in_process_server('model.precision="int4"', "spec.draft_model=false") as s:
            request = urllib.request.Request(f"http://127.0.0.1:{s.port}/metrics",
                                             headers={"Authorization": f"Bearer {TOKEN}"})
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=30).read().decode())
    assert metric(text, "completer_fused_cpu_active") == 0
    said = [r for r in caplog.records if r.levelno == logging.WARNING and "fused CPU layer is not used" in r.message]
    assert len(said) == 1 and "could not be built" in said[0].message, caplog.text
