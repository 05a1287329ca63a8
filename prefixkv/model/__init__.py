"""Model side of prefixkv: loading (GGUF / HF), the decoder, paged attention, sampling, the runner.

OpenMP threads that spin while waiting are catastrophic on a shared, oversubscribed CPU (measured 15x slower
decode steps with 2 threads on 2 busy cores). Ask for passive waiting unless the user chose otherwise; this
only takes effect if torch has not been imported yet, so import prefixkv before torch where possible.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
