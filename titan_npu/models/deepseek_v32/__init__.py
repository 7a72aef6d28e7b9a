"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (a lightning indexer choosing each query's keys)."""
