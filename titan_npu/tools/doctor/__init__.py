"""The checks of `titan-npu doctor` (its command line: commands/doctor.py): is this machine (and, under
torchrun, this job) ready to train?

    titan-npu doctor [--config C]                                    versions, devices, environment, disk
    torchrun --nnodes 2 --nproc_per_node 8 ... -m titan_npu.cli doctor  + collectives on the real backend

Checks the software stack (Python, torch, torch_npu, CANN, driver) and whether its versions belong together,
the visible devices, the HCCL/NCCL variables in effect and what they do, free disk where checkpoints go against
the size the config implies, and, under torchrun, all_reduce / all_gather / broadcast on the job's backend with
each rank's time and the bus bandwidth. A rank that never checks in, or never reaches a collective, is named by
rank number within --timeout seconds instead of hanging the job. Exit code 0: no failures; 1: something failed.
"""

from titan_npu.tools.doctor.collectives import CollectiveResult, run_collectives
from titan_npu.tools.doctor.disk import check_disk
from titan_npu.tools.doctor.environment import check_environment
from titan_npu.tools.doctor.installed import ascend_toolkit_home, read_cann_version, read_npu_driver_version
from titan_npu.tools.doctor.report import Report
from titan_npu.tools.doctor.side_channel import RanksMissing, check_in, open_side_channel
from titan_npu.tools.doctor.versions import TORCH_NPU_CANN, parse_release, stack_findings

__all__ = [
    "TORCH_NPU_CANN",
    "CollectiveResult",
    "RanksMissing",
    "Report",
    "ascend_toolkit_home",
    "check_disk",
    "check_environment",
    "check_in",
    "open_side_channel",
    "parse_release",
    "read_cann_version",
    "read_npu_driver_version",
    "run_collectives",
    "stack_findings",
]
