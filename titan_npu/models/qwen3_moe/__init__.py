"""Qwen3-MoE: the dense Qwen3 decoder with mixture-of-experts feed-forwards (models/moe_decoder, models/moe)."""
