#!/usr/bin/env python
"""pass@1 / pass@k evaluation (same as `megatron-rl evaluate`; see megatron_rl/cli/evaluate.py)."""
import sys

from megatron_rl.cli import main

if __name__ == "__main__":  # verifier pools spawn processes: the guard is required
    sys.exit(main(["evaluate", *sys.argv[1:]]))
