"""Model side of prefixkv: loading (GGUF / HF), the decoder, paged attention, sampling, the runner.

Importing this package imports `prefixkv` first, which bounds how long OpenMP workers spin before torch loads.
"""
