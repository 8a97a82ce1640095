#!/usr/bin/env bash
# The CPU demo under mpiexec (mpich from PyPI): rank 0 controller, then generator and trainer ranks
# as examples/cpu_demo.yaml lays them out. NP must match the ranks the config asks for.
#   NP=3 examples/mpiexec_cpu_demo.sh [key=value ...]
set -euo pipefail
NP=${NP:-3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec mpiexec -n "$NP" python -m megatron_rl.cli train examples/cpu_demo.yaml "$@"
