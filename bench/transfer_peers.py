"""The two processes of ``baton bench transfer``: a receiver and a sender, each holding a KV cache laid
out as the engine's (``[num_blocks, layers, 2, KV, block_size, D]``) and one end of every transport.

The parent drives both with commands over pipes (``Peer.call``). A transfer is timed from the
sender's start to the receiver's last byte with ``time.monotonic`` — CLOCK_MONOTONIC, one clock for
every process of a Linux host — so neither pipe round trip is inside the figure.

Transports: ``ucx`` and ``nccl`` go through Baton's own ``KVSender``/``KVReceiver`` (``nccl`` is
gloo for a CPU cache); ``tcp`` is a plain loopback socket (``sendall`` / ``recv_into``) carrying the
same bytes from the same cache into the same destination blocks.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import traceback
import zlib
from dataclasses import dataclass
from typing import Any

KV_TRANSPORTS = ("ucx", "nccl")
"""Moved through Baton's transport classes."""
TCP = "tcp"
POLL_S = 0.05
"""How often a waiting parent checks that its peer is still alive."""


@dataclass(frozen=True)
class KVGeometry:
    """A model's KV cache as the engine lays it out and allocates it."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    max_model_len: int
    kv_cache_dtype: str = "auto"
    """``--kv-cache-dtype``: a quantized cache moves its blocks (codes and scales) as they are."""

    def allocate(self, num_blocks: int) -> Any:
        """``[num_blocks, layers, 2, KV, block_size, D]``, zeros, from the engine's own allocator."""
        import torch

        from baton.common.engine.model_runner import allocate_kv_cache

        return allocate_kv_cache(
            self._shell(), num_blocks, self.block_size, getattr(torch, self.dtype), "cpu", self.kv_cache_dtype
        )

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.allocate(0).shape[1:])

    @property
    def bytes_per_block(self) -> int:
        import torch

        from baton.common.engine.model_runner import kv_cache_block_bytes

        return kv_cache_block_bytes(
            self._shell(), self.block_size, getattr(torch, self.dtype), self.kv_cache_dtype
        )

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _shell(self) -> Any:
        """What the engine's allocator reads of a model: its config's layer, head and dim counts."""
        from types import SimpleNamespace

        return SimpleNamespace(config=self)


@dataclass(frozen=True)
class PeerSpec:
    """What both peers build: the cache and the transports."""

    geometry: KVGeometry
    num_blocks: int
    transports: tuple[str, ...]
    """A subset of ``KV_TRANSPORTS`` and ``TCP``."""
    timeout_s: float
    seed: int


class PeerError(RuntimeError):
    """A peer failed a command, died, or did not answer in time."""


# -- the parent's handle on a peer -------------------------------------------------------------------
class Peer:
    """One child process running ``serve`` for ``role`` ("receiver" or "sender")."""

    def __init__(self, role: str, spec: PeerSpec) -> None:
        ctx = mp.get_context("spawn")
        self.role = role
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(role, spec, child), name=f"kv-{role}", daemon=True)

    def start(self) -> None:
        self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def call(self, *command: Any, timeout_s: float) -> Any:
        """Send ``command``; return the peer's answer, or raise ``PeerError``."""
        deadline = time.monotonic() + timeout_s
        try:
            self._conn.send(command)
            while not self._conn.poll(POLL_S):
                if not self.process.is_alive():
                    raise EOFError
                if time.monotonic() > deadline:
                    raise PeerError(f"{self.role}: no answer to {command[0]!r} within {timeout_s} s")
            status, value = self._conn.recv()
        except (EOFError, OSError) as e:  # the pipe broke: the peer is gone
            self.process.join(POLL_S)
            code = self.process.exitcode
            raise PeerError(f"{self.role} exited (code {code}) during {command[0]!r}") from e
        if status != "ok":
            raise PeerError(f"{self.role} failed {command[0]!r}: {value}")
        return value

    def stop(self, timeout_s: float) -> None:
        """Ask the peer to close its transports and exit; kill it if it does not in time."""
        if self.process.pid is None:  # never started
            return
        if self.process.is_alive():
            try:
                self.call("close", timeout_s=timeout_s)
            except (PeerError, OSError):
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout_s)
        self._conn.close()


