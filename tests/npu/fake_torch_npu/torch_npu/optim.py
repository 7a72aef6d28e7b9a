"""torch_npu.optim of the fake: the pinned wheel's own NpuFusedOptimizerBase and NpuFusedAdamW, executed as shipped.

Their step() rewires parameter storage with npu_change_data_ptr, which CPU tensors cannot do; construction,
zero_grad and the parameter dtype check run here exactly as on a card.
"""

from __future__ import annotations

import sys
import types

import npu_wheel

_utils = types.ModuleType("torch_npu.utils")
_utils._error_code = npu_wheel.error_code_module()
sys.modules["torch_npu.utils"] = _utils
sys.modules["torch_npu.utils._error_code"] = _utils._error_code
_combine = npu_wheel.load_module("torch_npu/utils/combine_tensors.py", "torch_npu.utils.combine_tensors")
_utils.npu_combine_tensors = _combine.npu_combine_tensors
_utils.get_part_combined_tensor = _combine.get_part_combined_tensor

NpuFusedOptimizerBase = npu_wheel.load_module(
    "torch_npu/optim/npu_fused_optim_base.py", "torch_npu.optim.npu_fused_optim_base").NpuFusedOptimizerBase
NpuFusedAdamW = npu_wheel.load_module(
    "torch_npu/optim/npu_fused_adamw.py", "torch_npu.optim.npu_fused_adamw").NpuFusedAdamW
