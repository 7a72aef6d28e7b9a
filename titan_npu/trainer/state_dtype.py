"""Adam moments stored in bf16 (optimizer.state_dtype) with the update computed in fp32 by torch's own Adam.

Each step upcasts a chunk of the moments to fp32, runs torch.optim.adam.adam on the fp32 copies (fused, foreach or
for-loop, as the group asks; a found_inf flag leaves them as they were), and stores them back rounded to the nearest
bf16 value (ties to even: Tensor.copy_'s rounding). Round-to-nearest keeps resume exact and the run deterministic;
the moments are running averages, so the rounding error (2^-9 relative) does not accumulate the way it would in the
parameters, which stay fp32. Only parameters held in fp32 take the narrower moments: pure bf16 parameters
(training.mixed_precision = false) already have bf16 moments.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Elements of moments upcast at once: two fp32 working copies of 2^26 elements are 512 MiB beside the state.
CHUNK_ELEMENTS = 2**26
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def moment_dtype(param: torch.Tensor, state_dtype: torch.dtype) -> torch.dtype:
    """The dtype `param`'s moments are kept in: state_dtype for an fp32 parameter, the parameter's own otherwise."""
    return state_dtype if param.dtype == torch.float32 else param.dtype


def _create_state(optimizer: torch.optim.Adam, group: dict, state_dtype: torch.dtype) -> None:
    """The state of parameters stepped for the first time, created as torch's Adam does but with narrow moments
    (made here so that the fp32 moments torch would create never exist)."""
    for p in group["params"]:
        state = optimizer.state[p]
        if p.grad is None or len(state):
            continue
        on_device = group["capturable"] or group["fused"]
        state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
                         if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
        dtype = moment_dtype(p, state_dtype)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)


def narrow_moments(optimizer: torch.optim.Optimizer) -> None:
    """Put the moments back into their dtype after Optimizer.load_state_dict, which casts every floating state to
    its parameter's dtype (the saved bf16 values widen exactly, so this restores them bit for bit)."""
    for p, state in optimizer.state.items():
        for key in MOMENTS:
            if key in state:
                state[key] = state[key].to(moment_dtype(p, optimizer.state_dtype))


def _chunks(params: list[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) ranges of `params` holding at most CHUNK_ELEMENTS elements each (one at least)."""
    ranges, start, size = [], 0, 0
    for i, p in enumerate(params):
        if i > start and size + p.numel() > CHUNK_ELEMENTS:
            ranges.append((start, i))
            start, size = i, 0
        size += p.numel()
    if start < len(params):
        ranges.append((start, len(params)))
    return ranges


@torch.no_grad()
def adam_group_step(optimizer: torch.optim.Adam, group: dict, state_dtype: torch.dtype) -> None:
    """One Adam/AdamW step of `group` whose moments are held in state_dtype, computed in fp32."""
    _create_state(optimizer, group, state_dtype)
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
    has_complex = optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    beta1, beta2 = group["betas"]
    for start, end in _chunks(params):
        stored = [exp_avgs[start:end], exp_avg_sqs[start:end], max_exp_avg_sqs[start:end]]
        # In the parameter's dtype: fp32 for the parameters whose moments are narrower, the moments themselves else.
        wide = [[t.to(p.dtype) for t, p in zip(moments, params[start:end])] for moments in stored]
        adam(params[start:end], grads[start:end], *wide, steps[start:end], amsgrad=group["amsgrad"],
             has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
             differentiable=group["differentiable"], fused=group["fused"],
             grad_scale=getattr(optimizer, "grad_scale", None), found_inf=getattr(optimizer, "found_inf", None),
             decoupled_weight_decay=group["decoupled_weight_decay"])
        for narrow, fp32 in zip(stored, wide):
            for dst, src in zip(narrow, fp32):
                if dst is not src:  # moments in the parameter's own dtype were updated in place
                    dst.copy_(src)


def closure_loss(closure) -> torch.Tensor | None:
    """An optimizer step's closure evaluated with gradients on (None without one), as torch's optimizers do."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class StateDtypeAdam(torch.optim.Adam):
    """torch's Adam / AdamW (decoupled_weight_decay) with its moments held in state_dtype (see the module)."""

    def __init__(self, params, *, state_dtype: torch.dtype = torch.bfloat16, **adam_kwargs) -> None:
        super().__init__(params, **adam_kwargs)
        self.state_dtype = state_dtype
        self.register_load_state_dict_post_hook(narrow_moments)

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group, moments upcast to fp32 for the update and stored back rounded."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            adam_group_step(self, group, self.state_dtype)
        return loss
