"""A worker's side of the re-sharded KV transfer between tensor-parallel degrees: the KV heads its
ranks hold, the per-rank destinations a decode worker names in the Prefill RPC, and the routes a
prefill worker plans from them (``common/transfer/reshard.py``). ``common/parallel/kv_ranks.py``
moves the bytes, each rank its own heads."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

from baton.common.engine.model_runner import kv_cache_layout
from baton.common.parallel.kv_ranks import Route, make_local_receiver, route_sender
from baton.common.parallel.kv_sharded import RankLink, ShardedReceiver, ShardedSender
from baton.common.transfer import KVReceiver, KVSender, TransferConfig, TransferDescriptor
from baton.common.transfer.reshard import HeadRange, plan
from baton.protos import baton_pb2


def _parallel(engine) -> bool:
    return engine.config.tensor_parallel_size > 1


def num_kv_heads(engine) -> int:
    """The model's KV heads (all ranks together)."""
    model = engine.model
    return (model.full_config if _parallel(engine) else model.config).num_kv_heads


def rank_heads(engine) -> list[HeadRange]:
    """Each rank's KV heads ``[start, end)``, in rank order."""
    if not _parallel(engine):
        return [(0, engine.model.config.num_kv_heads)]
    from baton.common.model.tensor_parallel import head_split

    full = engine.model.full_config
    return [kv for _, kv in head_split(full.num_heads, full.num_kv_heads, engine.config.tensor_parallel_size)]


def full_layout(engine) -> str:
    """``kv_cache_layout`` with the model's KV heads in place of rank 0's: what two workers at any
    tensor-parallel degrees must agree on (dtype, layers, heads, block size, head row)."""
    shape = list(engine.kv_cache.shape)
    shape[3] = num_kv_heads(engine)  # [num_blocks, L, 2, KV, bs, row]
    return kv_cache_layout(engine.kv_cache.new_empty(shape, device="meta"))


def bytes_per_token(engine) -> int:
    """KV bytes of one token, all ranks together."""
    cache = engine.kv_cache  # rank 0's: [num_blocks, L, 2, KV_0, bs, row]
    return cache[0].nbytes * num_kv_heads(engine) // cache.shape[3] // cache.shape[4]


def tp_settings(engine) -> dict:
    """What a worker publishes in its registry settings about its ranks."""
    return {"tensor_parallel_size": engine.config.tensor_parallel_size, "kv_heads": rank_heads(engine)}


def rank_link(engine) -> RankLink | None:
    """The line to the other ranks' transport (None for one process); start it once per worker."""
    return RankLink(engine.model).start() if _parallel(engine) else None


# -- decode ----------------------------------------------------------------------------------------
def make_receiver(config: TransferConfig, engine, link: RankLink | None) -> KVReceiver:
    """The decode worker's receiver: one per rank, or one taking head slices for one process."""
    if link is None:
        return make_local_receiver(config, engine.kv_cache)
    if config.backend != "ucx":
        raise ValueError("a tensor-parallel decode worker receives KV over --kv-transport ucx only")
    return ShardedReceiver(config, engine.kv_cache, link, rank_heads(engine))


def rank_destinations(receiver: KVReceiver) -> list[baton_pb2.RankDestination]:
    """Every rank's descriptor and heads, for the Prefill RPC (empty for one process)."""
    if not isinstance(receiver, ShardedReceiver):
        return []
    return [
        baton_pb2.RankDestination(
            destination=baton_pb2.TransferDescriptor(backend=d.backend, extra_json=json.dumps(d.to_dict())),
            kv_head_start=a,
            kv_head_end=b,
        )
        for d, (a, b) in zip(receiver.descriptors, receiver.heads)
    ]


class RankBytesCollector:
    """``baton:kv_received_bytes{rank}``: the KV bytes each rank of a decode worker received."""

    def __init__(self, receiver: KVReceiver, labels: dict[str, str]):
        self.receiver = receiver
        self.labels = labels

    def collect(self):
        r = self.receiver
        per_rank = r.rank_bytes() if isinstance(r, ShardedReceiver) else [r.stats().bytes]
        c = CounterMetricFamily(
            "baton:kv_received_bytes",
            "KV bytes received into each tensor-parallel rank's cache.",
            labels=[*self.labels, "rank"],
        )
        for rank, n in enumerate(per_rank):
            c.add_metric([*self.labels.values(), str(rank)], n)
        yield c


# -- prefill ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Destination:
    """A decode worker as a Prefill or Connect RPC names it."""

    descriptor: TransferDescriptor
    """Rank 0's receiver (the whole worker's, for one process)."""
    ranks: tuple[tuple[str, HeadRange], ...]
    """Each rank's receiver (``TransferDescriptor`` JSON) and KV heads."""
    key: str
    """Names the destination among a prefill worker's senders."""


def destination(
    request, parse: Callable[[baton_pb2.TransferDescriptor], TransferDescriptor], num_heads: int
) -> Destination:
    """The decode worker of a Prefill or Connect request (ValueError if malformed); without rank
    destinations, ``destination`` holds all ``num_heads`` heads."""
    own = parse(request.destination)
    if not request.rank_destinations:
        key = json.dumps(own.to_dict(), sort_keys=True)
        return Destination(own, ((key, (0, num_heads)),), key)
    ranks = []
    for r in request.rank_destinations:
        d = parse(r.destination)
        ranks.append((json.dumps(d.to_dict(), sort_keys=True), (r.kv_head_start, r.kv_head_end)))
    return Destination(own, tuple(ranks), json.dumps(ranks))


def routes(own: Sequence[HeadRange], dest: Destination, num_heads: int) -> list[Route]:
    """Which of this worker's ranks sends which heads to which decode rank (ValueError if the
    decode worker's ranks do not hold the model's heads)."""
    out = []
    for s in plan(own, [h for _, h in dest.ranks], num_heads):
        src_n = own[s.src_rank][1] - own[s.src_rank][0]
        dst_n = dest.ranks[s.dst_rank][1][1] - dest.ranks[s.dst_rank][1][0]
        whole = s.src_heads == (0, src_n) and s.dst_heads == (0, dst_n)
        out.append(Route(s.src_rank, dest.ranks[s.dst_rank][0], s.src_heads, s.dst_heads, whole))
    return out


def connect_sender(
    config: TransferConfig, engine, link: RankLink | None, dest: Destination, route_list: Sequence[Route]
) -> KVSender:
    """A connected sender to ``dest`` (blocking; call off the event loop): a plain one where this
    worker's one rank sends whole blocks to one, else every rank's routes."""
    if len(route_list) == 1 and route_list[0].whole and route_list[0].rank == 0:
        return route_sender(config, engine.kv_cache, route_list[0])
    sender = ShardedSender(config, engine.kv_cache, route_list, link, dest.key)
    sender.connect(dest.descriptor)
    return sender
