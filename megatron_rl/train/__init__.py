"""Megatron-Core trainer.

Part A (model): `parallel` (ParallelLayout, init_parallel, destroy_parallel), `model` (build_model
from a HF config), `hf_source` (resolve a model name/dir, incl. the SmolLM2 GGUF), `hf_weights`
(HF <-> Megatron shards: load_hf_weights, export_hf_tensors), `logprobs` (vocab-parallel token
logprobs and entropy). Conversion of whole checkpoints HF <-> Megatron dist checkpoint: `convert`
(with `hf_writer`, the safetensors shards), behind `megatron-rl convert` and tools/convert.py.
Import submodules directly; this package imports nothing heavy.
"""
