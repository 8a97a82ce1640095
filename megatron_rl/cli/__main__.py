"""`python -m megatron_rl.cli ...`: the same as the `megatron-rl` console script."""
import sys

from megatron_rl.cli import main

if __name__ == "__main__":  # verifier pools and dist_checkpointing spawn processes: the guard is required
    sys.exit(main())
