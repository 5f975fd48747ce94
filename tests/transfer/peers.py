"""The two processes of the transport tests: a decode-side receiver and a prefill-side sender.

Both build their caches from fixed seeds, so each side can recompute what the other holds. The
receiver runs a fixed script with sync points; the sender obeys commands. The test process
(``test_two_processes.py``) relays between them over pipes.
"""

from __future__ import annotations

import random
import time

# name -> (shape, dtype name); "real" is SmolLM2's block: 30 layers, K/V, 3 KV heads, 16 tokens, 64.
CACHES = {
    "tiny": ((64, 2, 2, 2, 4, 8), "float32"),
    "real": ((16, 30, 2, 3, 16, 64), "bfloat16"),
}
SENDER_SEED, RECEIVER_SEED = 1, 2
CHUNK_PAUSE_S = 0.1  # between sends, as if the next prefill chunk were computing
DEAD_TIMEOUT_S = 3.0


def make_cache(name: str, seed: int):
    """Random *bits* (NaNs, infinities and denormals included): equality is bit-exact or nothing."""
    import torch

    shape, dtype = CACHES[name]
    dtype = getattr(torch, dtype)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(bits)
    gen = torch.Generator().manual_seed(seed * 1000 + len(name))
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=gen).view(dtype)


def as_bits(tensor):
    import torch

    return tensor.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[tensor.dtype])


