#!/usr/bin/env python
"""Thin CLI: same as `megatron-rl evaluate` (see megatron_rl/commands/evaluate.py)."""
import sys

from megatron_rl.cli import main

if __name__ == "__main__":  # verifier pools spawn processes: the guard is required
    sys.exit(main(["evaluate", *sys.argv[1:]]))
