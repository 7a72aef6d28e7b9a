"""Parallelism on torch.distributed: parallel dims and mesh, layout checks, process group, FSDP / TP / PP,
activation checkpointing and compile, applied to a model from outside it."""

from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.layout import validate_layout
from titan_npu.parallel.process_group import destroy_process_group, init_process_group, world_info

__all__ = ["ParallelDims", "destroy_process_group", "init_process_group", "validate_layout", "world_info"]
