"""MXFP4 expert weights (the published gpt-oss checkpoints) dequantised on import.

A quantised tensor is stored as `<name>_blocks` uint8 [..., rows, G, 16] (two 4-bit E2M1 codes per byte, the low
nibble first: 32 values per group) and `<name>_scales` uint8 [..., rows, G] (one E8M0 exponent per group, biased by
127). Value = E2M1 code's number x 2^(scale - 127). The result is transposed as transformers' dequantiser returns it
(integrations/mxfp4.py: convert_moe_packed_tensors), which is the layout of the unquantised Hugging Face parameter.
"""

from __future__ import annotations

import torch

from titan_npu.errors import CheckpointError

# The 16 numbers an E2M1 code (sign, 2 exponent bits, 1 mantissa bit) stands for, by code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [E, rows, G, B] uint8 and scales [E, rows, G] -> [E, G * B * 2, rows] in `dtype`."""
    if blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                              f"(blocks must be scales' shape plus one dim of packed bytes); the checkpoint is damaged")
    blocks = blocks.to(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1))
    return values.flatten(-2).transpose(1, 2).contiguous()
