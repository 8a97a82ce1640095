"""LoRA vs full training on the same model, in one run: trainer peak memory and tokens/s, push bytes and time.

    .venv/bin/python benchmarks/lora.py [--model smollm2-135m] [--weights random|real] [--rank 16] [--seqs 8] [--min-len 64]
        [--max-len 192] [--steps 2] [--rounds 1] [--precision fp32|bf16] [--bucket-mb 64] [--push-reps 2] [--no-http]

Each (mode, round) runs in a fresh process, modes alternating (full, lora, lora, full, ...) so load from
other processes falls on both alike: it builds the `Trainer` (`trainer.lora.rank` = --rank on all four
targets, or 0 = full training), runs one warm-up `train_on` (the optimizer state is allocated there) and
`--steps` timed ones on the same random batch. Reported per mode (median over rounds):
- trainer memory: the peak while training (the peak counter reset once the Trainer is built, so the
  build's transients are left out) minus the memory before the Trainer was built (CPU: RSS, glibc
  returning large frees at once; GPU: the CUDA allocator's): weights, gradients, optimizer state and the
  step's activations together;
- tokens/s of `train_on` (real tokens; the optimizer step included);
- push: what the trainer sends to the generators after an update, streamed as the weight push streams
  it (`sync.pipeline.BucketStream`, buckets of --bucket-mb) and broadcast over gloo to a receiver
  process on this machine; time from the first exported tensor to the receiver's answer. The
  generator's own load is not in it. Full training and LoRA both push the whole merged model today
  (`hf_weights.export_hf_tensors`, W + alpha/r B A per adapted weight), so their bytes are equal. The
  LoRA process also streams its adapters alone (`lora_weights.export_adapter_tensors`, PEFT's tensors):
  what the adapter push sends (PEFT's tensors) over the same gloo path, for comparison.
- HTTP adapter push into a real SGLang server (the LoRA process, unless --no-http): the real trainer-side
  code (`sync.trainer_push.TrainerPush(adapters=True)`, `trainer.lora.push: adapter`): the adapters
  gathered, pickled, base64 in one `/load_lora_adapter_from_tensors` request, then the server holding the
  adapter checked, into one server started as a run starts it (`--enable-lora`, on CPU `--lora-backend
  torch_native`), the server's load included. Its base: the trainer's weights written as an HF folder with
  --model's config and tokenizer, float32, one thread, a port in 31700-31799. Best of --push-reps after a
  warm-up push. Compared with the merged push of the same process over gloo above (which leaves out
  SGLang's load of the merged weights, so the ratio flatters the merged push). The merged push into a real server is
  not timed here: on this loaded machine (load average 25) its update group's first broadcast timed out.
Ratios are LoRA / full, and HTTP adapter push / merged push. On GPU both modes build the local layer spec (MEGATRON_RL_GPU_TE=0: LoRA refuses
Transformer Engine), so the comparison is like for like.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = timedelta(seconds=600)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ receiver (a generator's stand-in)
def receive(port: int) -> None:
    """Join the pair group, then per push: [nbytes] headers and buckets until a 0 header, then answer."""
    import torch
    import torch.distributed as dist

    from megatron_rl.sync.group import _join

    torch.set_num_threads(1)
    pg = _join("gloo", "127.0.0.1", port, 2, 1, "bench-lora", TIMEOUT)
    header = torch.zeros(1, dtype=torch.int64)
    while True:
        dist.broadcast(header, group=pg, group_src=0)
        n = int(header.item())
        if n < 0:
            return
        if n == 0:
            dist.broadcast(torch.zeros(1), group=pg, group_src=1)  # done: every byte landed
            continue
        dist.broadcast(torch.empty(n, dtype=torch.uint8), group=pg, group_src=0)


def push(pg, named, bucket_mb: float) -> tuple[int, float, int]:
    """Stream `named` in buckets to the receiver: (bytes, seconds, tensors)."""
    import torch
    import torch.distributed as dist

    from megatron_rl.sync.buckets import ramp_start
    from megatron_rl.sync.pipeline import BucketStream

    cap = int(bucket_mb * (1 << 20))
    total = tensors = 0
    start = time.perf_counter()
    for bucket in BucketStream(named, cap, "cpu", first_bucket_bytes=ramp_start(cap)):
        dist.broadcast(torch.tensor([bucket.nbytes], dtype=torch.int64), group=pg, group_src=0)
        dist.broadcast(bucket.flat, group=pg, group_src=0)
        total += bucket.nbytes
        tensors += len(bucket.metas)
    dist.broadcast(torch.zeros(1, dtype=torch.int64), group=pg, group_src=0)
    dist.broadcast(torch.zeros(1), group=pg, group_src=1)
    return total, time.perf_counter() - start, tensors


# ------------------------------------------------------------------ one mode in a fresh process
def child(args: argparse.Namespace) -> dict:
    import torch
    import torch.multiprocessing as mp

    from megatron_rl.config import config_from_dict
    from megatron_rl.platform import memory
    from megatron_rl.sync.group import _join, free_port
    from megatron_rl.train.hf_weights import export_hf_tensors
    from megatron_rl.train.lora_weights import export_adapter_tensors
    from megatron_rl.train.trainer import Trainer

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from trainer import make_batch  # the trainer benchmark's random batch

    cuda = torch.cuda.is_available()
    before = memory.start_peak_window()
    trainer_cfg = {"model": args.model, "precision": args.precision, "lr": 1e-5, "micro_batch_tokens": args.micro_tokens}
    if args.mode == "lora":
        trainer_cfg["lora"] = {"rank": args.rank, "alpha": 2.0 * args.rank}
    t0 = time.perf_counter()
    if args.weights == "random":  # the model's shapes, random weights: no checkpoint to read and convert
        from megatron_rl.train.hf_source import resolve_model

        torch.manual_seed(0)
        hf_config = resolve_model(args.model).config()
        trainer = Trainer(config_from_dict({"trainer": {**trainer_cfg, "model": "random"}}), hf_config=hf_config,
                          load_weights=False)
    else:
        trainer = Trainer(config_from_dict({"trainer": trainer_cfg}))
    _progress(f"{args.mode}: trainer built in {time.perf_counter() - t0:.1f} s")
    # the peak from here on: the model as built plus what training adds (gradients, optimizer state,
    # activations), without the transients of building it (the same in both modes)
    memory.start_peak_window()
    batch = make_batch(trainer.dims.vocab_size, args.seqs, args.min_len, args.max_len)
    real = sum(len(s.token_ids) for s in batch.sequences)
    trainer.train_on(batch)  # warm-up: Adam state, buffers
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_on(batch)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = memory.window_peak()
    trained = sum(p.numel() for c in trainer.model_chunks for p in c.parameters() if p.requires_grad)
    total = sum(p.numel() for c in trainer.model_chunks for p in c.parameters())

    _progress(f"{args.mode}: {args.steps} steps of {real} tokens: {[round(t, 2) for t in times]} s")
    port = free_port()
    receiver = mp.get_context("spawn").Process(target=receive, args=(port,))
    receiver.start()
    pg = _join("gloo", "127.0.0.1", port, 2, 0, "bench-lora", TIMEOUT)
    out = {"mode": args.mode, "memory_bytes": peak - before, "tokens_per_s": real * len(times) / sum(times),
           "tokens": real, "step_s": times, "trained_params": trained, "params": total,
           "device": "cuda" if cuda else "cpu"}
    pushes = {"merged": lambda: export_hf_tensors(trainer.model_chunks)}
    if args.mode == "lora":
        pushes["adapters"] = lambda: export_adapter_tensors(trainer.model_chunks)
    import torch.distributed as dist

    for name, named in pushes.items():
        push(pg, named(), args.bucket_mb)  # warm-up: buffers, page faults
        runs = [push(pg, named(), args.bucket_mb) for _ in range(args.push_reps)]
        out[f"push_{name}_bytes"], _, out[f"push_{name}_tensors"] = runs[0]
        out[f"push_{name}_s"] = min(r[1] for r in runs)
        _progress(f"{args.mode}: {name} push {runs[0][0] / 2**20:.1f} MiB in {out[f'push_{name}_s']:.3f} s")
    dist.broadcast(torch.tensor([-1], dtype=torch.int64), group=pg, group_src=0)
    receiver.join()
    if args.mode == "lora" and args.http:
        out.update(http_pushes(args, trainer))
    return out


# ------------------------------------------------------------------ pushes into a real SGLang server
def http_pushes(args: argparse.Namespace, trainer) -> dict:
    """The adapter push through `TrainerPush` into a real LoRA-enabled server (module docstring)."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from megatron_rl.config.trainer import LORA_TARGETS
    from megatron_rl.rollout.adapters import adapter_name, lora_server_args
    from megatron_rl.rollout.server import ServerSpec, SGLangServer
    from megatron_rl.sync.group import free_port
    from megatron_rl.sync.sender import SyncTarget
    from megatron_rl.sync.trainer_push import TrainerPush
    from megatron_rl.train.hf_source import resolve_model
    from megatron_rl.train.hf_weights import export_hf_tensors

    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    out: dict = {}
    try:
        source = resolve_model(args.model)
        config = source.config()
        config.dtype = "float32"
        config.save_pretrained(folder)
        source.tokenizer().save_pretrained(folder)
        state = {n: t.detach().cpu().clone() for n, t in export_hf_tensors(trainer.model_chunks)}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        del state
        spec = ServerSpec(model_path=str(folder), port=free_port(), max_total_tokens=1024, dtype="float32",
                          log_path=str(folder / "server.log"), threads=1, startup_timeout_s=900,
                          extra_args=lora_server_args(args.rank, LORA_TARGETS))
        t0 = time.perf_counter()
        with SGLangServer(spec) as server:
            _progress(f"lora: LoRA-enabled server up in {time.perf_counter() - t0:.1f} s")
            pusher = TrainerPush(trainer.model_chunks, args.bucket_mb, "127.0.0.1", adapters=True,
                                 base_model=str(folder))
            target = SyncTarget(server.url, 1, 0)
            times, report = [], None
            for version in range(1, args.push_reps + 2):  # the first: warm-up
                t0 = time.perf_counter()
                report = pusher.push(version, [target])
                assert adapter_name(version) in server.client.loaded_adapters()  # what finish_update checks
                times.append(time.perf_counter() - t0)
                if version > 1:
                    server.client.unload_lora_adapter(adapter_name(version - 1))
            out["http_adapter_s"] = min(times[1:])
            out["http_adapter_bytes"], out["http_adapter_tensors"] = report.bytes, report.tensors
            _progress(f"lora: HTTP adapter push {report.bytes / 2**20:.2f} MiB, {report.tensors} tensors, "
                      f"{[round(t, 3) for t in times]} s (first: warm-up)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def run_child(args: argparse.Namespace, mode: str) -> dict:
    from megatron_rl.platform.memory import exact_malloc_env

    env = exact_malloc_env()
    env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["MEGATRON_RL_GPU_TE"] = "0"  # the same layer spec for both modes (LoRA refuses TE)
    argv = [a for a in sys.argv[1:]] + ["--child", mode]
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())] + argv, capture_output=True, text=True,
                          env=env, cwd=str(ROOT), timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    for line in proc.stderr.splitlines():
        if line.startswith(f"{mode}: "):
            print(line, file=sys.stderr)
    if proc.returncode != 0 or not lines:
        sys.exit(f"{mode} child failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def report(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    full, lora = results["full"][0], results["lora"][0]
    mb = 1 << 20
    print(f"model {args.model} ({full['params'] / 1e6:.1f} M parameters), {args.precision}, device {full['device']}, "
          f"batch {args.seqs} sequences / {full['tokens']} tokens, {args.steps} timed steps x {args.rounds} round(s); "
          f"LoRA rank {args.rank} alpha {2 * args.rank:g} on linear_qkv, linear_proj, linear_fc1, linear_fc2: "
          f"{lora['trained_params'] / 1e6:.2f} M trained ({100 * lora['trained_params'] / lora['params']:.2f} %)")
    print(f"{'':28}{'full':>12}{'LoRA':>12}{'LoRA/full':>11}")
    rows = [("trainer memory (MiB)", med("full", "memory_bytes") / mb, med("lora", "memory_bytes") / mb),
            ("train tokens/s", med("full", "tokens_per_s"), med("lora", "tokens_per_s")),
            ("push bytes (MiB)", full["push_merged_bytes"] / mb, lora["push_merged_bytes"] / mb),
            ("push time (s)", med("full", "push_merged_s"), med("lora", "push_merged_s"))]
    for label, a, b in rows:
        print(f"{label:28}{a:12.2f}{b:12.2f}{b / a:10.3f}x")
    ad_bytes, ad_s = lora["push_adapters_bytes"] / mb, med("lora", "push_adapters_s")
    print(f"{'adapter-only push (MiB, s)':28}{'':12}{ad_bytes:12.2f}{ad_bytes / rows[2][1]:10.4f}x bytes")
    print(f"{'':28}{'':12}{ad_s:12.3f}{ad_s / rows[3][1]:10.4f}x time")
    print(f"gloo push: the merged model ({full['push_merged_tensors']} tensors) in both modes, so the bytes are "
          f"equal; the adapters alone ({lora['push_adapters_tensors']} tensors) {ad_bytes:.2f} MiB")
    if "http_adapter_s" in lora:
        h_bytes, h_s = lora["http_adapter_bytes"] / mb, med("lora", "http_adapter_s")
        m_bytes, m_s = lora["push_merged_bytes"] / mb, med("lora", "push_merged_s")
        print(f"HTTP adapter push into a real SGLang server (TrainerPush, the server's load included), "
              f"{lora['http_adapter_tensors']} tensors, vs the LoRA process's merged push (gloo, no server load):")
        print(f"{'':28}{'merged':>12}{'adapter':>12}{'adapter/merged':>16}")
        print(f"{'bytes (MiB)':28}{m_bytes:12.2f}{h_bytes:12.2f}{h_bytes / m_bytes:15.4f}x")
        print(f"{'time (s)':28}{m_s:12.3f}{h_s:12.3f}{h_s / m_s:15.4f}x")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", choices=["random", "real"], default="random",
                    help="random: --model's architecture with random weights (the figures do not depend on the "
                         "values; reading and de-quantising SmolLM2's GGUF takes minutes on a loaded machine)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument("--micro-tokens", type=int, default=1024, help="packing bin capacity")
    ap.add_argument("--steps", type=int, default=2, help="timed train_on steps per process")
    ap.add_argument("--rounds", type=int, default=1, help="processes per mode (alternating)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                    help="default: bf16 on GPU, fp32 on CPU (bf16 matmuls are emulated, and slow, on CPUs "
                         "without AVX512-BF16 / AMX)")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--push-reps", type=int, default=2, help="timed pushes per kind; the best is reported")
    ap.add_argument("--no-http", dest="http", action="store_false",
                    help="skip the HTTP adapter push into a real SGLang server")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per process")
    ap.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.precision is None:
        import torch

        args.precision = "bf16" if torch.cuda.is_available() else "fp32"
    if args.child:
        args.mode = args.child
        result = child(args)
        os.write(sys.stdout.fileno(), (json.dumps(result) + "\n").encode())
        return
    results: dict[str, list[dict]] = {"full": [], "lora": []}
    for i in range(args.rounds):
        for mode in (("full", "lora") if i % 2 == 0 else ("lora", "full")):
            results[mode].append(run_child(args, mode))
    report(args, results)


if __name__ == "__main__":
    main()
