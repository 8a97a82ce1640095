"""Real MPI from the mpich wheel: mpiexec -n 3 with mpi4py point-to-point and collectives."""
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "mpi_roundtrip.py"


def test_mpiexec_three_ranks_round_trip():
    mpiexec = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    assert mpiexec, "mpiexec missing: ./dev setup installs the mpich wheel"
    out = subprocess.run([mpiexec, "-n", "3", sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MPI ranks=3 all_ok=True" in out.stdout
