"""Who may drive the local model: a bearer token, the Origin and Host checks.

- Token: created on first start in a file only its owner can read, at a fixed
  per-user path, so editor clients on the same machine can read it there.
- Origin: a web page in the user's browser always sends one; editor clients
  send none. Any Origin but the server's own (the dashboard) or an allowed one
  is refused, so a page cannot reach the model through the user's browser.
- Host: when bound to loopback, a Host that names anything but a loopback
  address or `localhost` is refused (DNS rebinding).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


def default_token_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "completer" / "token"


def load_or_create_token(path: Path) -> str:
    """The token in `path`, created (0600, in a 0700 directory) if missing."""
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host part of a Host header (`[::1]:8750` -> `::1`)."""
    if header.startswith("["):
        return header[1: header.find("]")]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def token_matches(expected: str, authorization: str | None, path: str) -> bool:
    """`Authorization: Bearer TOKEN`, or `?token=TOKEN` for clients that cannot set headers."""
    offered = ""
    if authorization and authorization.lower().startswith("bearer "):
        offered = authorization[7:].strip()
    else:
        offered = (parse_qs(urlsplit(path).query).get("token") or [""])[0]
    return bool(offered) and hmac.compare_digest(offered.encode(), expected.encode())


def origin_allowed(origin: str | None, host_header: str | None, scheme: str,
                   allowed: list[str]) -> bool:
    """No Origin (an editor client), the server's own, or a configured one."""
    if origin is None:
        return True
    own = f"{scheme}://{host_header}" if host_header else None
    return origin == own or origin in allowed


def host_allowed(host_header: str | None, bound_host: str) -> bool:
    """When bound to loopback, only loopback names may appear in Host."""
    if not is_loopback(bound_host):
        return True
    return host_header is not None and is_loopback(host_name(host_header))
