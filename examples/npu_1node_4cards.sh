#!/usr/bin/env bash
# Llama 2 7B on one node with 4 Ascend 910B cards (64 GB): FSDP over the 4 cards (HCCL), bf16, selective AC.
# Memory per card (titan-npu plan): ~25 GiB of fp32 weights/grads/Adam state + ~13 GiB of activations at
# batch_size 1 x seq 4096 -> ~46 GiB of 64. Global batch = 1 x 16 (accumulation) x 4 cards = 64 sequences.
#
#   DATA=/data/tokens bash examples/npu_1node_4cards.sh
#   DATA=/data/tokens CARDS=0,1,2,3 PORT=29500 bash examples/npu_1node_4cards.sh --training.max_steps 1000
#
# Needs CANN's environment (. /usr/local/Ascend/ascend-toolkit/set_env.sh) and torch + torch_npu of one version.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/npu_env.sh  # the standard Ascend launch environment
: "${DATA:?set DATA to a prepared token directory (titan-npu prepare-data)}"
export ASCEND_RT_VISIBLE_DEVICES=${CARDS:-0,1,2,3}
NPROC=$(awk -F, '{print NF}' <<<"$ASCEND_RT_VISIBLE_DEVICES")

torchrun --standalone --nproc_per_node "$NPROC" --master_port "${PORT:-29500}" train.py \
    --config configs/llama2_7b.toml \
    --data_dir "$DATA" \
    --checkpoint_dir "${CKPT:-checkpoints/llama2_7b}" \
    --log_dir "${LOGS:-logs/llama2_7b}" \
    --parallel.dp_shard -1 --parallel.tp_degree 1 --parallel.pp_degree 1 \
    "$@"
