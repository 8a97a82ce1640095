"""Trainer checkpoints: Megatron `dist_checkpointing`, written atomically, resumable bit-exactly.

Each checkpoint is one dist_checkpointing directory `root/iter_<7-digit step>` (model, optimizer, RNG,
step, layout, the controller's JSON extra state), written aside and committed by a rename with
`root/latest_checkpointed_iteration.txt` holding the newest complete one's step: Megatron-LM's
torch_dist layout (`checkpoint_dirs`: a writer killed at any moment leaves a usable previous
checkpoint). The common state also carries Megatron-LM's `iteration` and `checkpoint_version` keys;
what differs from a Megatron-LM checkpoint: no `args` namespace, RNG state under our own keys, and
the optimizer's sharded keys are Megatron-Core's (the same code), not `opt_param_scheduler`.

Resharding (format_version 2): a checkpoint loads into any TP/PP/VPP/DP layout, weights and
Adam state alike, also for models that `train/model.py` pads for TP (vocab, KV groups, MLP width
rounded up to multiples of tp, so the stored global shapes depend on the saving TP):
- every padding sits at the END of its axis in global coordinates, so the padded tensors are marked
  `allow_shape_mismatch` (the load reads the overlap and zero-fills the rest, i.e. the padding);
- the SwiGLU fc1 is saved with Megatron's `singleton_local_shards` layout (gate and up under
  separate keys, one key per layer), else up would start at the padded width of the saving TP;
- the unpadded model dims are stored and checked: a checkpoint of another model is refused with a
  CheckpointError naming the differing field (the shape mismatch allowance would load it silently).
Optimizer formats (`save_checkpoint(optimizer_format=...)`, `trainer.checkpoint_optimizer`):
`fully_reshardable` (default; gathered over DP into model-space tensors while saving, loads into
any layout) or `dp_reshardable` (each rank's flat shard, the faster save; after a TP/PP/VPP change
the optimizer state is not loaded and Adam restarts, `LoadResult.optimizer_loaded=False`). RNG
state is restored only at the identical layout (`LoadResult.rng_restored`). Format 1 checkpoints
(stacked layer keys, dp_reshardable) still load, at any TP whose padding equals the saving TP's.

Integrity (`checkpoint_manifest`): every save ends with a manifest of sizes and CRC32s; a load
first checks the files against it (`verify`: "checksum" or "size") and reads nothing of a damaged
checkpoint. Any damage found then or while reading surfaces as one CheckpointError naming the
checkpoint and the file. Checkpoints from before manifests (no `has_manifest` in their common
state) load with a warning; a checkpoint saved with a manifest that lost it is refused.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_rl.train.checkpoint_dirs import barrier, begin_save, commit_save, iter_dirname, resolve_checkpoint
from megatron_rl.train.checkpoint_manifest import MANIFEST, VERIFY_MODES, CheckpointError, describe, verify_manifest

log = logging.getLogger(__name__)

# 2: one key per layer and the SwiGLU gate/up under separate keys (Megatron's singleton_local_shards),
#    padded tensors marked allow_shape_mismatch, model dims and optimizer format in the common state.
# 1: stacked layer keys, gate/up in one key, dp_reshardable optimizer; still loaded (see load_checkpoint).
FORMAT_VERSION = 2
_MODEL_METADATA: dict[int, dict[str, Any] | None] = {1: None, 2: {"singleton_local_shards": True}}
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
# Megatron-LM's `checkpoint_version` of its checkpoints (3.0 since 2020), stored for its tools beside `iteration`.
MEGATRON_CHECKPOINT_VERSION = 3.0
# ModelDims fields that define the HF model (not the TP-padded sizes): they must match on load.
DIMS_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "ffn_size", "qkv_bias", "tie_embeddings", "norm_eps", "rope", "max_position_embeddings",
               "sliding_window")
# Megatron parameters whose global shape depends on the TP padding (train/model.py).
_PADDED = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
           "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
           "embedding.word_embeddings.weight", "output_layer.weight",
           # LoRA adapters (train/lora.py) split like their weight: B of column layers, A of row layers
           "self_attention.linear_qkv.lora_B", "self_attention.linear_proj.lora_A", "mlp.linear_fc1.lora_B",
           "mlp.linear_fc2.lora_A")


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
    optimizer_loaded: bool = True  # False: not reshardable to this layout, not asked, or never stepped
    rng_restored: bool = True  # only at the identical TP/PP/DP/VPP layout
    optimizer_format: str = "dp_reshardable"
    reference_loaded: bool = False  # the KL reference policy came from the checkpoint


REFERENCE_PREFIX = "reference."  # sharded keys of the KL reference policy


def _layout_now(layout) -> dict[str, Any]:
    # cp only when used: checkpoints written before context parallel compare equal at cp = 1
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "vpp": layout.vpp,
            **({"cp": layout.cp} if layout.cp > 1 else {})}


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


# ---------------------------------------------------------------- model identity and TP padding

def _dims_record(model: list) -> dict[str, Any]:
    """The unpadded ModelDims fields (the HF model's architecture), as plain values."""
    dims = getattr(model[0], "mrl_dims", None)
    if dims is None:
        raise CheckpointError("the model chunks carry no `mrl_dims` (build them with train.model.build_model)")
    record = dataclasses.asdict(dims)
    return {k: record[k] for k in DIMS_FIELDS}


def _lora_record(model: list) -> dict[str, Any] | None:
    """The LoRA adapters the (possibly wrapped) chunks carry (train/lora.py), as plain values; None without."""
    chunk = model[0]
    while hasattr(chunk, "module"):
        chunk = chunk.module
    spec = getattr(chunk, "mrl_lora", None)
    return spec.record() if spec is not None else None


def _check_same_lora(ckpt: Path, saved: dict[str, Any] | None, now: dict[str, Any] | None) -> None:
    # Megatron loads only the keys it is asked for: adapters of another rank or set of modules, or none
    # where the model has some, would otherwise load partly or be left at their initial values silently.
    def same(r):  # dropout may change between runs: it is no part of the adapters' shapes or values
        return None if r is None else (r["rank"], r["alpha"], tuple(r["targets"]))

    if same(saved) != same(now):
        def say(r):
            return "none" if r is None else f"rank {r['rank']}, alpha {r['alpha']}, targets {','.join(r['targets'])}"
        raise CheckpointError(f"{ckpt} holds other LoRA adapters (trainer.lora) than the model being loaded: "
                              f"{say(saved)} in the checkpoint, {say(now)} in the model")


def _check_same_model(ckpt: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    # Padded tensors load with allow_shape_mismatch: without this check another model of another
    # size would load silently (truncated or zero-filled).
    for key in DIMS_FIELDS:
        if saved.get(key) != now[key]:
            raise CheckpointError(f"{ckpt} holds another model: {key}={saved.get(key)!r} in the checkpoint, "
                                  f"{now[key]!r} in the model being loaded")


def _check_v1_padding(ckpt: Path, dims: dict[str, Any], saved_tp: int, tp: int) -> None:
    def padded(t: int) -> tuple[int, ...]:
        return tuple(-(-dims[k] // t) * t for k in ("vocab_size", "num_kv_heads", "ffn_size"))

    if padded(saved_tp) != padded(tp):
        raise CheckpointError(
            f"{ckpt} (format_version 1) was saved at tp={saved_tp}, whose TP padding of this model differs "
            f"from tp={tp}'s; load it at tp={saved_tp} and save it again (format {FORMAT_VERSION} reshards)")


def _allow_padding_mismatch(sd: dict[str, Any]) -> None:
    """Mark the tensors whose global shape depends on the TP padding: all paddings sit at the END
    of their axis in global coordinates, so loading reads the overlap and zero-fills the rest."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def flagging(build_fn):  # a factory (SwiGLU fc1) builds its tensors later: flag them then
        def build(*args, **kwargs):
            built = build_fn(*args, **kwargs)
            for t in nested_values(built if isinstance(built, (dict, list)) else [built]):
                if isinstance(t, ShardedTensor):
                    t.allow_shape_mismatch = True
            return built
        return build

    for item in nested_values(sd):
        if not str(getattr(item, "key", "")).endswith(_PADDED):
            continue
        if isinstance(item, ShardedTensor):
            item.allow_shape_mismatch = True
        elif isinstance(item, ShardedTensorFactory):
            item.build_fn = flagging(item.build_fn)


# ---------------------------------------------------------------- the sharded state

def _sharded_state(model: list, optimizer, layout, *, is_loading: bool, with_optimizer: bool,
                   with_rng: bool, version: int, optimizer_format: str,
                   reference: list | None = None) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict[str, Any] = {}
    metadata = _MODEL_METADATA[version]
    for i, chunk in enumerate(model):
        target = chunk.module if hasattr(chunk, "module") else chunk
        sd = target.sharded_state_dict(metadata=dict(metadata) if metadata else None)
        if version >= 2:
            _allow_padding_mismatch(sd)
        state[_model_key(i, len(model))] = sd
    if with_optimizer and optimizer is not None:
        # Nested per chunk: VPP chunks reuse the same local state-dict keys. fully_reshardable builds
        # its model-space tensors with dataclasses.replace() of the model's sharded tensors
        # (factories included), so they inherit allow_shape_mismatch.
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata={"distrib_optim_sharding_type": optimizer_format})
    if with_rng:
        coords = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                  ps.get_data_parallel_rank(with_context_parallel=True))  # one RNG state per CP rank too
        shape = (layout.pp, layout.tp, layout.dp * layout.cp)
        state["rng_state"] = ShardedObject("rng_state", rng_state() if not is_loading else None,
                                           shape, coords, replica_id=0)
    for i, chunk in enumerate(reference or []):  # the KL reference policy, under its own key prefix
        sd = chunk.sharded_state_dict(prefix=REFERENCE_PREFIX, metadata=dict(metadata) if metadata else None)
        _allow_padding_mismatch(sd)
        state[f"reference{i}"] = sd
    return state


def _optimizer_has_state(optimizer) -> bool:
    """False for an optimizer that has not stepped yet (torch Adam keeps no state before step 1)."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return all(len(getattr(o, "optimizer", o).state) > 0 for o in opts)


def save_checkpoint(root: str | Path, model: list, optimizer, layout, step: int,
                    extra: dict[str, Any] | None = None, keep_last: int | None = 0,
                    optimizer_format: str = "fully_reshardable", reference: list | None = None) -> Path:
    """Collective: save model chunks, optimizer, RNG, step and `extra` (JSON) under `root`.

    `optimizer_format`: "fully_reshardable" (loads into any layout) or "dp_reshardable" (faster,
    reshards only over DP). `reference`: the KL reference policy's chunks, saved beside the model.
    `keep_last`: delete all but the newest this many checkpoints of `root` after the save (0 or None: keep all)."""
    from megatron.core import dist_checkpointing

    if optimizer_format not in OPTIMIZER_FORMATS:
        raise CheckpointError(f"optimizer_format {optimizer_format!r}: expected one of {OPTIMIZER_FORMATS}")
    root = Path(root)
    extra_json = json.dumps(extra or {}, sort_keys=True)  # fail before writing anything
    dims = _dims_record(model)
    tmp = begin_save(root, iter_dirname(step))
    # A fresh optimizer has no state to save (and faking one would take an Adam step): it is saved
    # as absent and stays fresh on load, which is exactly the saved situation.
    has_opt = optimizer is not None and _optimizer_has_state(optimizer)
    state = _sharded_state(model, optimizer, layout, is_loading=False, with_optimizer=has_opt, with_rng=True,
                           version=FORMAT_VERSION, optimizer_format=optimizer_format, reference=reference)
    state.update(step=int(step), extra_json=extra_json, layout=_layout_now(layout), has_optimizer=has_opt,
                 format_version=FORMAT_VERSION, optimizer_format=optimizer_format, model_dims=dims,
                 lora=_lora_record(model),
                 has_reference=reference is not None, has_manifest=True,
                 iteration=int(step), checkpoint_version=MEGATRON_CHECKPOINT_VERSION)
    dist_checkpointing.save(state, str(tmp))
    return commit_save(root, tmp, int(step), keep_last)


def _resolve(path: str | Path) -> Path:
    ckpt = resolve_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(f"no complete checkpoint at {path}")
    return ckpt


def _load_common(ckpt: Path) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    try:
        json.loads((ckpt / "metadata.json").read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"damaged checkpoint {ckpt}: metadata.json cannot be read ({describe(e)})")
    try:
        return dist_checkpointing.load_common_state_dict(str(ckpt))
    except Exception as e:  # a missing or damaged common.pt surfaces as any type (EOFError, pickle errors...)
        raise CheckpointError(f"damaged checkpoint {ckpt}: common.pt cannot be read ({describe(e)})") from e


def verify_checkpoint(path: str | Path, mode: str = "checksum") -> Path:
    """Collective: check the checkpoint `path` designates against its manifest (`mode`: "checksum"
    reads every file, "size" only stats them) and return its directory. CheckpointError names the
    damaged file; a checkpoint from before manifests passes with a warning."""
    if mode not in VERIFY_MODES:
        raise CheckpointError(f"checkpoint verification {mode!r}: expected one of {VERIFY_MODES}")
    ckpt = _resolve(path)
    if verify_manifest(ckpt, mode):
        return ckpt
    if _load_common(ckpt).get("has_manifest"):
        raise CheckpointError(f"damaged checkpoint {ckpt}: {MANIFEST} is missing, but this checkpoint was saved "
                              f"with one (its common.pt says so); the copy is incomplete: copy it again")
    log.warning("%s has no %s (saved before checkpoints carried one): its files are not verified", ckpt, MANIFEST)
    return ckpt


def read_common(path: str | Path) -> dict[str, Any]:
    """Step, layout, extra state, formats and model dims of a checkpoint, without building a model."""
    ckpt = _resolve(path)
    common = _load_common(ckpt)
    version = common.get("format_version")
    if version not in _MODEL_METADATA:
        raise CheckpointError(f"{ckpt}: not a megatron_rl trainer checkpoint this version reads (format_version "
                              f"{version!r}; readable: {sorted(_MODEL_METADATA)})")
    try:
        return {"path": ckpt, "step": int(common["step"]), "layout": dict(common["layout"]),
                "extra": json.loads(common["extra_json"]), "has_optimizer": bool(common["has_optimizer"]),
                "format_version": int(version),
                "optimizer_format": common.get("optimizer_format", "dp_reshardable"),  # v1: dp_reshardable
                "model_dims": common.get("model_dims"), "has_reference": bool(common.get("has_reference", False)),
                "lora": common.get("lora")}  # checkpoints from before LoRA: none
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"damaged checkpoint {ckpt}: common.pt lacks or garbles a field "
                              f"({describe(e)})") from e


def load_checkpoint(path: str | Path, model: list, optimizer, layout, load_optimizer: bool = True,
                    reference: list | None = None, verify: str = "checksum") -> LoadResult:
    """Collective: load the checkpoint `path` designates into `model` (+ optimizer, RNG, and the KL
    reference policy into `reference` when both the caller and the checkpoint have one), resharded
    into this layout, after `verify_checkpoint(path, verify)` ("verified": the caller just did).
    Raises CheckpointError for a damaged checkpoint or one of another model."""
    from megatron.core import dist_checkpointing

    meta = read_common(path if verify == "verified" else verify_checkpoint(path, verify))
    ckpt: Path = meta["path"]
    saved, version, fmt = meta["layout"], meta["format_version"], meta["optimizer_format"]
    dims = _dims_record(model)
    _check_same_lora(ckpt, meta["lora"], _lora_record(model))
    if version >= 2:
        _check_same_model(ckpt, meta["model_dims"] or {}, dims)
    else:
        _check_v1_padding(ckpt, dims, int(saved["tp"]), layout.tp)
    same_mp = (saved["tp"], saved["pp"], saved.get("vpp")) == (layout.tp, layout.pp, layout.vpp)
    want_opt = load_optimizer and optimizer is not None and meta["has_optimizer"]
    with_opt = want_opt and (fmt == "fully_reshardable" or same_mp)
    with_rng = saved == _layout_now(layout)
    if want_opt and not with_opt:
        log.warning("%s was saved with tp=%s pp=%s vpp=%s and a dp_reshardable optimizer; loading the model "
                    "resharded into tp=%s pp=%s vpp=%s, optimizer state NOT loaded (Adam restarts)", ckpt,
                    saved["tp"], saved["pp"], saved.get("vpp"), layout.tp, layout.pp, layout.vpp)
    with_ref = reference if meta["has_reference"] else None
    state = _sharded_state(model, optimizer, layout, is_loading=True, with_optimizer=with_opt, with_rng=with_rng,
                           version=version, optimizer_format=fmt, reference=with_ref)
    try:
        loaded = dist_checkpointing.load(state, str(ckpt))
    except CheckpointError:
        raise
    except Exception as e:  # verified files make this rare; unverified (old) ones fail here in any type
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {describe(e)}") from e
    for i, chunk in enumerate(model):
        target = chunk.module if hasattr(chunk, "module") else chunk
        target.load_state_dict(loaded[_model_key(i, len(model))])
    for i, chunk in enumerate(with_ref or []):
        chunk.load_state_dict(_strip_prefix(loaded[f"reference{i}"], REFERENCE_PREFIX))
    if with_opt:
        optimizer.load_state_dict(loaded["optimizer"])
    if with_rng:
        set_rng_state(loaded["rng_state"])
    barrier()
    return LoadResult(path=ckpt, step=meta["step"], extra=meta["extra"], saved_layout=saved,
                      optimizer_loaded=with_opt, rng_restored=with_rng, optimizer_format=fmt,
                      reference_loaded=with_ref is not None)


def _strip_prefix(sd: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}
