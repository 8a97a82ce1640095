#!/usr/bin/env bash
# The CPU demo under mpiexec (mpich from PyPI): rank 0 controller, then generator and trainer ranks
# as examples/cpu_demo.yaml lays them out; the rank count comes from `megatron-rl plan` (one node),
# so it follows the config and its overrides.
#   examples/mpiexec_cpu_demo.sh [key=value ...]
set -euo pipefail
NP=${NP:-$(python -m megatron_rl.cli plan examples/cpu_demo.yaml "$@" --nodes 1 --print-tasks)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec mpiexec -n "$NP" python -m megatron_rl.cli train examples/cpu_demo.yaml "$@"
