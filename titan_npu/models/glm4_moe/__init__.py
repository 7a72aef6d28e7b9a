"""GLM-4.5 (Glm4MoeForCausalLM): the MoE decoder with partial RoPE and DeepSeek-V3's sigmoid group-limited routing."""
