"""Hosts for tests/cluster/test_cluster_security.py: a user's folders (open to other
users, as a home often is), a network namespace or this one; the Ray nodes
started there, each a session of its own (its daemons and workers, ended
together); what another host or another user can do to them."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from completer.cluster import ray_security as rs
from latency_bench.harness import ROOT

PY = sys.executable


# -- hosts: a home and a runtime folder each, reachable by other users ----------------


@dataclass
class Host:
    """One machine of a test: a network namespace (None: this one) and a user's own folders."""

    ns: str | None
    ip: str
    home: Path
    runtime: Path  # $XDG_RUNTIME_DIR: Ray's private folder is made in it

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        return {**env, "HOME": str(self.home), "XDG_RUNTIME_DIR": str(self.runtime), "PYTHONUNBUFFERED": "1"}

    def argv(self, *words: str) -> list[str]:
        return (["ip", "netns", "exec", self.ns] if self.ns else []) + list(words)

    @property
    def token(self) -> Path:
        return self.home / ".ray" / "auth_token"

    @property
    def private(self) -> Path:
        return self.runtime / "completer-ray"


# -- processes: a Ray node is a session of its own ---------------------------------------


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid`: a node's daemons and the workers its raylet started."""
    out = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat_file.parent.name))
    return out


def end_session(sid: int) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        for pid in session_members(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while session_members(sid) and time.monotonic() < deadline:
            time.sleep(0.2)


def node_argv(words: list[str], addresses: dict[str, str]) -> list[str]:
    """A documented command, its placeholders filled, as this interpreter runs it."""
    words = [re.sub("|".join(addresses), lambda m: addresses[m.group(0)], w) for w in words]
    program = {"completer": [PY, "-m", "completer.cli"], "ray": [PY, "-m", "ray.scripts.scripts"]}[words[0]]
    return program + words[1:]


def start_node(host: Host, argv: list[str]) -> tuple[int, subprocess.CompletedProcess]:
    """Run a node's start command on `host` in a session of its own; the session (to end) and the result."""
    proc = subprocess.Popen(host.argv(*argv), cwd=ROOT, env=host.env(), start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=180)
    return proc.pid, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def probe(host: Host, *args: str) -> dict:
    done = subprocess.run(host.argv(PY, str(ROOT / "tests" / "support" / "ray_probe.py"), *args), cwd=ROOT, env=host.env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def listening(host: Host) -> dict[int, set[str]]:
    """Port -> the addresses it listens on, in `host`'s namespace."""
    out = subprocess.run(host.argv("ss", "-ltnH"), capture_output=True, text=True, check=True).stdout
    ports: dict[int, set[str]] = {}
    for line in out.splitlines():
        local = line.split()[3]
        ports.setdefault(int(local.rpartition(":")[2]), set()).add(host_of(local))
    return ports


def host_of(socket_address: str) -> str:
    """`ss`'s local address without its port, brackets and IPv4-mapped prefix."""
    return socket_address.rpartition(":")[0].strip("[]").removeprefix("::ffff:")


def on_loopback(address: str) -> bool:
    return address not in ("*", "0.0.0.0", "::") and rs.is_loopback(address)


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30)


def check_private_from_nobody(token: Path, session_dir: Path) -> None:
    """The token file and Ray's folder: modes, and what user `nobody` is refused."""
    assert stat.S_IMODE(token.stat().st_mode) == 0o600, oct(token.stat().st_mode)
    assert as_nobody("cat", str(token)).returncode != 0, "user nobody read Ray's token"
    assert as_nobody("ls", str(session_dir / "logs")).returncode != 0, "user nobody listed Ray's logs"
    planted = session_dir / "sockets" / "planted"
    assert as_nobody("touch", str(planted)).returncode != 0 and not planted.exists(), \
        "user nobody created a file among Ray's sockets"


def session_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


# -- a GCS stand-in -------------------------------------------------------------------------


class FakeGcs(grpc.GenericRpcHandler):
    """Answers every call: OK (a cluster without token authentication) or `code`."""

    def __init__(self, code: grpc.StatusCode | None):
        self.code = code

    def service(self, handler_call_details):
        def answer(request, context):
            if self.code is not None:
                context.abort(self.code, "no token")
            return b""

        return grpc.unary_unary_rpc_method_handler(answer)


def fake_gcs(code: grpc.StatusCode | None = None) -> tuple[grpc.Server, str]:
    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((FakeGcs(code),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"
