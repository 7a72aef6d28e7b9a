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
CONFIG=${CONFIG:-configs/llama2_7b.toml}
source examples/restart_common.sh  # CARDS, MAX_RESTARTS, SHUTDOWN_TIMEOUT, DATA, CKPT, LOGS -> TORCHRUN_ARGS, TRAIN_ARGS

torchrun --standalone "${TORCHRUN_ARGS[@]}" train.py "${TRAIN_ARGS[@]}" "$@"
