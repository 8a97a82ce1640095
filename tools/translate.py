#!/usr/bin/env python
"""Thin CLI: same as `megatron-rl translate` (see megatron_rl/commands/translate.py)."""
import sys

from megatron_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["translate", *sys.argv[1:]]))
