#!/usr/bin/env bash
# One node with 8 Ascend 910B cards (64 GB). LAYOUT picks how the 8 cards are used:
#   fsdp  (default) Llama 2 13B, FSDP over 8 cards, selective AC      (~54 GiB per card at seq 4096)
#   tp2   Llama 2 13B, TP=2 inside card pairs x FSDP 4, no AC        (~52 GiB per card)
#   3d    Llama 2 13B, TP=2 x PP=2 (1F1B, 8 microbatches) x FSDP 2  (long sequences: raise --training.seq_len)
#
#   DATA=/data/tokens bash examples/npu_1node_8cards.sh
#   DATA=/data/tokens LAYOUT=3d bash examples/npu_1node_8cards.sh --training.seq_len 8192
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/npu_env.sh  # the standard Ascend launch environment
: "${DATA:?set DATA to a prepared token directory (titan-npu prepare-data)}"
export ASCEND_RT_VISIBLE_DEVICES=${CARDS:-0,1,2,3,4,5,6,7}
case "${LAYOUT:-fsdp}" in
  fsdp) LAYOUT_ARGS=(--parallel.dp_shard -1 --parallel.tp_degree 1 --parallel.pp_degree 1
                     --activation_checkpoint.mode selective) ;;
  tp2)  LAYOUT_ARGS=(--parallel.dp_shard -1 --parallel.tp_degree 2 --parallel.pp_degree 1
                     --activation_checkpoint.mode none) ;;
  # Under PP, batch_size x gradient_accumulation_steps sequences are split into pp_microbatches microbatches.
  3d)   LAYOUT_ARGS=(--parallel.dp_shard -1 --parallel.tp_degree 2 --parallel.pp_degree 2
                     --parallel.pp_schedule 1F1B --parallel.pp_microbatches 8
                     --training.batch_size 1 --training.gradient_accumulation_steps 16) ;;
  *) echo "LAYOUT must be fsdp, tp2 or 3d" >&2; exit 2 ;;
esac

torchrun --standalone --nproc_per_node 8 --master_port "${PORT:-29500}" train.py \
    --config configs/llama2_13b.toml \
    --data_dir "$DATA" \
    --checkpoint_dir "${CKPT:-checkpoints/llama2_13b}" \
    --log_dir "${LOGS:-logs/llama2_13b}" \
    "${LAYOUT_ARGS[@]}" "$@"
