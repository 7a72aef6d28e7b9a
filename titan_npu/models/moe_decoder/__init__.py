"""The decoder with mixture-of-experts feed-forwards that MoE families share: args, model, parallel plan, kinds."""
