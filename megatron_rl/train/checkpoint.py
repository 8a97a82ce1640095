"""Trainer checkpoints: Megatron `dist_checkpointing`, written atomically, resumable bit-exactly.

Layout under a checkpoint root:

    root/step_00000012/        one complete dist_checkpointing directory (model, optimizer, RNG,
                               step, layout, the controller's JSON extra state)
    root/latest                text file naming the newest complete checkpoint ("step_00000012")
    root/step_00000013.tmp-ab12cd/   a save in progress (or the debris of a crashed one)

A save writes everything into `<name>.tmp-<id>`, then rank 0 renames it to `<name>` (atomic on
POSIX within one file system) and replaces `latest` through a temporary file + `os.replace`. A
writer killed at any moment leaves either the old `latest` -> old complete checkpoint, or the new
one: never a half-written checkpoint behind `latest`. Debris is removed by the next save.

Resharding: model weights load into any TP/PP layout (dist_checkpointing reshards). The
DistributedOptimizer state uses `dp_reshardable` (fast, fully parallel; it can change only the DP
size), so after a TP/PP change the optimizer state is not loaded (Adam restarts; the caller is told
through `LoadResult.optimizer_loaded`), and neither is the per-rank RNG state.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

LATEST = "latest"
FORMAT_VERSION = 1
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_MARK = ".tmp-"


class CheckpointError(RuntimeError):
    pass


# ---------------------------------------------------------------- atomic directory mechanics

def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_str(value: str | None) -> str:
    if not dist.is_initialized():
        assert value is not None
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def write_pointer(root: Path, name: str) -> None:
    """Atomically make `root/latest` name `name` (temporary file, fsync, os.replace, fsync dir)."""
    tmp = root / f"{LATEST}{_TMP_MARK}{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def resolve_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint directory `path` designates: a root (follows `latest`) or one checkpoint.

    Returns None for a root holding no complete checkpoint.
    """
    path = Path(path)
    if (path / "metadata.json").is_file():  # a dist_checkpointing directory itself
        return path
    pointer = path / LATEST
    if pointer.is_file():
        target = path / pointer.read_text().strip()
        if (target / "metadata.json").is_file():
            return target
        log.warning("%s names %s, which is not a complete checkpoint; using the newest one", pointer, target)
    done = [p for p in complete_checkpoints(path) if (p / "metadata.json").is_file()]
    return done[-1] if done else None


def remove_debris(root: Path) -> list[Path]:
    """Delete leftovers of interrupted saves (`*.tmp-*`); call only while no save runs."""
    removed = []
    for p in root.iterdir() if root.is_dir() else []:
        if _TMP_MARK in p.name:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(p)
    return removed


def begin_save(root: Path, name: str) -> Path:
    """Rank 0 clears debris and creates a fresh temporary directory; every rank gets its path."""
    tmp_name = None
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for p in remove_debris(root):
            log.info("removed debris of an interrupted save: %s", p)
        tmp_name = f"{name}{_TMP_MARK}{uuid.uuid4().hex[:8]}"
        (root / tmp_name).mkdir()
    return root / _broadcast_str(tmp_name)


def commit_save(root: Path, tmp: Path, name: str, keep_last: int = 0) -> Path:
    """After every rank finished writing `tmp`: rename it to `root/name`, move `latest`, prune."""
    final = root / name
    _barrier()
    if _rank() == 0:
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step: move the old one aside first
            old = root / f"{name}{_TMP_MARK}old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        write_pointer(root, name)
        if keep_last > 0:
            for p in complete_checkpoints(root)[:-keep_last]:
                if p != final:
                    shutil.rmtree(p)
    _barrier()
    return final


# ---------------------------------------------------------------- what goes into a checkpoint

