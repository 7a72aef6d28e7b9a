"""The dense decoder-only transformer that Llama, Qwen2 and Qwen3 share: args, model, parallel plan, HF mapping."""
