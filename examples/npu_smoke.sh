#!/usr/bin/env bash
# Smoke test on Ascend NPUs: the fused-kernel checks on one card, then the debug model on 1 card (FlashAttention
# and the eager baseline) and on NPUS cards (default 4) with torchrun + HCCL. Prints PASS/FAIL per stage.
#
#   bash examples/npu_smoke.sh                 # 1 card, then 4
#   NPUS=8 STEPS=50 bash examples/npu_smoke.sh
#   EXTRA_ARGS="--data_dir /data/tokens" OP_CHECK_ARGS=--quick bash examples/npu_smoke.sh
#
# Needs CANN's environment (source /usr/local/Ascend/ascend-toolkit/set_env.sh) and torch + torch_npu of one
# version (docs/npu.md). Logs go to $OUT (default /tmp/titan_npu_smoke; a non-empty folder an earlier smoke run
# did not make is refused).
set -u
cd "$(dirname "$0")/.."
source examples/npu_env.sh  # the standard Ascend launch environment
NPUS=${NPUS:-4}
OUT=${OUT:-/tmp/titan_npu_smoke}
export TITAN_DEVICE=npu
source examples/smoke_common.sh  # STEPS, OP_CHECK_ARGS, EXTRA_ARGS; stage, *_stage, verdict

stage versions python -c "
import torch, torch_npu
from titan_npu.device import setup_device
d = setup_device()
print('torch', torch.__version__, 'torch_npu', torch_npu.__version__, 'devices', torch.npu.device_count(), d.name)"
cat "$OUT/versions.log"
COUNT=$(python -c "import torch, torch_npu; print(torch.npu.device_count())" 2>/dev/null || echo 0)

op_check_stage ASCEND_RT_VISIBLE_DEVICES
one_device_stages card
if [ "$COUNT" -ge "$NPUS" ]; then
  torchrun_stage "$NPUS" card
else
  echo "SKIP train_${NPUS}card: only $COUNT NPU(s) visible"
fi

verdict npu
