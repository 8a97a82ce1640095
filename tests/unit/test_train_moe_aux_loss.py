"""The router load-balancing loss counts real tokens only: packed bins carry padding (bin tails for
SP/PP/EP, all-pad bins for EP, segment tails for CP), and the trainer's forward hands it to Megatron as
`padding_mask`. Reference: the Switch loss E * sum_i f_i P_i (Megatron's definition, f_i the fraction of
top-k slots routed to expert i, P_i the mean router probability) computed by hand from the router's
input of the real tokens."""
import pytest
import torch

from megatron_rl.records import TrainSequence
from megatron_rl.train.packing import pack_sequences
from support.train_models import make_tiny_moe

COEF = 0.01


def _seqs() -> list[TrainSequence]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n, p in ((9, 3), (6, 2)):
        ids = torch.randint(1, 301, (n,), generator=g).tolist()
        out.append(TrainSequence(ids, p, [0.0] * (n - p), advantage=1.0))
    return out


def _switch_loss(x: torch.Tensor, router_weight: torch.Tensor, topk: int) -> torch.Tensor:
    """E * sum_i f_i * P_i over the rows of `x` (tokens x hidden)."""
    probs = torch.softmax(x.double() @ router_weight.double().t(), dim=-1)
    n_tokens, n_experts = probs.shape
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0)
    f = chosen.sum(0) / (n_tokens * topk)
    return n_experts * (f * probs.mean(0)).sum()


