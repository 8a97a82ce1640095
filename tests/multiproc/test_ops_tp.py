"""Vocab-parallel (TP=2, two gloo processes on CPU) fused losses equal TP=1.

Each rank holds its half of the vocabulary (logits, or output-weight rows); the loss must be the
TP=1 value on both ranks, each rank's logits gradient the matching slice of the TP=1 gradient, and
the fused-linear hidden gradient (all-reduced) the TP=1 one. Also with TP vocab padding (`vocab_size`
below the padded width, so rank 1's shard is partly padding): the padding gets zero gradient.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EPS_LOW, EPS_HIGH = 0.2, 0.28
B, T, H, V = 2, 7, 12, 2 * 41  # odd local vocab: exercises the non-vector tails too
# Real vocab of the padded case: rank 1's shard [41, 82) is 34 real columns + 7 of TP padding (which
# hold large logits / non-zero weight rows here, so including them anywhere would show).
VOCAB_PADDED = V - 7


def make_inputs(dtype, vocab: int = V):
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
    logits[..., vocab:] = 5.0
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    targets = torch.randint(0, vocab, (B, T), generator=g)
    targets[0, :3] = torch.tensor([0, V // 2 - 1, V // 2])  # shard edges
    ratio = 0.4 + 1.4 * torch.rand(B, T, generator=g, dtype=torch.float64)
    exact = torch.log_softmax(logits[..., :vocab].double(), -1).gather(-1, targets[..., None])[..., 0]
    behaviour = (exact - ratio.log()).float()
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    return logits, hidden, weight, targets, behaviour, adv, mask


def run_all(rank: int, world: int, group) -> dict:
    """Loss and gradients of this rank's shard for each backend/dtype/op."""
    from megatron_rl.ops import _backend, fused_clipped_loss, fused_linear_clipped_loss

    out = {}
    backends = ["torch"] + (["ext"] if _backend.extension_available() else [])
    vl = V // world
    cols = slice(rank * vl, (rank + 1) * vl)
    for backend in backends:
        os.environ["MEGATRON_RL_OPS_BACKEND"] = backend
        for dtype in (torch.float32, torch.bfloat16):
            for vocab in (V, VOCAB_PADDED):
                logits, hidden, weight, targets, behaviour, adv, mask = make_inputs(dtype, vocab)
                z = logits[..., cols].clone().requires_grad_(True)
                loss, logp = fused_clipped_loss(z, targets, behaviour, adv, mask, EPS_LOW, EPS_HIGH,
                                                tp_group=group, vocab_size=vocab, return_logprobs=True)
                loss.backward()
                h = hidden.clone().requires_grad_(True)
                w = weight[cols].clone().requires_grad_(True)
                lin = fused_linear_clipped_loss(h, w, targets, behaviour, adv, mask, EPS_LOW, EPS_HIGH,
                                                tp_group=group, chunk_tokens=5, vocab_size=vocab)
                lin.backward()
                out[(backend, str(dtype), vocab)] = dict(loss=loss.detach(), grad=z.grad, lin=lin.detach(),
                                                         grad_h=h.grad, grad_w=w.grad, logp=logp)
    return out


def _worker(rank: int, world: int, init_file: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(run_all(rank, world, dist.group.WORLD), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_equals_tp1(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = run_all(0, 1, None)
    assert set(ranks[0]) == set(single) and len(single) >= 2
    for key, ref in single.items():
        tol = dict(rtol=1e-5, atol=1e-6) if "float32" in key[1] else dict(rtol=2e-2, atol=2e-2)
        for r in ranks:
            torch.testing.assert_close(r[key]["loss"], ref["loss"], **tol, msg=f"loss {key}")
            torch.testing.assert_close(r[key]["lin"], ref["lin"], **tol, msg=f"linear loss {key}")
            torch.testing.assert_close(r[key]["grad_h"].float(), ref["grad_h"].float(), **tol,
                                       msg=f"hidden grad {key}")
            torch.testing.assert_close(r[key]["logp"], ref["logp"], rtol=1e-5, atol=1e-5, msg=f"logp {key}")
        grad = torch.cat([r[key]["grad"] for r in ranks], dim=-1)
        torch.testing.assert_close(grad.float(), ref["grad"].float(), **tol, msg=f"logits grad {key}")
        grad_w = torch.cat([r[key]["grad_w"] for r in ranks], dim=0)
        torch.testing.assert_close(grad_w.float(), ref["grad_w"].float(), **tol, msg=f"weight grad {key}")
        assert ref["grad"].abs().sum() > 0
        vocab = key[2]  # padding columns / weight rows: zero gradient on the rank that holds them
        assert torch.count_nonzero(grad[..., vocab:]) == 0 and torch.count_nonzero(grad_w[vocab:]) == 0
    # the padded TP=1 reference itself: log_softmax over the real columns only
    logits, _, _, targets, *_ = make_inputs(torch.float32, VOCAB_PADDED)
    exact = torch.log_softmax(logits[..., :VOCAB_PADDED].double(), -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(single[("torch", str(torch.float32), VOCAB_PADDED)]["logp"].double(), exact,
                               rtol=0, atol=2e-5)
