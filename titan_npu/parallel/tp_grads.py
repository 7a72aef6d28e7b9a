"""Tensor-parallel gradients in their parameters' layout when no data-parallel wrapper puts them there.

DTensor's backward picks each gradient's placements by its own sharding rules, which need not be the parameter's:
- the vocab-parallel embedding (weight Shard(0)): embedding_dense_backward has no row-wise rule, so the gradient
  is computed Replicate, full [vocab, dim] on every rank;
- sequence-parallel norm weights (Replicate): their gradient is a sum over the sequence shards, Partial(sum).
FSDP / replicate redistribute every gradient to the parameter's tensor-parallel placements in their post-backward,
so those layouts are right. Under pure TP (tp > 1, one data-parallel rank) nothing did, and the gradients kept
those placements: a full-size embedding gradient per rank (and optimizer arithmetic on it), pending partial sums.

The hooks live on the parameters' autograd identity, which `to_empty` replaces (a hook registered on a meta
parameter never fires), so parallelize only requests them and materialize installs them on the real parameters.
"""

from __future__ import annotations

from torch import nn

_REQUESTED = "_titan_grads_to_param_layout"


def request_grads_in_param_layout(model: nn.Module) -> None:
    """Mark a tensor-parallel model that no data-parallel wrapper follows: its materialisation installs the hooks."""
    setattr(model, _REQUESTED, True)


def install_requested_grad_hooks(model: nn.Module) -> int:
    """Install the hooks if the model asked for them (once); call when its parameters are final. Returns how many."""
    if not getattr(model, _REQUESTED, False):
        return 0
    setattr(model, _REQUESTED, False)
    return keep_grads_in_param_layout(model)


def keep_grads_in_param_layout(model: nn.Module) -> int:
    """Make every DTensor parameter's gradient arrive in the parameter's mesh and placements; returns how many.

    A hook on the parameter converts each backward's gradient before it is accumulated, so accumulation adds
    like to like: Replicate -> Shard is a local slice (no communication, the full-size gradient is freed at once),
    Partial -> Replicate an all-reduce of a norm weight (dim elements).
    """
    count = 0
    for p in model.parameters():
        if not p.requires_grad or not hasattr(p, "placements"):
            continue
        # The hook keeps the mesh and placements, not the parameter (no reference cycle through the hook).
        p.register_hook(_to_layout(p.device_mesh, tuple(p.placements)))
        count += 1
    return count


def _to_layout(mesh, placements: tuple):
    def hook(grad):
        if not hasattr(grad, "placements") or (grad.device_mesh == mesh and tuple(grad.placements) == placements):
            return grad
        return grad.redistribute(mesh, placements)

    return hook
