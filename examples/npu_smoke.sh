#!/usr/bin/env bash
# Smoke test on Ascend NPUs: the fused-kernel checks on one card, then the debug model on 1 card (FlashAttention
# and the eager baseline) and on NPUS cards (default 4) with torchrun + HCCL. Prints PASS/FAIL per stage.
#
#   bash examples/npu_smoke.sh                 # 1 card, then 4
#   NPUS=8 STEPS=50 bash examples/npu_smoke.sh
#   EXTRA_ARGS="--data_dir /data/tokens" OP_CHECK_ARGS=--quick bash examples/npu_smoke.sh
#
# Needs CANN's environment (source /usr/local/Ascend/ascend-toolkit/set_env.sh) and torch + torch_npu of one
# version (docs/npu.md). Logs go to $OUT (default /tmp/titan_npu_smoke).
set -u
cd "$(dirname "$0")/.."
NPUS=${NPUS:-4}
STEPS=${STEPS:-30}
OP_CHECK_ARGS=${OP_CHECK_ARGS:---bench}  # --quick for small shapes only
EXTRA_ARGS=${EXTRA_ARGS:-}              # more train.py overrides for every run
OUT=${OUT:-/tmp/titan_npu_smoke}
rm -rf "$OUT" && mkdir -p "$OUT"
export TITAN_DEVICE=npu
FAILED=0

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
import torch, torch_npu
from titan_npu.device import setup_device
d = setup_device()
print('torch', torch.__version__, 'torch_npu', torch_npu.__version__, 'devices', torch.npu.device_count(), d.name)"
cat "$OUT/versions.log"
COUNT=$(python -c "import torch, torch_npu; print(torch.npu.device_count())" 2>/dev/null || echo 0)

stage op_check env ASCEND_RT_VISIBLE_DEVICES="${ASCEND_RT_VISIBLE_DEVICES:-0}" python examples/op_check.py $OP_CHECK_ARGS
grep -E "^(PASS|FAIL)|bench" "$OUT/op_check.log"
stage train_1card_flash train 1card_flash python train.py
stage train_1card_eager train 1card_eager python train.py --model.use_flash_attention false
for log in "$OUT"/train_1card_*.log; do echo "$(basename "$log" .log): $(grep "Step $STEPS\]" "$log")"; done
if [ "$COUNT" -ge "$NPUS" ]; then
  stage "train_${NPUS}card" train "${NPUS}card" torchrun --standalone --nproc_per_node "$NPUS" train.py
  grep -h "Step $STEPS\]" "$OUT/train_${NPUS}card.log"
else
  echo "SKIP train_${NPUS}card: only $COUNT NPU(s) visible"
fi

if [ "$FAILED" -eq 0 ]; then echo "npu smoke: PASS"; else echo "npu smoke: FAIL ($FAILED stage(s))"; exit 1; fi
