"""torchrun worker for tests/multiproc/test_train_model_parallel.py.

argv: CASES_JSON OUT_DIR. Each case: {name, model_dir, tokens, tp, pp, vpp, grad_weights?}. Per case,
every rank builds the Megatron model for the layout, loads the HF weights, runs Megatron's pipeline
schedule (forward only, or forward+backward of sum(logprobs * grad_weights) when given) and writes:
- OUT/{name}.logprobs.pt (last stage, TP rank 0): logprobs and entropy [B, T-1]
- OUT/{name}.export.pp{r}.vp.json (TP rank 0 of each stage): exported HF names, and which of them
  differ bit-wise from the source tensors
- OUT/{name}.grads.pp{r}.pt (TP rank 0, when grad_weights): exported HF-named gradients
"""
import json
import sys
from pathlib import Path

import torch


def run_case(case: dict, out: Path) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.train.hf_source import resolve_model
    from megatron_rl.train.hf_weights import export_hf_tensors, load_hf_weights
    from megatron_rl.train.logprobs import token_logprobs
    from megatron_rl.train.model import build_model, forward_logits
    from megatron_rl.train.parallel import ParallelLayout, init_parallel, tp_group

    layout = init_parallel(ParallelLayout(case["tp"], case["pp"], 1, case.get("vpp")), backend="gloo")
    source = resolve_model(case["model_dir"])
    config = source.config()
    chunks = build_model(config, layout, torch.float32)
    load_hf_weights(chunks, source.tensors())
    tokens = torch.load(case["tokens"])
    weights = torch.load(case["grad_weights"]) if case.get("grad_weights") else None
    n_mb, t = tokens.shape
    collected = []

    def forward_step(data_iterator, model):
        i = next(data_iterator)
        ids = tokens[i:i + 1]
        output = forward_logits(model, ids)

        def loss_func(logits):
            lp, ent = token_logprobs(logits[:, :-1], ids[:, 1:], tp_group(), config.vocab_size,
                                     chunk_tokens=7, with_entropy=True)  # small chunks: test chunking
            loss = (lp * weights[i:i + 1]).sum() if weights is not None else lp.sum() * 0
            collected.append((i, lp.detach(), ent.detach()))
            return loss, {"lp": lp.detach()}

        return output, loss_func

    fb = get_forward_backward_func()
    iters = [iter(range(n_mb)) for _ in chunks]
    fb(forward_step_func=forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
       model=chunks, num_microbatches=n_mb, seq_length=t, micro_batch_size=1,
       forward_only=weights is None)
    # the schedule scales each microbatch loss by 1/num_microbatches before backward
    if weights is not None and ps.get_tensor_model_parallel_world_size() > 1:
        # q/k norms (Qwen3) are replicated over TP but each rank backpropagates only its heads: the
        # trainer's finalize_model_grads sums their grads over TP; this raw schedule must do it too.
        for chunk in chunks:
            for pname, p in chunk.named_parameters():
                if p.grad is not None and ("q_layernorm" in pname or "k_layernorm" in pname):
                    torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    name = case["name"]
    if collected and tp_rank == 0:
        collected.sort(key=lambda c: c[0])
        torch.save({"logprobs": torch.cat([c[1] for c in collected]),
                    "entropy": torch.cat([c[2] for c in collected])}, out / f"{name}.logprobs.pt")
    source_tensors = source.tensors()
    names, differ = [], []
    for hf_name, tensor in export_hf_tensors(chunks):
        names.append(hf_name)
        if not torch.equal(tensor, source_tensors[hf_name]):
            differ.append(hf_name)
    if weights is not None:
        grads = dict(export_hf_tensors(chunks, grads=True))
        if tp_rank == 0:
            torch.save(grads, out / f"{name}.grads.pp{pp_rank}.pt")
    if tp_rank == 0:
        (out / f"{name}.export.pp{pp_rank}.json").write_text(json.dumps({"names": names, "differ": differ}))


def main() -> None:
    torch.set_num_threads(1)
    from megatron_rl.platform import ensure_megatron_shims

    ensure_megatron_shims()
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for case in cases:
        run_case(case, out)
    from megatron_rl.train.parallel import destroy_parallel

    destroy_parallel(destroy_process_group=True)
    print("WORKER OK", flush=True)


if __name__ == "__main__":
    main()
