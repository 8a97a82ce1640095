"""Which PMI plugin srun needs (`srun --mpi=`) for the MPI library this environment's mpi4py loads.

Under Slurm's default (`--mpi=none` on most sites) no rank finds a process-management server, every
task initialises MPI alone and the run stops with "the job has 1". The plugin must be the one the
library speaks: MPICH and its derivatives (the `mpich` wheel of the cpu/gpu extras, Intel MPI,
MVAPICH) PMI-2; HPE Cray MPICH Slurm's cray_shasta; Open MPI 5, which starts its processes through
PMIx only, pmix. `megatron-rl plan` and `doctor` print the answer; the sbatch examples take it from
`plan --print-srun-mpi` unless SRUN_MPI is set (`srun --mpi=list` shows what a site offers).
"""
from __future__ import annotations

import subprocess
import sys

# (text in the library's version string, plugin, why); first match wins: Cray MPICH before MPICH
PLUGINS = (
    ("CRAY MPICH", "cray_shasta", "HPE Cray MPICH starts through Slurm's cray_shasta plugin"),
    ("Open MPI", "pmix", "Open MPI 5 starts its processes through PMIx only"),
    ("MPICH", "pmi2", "MPICH (the mpich wheel too) speaks PMI-2 under srun"),
    ("Intel(R) MPI", "pmi2", "Intel MPI under srun: PMI-2 (I_MPI_PMI_LIBRARY=libpmi2.so)"),
    ("MVAPICH", "pmi2", "MVAPICH speaks PMI-2"),
)
DEFAULT_PLUGIN = "pmi2"

# mpi4py would initialise MPI on import; the version string is readable before MPI_Init. A child
# process, so neither this process's mpi4py settings nor an MPI singleton are left behind.
_PROBE = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
          "print(MPI.Get_library_version().splitlines()[0].strip())")


def mpi_library() -> str | None:
    """First line of the version string of the MPI library mpi4py loads here (MPI4PY_LIBMPI or the
    first found: the mpich wheel in the venv, else the system's); None when none loads."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return " ".join(out.stdout.split()) or None


def pmi_plugin(library: str | None) -> tuple[str, str]:
    """(srun --mpi value, why) for an MPI library version string."""
    if library is None:
        return DEFAULT_PLUGIN, "no MPI library loads here (mpi4py): install one (pip install mpich) first"
    for text, plugin, why in PLUGINS:
        if text.lower() in library.lower():
            return plugin, why
    return DEFAULT_PLUGIN, f"unknown MPI library {library!r}: check `srun --mpi=list` and set SRUN_MPI"
