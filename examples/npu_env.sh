#!/usr/bin/env bash
# The standard Ascend launch environment, sourced by the examples/npu_*.sh launchers (and multinode.sh): what
# MindSpeed-LLM's and torchtitan-npu's scripts export. Every value already in the environment wins. train.py sets
# CPU_AFFINITY_CONF and the TORCH_HCCL_* monitor switch itself before it imports torch (torch imports torch_npu);
# exporting them here also covers every other process the job runs. TASK_QUEUE_ENABLE is not exported: train.py
# sets it from training.npu_task_queue (1, torch_npu's training level; 2 is for pure inference), and an exported
# value would win over the config.
export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}        # bind each rank's host threads to the cores near its card
export STREAMS_PER_DEVICE=${STREAMS_PER_DEVICE:-32}     # stream pool per card (torch_npu's default is 8)
# ProcessGroupHCCL: abort the group on a collective error, watch the watchdog. The flight recorder's buffer
# (TORCH_HCCL_TRACE_BUFFER_SIZE) and its dump on a timeout (TORCH_HCCL_DUMP_ON_TIMEOUT, which needs the buffer) follow
# reliability.flight_recorder_size.
export TORCH_HCCL_ASYNC_ERROR_HANDLING=${TORCH_HCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_HCCL_ENABLE_MONITORING=${TORCH_HCCL_ENABLE_MONITORING:-1}
# Multi-node: HCCL_CONNECT_TIMEOUT (120..7200 s) comes from [comm] init_timeout_s and HCCL_EXEC_TIMEOUT from
# timeout_s (a tenth below it, so that HCCL times out and writes its plog before the process group's watchdog;
# train.py sets them; the 70B configs raise init_timeout_s to 3600 for nodes that start minutes apart). Export them
# only to override the config, HCCL_EXEC_TIMEOUT below comm.timeout_s.
