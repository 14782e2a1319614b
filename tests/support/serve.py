"""`completer serve` started as a user starts it, in a process of its own, read
until it says it is listening (or exits): for the start-up tests."""

import os
import subprocess
import sys
import threading

from latency_bench.harness import ROOT, stop_server


def start(*args: str, env: dict | None = None, until: str = "listening on",
          timeout: float = 120) -> tuple[subprocess.Popen, list[str]]:
    """`completer serve --port 0 ARGS`, read until a line contains `until` or
    it exits: (the process, what it printed so far, stdout and stderr in
    order). The caller stops it (latency_bench.harness.stop_server)."""
    # compat.port too: its default, 8012, may be another server's (and a start there would warn).
    cmd = [sys.executable, "-m", "completer.cli", "serve", "--port", "0", "--set", "compat.port=0", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    watchdog = threading.Timer(timeout, proc.kill)  # a start that hangs silently fails the test, late
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if until in line:
                break
    finally:
        watchdog.cancel()
    return proc, lines


def serve_until_listening(*args: str, env: dict | None = None) -> tuple[int | None, str]:
    """`completer serve --port 0 ARGS` until it exits or says it is listening
    (then it is stopped): (its exit status, None if it got to listening; all
    it printed)."""
    proc, lines = start(*args, env=env)
    listening = any("listening on" in line for line in lines)
    stop_server(proc)
    lines += proc.stdout.readlines()
    proc.stdout.close()
    return None if listening else proc.returncode, "".join(lines)


def refused(*args: str, env: dict | None = None) -> str:
    """The one `error:` line of a start that must fail before listening."""
    status, output = serve_until_listening(*args, env=env)
    assert status is not None, f"the server started:\n{output}"
    assert status != 0 and "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    return errors[0]
