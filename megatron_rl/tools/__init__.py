"""Reusable logic of the tools (`tools/*.py` and `megatron-rl <cmd>` are thin CLIs over it):
checkpoint conversion (convert, hf_writer), format and difficulty filtering (filter_format,
filter_difficulty), sampling + grading (sampling, evaluate), translation (translate), the
memory/throughput estimator (estimate) and the config reference generator (config_docs)."""
