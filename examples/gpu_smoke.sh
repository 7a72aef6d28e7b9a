#!/usr/bin/env bash
# Smoke test on NVIDIA GPUs: the fused-kernel checks (SDPA flash / memory-efficient) on one GPU, then the debug
# model on 1 GPU (fused and eager attention) and on GPUS GPUs (default: all, at most 4) with torchrun + NCCL.
# Prints PASS/FAIL per stage.
#
#   bash examples/gpu_smoke.sh
#   GPUS=2 STEPS=50 bash examples/gpu_smoke.sh
#   EXTRA_ARGS="--data_dir /data/tokens" OP_CHECK_ARGS=--quick bash examples/gpu_smoke.sh
#
# Logs go to $OUT (default /tmp/titan_gpu_smoke).
set -u
cd "$(dirname "$0")/.."
STEPS=${STEPS:-30}
OP_CHECK_ARGS=${OP_CHECK_ARGS:---bench}  # --quick for small shapes only
EXTRA_ARGS=${EXTRA_ARGS:-}              # more train.py overrides for every run
OUT=${OUT:-/tmp/titan_gpu_smoke}
rm -rf "$OUT" && mkdir -p "$OUT"
export TITAN_DEVICE=cuda
FAILED=0
COUNT=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
GPUS=${GPUS:-$(( COUNT < 4 ? COUNT : 4 ))}

stage() {  # stage <name> <command...>: run, keep the log, print PASS/FAIL and the log's tail on failure
  local name=$1; shift
  echo "== $name"
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "PASS $name"
  else
    echo "FAIL $name (log: $OUT/$name.log)"; tail -n 15 "$OUT/$name.log"; FAILED=$((FAILED + 1))
  fi
}

loss_fell() {  # loss_fell <log_dir>: the run logged finite losses and the last is below the first
  python - "$1" <<'PY'
import json, math, sys
losses = [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"loss"' in l]
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} logged steps")
sys.exit(0 if losses and all(map(math.isfinite, losses)) and losses[-1] < losses[0] else 1)
PY
}

train() {  # train <name> <launcher...> -- <overrides...>
  local name=$1; shift
  "$@" --config configs/debug.toml --training.max_steps "$STEPS" --training.dtype bf16 \
    --metrics.log_interval 10 --metrics.log_dir "$OUT/$name" --checkpoint.dir "$OUT/$name/ckpt" \
    --checkpoint.save_interval "$STEPS" $EXTRA_ARGS && loss_fell "$OUT/$name"
}

stage versions python -c "
import torch
from titan_npu.device import setup_device
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count(), setup_device().name)"
cat "$OUT/versions.log"

stage op_check env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" python examples/op_check.py $OP_CHECK_ARGS
grep -E "^(PASS|FAIL)|bench" "$OUT/op_check.log"
stage train_1gpu_flash train 1gpu_flash python train.py
stage train_1gpu_eager train 1gpu_eager python train.py --model.use_flash_attention false
for log in "$OUT"/train_1gpu_*.log; do echo "$(basename "$log" .log): $(grep "Step $STEPS\]" "$log")"; done
if [ "$GPUS" -ge 2 ]; then
  stage "train_${GPUS}gpu" train "${GPUS}gpu" torchrun --standalone --nproc_per_node "$GPUS" train.py
  grep -h "Step $STEPS\]" "$OUT/train_${GPUS}gpu.log"
else
  echo "SKIP multi-GPU training: $COUNT GPU(s) visible"
fi

if [ "$FAILED" -eq 0 ]; then echo "gpu smoke: PASS"; else echo "gpu smoke: FAIL ($FAILED stage(s))"; exit 1; fi