def make_plan(num_blocks: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Three sends: one run of consecutive ids on both sides, then shuffled ids, uneven sizes."""
    rng = random.Random(seed)
    count = num_blocks * 3 // 8
    run = max(2, count // 4)
    src_start, dst_start = rng.randrange(num_blocks - run), rng.randrange(num_blocks - run)
    src = list(range(src_start, src_start + run))
    dst = list(range(dst_start, dst_start + run))
    src += rng.sample([i for i in range(num_blocks) if i not in src], count - run)
    dst += rng.sample([i for i in range(num_blocks) if i not in dst], count - run)
    cut1, cut2 = run, run + (count - run) // 3
    return [(src[a:b], dst[a:b]) for a, b in ((0, cut1), (cut1, cut2), (cut2, count))]


def flat(plan: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    return [s for c in plan for s in c[0]], [d for c in plan for d in c[1]]


def leftover(num_blocks: int, used: list[int], count: int) -> list[int]:
    return [i for i in range(num_blocks) if i not in used][:count]


# -- receiver ----------------------------------------------------------------------------------
def run_receiver(backend: str, conn) -> None:
    import torch

    from baton.common.transfer import TransferConfig, make_receiver

    torch.set_num_threads(1)
    caches = {name: make_cache(name, RECEIVER_SEED) for name in CACHES}
    initial = {name: c.clone() for name, c in caches.items()}
    config = TransferConfig(backend=backend, timeout_s=10.0)
    receivers = {name: make_receiver(config, caches[name]) for name in CACHES}
    conn.send({name: r.start().to_dict() for name, r in receivers.items()})

    conn.send(("phase1", _phase_busy(conn, receivers, caches, initial)))
    conn.send(("phase2", _phase_cancel(conn, receivers, caches, initial)))
    conn.send(("phase3", _phase_dead_sender(conn, receivers)))
    started = time.monotonic()
    for r in receivers.values():
        r.close()
    conn.send(("closed", {"close_s": time.monotonic() - started}))


def _phase_busy(conn, receivers, caches, initial) -> dict:
    """Expect the planned blocks, then decode (matmuls) until they have landed; check them."""
    import torch

    handles = {}
    for name, r in receivers.items():
        _, dst = flat(make_plan(len(caches[name]), seed=len(name)))
        handles[name] = r.expect(f"x-{name}", dst)
    conn.send("ready")
    a = torch.randn(256, 256)
    ticks, deadline = [time.monotonic()], time.monotonic() + 20
    while not all(h.done() for h in handles.values()) and time.monotonic() < deadline:
        a = torch.tanh(a @ a)  # one "decode step"
        ticks.append(time.monotonic())
    gaps = [b - a for a, b in zip(ticks, ticks[1:])] or [0.0]
    report = {"steps": len(ticks) - 1, "max_gap_s": max(gaps), "busy_s": ticks[-1] - ticks[0]}
    report["errors"] = {n: repr(h.exception()) for n, h in handles.items() if not h.ok()}
    report["nbytes"] = {n: h.nbytes for n, h in handles.items()}
    report["stats"] = {n: r.stats() for n, r in receivers.items()}
    report.update(_check_blocks(caches, initial))
    return report


def _check_blocks(caches, initial) -> dict:
    exact, untouched = {}, {}
    for name, cache in caches.items():
        src, dst = flat(make_plan(len(cache), seed=len(name)))
        sent = make_cache(name, SENDER_SEED)
        exact[name] = bool(torch_equal(as_bits(cache[dst]), as_bits(sent[src])))
        others = [i for i in range(len(cache)) if i not in dst]
        untouched[name] = bool(torch_equal(as_bits(cache[others]), as_bits(initial[name][others])))
    return {"exact": exact, "untouched": untouched}


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def _phase_cancel(conn, receivers, caches, initial) -> dict:
    """A cancelled transfer fails at once and its late payload is dropped; a silent one times out."""
    name = "tiny"
    r, cache = receivers[name], caches[name]
    used = flat(make_plan(len(cache), seed=len(name)))[1]
    ids = leftover(len(cache), used, 6)
    before = as_bits(cache[ids]).clone()
    handle = r.expect("cancelled", ids)
    started = time.monotonic()
    r.cancel("cancelled")
    report = {"cancel_error": _wait_error(handle, 5.0), "cancel_s": time.monotonic() - started}
    conn.send(("send_to_cancelled", ids))
    assert conn.recv() == "sent"
    deadline = time.monotonic() + 10
    expected_drop = len(ids) * cache[0].numel() * cache.element_size()
    while r.stats().dropped_bytes < expected_drop and time.monotonic() < deadline:
        time.sleep(0.01)
    report["dropped_bytes"], report["expected_drop"] = r.stats().dropped_bytes, expected_drop
    report["cancelled_untouched"] = torch_equal(as_bits(cache[ids]), before)

    silent = r.expect("silent", leftover(len(cache), used + ids, 2), timeout_s=1.0)
    started = time.monotonic()
    report["timeout_error"] = _wait_error(silent, 5.0)
    report["timeout_s"] = time.monotonic() - started
    return report


def _phase_dead_sender(conn, receivers) -> dict:
    """Half a transfer arrives, then the sender is killed: the wait fails within the timeout."""
    r = receivers["real"]
    handle = r.expect("dead", list(range(8)), timeout_s=DEAD_TIMEOUT_S)
    conn.send("ready")
    started = time.monotonic()
    error = _wait_error(handle, DEAD_TIMEOUT_S + 5.0)
    return {"dead_error": error, "dead_wait_s": time.monotonic() - started}


def _wait_error(handle, timeout: float) -> str | None:
    from baton.common.transfer import TransferError

    try:
        handle.wait(timeout)
    except TransferError as e:
        return f"TransferError: {e}"
    return None


# -- sender ------------------------------------------------------------------------------------
def run_sender(backend: str, conn) -> None:
    import torch

    from baton.common.transfer import TransferConfig, TransferDescriptor, make_sender

    torch.set_num_threads(1)
    caches = {name: make_cache(name, SENDER_SEED) for name in CACHES}
    config = TransferConfig(backend=backend, timeout_s=10.0)
    descriptors = conn.recv()
    senders = {name: make_sender(config, caches[name]) for name in CACHES}
    for name, s in senders.items():
        s.connect(TransferDescriptor.from_dict(descriptors[name]))
    while (command := conn.recv()) != "close":
        if command == "stats":
            conn.send({name: s.stats() for name, s in senders.items()})
        else:
            conn.send(_send(senders, *command))
    for s in senders.values():
        s.close()


def _send(senders, name: str, tid: str, plan) -> str:
    for src, dst in plan:
        senders[name].send(tid, src, dst)
        time.sleep(CHUNK_PAUSE_S)
    try:
        senders[name].finish(tid).wait(10.0)
    except Exception as e:
        return f"error: {e!r}"
    return "sent"
