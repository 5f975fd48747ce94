"""A pipeline-parallel rank other than 0: loads its stage (and tensor-parallel shard), then runs
what rank 0 sends it.

Started by ``pipeline_driver.launch_pipeline`` as
``python -m baton.common.parallel.pipeline_worker '<json StageSpec>'``, its stdin a pipe from rank 0
(the commands; end of file: rank 0 has gone, so the rank exits) and its stdout a pipe back (one
``ready`` line once the weights are loaded, then one JSON line per ``BusyIntervals``). A worker's
ranks also run their part of its KV transport (``kv_ranks.RankKV``: this stage's layers, straight
from or into this rank's cache), whose replies take over stdout from its first command on (busy
intervals are for offline engines, which move no KV).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys

from baton.common.parallel.pipeline import StageSpec

log = logging.getLogger(__name__)


def serve(spec: StageSpec, commands: int, replies: int) -> None:
    """Load the stage, report ready on fd ``replies``, meet the other ranks, then run commands
    from fd ``commands`` until a ``Stop`` or end of file."""
    import torch

    from baton.common.parallel import kv_ranks, messages
    from baton.common.parallel.pipeline import Stage
    from baton.common.parallel.ranks import pin_cpus

    pin_cpus(spec.cpus)
    stage = Stage(spec)
    model = stage.load()
    if not spec.device.startswith("cuda"):  # built by rank 0 before it started this rank
        from baton.kernels import cpu_ops

        cpu_ops.load()
    os.write(replies, b"ready\n")
    stage.start()
    cache: torch.Tensor | None = None
    kv = kv_ranks.RankKV(spec.rank, replies)  # this rank's part of the worker's KV transport
    cache_for = functools.partial(_cache_for, config=model.config, device=spec.device)
    with torch.inference_mode(), contextlib.closing(kv):
        while True:
            msg = messages.read(commands, spec.device)
            if msg is None or isinstance(msg, messages.Stop):
                return
            if isinstance(msg, messages.StageForward):
                cache = cache_for(cache, msg)
                stage.forward(msg.batches, cache)
            elif isinstance(msg, kv_ranks.Command):
                cache = kv.handle(msg, cache, cache_for)
            elif isinstance(msg, messages.Logits):
                if stage.last:
                    stage.lm_head(msg.hidden, msg.greedy)
            elif isinstance(msg, messages.BusyIntervals):
                os.write(replies, (json.dumps(list(stage.busy)) + "\n").encode())


def _cache_for(cache, msg, config, device: str):
    """This rank's KV cache for a message naming rank 0's cache shape (``stage_cache``)."""
    from baton.common.parallel.pipeline import stage_cache

    return stage_cache(cache, msg.cache_shape, msg.cache_dtype, config, device)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    spec = StageSpec.from_json(sys.argv[1])
    try:
        serve(spec, sys.stdin.fileno(), sys.stdout.fileno())
    except Exception:
        log.exception("pipeline-parallel rank %d (stage %d) failed", spec.rank, spec.layout.stage(spec.rank))
        sys.exit(1)


if __name__ == "__main__":
    main()
