"""`megatron-rl convert {to-megatron,to-hf} SRC OUT [--tp N --pp N] [--peft-adapter DIR]`: HF <-> Megatron
dist checkpoints (a LoRA run's exports merged, and as a PEFT adapter folder with --peft-adapter).

Launch under torchrun (or srun) with TP*PP*DP processes for a sharded layout; a plain process is a
world of one. See megatron_rl.train.convert for what bounds memory.
"""
from __future__ import annotations

import argparse

from megatron_rl.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    a = sub.add_parser("to-megatron", help="HF directory (or smollm2-135m) -> dist checkpoint root")
    a.add_argument("source", help="HF model directory (config.json + safetensors) or smollm2-135m")
    a.add_argument("out", help="checkpoint root to create (iter_0000000/, latest_checkpointed_iteration.txt, "
                               "hf_config/)")
    b = sub.add_parser("to-hf", help="dist checkpoint (root or step dir) -> HF directory")
    b.add_argument("checkpoint", help="checkpoint root (the iteration its latest_checkpointed_iteration.txt "
                                      "names) or one iter_* directory")
    b.add_argument("out", help="HF directory to write (safetensors shards, index, config, tokenizer)")
    b.add_argument("--hf-config", default=None,
                   help="HF config source (model dir/name); default: hf_config/ next to the checkpoint")
    b.add_argument("--peft-adapter", default=None, metavar="DIR",
                   help="a LoRA run's checkpoint (trainer.lora): also write its adapters as an HF PEFT adapter "
                        "folder (adapter_config.json + adapter_model.safetensors); OUT gets the merged model "
                        "(default: none, only the merged model)")
    b.add_argument("--max-shard-mb", type=int, default=2048, help="size of each safetensors shard")
    b.add_argument("--verify", choices=["checksum", "size"], default="checksum",
                   help="check the checkpoint's files against its manifest: CRC32 of every file (default), "
                        "or presence and sizes only (no extra read of a large checkpoint)")
    a.add_argument("--force", action="store_true",
                   help="write into a folder that already holds checkpoints (moves its tracker file to step 0)")
    for p in (a, b):
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of this job")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of this job")
        p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                       help="weights dtype (default: the source's)")
        p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl on GPU")


def main(args: argparse.Namespace) -> int:
    from megatron_rl.platform import silence_expected_cpu_warnings

    # the conversion imports Megatron-Core before init_parallel would silence its CPU import warnings
    silence_expected_cpu_warnings()
    from megatron_rl.train.convert import ConversionError, hf_to_megatron, megatron_to_hf
    from megatron_rl.train.checkpoint_manifest import CheckpointError
    from megatron_rl.train.parallel import ParallelLayout

    try:
        layout = ParallelLayout(args.tp, args.pp, dp=0)
        if args.direction == "to-megatron":
            r = hf_to_megatron(args.source, args.out, layout, dtype=args.dtype, backend=args.backend,
                               force=args.force)
        else:
            if args.max_shard_mb < 1:
                raise ValueError("--max-shard-mb must be >= 1")
            r = megatron_to_hf(args.checkpoint, args.out, layout, hf_config=args.hf_config, dtype=args.dtype,
                               max_shard_bytes=args.max_shard_mb << 20, backend=args.backend,
                               verify=args.verify, peft_dir=args.peft_adapter)
    except (ConversionError, CheckpointError, FileNotFoundError, ValueError) as e:
        log.error("%s", e)
        return 1
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"convert: wrote {r.path} (tp={r.layout.tp} pp={r.layout.pp} dp={r.layout.dp}"
              + (f", {len(r.files)} file(s)" if r.files else "") + ")", flush=True)
    return 0
