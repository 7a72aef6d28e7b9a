"""Parallelism on torch.distributed: parallel dims and mesh, process group, and how a model is parallelised."""

from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.process_group import destroy_process_group, init_process_group, world_info

__all__ = ["ParallelDims", "destroy_process_group", "init_process_group", "world_info"]
