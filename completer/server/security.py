"""Who may drive the local model: a bearer token, the Origin and Host checks.

- Token: created on first start in a file only its owner can read, at a fixed
  per-user path, so editor clients on the same machine can read it there. A
  token file that others could read or swap (group/other permissions, another
  owner, a symbolic link) is refused, and so is a token under 16 characters.
- Origin: a web page in the user's browser always sends one; editor clients
  send none. Any Origin but the server's own (the dashboard) or an allowed one
  is refused, so a page cannot reach the model through the user's browser.
- Host: when bound to loopback, a Host that names anything but a loopback
  address or `localhost` is refused (DNS rebinding).
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import secrets
import stat
import tempfile
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


def default_token_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "completer" / "token"


MIN_TOKEN_CHARS = 16  # a short token could be guessed over the loopback port


class TokenError(ValueError):
    """A token or token file that is refused; the message says how to fix it."""


def check_token(token: str, source: str) -> str:
    """The token, if long enough; `source` names where it came from."""
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"the token from {source} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
                         f"(e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def read_token_file(path: Path) -> str | None:
    """The token in `path` (stripped; "" if the file is empty), None if there is
    no file. Refused: a symbolic link (another user could point it elsewhere),
    anything but a regular file, a file another user owns, and one that group
    or others may read or write."""
    # O_NOFOLLOW: a link at `path` fails with ELOOP instead of being followed;
    # O_NONBLOCK: a FIFO planted there cannot hang the start.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TokenError(f"{path}: is a symbolic link; refusing to follow it for the token "
                             f"(put the token in a regular file there, mode 600)") from None
        raise TokenError(f"{path}: cannot read the token file ({e.strerror})") from None
    with os.fdopen(fd, "r") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TokenError(f"{path}: not a regular file; the token must be in one (mode 600)")
        if st.st_uid != os.geteuid():
            raise TokenError(f"{path}: owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); "
                             f"refusing its token")
        if st.st_mode & 0o077:
            raise TokenError(f"{path}: group or others may read or write the token file "
                             f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}")
        return f.read().strip()


def load_or_create_token(path: Path) -> str:
    """The token in `path`, created (0600, in a 0700 directory) if missing or empty."""
    token = read_token_file(path)
    if token:
        return check_token(token, str(path))
    if token == "":  # an empty file gets a new token, as a missing one does
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    # Written whole into a new private file beside it, then linked into place:
    # a reader never sees half a token, and link() neither follows nor replaces
    # whatever is at `path` (a link planted there, or another start's file).
    fd, partial = tempfile.mkstemp(prefix=".token-", dir=path.parent)  # 0600, created exclusively
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        try:
            os.link(partial, path)
        except FileExistsError:  # another start created it first: use theirs (checked like any)
            return load_or_create_token(path)
    finally:
        os.unlink(partial)
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
    return bool(offered) and same_secret(offered, expected)


def same_secret(offered: str, expected: str) -> bool:
    """Constant-time equality. Header values reach here decoded with
    surrogateescape (aiohttp, websockets), so a non-ASCII byte is a lone
    surrogate that plain UTF-8 cannot encode: encoded the same way, it is
    just another wrong key, not an exception (a 500)."""
    return hmac.compare_digest(offered.encode("utf-8", "surrogateescape"),
                               expected.encode("utf-8", "surrogateescape"))


def api_key_matches(expected: str, authorization: str | None, *api_keys: str | None) -> bool:
    """The token as HTTP API clients send it: `Authorization: Bearer TOKEN`
    (llama.vim's api_key, the OpenAI clients, Continue, Tabby), a bare
    `Authorization: TOKEN` (llama.cpp takes both), or a key header
    (`X-Api-Key`, Azure's `api-key`); any one of them that matches. An empty
    one (llama.vim sends `Bearer ` with no key set) matches nothing."""
    offered = list(api_keys)
    if authorization:
        value = authorization.strip()
        if value[:6].lower() == "bearer" and (len(value) == 6 or value[6].isspace()):
            value = value[6:].strip()
        offered.append(value)
    return any(key and same_secret(key, expected) for key in offered)


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
