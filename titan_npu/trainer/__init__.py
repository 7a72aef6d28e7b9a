"""The training loop and what it is made of: optimizer, lr schedule, precision."""

from titan_npu.trainer.trainer import Trainer

__all__ = ["Trainer"]
