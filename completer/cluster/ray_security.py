"""Ray's control plane kept to the user who runs it: token authentication on,
the token file and Ray's temp folder private, the node's ports on loopback
when the cluster is one machine.

What Ray 2.60 does by itself (its sources, and `ray start`, `ray status`, `ss`
on a test host), and so what this module does instead:

- `ray.init()` starting a local cluster turns token authentication on and
  writes ~/.ray/auth_token with the umask's mode (0644 by default): here the
  token file is created 0600 first, and an existing one is refused unless it
  is its user's alone (server.security's rules for our own token).
- `ray start --head` turns it on only with RAY_AUTH_MODE=token or a token
  file already there; else it prints "Token authentication is disabled" and
  its job API runs anyone's command: every start here sets the mode.
- Ray makes every folder under its temp dir 0777 without the sticky bit
  (_common/utils.py, try_make_directory_shared): its temp dir goes inside a
  folder of ours, 0700, so no other user reaches its sockets or logs.
- A node whose address is loopback binds every port to loopback. Any other
  address: the gRPC servers (GCS, raylet, workers) on every interface, the
  agents' HTTP on the node's address, and three Prometheus servers (the node
  exporter, the dashboard's, the autoscaler's) on 0.0.0.0 with no token.
  `ray start --node-ip-address 127.0.0.1` is silently replaced by the
  machine's address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (services.py,
  resolve_ip_for_localhost): set for a loopback node.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from completer.server.security import TokenError, check_token, read_token_file

AUTH_MODE = "RAY_AUTH_MODE"
TOKEN_VAR = "RAY_AUTH_TOKEN"
TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"
# Ray's switch between "clusters" and "this machine only": off, every address
# it would pick or resolve from loopback stays loopback.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray's three Prometheus servers answer without a token on 0.0.0.0 when the
# node's address is not loopback, and 2.60 has no switch for the dashboard's
# or the autoscaler's: a port that cannot be bound makes each log the error
# and go on without it (dashboard/head.py, autoscaler monitor.py).
METRICS_OFF = {"RAY_enable_metrics_collection": "0", "DASHBOARD_METRIC_PORT": "-1",
               "AUTOSCALER_METRIC_PORT": "-1"}


class ClusterSecurityError(ValueError):
    """Ray would run unguarded or its secrets lie open; the message, one line, says how to fix it."""


@dataclass(frozen=True)
class RayToken:
    """Where Ray's processes read the cluster token: $RAY_AUTH_TOKEN, else a file."""

    path: Path | None  # None: $RAY_AUTH_TOKEN

    def describe(self) -> str:
        return f"${TOKEN_VAR}" if self.path is None else str(self.path)

    def environment(self) -> dict[str, str]:
        """Token authentication on, from this token: for Ray's processes and the drivers that join."""
        env = {AUTH_MODE: "token"}
        if self.path is not None:  # named even when it is Ray's default: the file checked is the file read
            env[TOKEN_PATH_VAR] = str(self.path)
        return env