def rng_state() -> dict[str, Any]:
    """This rank's RNG streams: Python, torch CPU, CUDA, Megatron's model-parallel tracker."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


@dataclass
class LoadResult:
    path: Path
    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    saved_layout: dict[str, Any] = field(default_factory=dict)
    optimizer_loaded: bool = True  # False: layout changed, not asked, or saved before the first step
    rng_restored: bool = True


def _layout_now(layout) -> dict[str, Any]:
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "vpp": layout.vpp}


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _sharded_state(model: list, optimizer, layout, *, is_loading: bool, with_optimizer: bool,
                   with_rng: bool) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict[str, Any] = {}
    model_sd: dict[str, Any] = {}
    for i, chunk in enumerate(model):
        sd = chunk.module.sharded_state_dict() if hasattr(chunk, "module") else chunk.sharded_state_dict()
        state[_model_key(i, len(model))] = sd
        model_sd.update(sd)
    if with_optimizer and optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=OPTIM_METADATA)
    if with_rng:
        coords = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                  ps.get_data_parallel_rank())
        shape = (layout.pp, layout.tp, layout.dp)
        state["rng_state"] = ShardedObject("rng_state", rng_state() if not is_loading else None,
                                           shape, coords, replica_id=0)
    return state


def _optimizer_has_state(optimizer) -> bool:
    """False for an optimizer that has not stepped yet (torch Adam keeps no state before step 1)."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return all(len(getattr(o, "optimizer", o).state) > 0 for o in opts)


def save_checkpoint(root: str | Path, model: list, optimizer, layout, step: int,
                    extra: dict[str, Any] | None = None, keep_last: int = 0) -> Path:
    """Collective: save model chunks, optimizer, RNG, step and `extra` (JSON) under `root`."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    extra_json = json.dumps(extra or {}, sort_keys=True)  # fail before writing anything
    name = step_dirname(step)
    tmp = begin_save(root, name)
    # A fresh optimizer has no state to save (and faking one would take an Adam step): it is saved
    # as absent and stays fresh on load, which is exactly the saved situation.
    has_opt = optimizer is not None and _optimizer_has_state(optimizer)
    state = _sharded_state(model, optimizer, layout, is_loading=False, with_optimizer=has_opt, with_rng=True)
    state.update(step=int(step), extra_json=extra_json, layout=_layout_now(layout),
                 has_optimizer=has_opt, format_version=FORMAT_VERSION)
    dist_checkpointing.save(state, str(tmp))
    return commit_save(root, tmp, name, keep_last)


def read_common(path: str | Path) -> dict[str, Any]:
    """Step, layout and extra state of a checkpoint, without building a model."""
    from megatron.core import dist_checkpointing

    ckpt = resolve_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(f"no complete checkpoint at {path}")
    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: not a megatron_rl trainer checkpoint (format_version "
                              f"{common.get('format_version')!r})")
    return {"path": ckpt, "step": int(common["step"]), "layout": dict(common["layout"]),
            "extra": json.loads(common["extra_json"]), "has_optimizer": bool(common["has_optimizer"])}


def load_checkpoint(path: str | Path, model: list, optimizer, layout, load_optimizer: bool = True) -> LoadResult:
    """Collective: load the checkpoint `path` designates into `model` (+ optimizer, RNG)."""
    from megatron.core import dist_checkpointing

    meta = read_common(path)
    ckpt: Path = meta["path"]
    saved = meta["layout"]
    same_mp = (saved["tp"], saved["pp"], saved.get("vpp")) == (layout.tp, layout.pp, layout.vpp)
    with_opt = load_optimizer and optimizer is not None and same_mp and meta["has_optimizer"]
    with_rng = saved == _layout_now(layout)
    if load_optimizer and optimizer is not None and not same_mp:
        log.warning("%s was saved with tp=%s pp=%s vpp=%s; loading the model resharded into tp=%s pp=%s "
                    "vpp=%s, optimizer state NOT loaded (dp_reshardable)", ckpt, saved["tp"], saved["pp"],
                    saved.get("vpp"), layout.tp, layout.pp, layout.vpp)
    state = _sharded_state(model, optimizer, layout, is_loading=True, with_optimizer=with_opt, with_rng=with_rng)
    loaded = dist_checkpointing.load(state, str(ckpt))
    for i, chunk in enumerate(model):
        target = chunk.module if hasattr(chunk, "module") else chunk
        target.load_state_dict(loaded[_model_key(i, len(model))])
    if with_opt:
        optimizer.load_state_dict(loaded["optimizer"])
    if with_rng:
        set_rng_state(loaded["rng_state"])
    _barrier()
    return LoadResult(path=ckpt, step=meta["step"], extra=meta["extra"], saved_layout=saved,
                      optimizer_loaded=with_opt, rng_restored=with_rng)
