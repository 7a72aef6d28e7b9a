"""gpt-oss: attention sinks, alternating sliding-window / full attention, YaRN RoPE, MoE with clamped SwiGLU."""
