"""kill -9 of a trainer in the middle of a checkpoint save leaves the previous checkpoint usable.

The writer (this file's `__main__` part, a separate process) trains, saves checkpoint 1, trains
again and starts saving checkpoint 2; it announces the moment (before dist_checkpointing writes, or
after it wrote but before the commit) and the test SIGKILLs its whole process group there. The test
then resolves the root (its tracker file), loads it into a fresh trainer and checks the weights are those of
checkpoint 1, bit for bit, and that the next save cleans the debris up.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


def _config(model_dir: str):
    from megatron_rl.config import config_from_dict

    return config_from_dict({"trainer": {"model": model_dir, "precision": "fp32", "micro_batch_tokens": 32,
                                         "lr": 1e-2}})


def _batch(vocab: int, seed: int):
    from megatron_rl.records import Batch, TrainSequence

    g = torch.Generator().manual_seed(seed)
    seqs = [TrainSequence(torch.randint(3, vocab, (9,), generator=g).tolist(), 3, [-3.0] * 6,
                          advantage=float(i % 2) - 0.5) for i in range(4)]
    return Batch(seqs, n_mini=2, policy_version=seed)


def writer(model_dir: str, root: Path, moment: str) -> None:
    import megatron.core.dist_checkpointing as dcp

    from megatron_rl.train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(_config(model_dir))
    vocab = trainer.dims.vocab_size
    trainer.train_on(_batch(vocab, 0))
    trainer.save(root, extra={"data_position": 1})
    torch.save({n: p.detach().clone() for n, p in trainer.model_chunks[0].named_parameters()}, root.parent / "saved1.pt")
    trainer.train_on(_batch(vocab, 1))
    original = dcp.save

    def announcing_save(state, directory, *args, **kwargs):
        if moment == "before_write":
            print("MIDSAVE", directory, flush=True)
        out = original(state, directory, *args, **kwargs)
        if moment == "before_commit":
            print("MIDSAVE", directory, flush=True)
            time.sleep(300)  # the test kills us here: data written, not yet renamed / pointed to
        return out

    dcp.save = announcing_save
    trainer.save(root, extra={"data_position": 2})
    print("SAVE2 COMPLETED", flush=True)


# "before_commit" is the decisive moment (a complete-looking directory that must not be used);
# the writer also supports "before_write" (kill as dist_checkpointing starts) for manual runs.
@pytest.mark.parametrize("moment", ["before_commit"])
def test_kill_mid_save_keeps_previous_checkpoint(tiny_llama_dir, tmp_path, moment):
    from megatron_rl.train.checkpoint import resolve_checkpoint
    from megatron_rl.train.trainer import Trainer

    root = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, __file__, str(tiny_llama_dir), str(root), moment],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    try:
        line = ""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.startswith("MIDSAVE"):
                break
        assert line.startswith("MIDSAVE"), f"writer never reached the save (rc={proc.poll()})"
        os.killpg(proc.pid, signal.SIGKILL)  # the writer and anything it spawned
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    tmp_dir = Path(line.split()[1])
    assert tmp_dir.exists() and ".tmp-" in tmp_dir.name  # debris of the interrupted save
    assert resolve_checkpoint(root) == root / "iter_0000001"

    trainer = Trainer(_config(str(tiny_llama_dir)))
    assert trainer.load(root) == {"data_position": 1} and trainer.version == 1
    saved = torch.load(tmp_path / "saved1.pt")
    params = dict(trainer.model_chunks[0].named_parameters())
    for name, value in saved.items():
        assert torch.equal(params[name].detach(), value), name
    trainer.train_on(_batch(trainer.dims.vocab_size, 1))
    assert trainer.save(root) == root / "iter_0000002"
    assert not tmp_dir.exists() and resolve_checkpoint(root) == root / "iter_0000002"


if __name__ == "__main__":
    writer(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
