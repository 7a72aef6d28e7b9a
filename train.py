"""Training entry for torchrun: `torchrun --nproc_per_node 4 train.py --config configs/llama_7b.toml`."""

from titan_npu.train import cli_main

if __name__ == "__main__":
    cli_main()
