"""The prefill workers `completer serve` starts on this machine: one
`completer prefill-worker` process each, on the serving config, pinned to
its CPUs. A worker that exits is started again when its link next retries."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading

import msgspec

from completer.config import Config

log = logging.getLogger(__name__)
LISTENING = re.compile(r"prefill worker listening on (\S+:\d+)")
START_TIMEOUT_S = 300.0  # loading a model (and fetching the default one on a first run)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the server dies, however it dies (Linux)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass


class LocalWorker:
    def __init__(self, config: Config, token: str, index: int, cpus: list[int]):
        self.config_json = msgspec.json.encode(config)
        self.token, self.index, self.cpus = token, index, cpus
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.lock = threading.Lock()

    def start(self) -> str:
        cmd = [sys.executable, "-m", "completer.cli", "prefill-worker", "--config-json", "-",
               "--host", "127.0.0.1", "--port", "0"]
        if self.cpus:
            cmd += ["--cpus", ",".join(map(str, self.cpus))]
        env = {**os.environ, "COMPLETER_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, text=True, preexec_fn=_die_with_parent)
        proc.stdin.write(self.config_json.decode())
        proc.stdin.close()
        lines = []
        timer = threading.Timer(START_TIMEOUT_S, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                lines.append(line)
                if m := LISTENING.search(line):
                    break
            else:
                raise RuntimeError(f"prefill worker {self.index} exited at start: {''.join(lines[-5:]).strip()}")
        finally:
            timer.cancel()
        threading.Thread(target=self._relay, args=(proc,), name="prefill-worker-log", daemon=True).start()
        self.proc, self.address = proc, m.group(1)
        log.info("prefill worker %d (pid %d) listening on %s", self.index, proc.pid, self.address)
        return self.address

    def _relay(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # its warnings, in the server's log
            print(f"[prefill worker {self.index}] {line}", end="", file=sys.stderr, flush=True)

    def resolve(self) -> str:
        """Its address, after starting it again if it exited."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                if self.proc is not None:
                    log.warning("prefill worker %d exited (%s); starting it again", self.index, self.proc.returncode)
                self.start()
            return self.address

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
