#!/usr/bin/env python
"""HF <-> Megatron dist-checkpoint conversion (same as `megatron-rl convert`).

    torchrun --nproc_per_node=2 tools/convert.py to-megatron HF_DIR ckpt/ --tp 2
    torchrun --nproc_per_node=2 tools/convert.py to-hf ckpt/ hf_out/ --pp 2
"""
import sys

from megatron_rl.cli import main

if __name__ == "__main__":  # dist_checkpointing spawns helper processes: the guard is required
    sys.exit(main(["convert", *sys.argv[1:]]))
