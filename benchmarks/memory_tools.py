"""Peak memory per rank with and without bf16 optimizer moments and activation offload, measured on CPU next to
the planner's prediction (the figures docs/planning.md and docs/optimizers.md quote).

    python benchmarks/memory_tools.py                           # configs/debug.toml, FSDP over 2 ranks
    python benchmarks/memory_tools.py --world 1 --seq-len 512 --batch-size 4

Each case builds the model with the trainer's own parallelize and materialise steps (FSDP over --world gloo ranks)
and its optimizer, runs one warm-up step (so gradients and moments exist) and measures, with torch's own CPU
allocator accounting (torch.profiler profile_memory=True: the running sum of allocations and frees,
benchmarks/cp_memory.py's peak_of_step):
  - state: the optimizer's moments, in bytes (the local shards: exact);
  - fwd+bwd: the peak a forward and backward add above parameters, gradients and moments;
  - opt step: the peak the optimizer step adds (bf16 moments: their fp32 working copies);
  - peak/rank: parameters + gradients + moments + the larger of the two, the rank's peak in the planner's terms
    (its collective buffers and runtime reserve, which CPU runs do not have, left out).
Offload on CPU saves nothing (the host is the device), so this benchmark measures the accelerator's timeline with a
hook of its own: the hooks copy each moved tensor into a host pool allocated before the measured step (so it is not
counted, as host memory is not device memory) and copy it back into a fresh tensor for backward (what the device
copy would take). The planner's figures are the same rank's: state_bytes, rank_activations + temporary_bytes with
the host apart from the device.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cp_memory import _free_port, peak_of_step

from titan_npu import ops
from titan_npu.config.loader import load_config
from titan_npu.parallel.activation_offload import ActivationOffload, _Packed

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
CASES = {
    "fp32 moments": [],
    "bf16 moments": ["--optimizer.state_dtype", "bf16"],
    "offload": ["--activation_checkpoint.offload", "true"],
    "offload + bf16 moments": ["--activation_checkpoint.offload", "true", "--optimizer.state_dtype", "bf16"],
    "selective 1/2": ["--activation_checkpoint.mode", "selective"],
    "selective 1/2 + offload": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.offload", "true"],
}


class HostPoolOffload(ActivationOffload):
    """The offload hooks with host memory kept apart from the measured allocations: moved tensors go into a pool
    allocated beforehand, and come back into fresh tensors (the device copies)."""

    pool: torch.Tensor | None = None
    used = 0

    def _move(self, tensor: torch.Tensor) -> _Packed:
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-self.used // 64) * 64
        self.used = start + nbytes
        host = self.pool[start:start + nbytes].view(tensor.dtype).view(tensor.size()).copy_(tensor)
        self.moved_bytes += nbytes
        self.moved_tensors += 1
        return _Packed(host, tensor.device, None)

    def _copy_back(self, packed: _Packed) -> None:
        packed.back = packed.host.clone()


def case_config(config: str, seq_len: int, batch_size: int, extra: list[str]):
    return load_config(config, ["--training.seq_len", str(seq_len), "--training.batch_size", str(batch_size),
                                "--activation_checkpoint.offload_min_bytes", "0", *extra])


def planned(config: str, seq_len: int, batch_size: int, extra: list[str], world: int) -> dict[str, int]:
    """The planner's state, fwd+bwd and optimizer-step bytes of rank 0 of the case, host apart from device."""
    from titan_npu.planner.activations import rank_activations
    from titan_npu.planner.layout import job_from_config, layout_from_config
    from titan_npu.planner.parameters import state_bytes
    from titan_npu.planner.temporaries import temporary_bytes

    cfg = case_config(config, seq_len, batch_size, extra)
    job, layout = job_from_config(cfg), layout_from_config(cfg, world)
    state = state_bytes(job, layout, 0)
    acts = rank_activations(job, layout, 0, "cpu", host_apart=True)
    temp = temporary_bytes(job, layout, 0, acts.extra, "cpu", state.parameters)
    step = acts.saved + temp.during_backward
    return {"state": state.optimizer, "step": step, "opt": temp.optimizer_step,
            "peak": state.parameters + state.gradients + state.optimizer + max(step, temp.optimizer_step)}


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _rank(rank: int, world: int, port: int, config: str, seq_len: int, batch_size: int, extra: list[str],
          out: dict) -> None:
    from titan_npu.models.registry import build_model_args, spec_of
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.parallelize import build_model_parts
    from titan_npu.trainer.optimizer import build_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    ops.set_kernels("reference")  # the ops the planner's activation model describes
    try:
        cfg = case_config(config, seq_len, batch_size, extra)
        dims = ParallelDims.from_config(cfg.parallel, world)
        if world > 1:
            dims.build_mesh("cpu")
        args = build_model_args(cfg.model)
        _, (model,) = build_model_parts(spec_of(args), cfg, dims, args, torch.device("cpu"))
        optimizer = build_optimizer([model], cfg.optimizer, "cpu")
        offload = getattr(model, "activation_offload", None)
        if offload is not None:
            offload.__class__ = HostPoolOffload
        torch.manual_seed(rank)
        tokens = torch.randint(0, args.vocab_size, (batch_size, seq_len + 1))

        def forward_backward() -> None:
            if offload is not None:
                offload.used = 0
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()

        if offload is not None:  # a generous pool for the warm-up pass, which tells what a pass moves
            offload.pool = torch.empty(1 << 30, dtype=torch.uint8)
        forward_backward()
        optimizer.step()
        if offload is not None:  # a pool of exactly what a pass moves, allocated before the measured step
            needed, offload.pool = offload.used, None
            offload.pool = torch.empty(needed, dtype=torch.uint8)
        state = _local_bytes(v for s in optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor) and v.ndim > 0)
        step = peak_of_step(forward_backward)
        opt = peak_of_step(optimizer.step)
        params = _local_bytes(model.parameters())
        grads = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        result = {"state": state, "step": step, "opt": opt, "peak": params + grads + state + max(step, opt)}
        results = [None] * world
        dist.all_gather_object(results, result)
        if rank == 0:
            out["ranks"] = results
    finally:
        dist.destroy_process_group()


def measure(config: str, seq_len: int, batch_size: int, extra: list[str], world: int) -> dict[str, int]:
    """Rank 0's measured figures of one case (world processes)."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(world, _free_port(), config, seq_len, batch_size, extra, out), nprocs=world, join=True)
        return dict(out["ranks"][0])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "debug.toml"))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args(argv)
    print(f"{Path(a.config).name}, seq {a.seq_len}, micro-batch {a.batch_size}, FSDP over {a.world} rank(s); rank 0, "
          "MiB measured / planned (CPU allocator accounting; offload with host memory apart)")
    print(f"{'case':<24} {'state':>15} {'fwd+bwd':>15} {'opt step':>15} {'peak/rank':>15}  planned/measured")
    for name, extra in CASES.items():
        got = measure(a.config, a.seq_len, a.batch_size, extra, a.world)
        want = planned(a.config, a.seq_len, a.batch_size, extra, a.world)
        cells = "".join(f" {got[k] / MiB:>7.1f}/{want[k] / MiB:<7.1f}" for k in ("state", "step", "opt", "peak"))
        print(f"{name:<24}{cells}  {want['peak'] / got['peak']:.3f}")


if __name__ == "__main__":
    main()
