"""titan-npu: PyTorch-native LLM pretraining on Ascend NPUs, NVIDIA GPUs and CPUs."""

__version__ = "0.1.0"
