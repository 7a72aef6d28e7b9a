# Sourced by examples/restart_single_node.sh and examples/restart_multi_node.sh (not run on its own), in the
# repository root with CONFIG set: the restart settings both share and the arguments they pass to torchrun and
# train.py (TORCHRUN_ARGS, TRAIN_ARGS).
CARDS=${CARDS:-8}
MAX_RESTARTS=${MAX_RESTARTS:-3}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-600}
NAME=$(basename "${CONFIG%.*}")

TORCHRUN_ARGS=(--nproc_per_node "$CARDS" --max-restarts "$MAX_RESTARTS")
if torchrun --help 2>/dev/null | grep -q -- '--shutdown-timeout'; then  # torch >= 2.6
  TORCHRUN_ARGS+=(--shutdown-timeout "$SHUTDOWN_TIMEOUT")
fi
TRAIN_ARGS=(--config "$CONFIG")
if [ -n "${DATA:-}" ]; then
  TRAIN_ARGS+=(--data_dir "$DATA")
fi
TRAIN_ARGS+=(--checkpoint_dir "${CKPT:-checkpoints/$NAME}" --log_dir "${LOGS:-logs/$NAME}" --checkpoint.resume auto)
