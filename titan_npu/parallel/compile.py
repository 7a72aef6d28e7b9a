"""torch.compile per transformer block: every block has the same code, so one compiled graph serves them all.

Compiling blocks in place (nn.Module.compile) rather than wrapping them keeps parameter names unchanged, so
checkpoints and FSDP see the same model with or without compile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from titan_npu.config.schema import CompileConfig



def apply_compile(model: nn.Module, cfg: CompileConfig, inside_checkpoint: bool = False) -> int:
    """Compile each block of model.layers with cfg.backend; returns how many blocks were compiled.

    inside_checkpoint compiles the module inside an activation-checkpoint wrapper instead of the wrapper.
    """
    from titan_npu import ops

    # The op dispatch imports the vendor kernel modules on first use; doing it now keeps the import out of the
    # trace (an import there is a graph break, and a graph break inside a tensor-parallel block breaks backward).
    ops.available_backends()
    count = 0
    for block in model.layers.values():
        if block is None:
            continue
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        if inner is not None and inside_checkpoint:
            # Compiling a checkpointed tensor-parallel block fails inside torch (a device mesh among the tensors
            # saved for backward); compiling what the checkpoint wraps works, with recompute in eager.
            inner.compile(backend=cfg.backend)
        else:
            block.compile(backend=cfg.backend)
        count += 1
    return count
