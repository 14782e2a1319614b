"""llama.cpp's `llama-server` as a benchmark peer, on completer's own weights.

The keystroke-replay benchmark compares completer with the server that
self-hosted editor plugins (llama.vim, llama.vscode) talk to. The ratio means
something only if both run the same weights, so this builds `llama-server`
from source (the `llama-cpp-python` sdist vendors llama.cpp, and PyPI is the
one index every machine here reaches) and writes GGUFs of completer's default
model at the precision completer resolves to (`model.precision`).

    python -m latency_bench llama-peer build [--version V] [--jobs 2]
    python -m latency_bench llama-peer gguf --type f32|f16|bf16|q8_0 [--source P] [--out P]

The benches import `server_binary`, `matched_gguf` and `llama_server`
(`real_sizes.py` also `quantize_binary`: the build makes `llama-quantize` too,
for the K-quants gguf-py cannot write); importing this needs neither torch nor
gguf/numpy.

One file a little past 300 lines: building the peer, writing its GGUFs and
running it are the one peer a benchmark starts.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from completer.model_store import cache_dir, cached_path, pull

# The newest llama-cpp-python on PyPI when this was written (llama.cpp commit
# 0c1e570); builds here with gcc 12 in about 10 minutes on 2 cores.
DEFAULT_VERSION = "0.3.36"

# Draft-model-free speculation in this version (`--spec-type`): ngram-simple,
# ngram-map-k(4v), ngram-mod (`--spec-default`: a hash pool shared by all
# slots, tuned for 24-token matches and 48-64 token drafts when rewriting whole
# blocks), ngram-cache (lookup decoding from -lcs/-lcd statistics files). Our
# prompt lookup's peer is ngram-simple: it drafts the m tokens that followed the
# last earlier occurrence, in the slot's prompt + output, of the last n tokens.
# n=3 (its default 12 rarely matches inside a completion); m=4 as engine_bench
# gives HF's prompt lookup. Opt-in (`extra=`): seen once here (Q4_1, 900-token
# prompt, busy CPU) 38% of drafts accepted, slower than plain, greedy text leaving
# the plain run's after 2 tokens (the batched verify rounds a near tie apart).
SPECULATIVE_FLAGS: tuple[str, ...] = (
    "--spec-type", "ngram-simple",
    "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4",
)


def build_root(version: str = DEFAULT_VERSION) -> Path:
    # Outside the repo: the sdist is 75 MB, its build tree several hundred.
    return cache_dir() / "llama.cpp" / version


# What `build` makes: the server, and the quantizer (K-quants such as Q4_K_M, which gguf-py cannot write).
TARGETS = ("llama-server", "llama-quantize")


def _binary(name: str, version: str, must_exist: bool) -> Path:
    path = build_root(version) / "build" / "bin" / name
    if must_exist and not path.is_file():
        raise FileNotFoundError(f"no {name} {version} at {path}; build it: "
                                f"python -m latency_bench llama-peer build --version {version}")
    return path


def server_binary(version: str = DEFAULT_VERSION, *, must_exist: bool = True) -> Path:
    return _binary("llama-server", version, must_exist)


def quantize_binary(version: str = DEFAULT_VERSION, *, must_exist: bool = True) -> Path:
    return _binary("llama-quantize", version, must_exist)


# ---------------------------------------------------------------- build

def _say(message: str) -> None:
    print(f"[llama_peer] {message}", flush=True)


def _step(name: str, log: Path, run) -> None:
    """`run(log_file)` -> ok; a failure prints one line naming the step and log, exit 1."""
    _say(f"{name} ...")
    start = time.monotonic()
    with log.open("w") as out:
        try:
            ok = run(out)
        except Exception as exc:  # noqa: BLE001 - whatever broke, it broke this step
            print(repr(exc), file=out)
            ok = False
    if not ok:
        _say(f"FAILED at step '{name}'; log: {log}")
        sys.exit(1)
    _say(f"{name} done in {time.monotonic() - start:.0f} s")


def _command(cmd: list[str]):
    return lambda out: subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT) == 0


def _extract(sdist: Path, dest: Path, out) -> bool:
    # Into a scratch folder first, so that an interrupted extract never looks done.
    scratch = dest.with_name(dest.name + ".part")
    shutil.rmtree(scratch, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(scratch, filter="tar")
    (top,) = scratch.iterdir()
    top.rename(dest)
    scratch.rmdir()
    return True


def build(version: str = DEFAULT_VERSION, jobs: int = 2) -> Path:
    """Every target of TARGETS (a build tree that has some builds only the others); the server's path."""
    binary = server_binary(version, must_exist=False)
    missing = [t for t in TARGETS if not _binary(t, version, False).is_file()]
    if not missing:
        print(binary)
        return binary
    root, started = build_root(version), time.monotonic()
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if not list(root.glob("llama_cpp_python-*.tar.gz")):
        # --no-binary: the wheels carry a prebuilt library, never the server.
        _step("download sdist", logs / "download.log", _command(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", str(root)]))
    src = root / f"llama_cpp_python-{version}"
    if not src.is_dir():
        sdist = next(root.glob("llama_cpp_python-*.tar.gz"))
        _step("extract", logs / "extract.log", functools.partial(_extract, sdist, src))
    out = root / "build"
    if not (out / "CMakeCache.txt").is_file():  # configured once; a later build adds the targets it lacks
        _configure(src, out, logs)
    _step(f"build {' '.join(missing)} (-j {jobs})", logs / f"build-{'+'.join(missing)}.log", _command(
        ["cmake", "--build", str(out), *(a for t in missing for a in ("--target", t)), "-j", str(jobs)]))
    _say(f"built {', '.join(missing)} in {time.monotonic() - started:.0f} s total")
    return server_binary(version)


def _configure(src: Path, out: Path, logs: Path) -> None:
    _step("configure", logs / "configure.log", _command([
        "cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(out),
        *(["-G", "Ninja"] if shutil.which("ninja") else []),
        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CCACHE=OFF",
        "-DBUILD_SHARED_LIBS=OFF",  # a binary that runs without its build tree
        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        # No network at build or run time: no model downloads (curl, https),
        # no web UI fetched from Hugging Face while building.
        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]))


# ---------------------------------------------------------------- weights

_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
# fp8 (W8A8) has no GGUF twin; int4 is the source file itself (Q4_1).
_FOR_PRECISION = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}


def default_gguf_path(type_: str, source: Path | None = None) -> Path:
    source = source or cached_path()
    stem = source.name.removesuffix(".gguf").rsplit(".", 1)[0]  # drops ".Q4_1"
    return source.with_name(f"{stem}.{type_.upper()}.gguf")


def write_gguf(type_: str, source: Path | None = None, out: Path | None = None) -> Path:
    """The source's weights, dequantized, stored as `type_` (f32, f16, bf16, q8_0)."""
    source = Path(source) if source else pull()
    out = Path(out) if out else default_gguf_path(type_, source)
    if out.is_file() and out.stat().st_mtime > source.stat().st_mtime:
        return out
    import gguf  # here, so that importing this module stays light
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_.upper()]
    reader = gguf.GGUFReader(source)
    tmp = out.with_name(out.name + ".part")  # a half-written file must not count as done
    writer = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer makes these itself
        if key == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[type_]])
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        # `t.shape` is ggml's order (innermost first); `t.data` already has
        # numpy's, which dequantize keeps and the writer reverses back.
        weights = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        # 1-D tensors (the norms) stay f32, as llama.cpp's converter keeps them.
        kind = qtype if weights.ndim > 1 else gguf.GGMLQuantizationType.F32
        # bf16 and quantized blocks are raw bytes to numpy, typed by raw_dtype.
        writer.add_tensor(t.name, gguf.quants.quantize(weights, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def matched_gguf(precision: str) -> Path:
    """The default model at completer's resolved precision ("fp32", "bf16",
    "int8"; "int4" is the default file, Q4_1), written on first use (seconds)."""
    if precision == "int4":
        return pull()
    if precision not in _FOR_PRECISION:
        raise ValueError(f"no llama.cpp GGUF matches completer's precision {precision!r} "
                         f"(only {', '.join(_FOR_PRECISION)})")
    return write_gguf(_FOR_PRECISION[precision])


# ---------------------------------------------------------------- server

@functools.cache
def _help(binary: Path) -> str:
    # Flags move between llama.cpp versions (--no-webui became --no-ui): ask it.
    return subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout


def server_command(binary: Path, gguf: Path, *, port: int, threads: int, parallel: int,
                   ctx_per_slot: int, extra: tuple[str, ...] = ()) -> list[str]:
    has = set(re.findall(r"--[\w-]+", _help(binary)))
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads),
           # With -np given, the KV cache is split (not unified): ctx_per_slot each.
           "-np", str(parallel), "-c", str(parallel * ctx_per_slot)]
    cmd += ["--cache-prompt"] if "--cache-prompt" in has else []  # the default; kept on
    # llama.vim's README starts the server so: reuse cached chunks of >= 256
    # tokens even where they moved in the prompt (shifting their KV).
    cmd += ["--cache-reuse", "256"] if "--cache-reuse" in has else []
    cmd += next(([f] for f in ("--no-ui", "--no-webui") if f in has), [])
    cmd += ["--offline"] if "--offline" in has else []
    return cmd + list(extra)


