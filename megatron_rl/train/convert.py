"""Checkpoint conversion HF <-> Megatron-Core dist-checkpoint (the families of train.model), any TP/PP.

Both directions are collective over the torch.distributed world (launch with torchrun/srun for
TP*PP > 1; a plain process is a world of one). The layout of the job decides the sharding:

- `hf_to_megatron(source, root, layout)`: every rank builds its TP/PP shard of the Megatron model
  (`train.model.build_model`), fills it from the HF safetensors *one tensor at a time*
  (`train.hf_weights.load_hf_weights` over the lazy `SafetensorsTensors`), and the shards are saved
  with `train.checkpoint.save_checkpoint` (atomic, resumable by the Trainer, reshardable to any
  TP/PP on load). The HF config and tokenizer are copied to `root/hf_config/` so that the reverse
  conversion needs nothing else. A folder that already holds checkpoints (a tracker file,
  `iter_*`: a run's) is refused unless `force=True`: the conversion would move its tracker to step 0.
- `megatron_to_hf(checkpoint, out_dir, layout, peft_dir=None)`: checks the checkpoint's files against its manifest
  (`verify`: "checksum" or "size"; a damaged file is a CheckpointError naming it, before anything
  is read), loads it (a converted one or a trainer checkpoint) at the job's layout — `train.checkpoint` reshards TP, PP and DP, TP padding
  included, and refuses a checkpoint of another model than the HF config describes — then streams
  `export_hf_tensors` (TP-gathered, padding removed, one tensor at a time) into safetensors
  shards written by TP rank 0 / DP rank 0 of every pipeline stage (`hf_writer.ShardWriter`).
  Rank 0 names the files and writes the index, config and tokenizer. A LoRA run's checkpoint
  (train/lora.py) exports merged weights, and with `peft_dir` also an HF PEFT adapter folder.

Memory per rank: its model shard (1 / (TP*PP) of the model) plus, transiently, one HF tensor
(q/k/v: three, while they are fused) on the way in; on the way out, one gathered full tensor plus
one output shard buffer (`max_shard_bytes`, default 2 GiB). The whole model is never held twice.
Output folders must be on a file system every rank sees (one node, or a shared FS under srun).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.progress import CountingMapping, Progress
from megatron_rl.train.parallel import ParallelLayout, init_parallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


class ConversionError(RuntimeError):
    pass


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    layout: ParallelLayout
    n_tensors: int  # tensors this rank wrote (export) or loaded (import)
    files: tuple[str, ...] = ()
    peak_buffer_bytes: int = 0  # largest output buffer this rank held (export)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _dtype_of_name(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ConversionError(f"dtype {name!r}: expected one of {list(DTYPES)}") from None


def _hf_dtype(config) -> torch.dtype:
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if d in DTYPES.values() else torch.float32


def _plain_config(config):
    """An HF config that `save_pretrained` accepts (a GGUF-loaded config carries quantisation)."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def save_hf_meta(source, folder: Path) -> None:
    """config.json and the tokenizer files of `source` (a ModelSource) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    _plain_config(source.config()).save_pretrained(folder)
    if source.gguf_file:
        try:
            source.tokenizer().save_pretrained(folder)
        except Exception:  # a GGUF without a tokenizer still converts; say so in the folder
            (folder / "NO_TOKENIZER").write_text("the source had no loadable tokenizer\n")
        return
    for name in _TOKENIZER_FILES:
        if (source.path / name).is_file():
            shutil.copy2(source.path / name, folder / name)


def _start(layout: ParallelLayout, backend: str | None) -> ParallelLayout:
    return init_parallel(layout, backend=backend)


def refuse_checkpoint_root(root: Path, step: int = 0) -> None:
    """ConversionError when `root` already holds checkpoints (a tracker file or iteration directories)."""
    from megatron_rl.train.checkpoint_dirs import TRACKER, complete_checkpoints, holds_checkpoints

    steps = [p.name for p in complete_checkpoints(root)]
    if steps or holds_checkpoints(root):
        held = f"{len(steps)} iteration directories ({steps[0]} .. {steps[-1]})" if steps else "a tracker file"
        raise ConversionError(f"{root} already holds checkpoints: {held}; converting into it would point "
                              f"{TRACKER} at the converted step {step}. Choose a new folder, or pass --force "
                              f"(force=True) to write there anyway")


def hf_to_megatron(source: str | Path, root: str | Path, layout: ParallelLayout = ParallelLayout(dp=0),
                   dtype: str | None = None, backend: str | None = None, step: int = 0,
                   force: bool = False) -> ConvertResult:
    """Collective: HF model (directory or `smollm2-135m`) -> dist checkpoint under `root`, which
    must hold no checkpoints yet unless `force`."""
    from megatron_rl.train.checkpoint import save_checkpoint
    from megatron_rl.train.hf_source import resolve_model
    from megatron_rl.train.hf_weights import load_hf_weights
    from megatron_rl.train.model import build_model

    if not force:  # before anything starts: a refused conversion changes nothing
        refuse_checkpoint_root(Path(root), step)
    layout = _start(layout, backend)
    src = resolve_model(source)
    config = src.config()
    torch_dtype = _dtype_of_name(dtype) or _hf_dtype(config)
    chunks = build_model(config, layout, torch_dtype)
    tensors = src.tensors()
    with Progress(len(tensors), "reading HF tensors", unit="tensor", enabled=_rank() == 0) as bar:
        load_hf_weights(chunks, CountingMapping(tensors, bar))
    root = Path(root)
    if _rank() == 0:
        save_hf_meta(src, root / "hf_config")
    _barrier()
    extra = {"converted_from": str(source), "dtype": str(torch_dtype).removeprefix("torch."),
             "model_type": config.model_type}
    path = save_checkpoint(root, chunks, None, layout, step, extra=extra)
    n = sum(1 for c in chunks for _ in c.parameters())
    return ConvertResult(path, layout, n)


def checkpoint_dtype(ckpt: Path) -> torch.dtype:
    """dtype of the model weights stored in a dist checkpoint (from its metadata, no tensor read)."""
    from megatron.core import dist_checkpointing

    from megatron_rl.train.checkpoint_manifest import describe

    try:
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
    except Exception as e:  # an unverified (pre-manifest) checkpoint's damaged .metadata, in any type
        raise ConversionError(f"checkpoint {ckpt}: its tensor metadata (.metadata) cannot be read "
                              f"({describe(e)})") from e
    for key, t in meta.items():
        if "word_embeddings" in key or "linear_qkv.weight" in key:
            return t.dtype
    raise ConversionError(f"{ckpt}: no model weights found in the checkpoint metadata")


def find_hf_config(ckpt: Path, hf_config: str | Path | None):
    """The ModelSource giving the architecture: `hf_config`, else `<checkpoint root>/hf_config`."""
    from megatron_rl.train.hf_source import resolve_model

    if hf_config is not None:
        return resolve_model(hf_config)
    for folder in (ckpt / "hf_config", ckpt.parent / "hf_config"):
        if (folder / "config.json").is_file():
            return resolve_model(folder)
    raise ConversionError(f"{ckpt}: no hf_config/ next to the checkpoint (a trainer checkpoint has none): "
                          f"pass --hf-config MODEL (hf_config= from Python), the HF model directory or name "
                          f"it was trained from (its run's trainer.model)")


def _export_bytes(chunks, dtype: torch.dtype) -> int:
    """About what this rank's stage exports (TP-split parameters counted whole; vocab padding included),
    the progress bar's total."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
               for c in chunks for p in c.parameters()) * torch.empty((), dtype=dtype).element_size()


