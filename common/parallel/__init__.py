"""Ranks of one worker on torch.distributed: process groups (``group``), the tensor-parallel
driver that rank 0 runs and the worker loop of the other ranks (``driver``, ``worker``)."""