# GGUFs whose server crashed while repacking weights for this CPU's kernels
# (seen: Q8_0 and Q4_1 on a Xeon with AMX, where the BF16 file starts fine)
# and that therefore run with --no-repack: a benchmark reports it.
STARTED_WITHOUT_REPACK: set[Path] = set()
# The process id of the llama-server running at each URL `llama_server` yields (its memory: real_sizes.py).
PIDS: dict[str, int] = {}


@contextlib.contextmanager
def llama_server(gguf: Path, *, port: int, threads: int, parallel: int, ctx_per_slot: int,
                 extra: tuple[str, ...] = (), version: str = DEFAULT_VERSION,
                 log: Path | None = None, timeout: float = 120.0):
    """llama-server on `gguf` while the block runs; yields its base URL. If it
    dies of a signal while loading, it is started once more with --no-repack."""
    binary = server_binary(version)
    if gguf in STARTED_WITHOUT_REPACK:
        extra = (*extra, "--no-repack")
    log = log or build_root(version) / "logs" / f"server-{port}.log"
    url = f"http://127.0.0.1:{port}"
    proc = _start(server_command(binary, gguf, port=port, threads=threads, parallel=parallel,
                                 ctx_per_slot=ctx_per_slot, extra=extra), log)
    try:
        try:
            _wait_healthy(proc, url, log, timeout)
        except RuntimeError:
            if proc.returncode >= 0 or "--no-repack" in extra or "--no-repack" not in _help(binary):
                raise
            _say(f"llama-server died of signal {-proc.returncode} loading {gguf.name}; again with --no-repack")
            STARTED_WITHOUT_REPACK.add(gguf)
            extra = (*extra, "--no-repack")
            proc = _start(server_command(binary, gguf, port=port, threads=threads, parallel=parallel,
                                         ctx_per_slot=ctx_per_slot, extra=extra), log)
            _wait_healthy(proc, url, log, timeout)
        PIDS[url] = proc.pid
        yield url
    finally:
        PIDS.pop(url, None)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    # Its output goes straight to a file, not a pipe that someone must drain:
    # a full pipe would stall the server mid-request.
    with log.open("w") as out:
        print(" ".join(cmd), file=out, flush=True)
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    # /health answers 503 while the model loads and warms up, 200 once it serves.
    deadline = time.monotonic() + timeout
    tail = lambda: "\n".join(log.read_text(errors="replace").splitlines()[-20:])  # noqa: E731
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited ({proc.returncode}) before it was ready; "
                               f"{log} ends:\n{tail()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:  # refused while it binds; HTTPError 503 while it loads
            pass
        time.sleep(0.1)
    raise TimeoutError(f"llama-server not healthy after {timeout:.0f} s; {log} ends:\n{tail()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build llama-server from the llama-cpp-python sdist")
    b.add_argument("--version", default=DEFAULT_VERSION)
    b.add_argument("--jobs", type=int, default=2)
    g = sub.add_parser("gguf", help="write the default model's weights at another precision")
    g.add_argument("--type", required=True, choices=sorted(_FILE_TYPES))
    g.add_argument("--source", type=Path, help="default: completer's default model (Q4_1)")
    g.add_argument("--out", type=Path, help="default: beside the source, <name>.<TYPE>.gguf")
    args = parser.parse_args(argv)
    if args.command == "build":
        return 0 if build(args.version, args.jobs) else 1
    started, out = time.monotonic(), write_gguf(args.type, args.source, args.out)
    print(f"{out} ({out.stat().st_size / 2**20:.0f} MiB, {time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
