#!/usr/bin/env bash
# Every parallel layout on a CPU (gloo) with a tiny model: each run starts from the weights of the same
# training.seed (they do not depend on the layout) and reads the same 4 sequences per step (batch_size x
# data-parallel degree = 4), so all of them print the same losses. Runs 2- and 4-process torchrun jobs; logs under
# $OUT.
#
#   bash examples/cpu_layouts.sh            # 20 steps each
#   STEPS=50 OUT=/tmp/layouts bash examples/cpu_layouts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-20}
OUT=${OUT:-/tmp/titan_npu_layouts}
mkdir -p "$OUT"
export TITAN_DEVICE=cpu
COMMON=(--config configs/debug.toml --model.dim 64 --model.n_layers 4 --model.n_heads 4 --model.n_kv_heads 2
        --training.seq_len 64 --training.max_steps "$STEPS" --training.dtype fp32 --training.seed 0
        --checkpoint.enable false --metrics.log_interval 5)

run() {  # run <name> <processes> <overrides...>
  local name=$1 nproc=$2; shift 2
  echo "== $name ($nproc processes)"
  torchrun --standalone --nproc_per_node "$nproc" train.py "${COMMON[@]}" --metrics.log_dir "$OUT/$name" "$@" \
    2>&1 | grep -E '^(layout|pipeline|\[Step)'
}

run fsdp 2 --training.batch_size 2
run dp_replicated 2 --training.batch_size 2 --parallel.fsdp false
run tp 2 --training.batch_size 4 --parallel.tp_degree 2
run pp_1f1b 2 --training.batch_size 4 --parallel.pp_degree 2 --parallel.pp_schedule 1F1B
run pp_interleaved 2 --training.batch_size 4 --parallel.pp_degree 2 --parallel.pp_schedule Interleaved1F1B
run fsdp_tp 4 --training.batch_size 2 --parallel.tp_degree 2
run hsdp 4 --training.batch_size 1 --parallel.dp_replicate 2
run tp_pp 4 --training.batch_size 4 --parallel.tp_degree 2 --parallel.pp_degree 2
