#!/usr/bin/env bash
# Smoke test on NVIDIA GPUs: the fused-kernel checks (SDPA cuDNN / flash / memory-efficient) on one GPU, then the debug
# model on 1 GPU (fused and eager attention) and on GPUS GPUs (default: all, at most 4) with torchrun + NCCL.
# Prints PASS/FAIL per stage.
#
#   bash examples/gpu_smoke.sh
#   GPUS=2 STEPS=50 bash examples/gpu_smoke.sh
#   EXTRA_ARGS="--data_dir /data/tokens" OP_CHECK_ARGS=--quick bash examples/gpu_smoke.sh
#
# Logs go to $OUT (default /tmp/titan_gpu_smoke; a non-empty folder an earlier smoke run did not make is refused).
# The checkout is put on PYTHONPATH: nothing needs installing or fetching.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/titan_gpu_smoke}
export TITAN_DEVICE=cuda
source examples/smoke_common.sh  # STEPS, OP_CHECK_ARGS, EXTRA_ARGS; stage, *_stage, verdict
COUNT=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
GPUS=${GPUS:-$(( COUNT < 4 ? COUNT : 4 ))}

stage versions python -c "
import torch
from titan_npu.device import setup_device
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count(), setup_device().name)"
cat "$OUT/versions.log"

op_check_stage CUDA_VISIBLE_DEVICES
one_device_stages gpu
if [ "$GPUS" -ge 2 ]; then
  torchrun_stage "$GPUS" gpu
else
  echo "SKIP multi-GPU training: $COUNT GPU(s) visible"
fi

verdict gpu
