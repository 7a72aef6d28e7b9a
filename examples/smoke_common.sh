# Sourced by examples/gpu_smoke.sh and examples/npu_smoke.sh (not run on its own), in the repository root with
# TITAN_DEVICE and OUT set: the settings both smoke tests share, a fresh $OUT, and their stages.
STEPS=${STEPS:-30}
OP_CHECK_ARGS=${OP_CHECK_ARGS:---bench}  # --quick for small shapes only
EXTRA_ARGS=${EXTRA_ARGS:-}              # more train.py overrides for every run
# Every stage imports this checkout's titan_npu (examples/op_check.py too, whose own folder is not the root),
# installed or not: nothing is fetched from a network.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# $OUT is emptied only if a smoke test made it (it holds SMOKE_MARKER); any other non-empty path is left alone.
SMOKE_MARKER=.titan_smoke_logs
if [ -e "$OUT/$SMOKE_MARKER" ]; then
  rm -rf "$OUT"
elif [ -e "$OUT" ] && { [ ! -d "$OUT" ] || [ -n "$(ls -A "$OUT")" ]; }; then
  echo "OUT=$OUT exists and was not made by a smoke test; set OUT to a new or empty directory" >&2
  exit 2
fi
mkdir -p "$OUT" && touch "$OUT/$SMOKE_MARKER"
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

op_check_stage() {  # op_check_stage <visible-devices variable>: the fused-kernel checks on one device (default 0)
  local var=$1
  stage op_check env "$var=${!var:-0}" python examples/op_check.py $OP_CHECK_ARGS
  grep -E "^(PASS|FAIL)|bench" "$OUT/op_check.log"
}

one_device_stages() {  # one_device_stages <unit>: the debug model on one device, fused then eager attention
  local unit=$1
  stage "train_1${unit}_flash" train "1${unit}_flash" python train.py
  stage "train_1${unit}_eager" train "1${unit}_eager" python train.py --model.use_flash_attention false
  for log in "$OUT"/train_1"${unit}"_*.log; do echo "$(basename "$log" .log): $(grep "Step $STEPS\]" "$log")"; done
}

torchrun_stage() {  # torchrun_stage <n> <unit>: the debug model on n devices with torchrun
  local name="$1$2"
  stage "train_$name" train "$name" torchrun --standalone --nproc_per_node "$1" train.py
  grep -h "Step $STEPS\]" "$OUT/train_$name.log"
}

verdict() {  # verdict <what>: one summary line; exit 1 if any stage failed
  if [ "$FAILED" -eq 0 ]; then echo "$1 smoke: PASS"; else echo "$1 smoke: FAIL ($FAILED stage(s))"; exit 1; fi
}
