#!/usr/bin/env bash
# A long run on one node that comes back by itself. torchrun restarts every process after a failure (a process
# killed, an HCCL error, a hang ended by the watchdog) up to MAX_RESTARTS times, and each restart resumes from the
# latest complete checkpoint (checkpoint.resume = auto, the default) with no flag changes: at most the steps since
# the last checkpoint are lost. Running the same command again after the job has ended resumes the same way.
#
#   DATA=/data/tokens bash examples/restart_single_node.sh
#   CARDS=4 MAX_RESTARTS=10 CONFIG=configs/llama3_8b.toml DATA=/data/tokens bash examples/restart_single_node.sh
#   TITAN_DEVICE=cpu CARDS=2 CONFIG=configs/debug.toml bash examples/restart_single_node.sh   # a CPU try-out
#
# SIGTERM or Ctrl-C (a scheduler's preemption) makes every rank finish its step, save a checkpoint and exit 0;
# torchrun waits SHUTDOWN_TIMEOUT seconds for that before it kills the processes, so make it longer than a save.
# docs/reliability.md says what survives what and how to size timeouts and disk.
set -euo pipefail
cd "$(dirname "$0")/.."
CARDS=${CARDS:-8}
MAX_RESTARTS=${MAX_RESTARTS:-3}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-600}
CONFIG=${CONFIG:-configs/llama2_7b.toml}
NAME=$(basename "${CONFIG%.*}")

# A rendezvous store of its own for every restart: with the store torchrun shares by default, a restarted process
# can read a dead peer's address and the process group never forms again (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

SHUTDOWN=()
if torchrun --help 2>/dev/null | grep -q -- '--shutdown-timeout'; then  # torch >= 2.6
  SHUTDOWN=(--shutdown-timeout "$SHUTDOWN_TIMEOUT")
fi
DATA_ARGS=()
if [ -n "${DATA:-}" ]; then
  DATA_ARGS=(--data_dir "$DATA")
fi

torchrun --standalone --nproc_per_node "$CARDS" --max-restarts "$MAX_RESTARTS" ${SHUTDOWN[@]+"${SHUTDOWN[@]}"} \
    train.py \
    --config "$CONFIG" \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
    --checkpoint_dir "${CKPT:-checkpoints/$NAME}" \
    --log_dir "${LOGS:-logs/$NAME}" \
    --checkpoint.resume auto \
    "$@"
