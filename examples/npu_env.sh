#!/usr/bin/env bash
# The standard Ascend launch environment, sourced by the examples/npu_*.sh launchers (and multinode.sh): what
# MindSpeed-LLM's and torchtitan-npu's scripts export. Every value already in the environment wins. train.py sets
# TASK_QUEUE_ENABLE, CPU_AFFINITY_CONF and the TORCH_HCCL_* monitor/dump switches itself before torch_npu starts;
# exporting them here also covers every other process the job runs.
export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-2}        # level-2 task-queue pipelining of operator launches
export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}        # bind each rank's host threads to the cores near its card
export STREAMS_PER_DEVICE=${STREAMS_PER_DEVICE:-32}     # stream pool per card (torch_npu's default is 8)
# ProcessGroupHCCL: abort the group on a collective error, watch the watchdog, dump the flight recorder on a
# timeout (its buffer, TORCH_HCCL_TRACE_BUFFER_SIZE, follows reliability.flight_recorder_size).
export TORCH_HCCL_ASYNC_ERROR_HANDLING=${TORCH_HCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_HCCL_ENABLE_MONITORING=${TORCH_HCCL_ENABLE_MONITORING:-1}
export TORCH_HCCL_DUMP_ON_TIMEOUT=${TORCH_HCCL_DUMP_ON_TIMEOUT:-1}
# Multi-node: HCCL_CONNECT_TIMEOUT (120..7200 s) and HCCL_EXEC_TIMEOUT come from [comm] init_timeout_s / timeout_s
# (train.py sets them; the 70B configs raise init_timeout_s to 3600 for nodes that start minutes apart). Export
# them only to override the config.
