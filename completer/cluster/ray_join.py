"""Joining a Ray cluster (a front door, `completer cluster join`): only one
that demands the token, and only with this machine's private copy of it.
Ray itself would join a head without token authentication and say nothing:
the head is asked first, with no token, and refused if it answers."""

from __future__ import annotations

import os

from completer.cluster.ray_security import (LOOPBACK_ONLY, ClusterSecurityError, RayToken, check_auth_mode,
                                            find_token, is_loopback, ray_temp_dir)

GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # answers anyone when tokens are off


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) as its parts; one line if it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ClusterSecurityError(f"{address!r}: expected HOST:PORT (the head's address and Ray port, e.g. "
                                   f"10.0.0.1:6379)")
    return host.strip("[]"), int(port)


def resolve_address(address: str) -> str:
    """"auto": the cluster that `completer cluster head|join` started on this
    machine (Ray records it in its temp dir); else `address` itself."""
    if address != "auto":
        split_address(address)
        return address
    recorded = ray_temp_dir() / "ray_current_cluster"
    try:
        return recorded.read_text().strip()
    except FileNotFoundError:
        raise ClusterSecurityError(f"cluster.address = 'auto': no Ray cluster started on this machine by "
                                   f"`completer cluster head` or `join` ({recorded} is missing)") from None


def answers_without_token(address: str, timeout_s: float = 10.0) -> bool:
    """Whether the GCS at `address` answers a request that carries no token:
    true for a cluster started without token authentication (a bare `ray
    start`). One it cannot reach raises ConnectionError."""
    import grpc  # Ray's dependency: imported only where a cluster is joined

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(GCS_PROBE)  # bytes in and out: an empty request is a valid one
        try:
            call(b"", timeout=timeout_s)
            return True
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return False
            raise ConnectionError(f"cannot reach the Ray cluster at {address} ({e.code().name})") from None


def refuse_open_cluster(address: str) -> None:
    if answers_without_token(address):
        raise ClusterSecurityError(
            f"the Ray cluster at {address} answers without a token (started without token authentication, "
            f"as a bare `ray start` does): anyone who reaches it can run code on its machines; refusing to join. "
            f"Start it with `completer cluster head` (docs/cluster.md)")


def check_join(address: str) -> tuple[RayToken, str]:
    """What joining the cluster at `address` needs: token authentication not
    turned off here, this machine's copy of the token, and a cluster that
    refuses requests without one. Returns the token and the address ("auto"
    resolved). Changes nothing (the start checks it before the model loads)."""
    check_auth_mode()
    token = find_token(create=False)
    resolved = resolve_address(address)
    refuse_open_cluster(resolved)
    return token, resolved


def secure_join(address: str) -> str:
    """check_join, then the environment Ray reads at import for it; the address to join."""
    token, resolved = check_join(address)
    host, _ = split_address(resolved)
    os.environ.update(token.environment() | (LOOPBACK_ONLY if is_loopback(host) else {}))
    return resolved
