"""One worker's ranks on torch.distributed, a floor above the engine: ``engine_factory`` builds the
engine a config asks for (one process, or tensor-, pipeline- or data-parallel ranks); the drivers
that rank 0 runs (``driver``, ``pipeline_driver``, ``data_parallel``) and the loops of the other
ranks (``worker``, ``pipeline_worker``); the ranks' launch and messages (``ranks``, ``messages``).
Process groups are ``common/model/rank_group.py``."""
