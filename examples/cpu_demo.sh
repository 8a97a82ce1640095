#!/usr/bin/env bash
# The CPU demo: Magistral's recipe end to end on one 2-core machine, on SmolLM2-135M-Instruct.
#   1. data      two-digit additions (RL problems) and worked traces (SFT cold start)
#   2. sft       cold start with the Megatron trainer (megatron-rl sft), then an HF export for SGLang
#   3. rl        asynchronous GRPO (megatron-rl train): SGLang generator, Megatron trainer, verifier
#                pool, MPI controller; in-flight weight updates after every trainer update
#   4. plot      runs/cpu_demo/rl/curves.png, the reward before/after and the held-out pass@1/pass@4
# Steps already done are skipped (delete runs/cpu_demo to start over; RUN_DIR=... to use another).
# Extra arguments are config overrides for the RL step, e.g. run.updates=10.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUN="${RUN_DIR:-runs/cpu_demo}"
CFG=examples/cpu_demo.yaml
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
stamp() { printf '\n=== %s  [%s]\n' "$1" "$(date +%H:%M:%S)"; }

stamp "1/4 data"
[[ -f "$RUN/data/eval.jsonl" ]] || python examples/cpu_demo_data.py "$RUN/data"

stamp "2/4 SFT cold start (Megatron trainer) + export to HF"
if [[ ! -f "$RUN/sft-hf/config.json" ]]; then
  [[ -e "$RUN/sft/checkpoints/latest_checkpointed_iteration.txt" ]] || megatron-rl sft "$CFG" trainer.lr=5e-5 "run.output_dir=$RUN/sft" \
      --data "$RUN/data/sft.jsonl" --batch-size 8 --epochs 1
  megatron-rl convert to-hf "$RUN/sft/checkpoints" "$RUN/sft-hf" --hf-config smollm2-135m
fi

stamp "3/4 asynchronous RL"
# run.resume=auto: continue from the run's checkpoint when an earlier demo left one, else start afresh
megatron-rl train "$CFG" "trainer.model=$RUN/sft-hf" "data.path=$RUN/data/problems.jsonl" \
  "data.eval_path=$RUN/data/eval.jsonl" "run.output_dir=$RUN/rl" run.resume=auto "$@"

stamp "4/4 results"
megatron-rl plot "$RUN/rl"
python examples/cpu_demo_summary.py "$RUN/rl/metrics.jsonl"
