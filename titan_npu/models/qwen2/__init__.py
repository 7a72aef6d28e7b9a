"""Qwen2 / Qwen2.5 dense (0.5B-72B): biases on the q/k/v projections, GQA, tied embeddings when small."""
