"""Model definitions: one folder per family (llama: Llama 2 and Llama 3)."""
