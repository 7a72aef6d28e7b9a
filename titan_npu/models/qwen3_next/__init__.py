"""Qwen3-Next and Qwen3.5: hybrid gated DeltaNet / gated attention decoders, dense or MoE with a gated shared expert."""
