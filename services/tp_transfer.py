"""A worker's side of the re-sharded KV transfer between tensor- and pipeline-parallel degrees: the
layers and KV heads each of its ranks holds (its *shard*), the per-rank destinations a decode worker
names in the Prefill RPC, and the routes a prefill worker plans from them
(``common/transfer/reshard.py``). ``common/parallel/kv_ranks.py`` moves the bytes, each rank its
own layers and heads."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

from baton.common.engine.model_runner import kv_cache_layout
from baton.common.parallel.kv_ranks import Route, make_local_receiver, route_sender
from baton.common.parallel.kv_sharded import RankLink, ShardedReceiver, ShardedSender
from baton.common.transfer import KVReceiver, KVSender, TransferConfig, TransferDescriptor
from baton.common.transfer.reshard import Shard, Slice, plan
from baton.protos import baton_pb2


def _parallel(engine) -> bool:
    return engine.config.tensor_parallel_size > 1 or engine.config.pipeline_parallel_size > 1


def _full_config(engine):
    """The model's config (all ranks together): every layer, every KV head."""
    model = engine.model
    return model.full_config if _parallel(engine) else model.config


def num_kv_heads(engine) -> int:
    """The model's KV heads (all ranks together)."""
    return _full_config(engine).num_kv_heads


def num_layers(engine) -> int:
    """The model's layers (all stages together)."""
    return _full_config(engine).num_layers


def rank_shards(engine) -> list[Shard]:
    """Each rank's layers and KV heads of the model's, in rank order (stage after stage, the
    tensor-parallel index innermost: ``parallel.pipeline.Layout``)."""
    full, cfg = _full_config(engine), engine.config
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    heads = [(0, full.num_kv_heads)]
    if tp > 1:
        from baton.common.model.tensor_parallel import head_split

        heads = [kv for _, kv in head_split(full.num_heads, full.num_kv_heads, tp)]
    layers = [(0, full.num_layers)]
    if pp > 1:
        from baton.common.model.pipeline_parallel import stage_layers

        layers = stage_layers(full.num_layers, pp)
    return [Shard(layers[r // tp], heads[r % tp]) for r in range(tp * pp)]


def all_of_model(engine) -> Shard:
    """The whole model's KV: what a decode worker that names no ranks holds."""
    return Shard((0, num_layers(engine)), (0, num_kv_heads(engine)))


def full_layout(engine) -> str:
    """``kv_cache_layout`` with the model's layers and KV heads in place of rank 0's: what two
    workers at any tensor- and pipeline-parallel degrees must agree on (dtype, layers, heads, block
    size, head row)."""
    shape = list(engine.kv_cache.shape)
    shape[1], shape[3] = num_layers(engine), num_kv_heads(engine)  # [num_blocks, L, 2, KV, bs, row]
    return kv_cache_layout(engine.kv_cache.new_empty(shape, device="meta"))


def bytes_per_token(engine) -> int:
    """KV bytes of one token, all ranks together."""
    cache = engine.kv_cache  # rank 0's: [num_blocks, L_0, 2, KV_0, bs, row]
    cell = cache[0].nbytes // (cache.shape[1] * cache.shape[3] * cache.shape[4])  # one layer, head, token
    return cell * num_layers(engine) * num_kv_heads(engine)


def tp_settings(engine) -> dict:
    """What a worker publishes in its registry settings about its ranks."""
    shards = rank_shards(engine)
    return {
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "pipeline_parallel_size": engine.config.pipeline_parallel_size,
        "kv_heads": [s.heads for s in shards],
        "kv_layers": [s.layers for s in shards],
    }


def rank_link(engine) -> RankLink | None:
    """The line to the other ranks' transport (None for one process); start it once per worker."""
    return RankLink(engine.model).start() if _parallel(engine) else None


# -- decode ----------------------------------------------------------------------------------------
def make_receiver(config: TransferConfig, engine, link: RankLink | None) -> KVReceiver:
    """The decode worker's receiver: one per rank, or one taking layer and head slices for one
    process."""
    if link is None:
        return make_local_receiver(config, engine.kv_cache)
    if config.backend != "ucx":
        raise ValueError(
            "a tensor- or pipeline-parallel decode worker receives KV over --kv-transport ucx only"
        )
    return ShardedReceiver(config, engine.kv_cache, link, rank_shards(engine))


def rank_destinations(receiver: KVReceiver) -> list[baton_pb2.RankDestination]:
    """Every rank's descriptor, layers and heads, for the Prefill RPC (empty for one process)."""
    if not isinstance(receiver, ShardedReceiver):
        return []
    return [
        baton_pb2.RankDestination(
            destination=baton_pb2.TransferDescriptor(backend=d.backend, extra_json=json.dumps(d.to_dict())),
            kv_head_start=shard.heads[0],
            kv_head_end=shard.heads[1],
            layer_start=shard.layers[0],
            layer_end=shard.layers[1],
        )
        for d, shard in zip(receiver.descriptors, receiver.shards)
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
            "KV bytes received into each rank's cache (its layers and KV heads; rank as in "
            "tensor- and pipeline-parallel layouts: stage * tensor_parallel_size + tensor-parallel rank).",
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
    ranks: tuple[tuple[str, Shard], ...]
    """Each rank's receiver (``TransferDescriptor`` JSON) and the layers and KV heads it holds."""
    key: str
    """Names the destination among a prefill worker's senders."""


def _rank_shard(r: baton_pb2.RankDestination, whole: Shard) -> Shard:
    """A rank destination's shard; no layers named (a worker of one stage): all of them."""
    layers = (r.layer_start, r.layer_end) if r.layer_end else whole.layers
    return Shard(layers, (r.kv_head_start, r.kv_head_end))


def destination(
    request, parse: Callable[[baton_pb2.TransferDescriptor], TransferDescriptor], whole: Shard
) -> Destination:
    """The decode worker of a Prefill or Connect request (ValueError if malformed); without rank
    destinations, ``destination`` holds the ``whole`` model's KV."""
    own = parse(request.destination)
    if not request.rank_destinations:
        key = json.dumps(own.to_dict(), sort_keys=True)
        return Destination(own, ((key, whole),), key)
    ranks = []
    for r in request.rank_destinations:
        d = parse(r.destination)
        ranks.append((json.dumps(d.to_dict(), sort_keys=True), _rank_shard(r, whole)))
    key = json.dumps([(d, s.layers, s.heads) for d, s in ranks])
    return Destination(own, tuple(ranks), key)


def _route(s: Slice, src: Shard, dst: Shard, descriptor: str) -> Route:
    """The route of one slice: layer ranges only where some layers of either rank stay behind."""
    same_layers = s.layers == src.layers == dst.layers
    whole = same_layers and s.heads == src.heads == dst.heads
    if same_layers:
        return Route(s.src_rank, descriptor, s.src_heads, s.dst_heads, whole)
    return Route(s.src_rank, descriptor, s.src_heads, s.dst_heads, whole, s.src_layers, s.dst_layers)


def routes(own: Sequence[Shard], dest: Destination, whole: Shard) -> list[Route]:
    """Which of this worker's ranks sends which layers and heads to which decode rank (ValueError
    if the decode worker's ranks do not hold every layer and head of the ``whole`` model)."""
    dst = [shard for _, shard in dest.ranks]
    num_layers, num_heads = whole.layers[1], whole.heads[1]
    return [
        _route(s, own[s.src_rank], dst[s.dst_rank], dest.ranks[s.dst_rank][0])
        for s in plan(own, dst, num_layers, num_heads)
    ]


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
