"""mpiexec -n 3: broadcast a config, ring-exchange numpy buffers and pickled objects, gather results."""
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
cfg = comm.bcast({"n_batch": 8, "version": 3} if rank == 0 else None, root=0)

send = np.full(100_000, rank, dtype=np.float32)
recv = np.empty_like(send)
right, left = (rank + 1) % size, (rank - 1) % size
MPI.Request.Waitall([comm.Isend(send, dest=right, tag=1), comm.Irecv(recv, source=left, tag=1)])
request = comm.isend({"from": rank, "version": cfg["version"]}, dest=right, tag=2)
message = comm.recv(source=left, tag=2)
request.wait()
total = np.zeros(1)
comm.Allreduce(np.array([float(rank)]), total, op=MPI.SUM)

ok = bool(recv.min() == recv.max() == left and message["from"] == left and total[0] == sum(range(size)))
results = comm.gather(ok, root=0)
if rank == 0:
    print(f"MPI ranks={size} all_ok={all(results)}", flush=True)
