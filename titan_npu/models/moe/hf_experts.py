"""Routed experts in Hugging Face checkpoints: one tensor per expert (or transformers 5's fused pair) <-> our
stacked [n_experts, ...] tensors, shared by the MoE families whose layers name them `mlp.experts.N.<proj>`
(DeepSeek-V3, GLM-4.5)."""

from __future__ import annotations

import re

import torch

from titan_npu.errors import CheckpointError

StateDict = dict[str, torch.Tensor]

EXPERT_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
PROJECTION_OF_HF = {hf: ours for ours, hf in EXPERT_PROJECTIONS.items()}
OUR_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
HF_FUSED = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)")
# decoder.hf.mapped_hf_name's refusal for a name with no one Hugging Face tensor (a stacked expert one among them)
MOE_UNKNOWN_NAME = ("'{key}' has no single Hugging Face tensor (stacked experts: see stacked_names); export only the "
                    "model's weights")


def stacked_expert_names(key: str, n_experts: int) -> list[str] | None:
    """The Hugging Face names of a stacked expert tensor's experts in order; None for any other tensor."""
    match = OUR_EXPERTS.fullmatch(key)
    if match is None:
        return None
    proj = EXPERT_PROJECTIONS[match.group(2)]
    return [f"model.layers.{match.group(1)}.mlp.experts.{e}.{proj}.weight" for e in range(n_experts)]


class ExpertStacker:
    """Collects a Hugging Face state dict's routed-expert tensors of each layer and stacks them into ours."""

    def __init__(self) -> None:
        self.per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}

    def take(self, layer: str, rest: str, tensor: torch.Tensor, ours: StateDict) -> bool:
        """Whether `rest` (a layer's key past `model.layers.{layer}.`) is a routed expert's; a fused pair is written
        to `ours` at once, a per-expert tensor kept for stack_into."""
        if (expert := HF_EXPERT.fullmatch(rest)) is not None:
            name = PROJECTION_OF_HF[expert.group(2)]
            self.per_expert.setdefault((layer, name), {})[int(expert.group(1))] = tensor
            return True
        if (fused := HF_FUSED.fullmatch(rest)) is not None:
            prefix = f"layers.{layer}.feed_forward.experts"
            if fused.group(1) == "down_proj":
                ours[f"{prefix}.w2"] = tensor
            else:
                ours[f"{prefix}.w1"], ours[f"{prefix}.w3"] = tensor.chunk(2, dim=1)
            return True
        return False

    def stack_into(self, ours: StateDict, n_experts: int) -> None:
        """Each layer's per-expert tensors stacked into `ours`, refusing a layer that lacks some."""
        for (layer, name), tensors in self.per_expert.items():
            if sorted(tensors) != list(range(n_experts)):
                raise CheckpointError(f"layer {layer} holds experts {sorted(tensors)} of its {name} projection but the "
                                      f"config says n_routed_experts={n_experts}; the checkpoint is incomplete")
            ours[f"layers.{layer}.feed_forward.experts.{name}"] = torch.stack([tensors[e] for e in range(n_experts)])
