"""Ray's control plane kept to its user (issue #43, items 1 and 2).

- A head and a second node started with docs/cluster.md's own commands, in
  two network namespaces (two hosts, as far as their sockets can tell): from
  the other host, a request without the token is refused on every port the
  head opens (the job API that ran `id` for the issue's attacker, the GCS),
  Ray's metrics servers are off, the token works, and a machine without a
  copy of the token cannot join.
- `completer serve --cluster` on one machine, with its home open to others
  (mode 755): user `nobody` can read neither Ray's token nor anything in
  Ray's folder, and every port Ray opens is on loopback.
- Joining refused without the token, with token authentication turned off,
  or to a head that answers without a token; the token file and Ray's folder
  refused at start when others may read or enter them.
- The docs start Ray nodes only through `completer cluster` (never a bare
  `ray start`) and name every port the head was seen to open.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from completer.cluster import ray_join, ray_security as rs
from latency_bench.harness import CLUSTER, ROOT, running_server
from support.ray_hosts import (PY, Host, check_private_from_nobody, end_session, fake_gcs, host_of, listening, node_argv,
                       on_loopback, probe, session_members, session_of, start_node)
from support.readme_blocks import FENCE, SHELLS, commands, parse_with_our_parsers
from support.netns import linked

DOC = ROOT / "docs" / "cluster.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TESTED_BLOCK = re.compile(r"<!-- cluster-test: several machines\b.*?-->\n```sh\n(.*?)^```", re.S | re.M)
RAY_METRICS_PORTS = (44217, 44227)  # the autoscaler's and the dashboard's Prometheus servers (no token)


@pytest.fixture
def hosts():
    """make(name, ns, ip): a Host whose home and runtime folder are mode 755
    (as a home often is): only the modes of what Ray keeps there stop others.
    A short root: Ray's socket paths under it must fit in 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    root.chmod(0o755)

    def make(name: str, ns: str | None, address: str) -> Host:
        home, runtime = root / name / "h", root / name / "r"
        for d in (home, runtime):
            d.mkdir(parents=True)
            d.chmod(0o755)
            d.parent.chmod(0o755)
        return Host(ns, address, home, runtime)

    make.root = root
    yield make
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def link():
    # Each one's default route over the link, as a machine has one: Ray picks its address from it.
    with linked(f"s{os.getpid()}", default_routes=True) as net:
        yield net


# -- the docs ------------------------------------------------------------------------------


def several_machines_block() -> str:
    found = TESTED_BLOCK.search(DOC.read_text())
    assert found, "docs/cluster.md: no <!-- cluster-test: several machines --> block"
    return found.group(1)


def documented_node_starts() -> list[list[str]]:
    """The block's commands that start a Ray node: the head's, then the other machines'."""
    return [w for w in commands(several_machines_block()) if w[:2] in (["completer", "cluster"], ["ray", "start"])]


