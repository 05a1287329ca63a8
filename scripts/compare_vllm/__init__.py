"""The side-by-side comparison of prefixkv with vLLM's CPU build: one command, both engines, alternating rounds.

`bash scripts/compare_vllm.sh` is the entry point. The modules split by which interpreter runs them: the vLLM side
(`side_vllm`) runs in vLLM's own venv; the prefixkv side (`side_prefixkv`), the model export, the measurement of
the machine's limits (`limits`) and the orchestrator (`__main__`) in prefixkv's; `workloads`, `offline_rows`,
`report` and the bound arithmetic of `limits` are plain Python that both could import.
"""