def _run(chunk, mb, *, with_mask: bool = True):
    """Forward + backward of zero times the logits (only the aux loss makes grads): per-layer aux loss
    (Megatron's tracker, divided by the coefficient), each router's input, the routers' grads."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from megatron_rl.train.step import _forward

    routers = [layer.mlp.router for layer in chunk.decoder.layers]
    inputs, hooks = [], [r.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for r in routers]
    clear_aux_losses_tracker()
    chunk.zero_grad(set_to_none=True)
    if with_mask:
        logits = _forward(chunk, mb, use_thd=False)
    else:  # what the trainer did before: no padding_mask
        logits = chunk(mb.tokens, mb.position_ids, mb.attention_mask())
    (logits.float().sum() * 0).backward()
    for h in hooks:
        h.remove()
    losses = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()
    return losses, [x.reshape(-1, x.shape[-1]) for x in inputs], [r.weight.grad.clone() for r in routers]


def _chunk(folder, layout, recompute=None):
    from transformers import AutoConfig

    from megatron_rl.train.model import build_model

    chunk = build_model(AutoConfig.from_pretrained(folder), layout, torch.float32, use_te=False,
                        recompute=recompute, router_aux_loss=COEF)[0]
    return chunk.train()


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("aux") / "m", family="qwen3_moe", experts=4, topk=2)


@pytest.fixture(scope="module")
def moe_chunk(tp1, moe_folder):
    chunk = _chunk(moe_folder, tp1)
    with torch.no_grad():  # sharp routing, so that pad tokens visibly skew the expert load
        for layer in chunk.decoder.layers:
            layer.mlp.router.weight.mul_(40.0)
    return chunk


def test_aux_loss_ignores_padding(moe_chunk):
    seqs = _seqs()
    exact = pack_sequences(seqs, capacity=64).micro_batches[0]
    padded = pack_sequences(seqs, capacity=64, pad_to_common=True, common_length=32).micro_batches[0]
    assert exact.length == 15 and padded.length == 32 and int(padded.pad_mask.sum()) == 32 - 15
    assert not exact.pad_mask.any()

    loss_padded, x_padded, grads_padded = _run(moe_chunk, padded)
    loss_exact, x_exact, grads_exact = _run(moe_chunk, exact)
    real = ~padded.pad_mask[0]
    for layer, router in enumerate(l.mlp.router for l in moe_chunk.decoder.layers):
        torch.testing.assert_close(x_padded[layer][real], x_exact[layer], atol=1e-5, rtol=0)
        ref = _switch_loss(x_exact[layer], router.weight.detach(), topk=2)
        torch.testing.assert_close(loss_padded[layer].double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss_exact[layer].double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads_padded[layer], grads_exact[layer], atol=1e-6, rtol=1e-4)

    # the padding does reach the router: without the mask the loss is that of all 32 positions
    loss_unmasked, x_unmasked, _ = _run(moe_chunk, padded, with_mask=False)
    for layer, router in enumerate(l.mlp.router for l in moe_chunk.decoder.layers):
        with_pad = _switch_loss(x_unmasked[layer], router.weight.detach(), topk=2)
        torch.testing.assert_close(loss_unmasked[layer].double(), with_pad, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(loss_unmasked, loss_exact, atol=1e-3)


def test_pad_mask_marks_bin_and_cp_segment_tails():
    seqs = _seqs()  # 9 and 6 tokens: under CP=2 each segment is padded to a multiple of 4 (12 and 8)
    rows = [pack_sequences(seqs, capacity=64, cp=(2, r), pad_multiple=1).micro_batches[0] for r in (0, 1)]
    assert sum(int((~m.pad_mask).sum()) for m in rows) == 15
    for m in rows:  # every pad position holds the pad id, every real one a token of the text (ids >= 1)
        assert (m.tokens[m.pad_mask] == 0).all()


def test_all_padding_bin_adds_no_aux_loss(moe_chunk):
    """EP evens the ranks' bin counts with all-pad bins: they run with no aux loss (no NaN from Megatron's
    division by a zero token count), and the coefficient is back for the next bin."""
    bins = pack_sequences(_seqs(), capacity=64, pad_to_common=True, min_bins=2).micro_batches
    assert bins[1].seq_indices == [] and bool(bins[1].pad_mask.all())
    loss, _, grads = _run(moe_chunk, bins[1])
    assert torch.equal(loss, torch.zeros_like(loss)) and all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    assert moe_chunk.config.moe_aux_loss_coeff == COEF
    loss_real, _, grads_real = _run(moe_chunk, bins[0])
    assert bool((loss_real > 0).all()) and all(bool(g.abs().max() > 0) for g in grads_real)


def test_aux_free_moe_gets_no_padding_mask(tp1, tmp_path):
    from transformers import AutoConfig

    from megatron_rl.train.model import build_model
    from megatron_rl.train.moe import router_padding

    folder = make_tiny_moe(tmp_path / "m", family="qwen3_moe", experts=4, topk=2)
    chunk = build_model(AutoConfig.from_pretrained(folder), tp1, torch.float32, use_te=False)[0]
    mb = pack_sequences(_seqs(), capacity=64, pad_to_common=True, common_length=32).micro_batches[0]
    with router_padding(chunk, mb, {"x": 1}) as kw:
        assert kw == {"x": 1}  # coefficient 0: nothing to mask


def test_all_padding_bin_adds_no_aux_loss_under_full_recompute(tp1, moe_folder, moe_chunk):
    """Full recompute re-runs each layer in the backward, and that re-run (grad on) is where Megatron adds
    the aux loss; the all-pad bin keeps the coefficient at 0 through it (before, the restored coefficient
    gave the pad tokens an aux loss: nonzero router grads), and a real bin still gets the aux loss of the
    plain step."""
    from megatron_rl.train.model import Recompute

    full = _chunk(moe_folder, tp1, Recompute("full"))
    assert full.config.recompute_granularity == "full"
    full.load_state_dict(moe_chunk.state_dict())
    bins = pack_sequences(_seqs(), capacity=64, pad_to_common=True, min_bins=2).micro_batches
    loss, _, grads = _run(full, bins[1])
    assert torch.equal(loss, torch.zeros_like(loss)) and all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    assert full.config.moe_aux_loss_coeff == COEF  # back after the backward pass
    loss_full, _, grads_full = _run(full, bins[0])
    loss_plain, _, grads_plain = _run(moe_chunk, bins[0])
    assert bool((loss_full > 0).all())
    torch.testing.assert_close(loss_full, loss_plain, rtol=1e-5, atol=0)
    for g_full, g_plain in zip(grads_full, grads_plain):
        torch.testing.assert_close(g_full, g_plain, rtol=1e-5, atol=1e-8)


def test_full_recompute_with_ep_and_aux_loss_is_accepted():
    from transformers import AutoConfig

    from megatron_rl.train.model import Recompute, model_dims, transformer_config
    from megatron_rl.train.parallel import ParallelLayout

    config = transformer_config(model_dims(AutoConfig.for_model("qwen3_moe")), ParallelLayout(dp=2, ep=2),
                                recompute=Recompute("full"), router_aux_loss=0.01)
    assert config.recompute_granularity == "full" and config.moe_aux_loss_coeff == 0.01
