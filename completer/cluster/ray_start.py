"""`completer cluster head` and `completer cluster join HEAD:PORT`: the Ray
nodes of a cluster on several machines, started by `ray start` with token
authentication on (a bare `ray start --head` leaves it off, and its job API
then runs anyone's command), the token file and Ray's temp folder private,
Ray's metrics servers off where they would answer the network without a
token, and the node's address the one given (ray_security.py says why each).
Ray's own `ray stop` stops a node."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from completer.cluster import ray_join, ray_security as rs

RAY_PORT = 6379  # Ray's default GCS port


@dataclass(frozen=True)
class NodeStart:
    """One `ray start`: its arguments and what it adds to the environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def node_environment(token: rs.RayToken, node_ip: str) -> dict[str, str]:
    """Token authentication on; on loopback everything stays there (metrics
    too), else Ray's metrics servers, which would answer anyone, are off."""
    return token.environment() | (rs.LOOPBACK_ONLY if rs.is_loopback(node_ip) else rs.METRICS_OFF)


def ray_start(*options: str) -> list[str]:
    # This interpreter's Ray: the one `completer serve` will load (not whatever `ray` is on PATH).
    return [sys.executable, "-m", "ray.scripts.scripts", "start", "--disable-usage-stats", *options]


def resources(num_cpus: float | None, num_gpus: float | None) -> list[str]:
    out = []
    if num_cpus is not None:
        out += ["--num-cpus", f"{num_cpus:g}"]
    if num_gpus is not None:
        out += ["--num-gpus", f"{num_gpus:g}"]
    return out


def check_node_ip(node_ip: str) -> None:
    if node_ip in ("0.0.0.0", "::", ""):
        raise rs.ClusterSecurityError(f"--node-ip-address {node_ip!r}: give this machine's address that the "
                                      f"others reach (Ray binds what it can to it), or 127.0.0.1 for this one alone")


def head_start(node_ip: str, port: int, num_cpus: float | None = None,
               num_gpus: float | None = None) -> tuple[NodeStart, rs.RayToken]:
    """The head: a token made if there is none; the dashboard's job API left out (nothing here uses it)."""
    check_node_ip(node_ip)
    rs.check_auth_mode()
    token = rs.find_token(create=True)
    argv = ray_start("--head", "--node-ip-address", node_ip, "--port", str(port),
                     "--temp-dir", str(rs.ray_temp_dir()), "--include-dashboard", "false",
                     *resources(num_cpus, num_gpus))
    return NodeStart(argv, node_environment(token, node_ip)), token


def join_start(address: str, node_ip: str | None = None, num_cpus: float | None = None,
               num_gpus: float | None = None) -> tuple[NodeStart, rs.RayToken]:
    """Another machine: only with the head's token, and only to a head that demands it."""
    host, _ = ray_join.split_address(address)
    if rs.is_loopback(host):
        raise rs.ClusterSecurityError(f"{address}: a head on loopback takes no other machine; start the head "
                                      f"with --node-ip-address set to an address this machine reaches")
    if node_ip is not None:
        check_node_ip(node_ip)
    token, _ = ray_join.check_join(address)
    argv = ray_start("--address", address, "--temp-dir", str(rs.ray_temp_dir()), *resources(num_cpus, num_gpus))
    if node_ip is not None:
        argv += ["--node-ip-address", node_ip]
    # Where Ray picks the address itself (from the route to the head), it is not loopback.
    return NodeStart(argv, node_environment(token, node_ip or host)), token


