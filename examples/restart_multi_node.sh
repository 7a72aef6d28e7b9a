#!/usr/bin/env bash
# A long multi-node run that comes back by itself. Run this same command on every node (no node rank: the c10d
# rendezvous numbers the nodes). When any process fails, torchrun on every node stops its processes, the nodes meet
# again and all processes restart from the latest complete checkpoint, up to MAX_RESTARTS times. A node that
# reboots rejoins when its command is started again (by the scheduler, systemd or a person) within the rendezvous
# timeout; until then the other nodes wait. checkpoint.dir must be on storage every node sees.
#
#   on every node:  NODES=8 MASTER_ADDR=10.0.0.1 DATA=/data/tokens bash examples/restart_multi_node.sh
#   CPU try-out on one machine, two "nodes" of 2 processes, each in its own shell:
#     TITAN_DEVICE=cpu NODES=2 CARDS=2 MASTER_ADDR=127.0.0.1 CONFIG=configs/debug.toml bash examples/restart_multi_node.sh
#
# MASTER_ADDR hosts the rendezvous: if that node itself goes down the job ends, and the scheduler's relaunch (SLURM
# --requeue, a Kubernetes restartPolicy) of the same command resumes it. docs/reliability.md has the details.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the node that hosts the rendezvous (reachable from all nodes)}"
NODES=${NODES:-2}
PORT=${PORT:-29500}
JOIN_TIMEOUT=${JOIN_TIMEOUT:-1800}  # seconds the nodes wait for a missing one (a rebooting node) at each rendezvous
CONFIG=${CONFIG:-configs/llama2_70b.toml}
source examples/restart_common.sh  # CARDS, MAX_RESTARTS, SHUTDOWN_TIMEOUT, DATA, CKPT, LOGS -> TORCHRUN_ARGS, TRAIN_ARGS
# A store of its own for every rendezvous round: a restart that a node's arrival causes is not counted on the other
# nodes, so the restart count that scopes the process group's keys in torchrun's shared store can differ by node.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

torchrun --nnodes "$NODES" "${TORCHRUN_ARGS[@]}" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$PORT" --rdzv_id "${RDZV_ID:-titan-npu-$NAME}" \
    --rdzv_conf "join_timeout=$JOIN_TIMEOUT" \
    train.py "${TRAIN_ARGS[@]}" "$@"
