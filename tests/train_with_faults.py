"""train.py with the test fault hooks of fault_hooks.py, configured by TITAN_FAULT_* variables (tests only).

`torchrun ... tests/train_with_faults.py ARGS` runs what `torchrun ... train.py ARGS` runs, failing where asked.
"""

import os
import sys

from fault_hooks import Faults, train_with_faults

from titan_npu.cli import run_as_process

if __name__ == "__main__":
    run_as_process(lambda: train_with_faults(sys.argv[1:], Faults.from_env(int(os.environ.get("RANK", "0")))))
