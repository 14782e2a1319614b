"""The rendezvous store where a link's K/V pair group meets (gloo's device
addresses, NCCL's unique id), in place of torch's TCPStore.

TCPStore's server listens on every interface whatever host it is given, and
admits anyone: any local process could read, write and delete the keys a
link uses, or grow the decode process's memory without bound. Here:

- the decode side keeps the keys in an in-process `HashStore` and serves it
  on the link's own address only (the one its control connection uses);
- a peer is admitted only after sending the link's secret, a fresh random
  one per connection, which reached the worker in the `Hello` of the
  control channel (itself admitted by the server's token);
- what a peer may store is bounded: key and value sizes, keys, bytes.

The worker's end is `RemoteStore`, a `torch.distributed.Store` whose calls
cross that connection (torch lets a Python class serve as a c10d store).
"""

from __future__ import annotations

import datetime
import hmac
import secrets
import socket
import struct
import threading

import msgspec
import torch.distributed as dist

SECRET_BYTES = 32
HANDSHAKE_S = 5.0  # to send the secret: a connection that does not is closed
MAX_PEERS = 4  # admitted connections at once (a link needs one)
MAX_KEY = 1024
MAX_VALUE = 64 * 1024  # gloo's address, NCCL's 128-byte id: far less
MAX_KEYS = 512
MAX_BYTES = 1 << 20
STORE_TIMEOUT = datetime.timedelta(seconds=10)  # a get or wait on a key nobody sets
_LEN = struct.Struct("!I")
MAX_FRAME = MAX_KEY + MAX_VALUE + 256  # one request: an op, a key, a value


def _send(sock: socket.socket, value) -> None:
    body = msgspec.msgpack.encode(value)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise ConnectionError("closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket):
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"a store request of {n} bytes is over the {MAX_FRAME} limit")
    return msgspec.msgpack.decode(_recv_exactly(sock, n))


def _shut(sock: socket.socket) -> None:
    """Wakes a thread blocked in the socket's accept or recv (which closing alone does not)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected, or already closed
        pass


class StoreRefused(RuntimeError):
    """A request past the store's bounds; the peer's connection is closed."""


class LinkStore:
    """The decode side's store for one link connection."""

    def __init__(self, host: str):
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.store = dist.HashStore()
        self.store.set_timeout(STORE_TIMEOUT)
        self.listener = socket.create_server((host, 0))  # the link's address alone, not every interface
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.keys: dict[str, int] = {}  # what peers stored: key -> bytes
        self.peers: set[socket.socket] = set()
        self.closed = False
        threading.Thread(target=self._accept, name="link-store", daemon=True).start()

    def close(self) -> None:
        """Stops listening and drops every peer; the store's threads end.
        (On Linux, closing a socket does not wake a thread blocked in its
        accept or recv: the thread would wait forever, the listening socket
        still open under it, one of each per connection the link ever
        tried. Shutting it down first does wake it.)"""
        _shut(self.listener)  # (its thread closes it: no other thread's accept meets a reused descriptor)
        with self.lock:  # (a peer's thread closes its socket, after taking the lock)
            self.closed = True
            for sock in self.peers:  # a stopped worker never closes its end: its thread would wait
                _shut(sock)
            self.peers = set()

    def _accept(self) -> None:
        try:
            while True:
                try:
                    sock, _ = self.listener.accept()
                except OSError:  # shut down by close()
                    return
                with self.lock:
                    refused = self.closed or len(self.peers) >= MAX_PEERS
                    if not refused:
                        self.peers.add(sock)
                if refused:
                    sock.close()
                    if self.closed:
                        return
                    continue
                threading.Thread(target=self._serve, args=(sock,), name="link-store-peer", daemon=True).start()
        finally:
            self.listener.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(HANDSHAKE_S)
            if not hmac.compare_digest(_recv_exactly(sock, SECRET_BYTES), self.secret):
                return
            sock.settimeout(None)  # a get blocks until its key is set (or STORE_TIMEOUT)
            sock.sendall(b"\x01")
            while True:
                request = _recv(sock)
                try:
                    _send(sock, [True, self._do(*request)])
                except StoreRefused as e:
                    _send(sock, [False, str(e)])
                    return
                except Exception as e:  # a timeout, a missing key: the caller's error, the link goes on
                    _send(sock, [False, f"{type(e).__name__}: {e}"])
        except (OSError, ConnectionError, ValueError, TypeError, msgspec.DecodeError):
            return
        finally:
            with self.lock:
                self.peers.discard(sock)
            sock.close()

    def _account(self, key: str, size: int) -> None:
        """Refuses what would pass the bounds; else counts it."""
        if len(key) > MAX_KEY or size > MAX_VALUE:
            raise StoreRefused(f"key of {len(key)} or value of {size} bytes: over the store's bounds "
                               f"({MAX_KEY}, {MAX_VALUE})")
        with self.lock:
            total = sum(self.keys.values()) - self.keys.get(key, 0) + size
            if (key not in self.keys and len(self.keys) >= MAX_KEYS) or total > MAX_BYTES:
                raise StoreRefused(f"the link's store holds {len(self.keys)} keys, {total} bytes: full")
            self.keys[key] = size

    def _do(self, op: str, key=None, a=None, b=None):
        s = self.store
        if op == "set":
            self._account(key, len(a))
            return s.set(key, a)
        if op == "get":
            return s.get(key)
        if op == "add":
            self._account(key, 20)  # a decimal integer
            return s.add(key, int(a))
        if op == "compare_set":
            self._account(key, max(len(b), len(a)))
            return s.compare_set(key, a, b)
        if op == "check":
            return s.check(list(key))
        if op == "wait":
            return s.wait(list(key)) if a is None else s.wait(list(key), datetime.timedelta(seconds=a))
        if op == "delete_key":
            with self.lock:
                self.keys.pop(key, None)
            return s.delete_key(key)
        if op == "num_keys":
            return s.num_keys()
        raise StoreRefused(f"unknown store operation {op!r}")


class RemoteStore(dist.Store):
    """The worker's end: a c10d store whose every call goes to the decode
    side's `LinkStore`, after the secret."""

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float = 30.0):
        super().__init__()
        self.lock = threading.Lock()
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.sendall(secret)
        if _recv_exactly(self.sock, 1) != b"\x01":
            raise ConnectionError("the decode side's store refused this worker")

    def _call(self, *request):
        with self.lock:
            try:
                _send(self.sock, list(request))
                ok, value = _recv(self.sock)
            except (OSError, ConnectionError) as e:  # c10d's callers expect its RuntimeError
                raise RuntimeError(f"link store: connection lost ({e})") from None
        if not ok:
            raise RuntimeError(f"link store: {value}")
        return value

    def set(self, key, value):
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key):
        return self._call("get", key)

    def add(self, key, amount):
        return self._call("add", key, amount)

    def compare_set(self, key, expected, desired):
        encode = (lambda v: v.encode() if isinstance(v, str) else bytes(v))
        return self._call("compare_set", key, encode(expected), encode(desired))

    def check(self, keys):
        return self._call("check", list(keys))

    def wait(self, keys, timeout=None):
        self._call("wait", list(keys), None if timeout is None else timeout.total_seconds())

    def delete_key(self, key):
        return self._call("delete_key", key)

    def num_keys(self):
        return self._call("num_keys")

    def close(self) -> None:
        self.sock.close()
