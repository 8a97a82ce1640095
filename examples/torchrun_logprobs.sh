#!/usr/bin/env bash
# Logprob evaluation under torchrun (trainer only, forward only, no update): mean completion-token
# NLL / logprob of a JSONL of traces (the `megatron-rl sft --data` formats) under trainer.model,
# through the same Megatron schedule as training (tools/logprobs_eval.py -> Trainer.evaluate).
#   NPROC=2 examples/torchrun_logprobs.sh traces.jsonl [CONFIG] [key=value ...]
# Writes <run.output_dir>/logprobs_eval.json.
set -euo pipefail
DATA=${1:?usage: torchrun_logprobs.sh TRACES.jsonl [CONFIG] [overrides...]}
CONFIG=${2:-}
shift $(( $# >= 2 ? 2 : 1 ))
NPROC=${NPROC:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m torch.distributed.run --nproc_per_node="$NPROC" \
  --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29501}" \
  tools/logprobs_eval.py --data "$DATA" ${CONFIG:+"$CONFIG"} "$@"
