"""Re-sharded transfers over real UCX inside one process, as the ranks of two workers at different
tensor- and pipeline-parallel degrees run them: every source rank's cache holds its layers x heads
of a known KV, the routes come from the planner (``tp_transfer.routes``) and each route's sender
from ``kv_ranks.route_sender``; every destination rank's cache must then hold exactly its layers x
heads of the sent blocks, nothing elsewhere, and count exactly their bytes."""

from __future__ import annotations

import json

import pytest
import torch

from baton.common.parallel.kv_ranks import make_local_receiver, route_sender
from baton.common.transfer import TransferConfig
from baton.common.transfer.reshard import Shard
from baton.services.tp_transfer import Destination, routes

L, KV, BS, D, BLOCKS = 4, 3, 4, 8, 8  # [blocks, layers, K/V, KV heads, block, head_dim]
WHOLE = Shard((0, L), (0, KV))
CELL_BYTES = 2 * BS * D * 4  # one layer x head of one block, fp32


def grid(stages, heads) -> list[Shard]:
    return [Shard(layers, h) for layers in stages for h in heads]


PP1, PP2, PP3 = [(0, 4)], [(0, 2), (2, 4)], [(0, 2), (2, 3), (3, 4)]
ONE, TWO, THREE = [(0, 3)], [(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]


def _part(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    (l0, l1), (h0, h1) = shard.layers, shard.heads
    return full[:, l0:l1, :, h0:h1]


@pytest.mark.parametrize(
    "src, dst",
    [
        (grid(PP2, ONE), grid(PP1, ONE)),  # layer slices into one cache, each block's in place
        (grid(PP1, ONE), grid(PP2, ONE)),  # one cache cut into two stages
        (grid(PP2, ONE), grid(PP3, ONE)),  # a stage drawing on two
        (grid(PP2, TWO), grid(PP1, ONE)),  # TP x PP into one rank: received into scratch, scattered
        (grid(PP2, ONE), grid(PP1, TWO)),  # packed per block on the way out
        (grid(PP1, THREE), grid(PP3, TWO)),
        (grid(PP1, TWO), grid(PP1, ONE)),  # heads alone: payloads per run of blocks, as before
    ],
    ids=["pp2-pp1", "pp1-pp2", "pp2-pp3", "tp2pp2-tp1", "pp2-tp2", "tp3-pp3tp2", "tp2-tp1"],
)
def test_each_destination_rank_gets_exactly_its_cells_of_the_sent_blocks(src, dst):
    config = TransferConfig(backend="ucx", timeout_s=20.0)
    full = torch.randn(BLOCKS, L, 2, KV, BS, D, generator=torch.Generator().manual_seed(0))
    sources = [_part(full, s).contiguous() for s in src]
    caches = [torch.zeros_like(_part(full, s)) for s in dst]
    receivers = [make_local_receiver(config, c) for c in caches]
    senders = []
    src_ids, dst_ids = [1, 2, 3, 6], [0, 1, 5, 4]  # two runs: 1-2 -> 0-1, 3 -> 5 and 6 -> 4
    try:
        descriptors = [json.dumps(r.start().to_dict(), sort_keys=True) for r in receivers]
        handles = [r.expect("t", dst_ids) for r in receivers]
        dest = Destination(None, tuple(zip(descriptors, dst)), "k")  # type: ignore[arg-type]
        for route in routes(src, dest, WHOLE):
            senders.append(route_sender(config, sources[route.rank], route))
            senders[-1].send("t", src_ids, dst_ids)
        for s in senders:
            s.finish("t").wait(20)
        for h in handles:
            h.wait(20)
    finally:
        for s in senders:
            s.close()
        for r in receivers:
            r.close()
    untouched = [b for b in range(BLOCKS) if b not in dst_ids]
    for shard, cache, receiver, handle in zip(dst, caches, receivers, handles):
        assert torch.equal(cache[dst_ids], _part(full, shard)[src_ids])
        assert not cache[untouched].any()
        cells = (shard.layers[1] - shard.layers[0]) * (shard.heads[1] - shard.heads[0])
        assert receiver.stats().bytes == handle.nbytes == len(dst_ids) * cells * CELL_BYTES
        assert handle.landed_block_ids == frozenset(dst_ids)
