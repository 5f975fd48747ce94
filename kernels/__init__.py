"""Attention kernels: the CPU path the engine runs, Triton kernels for GPUs, torch references."""
