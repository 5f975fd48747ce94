"""A pipeline-parallel rank other than 0: loads its stage (and tensor-parallel shard), then runs
what rank 0 sends it.

Started by ``pipeline_driver.launch_pipeline`` as
``python -m baton.common.parallel.pipeline_worker '<json StageSpec>'``, its stdin a pipe from rank 0
(the commands; end of file: rank 0 has gone, so the rank exits) and its stdout a pipe back (one
``ready`` line once the weights are loaded, then one JSON line per ``BusyIntervals``).
"""

from __future__ import annotations

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

    from baton.common.parallel import messages
    from baton.common.parallel.pipeline import Stage, stage_cache
    from baton.common.parallel.worker import _pin

    _pin(spec.cpus)
    stage = Stage(spec)
    model = stage.load()
    if not spec.device.startswith("cuda"):  # built by rank 0 before it started this rank
        from baton.kernels import cpu_ops

        cpu_ops.load()
    os.write(replies, b"ready\n")
    stage.start()
    cache: torch.Tensor | None = None
    with torch.inference_mode():
        while True:
            msg = messages.read(commands, spec.device)
            if msg is None or isinstance(msg, messages.Stop):
                return
            if isinstance(msg, messages.StageForward):
                cache = stage_cache(cache, msg.cache_shape, msg.cache_dtype, model.config, spec.device)
                stage.forward(msg.batches, cache)
            elif isinstance(msg, messages.Logits):
                if stage.last:
                    stage.lm_head(msg.hidden, msg.greedy)
            elif isinstance(msg, messages.BusyIntervals):
                os.write(replies, (json.dumps(list(stage.busy)) + "\n").encode())


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
