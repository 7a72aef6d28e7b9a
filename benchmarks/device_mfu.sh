#!/usr/bin/env bash
# The 1B model on one device: tokens/s, MFU against the dense bf16 peak, peak memory, the compile speed-up, the
# attention kernel, and the float8 column (tokens/s, speed-up over bf16, MFU against the dense float8 peak, memory;
# run where the device has float8 tensor cores), in a few minutes (benchmarks/device_mfu.py; docs/performance.md).
#
#   bash benchmarks/device_mfu.sh
#   STEPS=20 WARMUP=5 bash benchmarks/device_mfu.sh --training.batch_size 4
#   bash benchmarks/device_mfu.sh --config configs/llama3_8b.toml --training.batch_size 1   # the 8B, float8 too
#
# Runs from a bare checkout: the checkout is put on PYTHONPATH, nothing is installed or fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" benchmarks/device_mfu.py --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" "$@"
