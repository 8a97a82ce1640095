#!/usr/bin/env python
"""Forward-only logprob evaluation of traces under trainer.model (see megatron_rl/cli/logprobs_eval.py).

    python -m torch.distributed.run --nproc_per_node=2 tools/logprobs_eval.py --data traces.jsonl \
        [CONFIG] trainer.tensor_parallel=2
"""
import sys

from megatron_rl.cli.logprobs_eval import main

if __name__ == "__main__":
    sys.exit(main())
