#!/usr/bin/env bash
# Llama 2 70B on NODES nodes x 8 Ascend 910B cards (64 cards for NODES=8): TP=8 inside each node (HCCS), FSDP over
# the nodes (RoCE), full activation checkpointing. Run this script on every node, the same command with its own
# NODE_RANK; MASTER_ADDR is node 0's address, reachable from all nodes.
#
#   node 0:  NODES=8 NODE_RANK=0 MASTER_ADDR=10.0.0.1 DATA=/data/tokens bash examples/multinode.sh
#   node k:  NODES=8 NODE_RANK=k MASTER_ADDR=10.0.0.1 DATA=/data/tokens bash examples/multinode.sh
#
# RDZV=c10d uses torch's c10d rendezvous instead of a fixed node rank (NODE_RANK is then ignored; any node may
# start first; the same RDZV_ID on every node). examples/npu_env.sh exports the Ascend launch environment;
# HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT follow [comm] unless set.
# If HCCL cannot find the right NIC, set HCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME) to the interface name.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to a prepared token directory (titan-npu prepare-data)}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
NODES=${NODES:-2}
PORT=${PORT:-29500}
PER_NODE=${PER_NODE:-8}
source examples/npu_env.sh  # the standard Ascend launch environment

if [ "${RDZV:-static}" = "c10d" ]; then
  LAUNCH=(--nnodes "$NODES" --nproc_per_node "$PER_NODE" --rdzv_backend c10d
          --rdzv_endpoint "$MASTER_ADDR:$PORT" --rdzv_id "${RDZV_ID:-titan-npu}")
else
  : "${NODE_RANK:?set NODE_RANK (0 .. NODES-1) for this node}"
  LAUNCH=(--nnodes "$NODES" --node_rank "$NODE_RANK" --nproc_per_node "$PER_NODE"
          --master_addr "$MASTER_ADDR" --master_port "$PORT")
fi

torchrun "${LAUNCH[@]}" train.py \
    --config "${CONFIG:-configs/llama2_70b.toml}" \
    --data_dir "$DATA" \
    --checkpoint_dir "${CKPT:-checkpoints/llama2_70b}" \
    --log_dir "${LOGS:-logs/llama2_70b}" \
    --parallel.tp_degree "$PER_NODE" --parallel.dp_shard -1 \
    "$@"
