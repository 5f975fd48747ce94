"""Move a 4k-token SmolLM2 KV (256 blocks of 16 tokens, 368,640 bytes each in bf16) between two
processes with each KV transport and with a plain TCP socket; print GB/s.

Patterns: ``one``  — one ``send`` of 256 consecutive blocks (one payload);
          ``chunks`` — 16 ``send`` calls of 16 consecutive blocks (chunked prefill);
          ``shuffled`` — 16 ``send`` calls to shuffled destination blocks (256 one-block payloads).
The clock starts before the first ``send`` and stops when the receiver's handle completes (both
``time.monotonic``, one clock for the whole machine). Figures are the median over repeats.

    python scripts/bench_transfer.py [--backends ucx nccl tcp] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

NUM_BLOCKS, SHAPE = 256, (30, 2, 3, 16, 64)  # SmolLM2: layers, K/V, KV heads, block size, head dim
PATTERNS = ("one", "chunks", "shuffled")


def make_cache(fill: bool):
    import torch

    torch.manual_seed(0)
    if fill:
        return torch.randn(NUM_BLOCKS, *SHAPE).to(torch.bfloat16)
    return torch.zeros(NUM_BLOCKS, *SHAPE, dtype=torch.bfloat16)


def plan(pattern: str, rep: int) -> list[tuple[list[int], list[int]]]:
    """(src ids, dst ids) per send call."""
    import random

    src = list(range(NUM_BLOCKS))
    if pattern == "one":
        return [(src, src)]
    dst = src[:]
    if pattern == "shuffled":
        random.Random(rep).shuffle(dst)
    return [(src[i : i + 16], dst[i : i + 16]) for i in range(0, NUM_BLOCKS, 16)]


# -- KV transports -----------------------------------------------------------------------------
def kv_receiver(backend: str, conn, repeats: int) -> None:
    from baton.common.transfer import TransferConfig, make_receiver

    cache = make_cache(fill=False)
    receiver = make_receiver(TransferConfig(backend=backend, timeout_s=60), cache)
    conn.send(receiver.start().to_dict())
    for pattern in PATTERNS:
        for rep in range(repeats):
            dst = [d for _, ds in plan(pattern, rep) for d in ds]
            handle = receiver.expect(f"{pattern}-{rep}", dst)
            finished = []
            handle.add_done_callback(lambda h, f=finished: f.append(time.monotonic()))
            conn.send("ready")
            handle.wait(60)
            conn.send(finished[0])
    conn.recv()
    receiver.close()


def kv_sender(backend: str, conn, repeats: int) -> None:
    from baton.common.transfer import TransferConfig, TransferDescriptor, make_sender

    cache = make_cache(fill=True)
    sender = make_sender(TransferConfig(backend=backend, timeout_s=60), cache)
    sender.connect(TransferDescriptor.from_dict(conn.recv()))
    for pattern in PATTERNS:
        for rep in range(repeats):
            conn.recv()  # receiver ready
            tid = f"{pattern}-{rep}"
            conn.send(time.monotonic())
            for src, dst in plan(pattern, rep):
                sender.send(tid, src, dst)
            sender.finish(tid).wait(60)
    conn.recv()
    sender.close()


# -- plain TCP baseline: one socket, received straight into the cache --------------------------
def tcp_receiver(conn, repeats: int) -> None:
    cache = make_cache(fill=False)
    view = memoryview(cache.view(__import__("torch").uint8).numpy()).cast("B")
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    peer, _ = server.accept()
    for _ in PATTERNS:
        for _ in range(repeats):
            conn.send("ready")
            got = 0
            while got < len(view):
                got += peer.recv_into(view[got:], len(view) - got)
            conn.send(time.monotonic())
    peer.close()
    server.close()


def tcp_sender(conn, repeats: int) -> None:
    cache = make_cache(fill=True)
    view = memoryview(cache.view(__import__("torch").uint8).numpy()).cast("B")
    sock = socket.create_connection(("127.0.0.1", conn.recv()))
    for _ in PATTERNS:
        for _ in range(repeats):
            conn.recv()
            conn.send(time.monotonic())
            sock.sendall(view)
    sock.close()


def run(backend: str, repeats: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    recv_parent, recv_child = ctx.Pipe()
    send_parent, send_child = ctx.Pipe()
    if backend == "tcp":
        targets = (tcp_receiver, (recv_child, repeats)), (tcp_sender, (send_child, repeats))
    else:
        targets = (kv_receiver, (backend, recv_child, repeats)), (kv_sender, (backend, send_child, repeats))
    procs = [ctx.Process(target=t, args=a) for t, a in targets]
    for p in procs:
        p.start()
    try:
        send_parent.send(recv_parent.recv())  # descriptor or port
        nbytes = NUM_BLOCKS * 368_640
        results = {}
        for pattern in PATTERNS:
            rates = []
            for _ in range(repeats):
                send_parent.send(recv_parent.recv())  # ready
                started = send_parent.recv()
                rates.append(nbytes / (recv_parent.recv() - started) / 1e9)
            results[pattern] = statistics.median(rates)
        if backend != "tcp":
            recv_parent.send("bye")
            send_parent.send("bye")
        return results
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["ucx", "nccl", "tcp"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{NUM_BLOCKS} blocks x 368640 B = {NUM_BLOCKS * 368640 / 1e6:.1f} MB per transfer")
    print(f"{'backend':8}" + "".join(f"{p:>12}" for p in PATTERNS) + "   (GB/s, median)")
    for backend in args.backends:
        results = run(backend, args.repeats)
        print(f"{backend:8}" + "".join(f"{results[p]:12.2f}" for p in PATTERNS), flush=True)


if __name__ == "__main__":
    main()