def documented_ports() -> tuple[set[int], bool]:
    """The ports docs/cluster.md's exposure table says Ray opens and guards (each refuses a request
    without the token), and whether it lists the system's ephemeral range among them."""
    section = DOC.read_text().split("## What is exposed, and to whom", 1)[1].split("\n## ", 1)[0]
    ports, ephemeral = set(), False
    for row in (r for r in section.splitlines() if r.startswith("|") and not r.startswith("|---")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        if not cells[-1].startswith(("refused", "401")):
            continue
        ephemeral |= "ephemeral" in cells[1]
        for low, high in re.findall(r"\b(\d{4,5})(?:-(\d{4,5}))?\b", cells[1]):
            ports.update(range(int(low), int(high or low) + 1))
    return ports, ephemeral


def ephemeral_ports() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_the_docs_start_ray_nodes_only_through_completer_cluster_and_their_commands_parse():
    for doc in DOCS:
        for fence in (f for f in FENCE.finditer(doc.read_text()) if f.group(1) in SHELLS):
            for words in commands(fence.group(2)):
                assert words[:2] != ["ray", "start"], f"{doc.name}: {' '.join(words)}: a bare `ray start` " \
                                                      f"leaves token authentication off"
                assert parse_with_our_parsers(words) is None, f"{doc.name}: {' '.join(words)}"
    starts = documented_node_starts()
    assert [w[:3] for w in starts] == [["completer", "cluster", "head"], ["completer", "cluster", "join"]], starts
    joined = [w for w in commands(several_machines_block()) if w[:2] == ["completer", "serve"]]
    assert joined and all("cluster.address=HEAD_IP:6379" in w for w in joined), joined
    ports, ephemeral = documented_ports()
    assert {6379, 52365, 10001} <= ports and ephemeral, ports


# -- several machines ------------------------------------------------------------------------


def test_a_head_started_as_the_docs_say_refuses_another_host_without_the_token_and_takes_a_node_with_it(
        link, hosts):
    a, b = hosts("a", link.a, link.A_IP), hosts("b", link.b, link.B_IP)
    addresses = {"HEAD_IP": link.A_IP, "NODE_IP": link.B_IP}
    head, join = (node_argv(w, addresses) for w in documented_node_starts())
    gcs = f"{link.A_IP}:6379"
    sessions = []
    try:
        sid, started = start_node(a, head)
        sessions.append(sid)
        assert started.returncode == 0, started.stdout + started.stderr
        # From the other host, no token: the job API and the GCS refuse, and so does every port.
        ran = hosts.root / "ran-without-token"
        assert probe(b, "job", link.A_IP, str(ran)) == {"status": 401}
        assert probe(b, "gcs", gcs) == {"status": "UNAUTHENTICATED"}
        ports = listening(a)
        exposed = sorted(p for p, where in ports.items() if not all(map(on_loopback, where)))
        assert 6379 in exposed
        assert probe(b, "open", link.A_IP, *map(str, exposed)) == {str(p): [] for p in exposed}
        assert not set(RAY_METRICS_PORTS) & set(ports), ports
        documented, _ = documented_ports()
        undocumented = [p for p in exposed if p not in documented and p not in ephemeral_ports()]
        assert not undocumented, f"ports open to other hosts that docs/cluster.md does not name: {undocumented}"
        # The token works: the same job API runs a job given it.
        ran_with = hosts.root / "ran-with-token"
        assert probe(b, "gcs", gcs, str(a.token)) == {"status": "OK"}
        assert probe(b, "job", link.A_IP, str(ran_with), str(a.token)) == {"status": 200}
        for _ in range(120):
            if ran_with.exists() and ran_with.read_text():
                break
            time.sleep(0.5)
        assert "uid=" in ran_with.read_text() and not ran.exists()
        # Other users of the head: its token and its files.
        check_private_from_nobody(a.token, a.private / "ray" / "session_latest")
        assert stat.S_IMODE(a.private.stat().st_mode) == 0o700
        # A machine without a copy of the token is refused in one line, before Ray starts.
        sid, refused = start_node(b, join)
        sessions.append(sid)
        assert refused.returncode != 0 and refused.stderr.strip().splitlines()[-1].startswith("error: no Ray token")
        assert not session_members(sid)
        # With a private copy (as `scp -p` makes it), it joins.
        b.token.parent.mkdir(mode=0o700)
        shutil.copyfile(a.token, b.token)
        b.token.chmod(0o600)
        sid, joined = start_node(b, join)
        sessions.append(sid)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert probe(a, "nodes", gcs, str(a.token)) == {"alive": sorted([link.A_IP, link.B_IP])}
    finally:
        for sid in sessions:
            end_session(sid)


# -- one machine ---------------------------------------------------------------------------


def test_a_one_machine_cluster_keeps_its_token_and_files_from_other_users_and_every_port_on_loopback(
        hosts, monkeypatch):
    one = hosts("one", None, "127.0.0.1")
    monkeypatch.setenv("HOME", str(one.home))  # the server's, and so its link's and Ray's
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(one.runtime))
    for key in [k for k in os.environ if k.startswith("RAY_AUTH")]:
        monkeypatch.delenv(key)
    with running_server(*CLUSTER, "cluster.replicas=1", timeout=300) as server:
        link_pid = int(subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", "completer.cluster.link"],
                                      capture_output=True, text=True).stdout.split()[0])
        ray_processes = set(session_members(session_of(link_pid)))  # the link, Ray's daemons and workers
        ray_sockets = {}  # address:port -> the process listening there
        for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
            if ray_processes & set(map(int, re.findall(r"pid=(\d+)", line))):
                ray_sockets[line.split()[3]] = re.search(r'\("([^"]+)"', line).group(1)
        raylet = next(p for p in ray_processes if Path(f"/proc/{p}/comm").read_text().strip() == "raylet")
        session_dir = Path(re.search(r"--session_dir=(\S+)", Path(f"/proc/{raylet}/cmdline").read_text()
                                     .replace("\0", " ")).group(1))
        gcs = re.search(r"Ray cluster at (\S+)", "".join(server.log)).group(1)
        open_sockets = {s: who for s, who in ray_sockets.items() if not on_loopback(host_of(s))}
        assert ray_sockets and not open_sockets, f"Ray listens beyond loopback: {open_sockets}"
        assert sum(who.startswith("ray::ServeRepli") for who in ray_sockets.values()) >= 2  # its Serve gRPC too
        check_private_from_nobody(one.token, session_dir)
        assert one.token.read_text().strip() and stat.S_IMODE(one.private.stat().st_mode) == 0o700
        with grpc.insecure_channel(gcs) as channel:  # another local user, no token: refused
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary(ray_join.GCS_PROBE)(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


# -- joining refused, files refused (no Ray started) ---------------------------------------------


def serve_joining(host: Host, address: str, **env: str) -> str:
    done = subprocess.run([PY, "-m", "completer.cli", "serve", "--cluster", "--model", "embedded", "--set",
                           f"cluster.address={address}", "--token", "test-token-1234567890"], cwd=ROOT,
                          env={**host.env(), **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    return done.stderr.strip().splitlines()[-1]


def test_a_front_door_joins_only_a_cluster_that_demands_the_token_and_only_with_a_private_copy(hosts, monkeypatch):
    door = hosts("door", None, "127.0.0.1")
    open_gcs, open_address = fake_gcs()
    guarded_gcs, guarded_address = fake_gcs(grpc.StatusCode.UNAUTHENTICATED)
    try:
        said = serve_joining(door, guarded_address)
        assert said.startswith(f"error: cluster.address = '{guarded_address}': no Ray token at "), said
        door.token.parent.mkdir()
        door.token.write_text("f" * 64)
        door.token.chmod(0o644)
        assert f"remove it (rm {door.token}" in serve_joining(door, guarded_address)
        door.token.chmod(0o600)
        assert "RAY_AUTH_MODE=disabled: refusing" in serve_joining(door, guarded_address, RAY_AUTH_MODE="disabled")
        assert "answers without a token" in serve_joining(door, open_address)
        for key, value in door.env().items():
            monkeypatch.setenv(key, value)
        token, address = ray_join.check_join(guarded_address)  # what a front door then goes on with
        assert (token.path, address) == (door.token, guarded_address)
    finally:
        open_gcs.stop(None)
        guarded_gcs.stop(None)


def test_rays_token_file_is_made_private_and_one_others_could_read_or_swap_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    path = rs.find_token(create=True).path
    assert path == tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert re.fullmatch(r"[0-9a-f]{64}", path.read_text())  # Ray's own form
    assert rs.find_token(create=True).path == path and len(set(path.parent.iterdir())) == 1  # kept, no leftovers
    refusals = {"others may read .* remove it": lambda: path.chmod(0o644),
                "not by you": lambda: (path.chmod(0o600), os.chown(path, 65534, 65534)),
                "symbolic link": lambda: (path.unlink(), (tmp_path / "elsewhere").write_text("f" * 64),
                                          path.symlink_to(tmp_path / "elsewhere")),
                "may write in the token's folder": lambda: path.parent.chmod(0o777)}
    for expected, spoil in refusals.items():
        spoil()
        with pytest.raises(rs.ClusterSecurityError, match=expected):
            rs.find_token(create=True)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(rs.ClusterSecurityError, match="RAY_AUTH_MODE=disabled"):
        rs.secure_local_cluster()


def test_rays_folder_is_made_private_and_one_others_may_enter_or_own_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    temp = rs.ray_temp_dir()
    assert temp == tmp_path / "completer-ray" / "ray" and stat.S_IMODE(temp.parent.stat().st_mode) == 0o700
    refusals = {"group or others may enter": lambda: temp.parent.chmod(0o755),
                "not by you": lambda: (temp.parent.chmod(0o700), os.chown(temp.parent, 65534, 65534)),
                "not a folder": lambda: (temp.parent.rmdir(), temp.parent.symlink_to(tmp_path))}
    for expected, spoil in refusals.items():
        spoil()
        with pytest.raises(rs.ClusterSecurityError, match=expected):
            rs.ray_temp_dir()
