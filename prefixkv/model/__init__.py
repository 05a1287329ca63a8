"""Model side of prefixkv: loading (GGUF / HF), the decoder, paged attention, sampling, the runner.

Importing this package imports `prefixkv` first, which asks OpenMP for passive waiting before torch loads.
"""