# -- in the child ----------------------------------------------------------------------------------
def serve(role: str, spec: PeerSpec, conn: Any) -> None:
    """A peer's main: build the cache and endpoints, then answer commands until "close"."""
    import torch

    _die_with_parent()
    torch.set_num_threads(1)  # one core each: the two peers share a two-core host
    peer = _Receiver(spec) if role == "receiver" else _Sender(spec)
    try:
        while True:
            name, *args = conn.recv()
            try:
                conn.send(("ok", getattr(peer, f"do_{name}")(*args)))
            except Exception:
                conn.send(("error", traceback.format_exc(limit=6)))
            if name == "close":
                return
    finally:
        peer.do_close()


try:  # looked up in the parent: no dlopen between fork and exec (it can hang in a threaded parent)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _die_with_parent() -> None:
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def make_cache(spec: PeerSpec, random_bits: bool) -> Any:
    """The engine's cache for ``spec.num_blocks``: zeros, or seeded random bits (NaNs and all, so
    equality is checked on bytes)."""
    import torch

    cache = spec.geometry.allocate(spec.num_blocks)
    if random_bits:
        gen = torch.Generator().manual_seed(spec.seed)
        cache.view(torch.uint8).random_(0, 256, generator=gen)
    return cache


def checksum(block_bytes: Any, num_blocks: int) -> int:
    """CRC-32 of the first ``num_blocks`` rows of a ``[N, bytes_per_block]`` uint8 tensor."""
    return zlib.crc32(memoryview(block_bytes[:num_blocks].numpy()).cast("B"))


class _Receiver:
    """Destination cache; a ``KVReceiver`` per Baton transport and a listening socket for TCP."""

    def __init__(self, spec: PeerSpec) -> None:
        from baton.common.transfer import TransferConfig, make_receiver
        from baton.common.transfer.blocks import as_block_bytes

        self.spec = spec
        self.cache = make_cache(spec, random_bits=False)
        self.blocks = as_block_bytes(self.cache)  # [N, bytes_per_block]
        self.receivers = {
            t: make_receiver(TransferConfig(backend=t, timeout_s=spec.timeout_s), self.cache)
            for t in spec.transports
            if t in KV_TRANSPORTS
        }
        self.listener: socket.socket | None = None
        self.tcp: socket.socket | None = None
        self.pending: tuple[str, Any] | None = None

    def do_open(self) -> dict[str, dict]:
        """Open every transport; their descriptors, for the sender."""
        descriptors = {t: r.start().to_dict() for t, r in self.receivers.items()}
        if TCP in self.spec.transports:
            self.listener = socket.create_server(("127.0.0.1", 0))
            self.listener.settimeout(self.spec.timeout_s)
            descriptors[TCP] = {"host": "127.0.0.1", "port": self.listener.getsockname()[1]}
        return descriptors

    def do_arm(self, transport: str, transfer_id: str, num_blocks: int) -> str:
        """Clear the destination blocks (so stale bytes cannot pass the check) and expect them."""
        self.cache[:num_blocks].zero_()
        if transport == TCP:
            self.pending = (TCP, _TcpLanding(self._tcp_connection(), self.blocks[:num_blocks]))
        else:
            handle = self.receivers[transport].expect(transfer_id, range(num_blocks))
            landed: list[float] = []
            handle.add_done_callback(lambda h: landed.append(time.monotonic()))
            self.pending = (transport, (handle, landed))
        return "ready"

    def do_wait(self, num_blocks: int) -> dict:
        """Wait for the armed transfer; when its last byte landed, how many, and their checksum."""
        assert self.pending is not None, "wait without arm"
        transport, state = self.pending
        self.pending = None
        if transport == TCP:
            landed_at, nbytes = state.wait(self.spec.timeout_s)
        else:
            handle, landed = state
            handle.wait(self.spec.timeout_s)
            landed_at, nbytes = landed[0], handle.nbytes
        return {"landed": landed_at, "nbytes": nbytes, "crc": checksum(self.blocks, num_blocks)}

    def do_close(self) -> str:
        for r in self.receivers.values():
            r.close()
        self.receivers = {}
        for s in (self.tcp, self.listener):
            if s is not None:
                s.close()
        self.tcp = self.listener = None
        return "closed"

    def _tcp_connection(self) -> socket.socket:
        if self.tcp is None:
            assert self.listener is not None
            self.tcp, _ = self.listener.accept()  # the sender connected at "connect"
            self.tcp.settimeout(self.spec.timeout_s)
        return self.tcp


