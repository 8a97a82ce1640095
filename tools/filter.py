#!/usr/bin/env python
"""Thin CLI: same as `megatron-rl filter` (see megatron_rl/commands/filter.py)."""
import sys

from megatron_rl.cli import main

if __name__ == "__main__":  # verifier pools spawn processes: the guard is required
    sys.exit(main(["filter", *sys.argv[1:]]))
