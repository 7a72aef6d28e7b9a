"""Qwen3 dense (0.6B-32B): per-head q/k RMSNorm, head_dim set apart from dim, GQA, tied embeddings when small."""
