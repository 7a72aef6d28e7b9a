"""Mixture-of-experts building blocks shared by model families: router, grouped experts, the layer, balancing."""
