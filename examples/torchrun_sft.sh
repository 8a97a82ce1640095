#!/usr/bin/env bash
# Trainer-only SFT cold start (megatron-rl sft) under torchrun: NPROC = TP x PP x DP processes.
#   examples/torchrun_sft.sh traces.jsonl [CONFIG] [key=value ...]
# CPU example: NPROC=2 examples/torchrun_sft.sh traces.jsonl "" trainer.tensor_parallel=2 trainer.precision=fp32
set -euo pipefail
DATA=${1:?usage: torchrun_sft.sh TRACES.jsonl [CONFIG] [overrides...]}
CONFIG=${2:-}
shift $(( $# >= 2 ? 2 : 1 ))
NPROC=${NPROC:-1}
NNODES=${NNODES:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m torch.distributed.run --nproc_per_node="$NPROC" --nnodes="$NNODES" \
  --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29500}" \
  -m megatron_rl.cli sft ${CONFIG:+"$CONFIG"} "$@" --data "$DATA"
