"""A config's initial weights as a checkpoint that any layout starts from (`titan-npu init-weights`).

Training already starts every layout from the same weights for a seed (models/init.py). A seed checkpoint pins
them beyond one code version: runs started from it (`checkpoint.initial_load = DIR`) share their first weights
even if the initialisation code, its tile size or the model's init table change later. It is a step-0
checkpoint directory holding the model only, in fp32, loaded through the ordinary initial_load path (DCP reads
each rank's shard). Run under torchrun with a sharded layout for a large model: each rank draws and writes only
its own shard.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
import warnings
from pathlib import Path

import torch.distributed as dist

from titan_npu import outputs
from titan_npu.atomic import as_os_error
from titan_npu.checkpoint import storage
from titan_npu.config.schema import JobConfig
from titan_npu.errors import CheckpointError

log = logging.getLogger("titan_npu")

SEED_COMMAND = "init-weights"  # the command whose marker a seed checkpoint carries


def create_seed_checkpoint(cfg: JobConfig, output: str | Path, overwrite: bool = False) -> int:
    """Write the initial weights of `cfg` (model and training.seed) to the checkpoint directory `output`.

    Collective under torchrun (every rank writes its shard); returns the number of parameters written.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titan_npu.config.loader import save_config
    from titan_npu.device import setup_device
    from titan_npu.models.registry import build_model_args, spec_of
    from titan_npu.parallel import ParallelDims, destroy_process_group, init_process_group, validate_layout
    from titan_npu.parallel.parallelize import build_model_parts

    output = Path(output)
    # Replaces only an earlier seed checkpoint holding nothing else (its marker lists its files), never a training
    # checkpoint, a run's checkpoint.dir or a folder of the user's files.
    outputs.check_folder_output("--output", output, SEED_COMMAND, overwrite, CheckpointError, "seed checkpoint",
                                allow="checkpoint")
    tmp = output.parent / f"{output.name}{storage.TMP_SUFFIX}"  # written first; only an unfinished seed is removed
    if (tmp.exists() or tmp.is_symlink()) and outputs.read_marker(tmp, SEED_COMMAND) is None:
        raise CheckpointError(f"--output {output}: {tmp}, where init-weights writes first, holds files it did not "
                              "write; move it away or choose another path")
    device = setup_device(cfg.parallel.backend)
    rank, world_size = init_process_group(device, cfg.comm)
    try:
        dims = ParallelDims.from_config(cfg.parallel, world_size)
        if world_size > 1:
            dims.build_mesh(device.type, cfg.comm.timeout_s)
        model_args = build_model_args(cfg.model)
        validate_layout(dims, model_args, cfg)
        # fp32 whatever training.dtype says: the weights a run's fp32 master copy (or a pure bf16 cast) starts from.
        _, parts = build_model_parts(spec_of(model_args), cfg, dims, model_args, device.torch_device)
        state = {}
        for part in parts:
            state.update(get_model_state_dict(part))
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            outputs.write_marker(tmp, SEED_COMMAND, [])  # an interrupted write is ours to remove
            save_config(cfg, tmp / storage.CONFIG_FILE)
        if world_size > 1:
            dist.barrier()
        with warnings.catch_warnings():
            # one process saves without a process group on purpose: DCP's warning that it assumes so is noise
            warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or "
                                    r"uninitialized", category=UserWarning)
            try:
                dcp.save({"model": state}, checkpoint_id=str(tmp), no_dist=world_size == 1)
            except BaseException as e:  # no space, read-only, ...: said of --output, and no half checkpoint left
                translated = as_os_error(e, output)  # before the temporary goes: it may be what filled the disk
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                if translated is e:
                    raise
                raise translated from e
        if rank == 0:
            info = {
                "step": 0,
                "tokens_seen": 0,
                "seed": cfg.training.seed,
                "world_size": world_size,
                "layout": dims.describe(),
                "model_args": dataclasses.asdict(model_args),
                "export_dtype": cfg.checkpoint.export_dtype,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            # the marker lists checkpoint.json too, which publish writes next
            outputs.write_marker(tmp, SEED_COMMAND, [p.name for p in tmp.iterdir()] + [storage.INFO_FILE])
            if output.exists():
                storage.remove_checkpoint(output)
            storage.publish(tmp, output, info)
        if world_size > 1:
            dist.barrier()
        return model_args.num_params()
    finally:
        destroy_process_group()
