"""Two channels per decode-engine/worker link: `FrameChannel`, length-prefixed
msgpack frames over a TCP socket (job metadata, aborts, heartbeats), and
`KVPair`, a torch.distributed process group of two that carries the K/V
tensors: gloo between CPU pools, NCCL between GPU pools (NCCL matches sends
to receives in call order, which the announced groups keep; the NCCL path
has not yet run on a GPU here: no session had one).

A pair is built per connection under a fresh store prefix: after a peer dies
mid-transfer a gloo group is unusable, and the next connection must not meet
the old one's keys."""

from __future__ import annotations

import datetime
import socket
import struct
import threading

import msgspec
import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store

from completer.disagg.link_store import RemoteStore
from completer.disagg.messages import ToDecode, ToWorker

MAX_FRAME = 64 * 2**20  # a Job holds a prompt's tokens; Done the logits (~200 KB)
_LEN = struct.Struct("!I")


class ChannelClosed(ConnectionError):
    """The peer closed the control connection (or sent something unreadable)."""


class FrameChannel:
    def __init__(self, sock: socket.socket, incoming: type):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._encoder = msgspec.msgpack.Encoder()
        self._send_lock = threading.Lock()

    @classmethod
    def to_worker(cls, sock: socket.socket) -> "FrameChannel":
        """The decode side's end (it sends ToWorker, reads ToDecode)."""
        return cls(sock, ToDecode)

    @classmethod
    def to_decode(cls, sock: socket.socket) -> "FrameChannel":
        return cls(sock, ToWorker)

    def send(self, message) -> None:
        body = self._encoder.encode(message)
        with self._send_lock:
            try:
                self.sock.sendall(_LEN.pack(len(body)) + body)
            except OSError as e:
                raise ChannelClosed(f"send failed: {e}") from None

    def recv(self):
        (n,) = _LEN.unpack(self._read(_LEN.size))
        if n > MAX_FRAME:
            raise ChannelClosed(f"frame of {n} bytes is over the {MAX_FRAME} limit")
        try:
            return self._decoder.decode(self._read(n))
        except msgspec.DecodeError as e:
            raise ChannelClosed(f"unreadable frame: {e}") from None

    def _read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except OSError as e:
                raise ChannelClosed(str(e)) from None
            if not chunk:
                raise ChannelClosed("connection closed")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class KVPair:
    """Rank 0 is the decode engine, rank 1 the worker."""

    DECODE, WORKER = 0, 1

    def __init__(self, store: Store, generation: int, rank: int, local_host: str, timeout_s: float,
                 device: torch.device = torch.device("cpu")):
        self.rank = rank
        self.store = store  # kept: NCCL meets its peer there at the first transfer, not here
        self.peer = 1 - rank
        store = PrefixStore(f"kv-pair-{generation}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            nccl = ProcessGroupNCCL.Options()
            nccl._timeout = timeout
            self.group = ProcessGroupNCCL(store, rank, 2, nccl)
            return
        opts = ProcessGroupGloo._Options()
        # Bound to the address the control connection uses, which the peer reaches.
        opts._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
        opts._timeout = timeout
        self.group = ProcessGroupGloo(store, rank, 2, opts)

    @classmethod
    def join(cls, store_host: str, store_port: int, secret: bytes, generation: int, local_host: str,
             timeout_s: float, device: torch.device) -> "KVPair":
        """The worker's end: meets the decode side in its store (`link_store`),
        admitted by the link's secret."""
        store = RemoteStore(store_host, store_port, secret)
        try:
            return cls(store, generation, cls.WORKER, local_host, timeout_s, device)
        except BaseException:
            store.close()
            raise

    def send(self, tensor: torch.Tensor, tag: int):
        """Starts the send; returns its work (wait() on it before reusing `tensor`)."""
        return self.group.send([tensor], self.peer, tag)

    def recv(self, into: torch.Tensor, tag: int, timeout_s: float) -> None:
        """Blocks until the announced tensor is in `into`; raises on a dead or stalled peer."""
        self.group.recv([into], self.peer, tag).wait(datetime.timedelta(seconds=timeout_s))

    def close(self) -> None:
        try:
            self.group.abort()
        except Exception:  # already broken: nothing more to release
            pass
        if isinstance(self.store, RemoteStore):
            self.store.close()