def token_path() -> Path:
    """Ray's: $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return Path(os.environ[TOKEN_PATH_VAR]).expanduser() if os.environ.get(TOKEN_PATH_VAR) \
        else Path.home() / ".ray" / "auth_token"


def check_auth_mode() -> None:
    """A mode set to anything but token (`disabled`) is refused, not followed."""
    mode = os.environ.get(AUTH_MODE, "")
    if mode not in ("", "token"):
        raise ClusterSecurityError(f"{AUTH_MODE}={mode}: refusing to run Ray without token authentication "
                                   f"(anyone who reaches its ports could run code as you); unset it")


def _check_folder_of(path: Path) -> None:
    """A folder others may write in could swap the token file after it was checked."""
    try:
        st = path.parent.lstat()
    except FileNotFoundError:
        return
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ClusterSecurityError(f"{path.parent}: group or others may write in the token's folder "
                                   f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod go-w {path.parent}")


def find_token(create: bool) -> RayToken:
    """The cluster token Ray will use, checked: $RAY_AUTH_TOKEN, else the file
    at token_path(), which must be a regular file of this user's, mode 600.
    `create`: a missing file gets a new token (a head, a one-machine cluster);
    else its absence is refused (a machine joining needs the head's token)."""
    if token := os.environ.get(TOKEN_VAR):
        try:
            check_token(token, f"${TOKEN_VAR}")
        except TokenError as e:
            raise ClusterSecurityError(str(e)) from None
        return RayToken(None)
    path = token_path()
    _check_folder_of(path)
    _refuse_if_others_could_read(path)
    try:
        if found := read_token_file(path):
            check_token(found, str(path))
            return RayToken(path)
        if not create:
            raise ClusterSecurityError(
                f"no Ray token at {path}: a machine joining a cluster needs its head's token; copy the head's "
                f"token file here (mode 600), or set {TOKEN_PATH_VAR} to such a file (docs/cluster.md)")
        _write_new_token(path)
    except TokenError as e:
        raise ClusterSecurityError(str(e)) from None
    return RayToken(path)


def _refuse_if_others_could_read(path: Path) -> None:
    """As read_token_file refuses it, but saying that a token others could
    read is spent (Ray 2.60 writes ~/.ray/auth_token with the umask's mode,
    and `completer serve --cluster` let it until issue #43)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077 and st.st_uid == os.geteuid():
        raise ClusterSecurityError(
            f"{path}: group or others may read or write Ray's token file (mode {stat.S_IMODE(st.st_mode):o}), "
            f"so they may hold the token: remove it (rm {path}; the next head or one-machine start makes a new "
            f"one, mode 600) and give the new one to the other machines")


def _write_new_token(path: Path) -> None:
    """A new token in the form Ray makes (64 hex digits, no newline), written
    whole into a private file beside `path` and linked into place, so nothing
    ever sees the file with another mode or half a token."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, partial = tempfile.mkstemp(prefix=".auth_token-", dir=path.parent)  # 0600, created exclusively
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(partial, path)
        except FileExistsError:
            if path.lstat().st_size == 0:  # an empty file counts as none: replace it
                os.replace(partial, path)
    finally:
        if os.path.lexists(partial):
            os.unlink(partial)
    read_token_file(path)  # another start's file, if it won the race, checked like any


def private_dir() -> Path:
    """Ours, 0700: $XDG_RUNTIME_DIR/completer-ray (a per-user folder by
    definition), else completer-ray-UID in the temp folder."""
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(runtime) / "completer-ray"
    return Path(tempfile.gettempdir()) / f"completer-ray-{os.geteuid()}"


def check_private(path: Path) -> None:
    """`path` is a folder (not a link) of this user's that no one else may enter."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise ClusterSecurityError(f"{path}: Ray's private folder is gone") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ClusterSecurityError(f"{path}: not a folder (a link or a file is there); remove it, or set "
                                   f"XDG_RUNTIME_DIR to a folder of your own")
    if st.st_uid != os.geteuid():
        raise ClusterSecurityError(f"{path}: owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); "
                                   f"refusing to keep Ray's sockets there (set XDG_RUNTIME_DIR to a folder of yours)")
    if st.st_mode & 0o077:
        raise ClusterSecurityError(f"{path}: group or others may enter Ray's private folder "
                                   f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 700 {path}")


def ray_temp_dir() -> Path:
    """Ray's temp dir (`--temp-dir`, `_temp_dir`), inside private_dir(),
    which is created 0700 or checked: Ray makes the temp dir itself and all
    under it 0777, so the folder around it is what keeps other users out."""
    private = private_dir()
    try:
        private.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_private(private)
    return private / "ray"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def secure_local_cluster() -> Path:
    """Before `ray.init(address="local")`: token authentication on with a
    private token, every port on loopback. Returns Ray's temp dir (private)."""
    check_auth_mode()
    token = find_token(create=True)
    temp = ray_temp_dir()
    os.environ.update(token.environment() | LOOPBACK_ONLY)  # read by Ray at import: set before it
    return temp


def keep_replica_grpc_on_loopback() -> None:
    """In a Serve replica, before Serve starts its inter-deployment gRPC
    server: Serve 2.60 binds it to [::] whatever the node's address
    (serve/_private/replica.py, _on_initialized); on a loopback node it is
    bound to loopback like the rest. (It checks the token either way.)"""
    import ray
    from ray.serve._private import replica as serve_replica

    if not is_loopback(ray.util.get_node_ip_address()):
        return
    bind = serve_replica.add_port_to_grpc_server

    def bind_on_loopback(server, address: str) -> int:
        return bind(server, "127.0.0.1:0" if address == "[::]:0" else address)

    serve_replica.add_port_to_grpc_server = bind_on_loopback