class _TcpLanding:
    """A thread that ``recv_into``s the destination rows until every byte is in."""

    def __init__(self, sock: socket.socket, rows: Any) -> None:
        self._view = memoryview(rows.numpy()).cast("B")
        self._sock = sock
        self._landed = 0.0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-tcp-recv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        got, total = 0, len(self._view)
        try:
            while got < total:
                n = self._sock.recv_into(self._view[got:], total - got)
                if n == 0:
                    raise ConnectionError(f"TCP peer closed after {got} of {total} bytes")
                got += n
            self._landed = time.monotonic()
        except BaseException as e:
            self._error = e

    def wait(self, timeout_s: float) -> tuple[float, int]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"TCP receive not done within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._landed, len(self._view)


class _Sender:
    """Source cache (seeded random bits); a ``KVSender`` per Baton transport and a TCP socket."""

    def __init__(self, spec: PeerSpec) -> None:
        from baton.common.transfer.blocks import as_block_bytes

        self.spec = spec
        self.cache = make_cache(spec, random_bits=True)
        self.blocks = as_block_bytes(self.cache)
        self.senders: dict[str, Any] = {}
        self.tcp: socket.socket | None = None

    def do_connect(self, descriptors: dict[str, dict]) -> dict:
        """Connect every transport; the UCX environment the transport ended up with."""
        from baton.common.transfer import TransferConfig, TransferDescriptor, make_sender

        for t in self.spec.transports:
            if t == TCP:
                d = descriptors[TCP]
                self.tcp = socket.create_connection((d["host"], d["port"]), timeout=self.spec.timeout_s)
                continue
            sender = make_sender(TransferConfig(backend=t, timeout_s=self.spec.timeout_s), self.cache)
            sender.connect(TransferDescriptor.from_dict(descriptors[t]))
            self.senders[t] = sender
        return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "UCXX_"))}

    def do_checksum(self, num_blocks: int) -> int:
        return checksum(self.blocks, num_blocks)

    def do_push(self, transport: str, transfer_id: str, num_blocks: int, blocks_per_send: int) -> dict:
        """Move the first ``num_blocks`` blocks to the same ids on the receiver; when it started."""
        started = time.monotonic()
        if transport == TCP:
            assert self.tcp is not None
            self.tcp.sendall(memoryview(self.blocks[:num_blocks].numpy()).cast("B"))
            return {"started": started, "nbytes": self.blocks[:num_blocks].nbytes}
        sender = self.senders[transport]
        step = blocks_per_send or num_blocks
        for first in range(0, num_blocks, step):
            ids = range(first, min(first + step, num_blocks))
            sender.send(transfer_id, ids, ids)
        handle = sender.finish(transfer_id)
        handle.wait(self.spec.timeout_s)
        return {"started": started, "nbytes": handle.nbytes}

    def do_memcpy(self, num_blocks: int, warmup: int, repeats: int) -> dict:
        """Seconds of ``torch`` copies of the same bytes within this process, and whether exact."""
        import torch

        src = self.cache[:num_blocks]
        dst = torch.empty_like(src)
        samples = []
        for i in range(warmup + repeats):
            started = time.perf_counter()
            dst.copy_(src)
            if i >= warmup:
                samples.append(time.perf_counter() - started)
        exact = torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
        return {"samples": samples, "nbytes": src.nbytes, "exact": bool(exact)}

    def do_close(self) -> str:
        for s in self.senders.values():
            s.close()
        self.senders = {}
        if self.tcp is not None:
            self.tcp.close()
            self.tcp = None
        return "closed"
