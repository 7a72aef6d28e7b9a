#!/usr/bin/env bash
# SLURM: `sbatch examples/slurm.sh` (edit the #SBATCH lines). One task per node runs torchrun, which starts one
# process per card; the first node of the allocation hosts the c10d rendezvous.
#SBATCH --job-name=titan-npu
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=logs/slurm-%j.out
#
#   DATA=/data/tokens sbatch examples/slurm.sh
#   DATA=/data/tokens CONFIG=configs/llama3_70b.toml sbatch --nodes 16 examples/slurm.sh --training.max_steps 5000
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
: "${DATA:?set DATA to a prepared token directory (titan-npu prepare-data)}"
PER_NODE=${PER_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${PORT:-29500}
# CANN's environment on every node (the batch shell's environment is copied by srun).
if [ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]; then
  # shellcheck disable=SC1091
  . /usr/local/Ascend/ascend-toolkit/set_env.sh
fi

srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" --nproc_per_node "$PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$PORT" --rdzv_id "$SLURM_JOB_ID" \
    train.py \
    --config "${CONFIG:-configs/llama2_70b.toml}" \
    --data_dir "$DATA" \
    --checkpoint_dir "${CKPT:-checkpoints/$SLURM_JOB_NAME}" \
    --log_dir "${LOGS:-logs/$SLURM_JOB_NAME}" \
    "$@"