def megatron_to_hf(checkpoint: str | Path, out_dir: str | Path, layout: ParallelLayout = ParallelLayout(dp=0),
                   hf_config: str | Path | None = None, dtype: str | None = None,
                   max_shard_bytes: int = 2 << 30, backend: str | None = None,
                   verify: str = "checksum", peft_dir: str | Path | None = None) -> ConvertResult:
    """Collective: dist checkpoint (root or step dir), checked against its manifest (`verify`:
    "checksum" or "size"), -> HF directory `out_dir`. A checkpoint of a LoRA run (trainer.lora) is
    exported merged (W + alpha/r B A per adapted weight: a plain HF model); `peft_dir` also writes its
    adapters as an HF PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for
    `peft.PeftModel.from_pretrained(base, peft_dir)` on the base model it was trained from."""
    from megatron.core import parallel_state as ps

    from megatron_rl.train.checkpoint import (CheckpointError, load_checkpoint, read_common, resolve_checkpoint,
                                              verify_checkpoint)
    from megatron_rl.train.hf_weights import export_hf_tensors
    from megatron_rl.train.lora import LoraSpec
    from megatron_rl.train.lora_weights import write_peft_adapter
    from megatron_rl.train.model import build_model

    from .hf_writer import ShardWriter, finalize_index

    layout = _start(layout, backend)
    ckpt = resolve_checkpoint(checkpoint)
    if ckpt is None:
        raise ConversionError(f"no complete checkpoint at {checkpoint}")
    verify_checkpoint(ckpt, verify)  # CheckpointError naming the damaged file, before any read
    src = find_hf_config(ckpt, hf_config)
    config = _plain_config(src.config())
    stored = checkpoint_dtype(ckpt)
    saved_lora = read_common(ckpt)["lora"]
    lora = (LoraSpec(saved_lora["rank"], saved_lora["alpha"], saved_lora["dropout"], tuple(saved_lora["targets"]))
            if saved_lora else None)
    if peft_dir is not None and lora is None:
        raise ConversionError(f"{ckpt} holds no LoRA adapters (its run had trainer.lora.rank 0): no PEFT adapter "
                              "folder to write")
    # same dtype as stored: loading is a plain copy; LoRA runs use the local layer spec (lora.check_model)
    chunks = build_model(config, layout, stored, lora=lora, use_te=False if lora else None)
    try:  # reshards into this layout, TP padding included; refuses a checkpoint of another model
        load_checkpoint(ckpt, chunks, None, layout, load_optimizer=False, verify="verified")
    except CheckpointError as e:
        raise ConversionError(f"{e} (HF config used: {src.path})") from e
    out = Path(out_dir)
    out_dtype = _dtype_of_name(dtype) or stored
    writes = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    pp_rank = ps.get_pipeline_model_parallel_rank()
    writer = ShardWriter(out, f"part-pp{pp_rank:03d}", max_shard_bytes) if writes else None
    n = 0
    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        for stale in list(out.glob("*.safetensors")) + list(out.glob("model.safetensors.index.json")):
            stale.unlink()  # a previous export's shards would be mixed with these
    _barrier()
    bar = Progress(_export_bytes(chunks, out_dtype), "writing HF shards", unit="B", unit_scale=True,
                   enabled=writer is not None and _rank() == 0)
    for name, tensor in export_hf_tensors(chunks, dtype=out_dtype):  # every TP rank iterates (gather)
        if writer is not None:
            writer.add(name, tensor)
            n += 1
            bar.update(tensor.numel() * tensor.element_size())
        del tensor
    bar.close()
    weight_map = writer.close() if writer is not None else {}
    total = writer.total_bytes if writer is not None else 0
    peak = writer.peak_buffer_bytes if writer is not None else 0
    gathered = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, (pp_rank, weight_map, total))
    else:
        gathered = [(pp_rank, weight_map, total)]
    files: list[str] = []
    if _rank() == 0:
        parts = sorted((g for g in gathered if g[1]), key=lambda g: g[0])
        files = finalize_index(out, [g[1] for g in parts], sum(g[2] for g in parts))
        config.dtype = out_dtype
        config.save_pretrained(out)
        for name in _TOKENIZER_FILES:
            if (src.path / name).is_file() and not src.gguf_file:
                shutil.copy2(src.path / name, out / name)
        if src.gguf_file:
            src.tokenizer().save_pretrained(out)
        (out / "megatron_rl_export.json").write_text(json.dumps(
            {"checkpoint": str(ckpt), "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp},
             "dtype": str(out_dtype).removeprefix("torch.")}, indent=2))
    _barrier()
    if peft_dir is not None:  # collective: every stage's adapters, TP-gathered, reach rank 0
        write_peft_adapter(chunks, peft_dir, str(hf_config if hf_config is not None else src.path),
                           dtype=out_dtype)
        _barrier()
    return ConvertResult(out, layout, n, tuple(files), peak)
