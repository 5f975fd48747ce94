"""Re-sharding cost in transfer (issue 14), over UCX between processes, SmolLM2-shaped KV (30
layers, 3 KV heads of 64, bf16, block 16), the same bytes in every mode:

* ``1->1``: one sender, one receiver process, whole blocks (no re-sharding);
* ``1->2``: one sender to two receiver processes holding heads 0-1 and 2 (a decode worker at TP=2):
  the sender packs each slice (``common/transfer/heads.py``), each receiver takes it whole;
* ``2->1``: two senders holding heads 0-1 and 2 (a prefill worker at TP=2; here in one process) to
  one receiver, which receives each slice into scratch and copies it into place;
* ``1->2 regions``: the alternative to packing, one payload per (block, layer, k/v) region straight
  from and into the caches (``--no-regions`` leaves it out: it is slow).

Each figure is the median of REPEATS transfers from the first ``send`` to the last receiver saying
its handle completed; modes alternate within each repeat; every transfer's bytes are checked.

    .venv/bin/python scripts/bench_reshard_transfer.py [TOKENS ...] [--no-regions]
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time

L, KV, BS, D = 30, 3, 16, 64
REPEATS = 7


def full_cache(num_blocks: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(-(2**15), 2**15, (num_blocks, L, 2, KV, BS, D), generator=g, dtype=torch.int16).view(
        torch.bfloat16
    )


def region_classes():
    """The other way to move a strided slice: one payload per (block, layer, k/v) region, straight
    from and into the caches (no packing, 2 * L payloads per block)."""
    from baton.common.transfer.heads import HeadSliceReceiver, HeadSliceSender, _as_bytes

    class RegionSender(HeadSliceSender):
        def _payloads(self, runs):
            h0, h1 = self.src_heads
            c = self._cache
            return [
                _as_bytes(c[b, layer, kv, h0:h1].unsqueeze(0))
                for r in runs
                for b in range(r.src, r.src + r.count)
                for layer in range(L)
                for kv in range(2)
            ]

    class RegionReceiver(HeadSliceReceiver):
        def _targets(self, header, landing):
            if header.heads is None or not landing:
                return super()._targets(header, landing)
            h0, h1 = header.heads
            c = self._cache
            return [
                _as_bytes(c[b, layer, kv, h0:h1].unsqueeze(0))
                for start, count in header.runs
                for b in range(start, start + count)
                for layer in range(L)
                for kv in range(2)
            ]

        def _scatter(self, header, staged):
            pass  # already in place

    return RegionSender, RegionReceiver


def receiver(heads: tuple[int, int], num_blocks: int, conn, regions: bool = False) -> None:
    import torch

    from baton.common.transfer import TransferConfig
    from baton.common.transfer.heads import HeadSliceReceiver

    torch.set_num_threads(1)
    cache = torch.zeros(num_blocks, L, 2, heads[1] - heads[0], BS, D, dtype=torch.bfloat16)
    cls = region_classes()[1] if regions else HeadSliceReceiver
    rx = cls(TransferConfig(timeout_s=60), cache)
    conn.send(rx.start().to_dict())
    want = full_cache(num_blocks)[:, :, :, heads[0] : heads[1]]
    while (msg := conn.recv()) is not None:
        tid, blocks = msg
        h = rx.expect(tid, list(range(blocks)))
        conn.send("armed")
        h.wait(60)
        conn.send(("done", time.perf_counter()))
        conn.send(bool(torch.equal(cache[:blocks].view(torch.int16), want[:blocks].view(torch.int16))))
        cache.zero_()
    rx.close()


def main() -> None:

    from baton.common.transfer import TransferConfig, TransferDescriptor, make_sender
    from baton.common.transfer.heads import HeadSliceSender

    tokens = [int(t) for t in sys.argv[1:] if t.isdigit()] or [1024, 4096]
    num_blocks = max(tokens) // BS
    ctx = mp.get_context("spawn")
    modes = {
        "1->1": [(0, 3)],
        "1->2": [(0, 2), (2, 3)],
        "2->1": [(0, 3)],
        "1->2 regions": [(0, 2), (2, 3)],
    }
    if "--no-regions" in sys.argv:
        del modes["1->2 regions"]
    peers = {}
    for mode, ranges in modes.items():
        for heads in ranges:
            a, b = ctx.Pipe()
            p = ctx.Process(target=receiver, args=(heads, num_blocks, b, "regions" in mode), daemon=True)
            p.start()
            peers.setdefault(mode, []).append((heads, p, a))
    cache = full_cache(num_blocks)
    config = TransferConfig(timeout_s=60)
    # 2->1: the two prefill ranks' caches (heads 0-1 and 2), each sent whole into the one receiver's
    # heads, which scatters them into place.
    rank_caches = [cache[:, :, :, 0:2].contiguous(), cache[:, :, :, 2:3].contiguous()]
    senders = {}
    for mode, parts in peers.items():
        senders[mode] = []
        if mode == "2->1":
            desc = TransferDescriptor.from_dict(parts[0][2].recv())
            for c, dst in zip(rank_caches, [(0, 2), (2, 3)]):
                s = HeadSliceSender(config, c, (0, c.shape[3]), dst)
                s.connect(desc)
                senders[mode].append(s)
            continue
        for heads, _, conn in parts:
            desc = TransferDescriptor.from_dict(conn.recv())
            whole = heads == (0, KV)
            cls = region_classes()[0] if "regions" in mode else HeadSliceSender
            s = make_sender(config, cache) if whole else cls(config, cache, heads, (0, heads[1] - heads[0]))
            s.connect(desc)
            senders[mode].append(s)
    seq = 0
    results = {}
    for n in tokens:
        blocks = n // BS
        times: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(REPEATS + 1):  # the first is a warm-up
            for mode in modes:
                seq += 1
                tid = f"t{seq}"
                for _, _, conn in peers[mode]:
                    conn.send((tid, blocks))
                for _, _, conn in peers[mode]:
                    assert conn.recv() == "armed"
                t0 = time.perf_counter()
                for s in senders[mode]:
                    s.send(tid, list(range(blocks)), list(range(blocks)))
                ends = []
                for _, _, conn in peers[mode]:
                    kind, t = conn.recv()
                    ends.append(t)
                    assert conn.recv(), f"{mode}: wrong bytes landed"
                if rep:
                    times[mode].append(max(ends) - t0)
        nbytes = blocks * cache[0].nbytes
        results[n] = {m: statistics.median(v) for m, v in times.items()}
        r = results[n]
        line = ", ".join(
            f"{m} {t * 1e3:.2f} ms ({nbytes / t / 1e9:.2f} GB/s, x{t / r['1->1']:.2f})" for m, t in r.items()
        )
        print(f"{n} tokens ({nbytes / 2**20:.1f} MiB in every mode): {line}", flush=True)
    # Packing alone: the 2-head and the 1-head slice of every block, as HeadSliceSender copies them.
    for n in tokens:
        blocks = n // BS
        pack = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            cache[:blocks, :, :, 0:2].contiguous()
            cache[:blocks, :, :, 2:3].contiguous()
            pack.append(time.perf_counter() - t0)
        print(f"{n} tokens: packing both slices {statistics.median(pack) * 1e3:.2f} ms", flush=True)
    for parts in peers.values():
        for _, p, conn in parts:
            conn.send(None)
            p.join(20)
    for ss in senders.values():
        for s in ss:
            s.close()


if __name__ == "__main__":
    main()
