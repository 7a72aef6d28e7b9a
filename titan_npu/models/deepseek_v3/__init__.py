"""DeepSeek-V3: multi-head latent attention, group-limited sigmoid MoE routing, aux-loss-free balancing."""