def run(start: NodeStart) -> bool:
    """`ray start`; its own output only when it fails (it would suggest a bare `ray start` to join)."""
    # The node's own settings decide loopback, not an environment this process inherited.
    inherited = {k: v for k, v in os.environ.items() if k not in rs.LOOPBACK_ONLY}
    done = subprocess.run(start.argv, env={**inherited, **start.env}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        print(f"error: `ray start` failed ({done.returncode})", file=sys.stderr)
        return False
    rs.check_private(rs.private_dir())  # Ray changes modes only inside its temp dir: still ours alone
    return True


def copy_hint(token: rs.RayToken, head_host: str) -> str:
    if token.path is None:
        return f"set ${rs.TOKEN_VAR} there to this head's token"
    home = Path.home()
    shown = str(token.path.relative_to(home)) if token.path.is_relative_to(home) else str(token.path)
    return (f"copy the token file there, private: mkdir -m 700 -p ~/.ray && scp -p {head_host}:{shown} "
            f"~/.ray/auth_token (or point ${rs.TOKEN_PATH_VAR} at a copy, mode 600)")


def cmd_head(args: argparse.Namespace) -> int:
    try:
        start, token = head_start(args.node_ip_address, args.port, args.num_cpus, args.num_gpus)
        if not run(start):
            return 1
    except rs.ClusterSecurityError as e:
        raise SystemExit(f"error: {e}") from None
    address = f"{args.node_ip_address}:{args.port}"
    loopback = rs.LOOPBACK_ONLY if rs.is_loopback(args.node_ip_address) else {}
    print(f"Ray head at {address}: token authentication on, token in {token.describe()} (mode 600, never "
          f"printed); Ray's files in {rs.private_dir()} (mode 700)")
    if loopback:
        print("on loopback: this machine alone (front doors: --set cluster.address=auto); for other machines, "
              "start the head with --node-ip-address ADDRESS")
    else:
        print(f"each other machine: {copy_hint(token, args.node_ip_address)}; then: completer cluster join {address}")
    print(f"front doors, on a machine of the cluster: completer serve --cluster --set cluster.address={address}")
    # Ray's tools send the token only when told to, and swap a loopback address for the machine's
    # network one unless told not to (ray_security.LOOPBACK_ONLY).
    told = " ".join(f"{k}={v}" for k, v in ({"RAY_AUTH_MODE": "token"} | loopback).items())
    print(f"status: {told} ray status --address {address}; stop a node: ray stop")
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    try:
        start, token = join_start(args.address, args.node_ip_address, args.num_cpus, args.num_gpus)
        if not run(start):
            return 1
    except (rs.ClusterSecurityError, ConnectionError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"joined the Ray cluster at {args.address}: token from {token.describe()}; Ray's files in "
          f"{rs.private_dir()} (mode 700)")
    return 0


def add_parser(sub) -> None:
    about = ("the Ray nodes of a cluster on several machines, for `completer serve --cluster`: `ray start` "
             "with token authentication on and Ray's files private (docs/cluster.md)")
    p = sub.add_parser("cluster", help=about, description=about)
    nodes = p.add_subparsers(dest="node", required=True)
    head = nodes.add_parser("head", help="start the head node (a token in ~/.ray/auth_token, made if missing)")
    head.add_argument("--node-ip-address", default="127.0.0.1", metavar="ADDRESS",
                      help="this machine's address that the others reach (default 127.0.0.1: this machine alone, "
                           "every port on loopback)")
    head.add_argument("--port", type=int, default=RAY_PORT, help=f"Ray's GCS port (default {RAY_PORT})")
    join = nodes.add_parser("join", help="add this machine to a head's cluster (needs the head's token: "
                                         "~/.ray/auth_token, $RAY_AUTH_TOKEN_PATH or $RAY_AUTH_TOKEN)")
    join.add_argument("address", metavar="HEAD:PORT", help="the head's address and port, as `cluster head` printed")
    join.add_argument("--node-ip-address", metavar="ADDRESS",
                      help="this machine's address that the others reach (default: Ray's pick, the one "
                           "that routes to the head)")
    for node in (head, join):
        node.add_argument("--num-cpus", type=float, help="CPUs Ray may place replicas on (default: all)")
        node.add_argument("--num-gpus", type=float, help="GPUs Ray may place replicas on (default: all)")
    head.set_defaults(func=cmd_head)
    join.set_defaults(func=cmd_join)
