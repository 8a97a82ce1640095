"""SegmentCausalAttention against Megatron-Core's DotProductAttention (the local spec's reference core
attention) on random q/k/v of a packed row: values and q/k/v gradients, GQA, softmax scale, fp32 and
bf16, sliding windows; masks it cannot interpret raise. And a packed bin through the step's forward
gives the logprobs of each sequence alone through HF (with a sliding window too: Megatron's local
module applies the window to the whole row and leaks across segments there)."""
import pytest
import torch

SEGMENTS = [5, 9, 1, 7, 3]  # last one plays the padding segment of a bin
HEADS, GROUPS, HEAD_DIM = 6, 2, 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Megatron's score buffer lives there


def _config(dtype=torch.float32, softmax_scale=None, window=None, skip_freq=None, groups=GROUPS):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=groups,
        kv_channels=HEAD_DIM, attention_dropout=0.0, hidden_dropout=0.0, softmax_scale=softmax_scale,
        masked_softmax_fusion=False, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_cpu_initialization=True, window_size=window, window_attn_skip_freq=skip_freq)


def _modules(config, layer_number=1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.train.attention import SegmentCausalAttention

    kw = dict(config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
              attention_type="self", softmax_scale=config.softmax_scale)
    return SegmentCausalAttention(**kw), DotProductAttention(**kw)


def _qkv(lengths, dtype, batch=1, groups=GROUPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, batch, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(t, batch, groups, HEAD_DIM, generator=g)
    v = torch.randn(t, batch, groups, HEAD_DIM, generator=g)
    w = torch.randn(t, batch, HEADS * HEAD_DIM, generator=g)
    return [x.to(DEVICE, dtype).requires_grad_() for x in (q, k, v)], w.to(DEVICE)


def _packed(lengths):
    """Block-diagonal causal mask [1, 1, T, T] (True = masked) and THD params, as packing builds them."""
    from megatron.core.packed_seq_params import PackedSeqParams

    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = len(seg)
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return ~allowed[None, None].to(DEVICE), params


def _run(module, qkv, w, **kw):
    """Output and q/k/v gradients of sum(out * w); fresh leaves so both modules see the same input."""
    leaves = [x.detach().clone().requires_grad_() for x in qkv]
    q, k, v = leaves
    if kw.pop("thd", False):
        q, k, v = q.squeeze(1), k.squeeze(1), v.squeeze(1)
    out = module(q, k, v, kw.pop("mask", None), **kw)
    out = out.reshape(w.shape)
    (out.float() * w).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def _assert_same(got, want, atol):
    """Max abs difference <= atol relative to the tensor's own scale (GQA sums K/V grads over heads)."""
    for a, b, name in zip([got[0]] + got[1], [want[0]] + want[1], ["output", "dq", "dk", "dv"]):
        tol = atol * max(1.0, float(b.float().abs().max()))
        err = float((a.float() - b.float()).abs().max())
        assert err <= tol, f"{name}: max abs difference {err} > {tol}"


@pytest.mark.parametrize("scale", [None, 0.37])
def test_packed_segments_match_megatron_fp32(tp1, scale):
    ours, ref = _modules(_config(softmax_scale=scale))
    mask, params = _packed(SEGMENTS)
    qkv, w = _qkv(SEGMENTS, torch.float32)
    want = _run(ref, qkv, w, mask=mask)
    _assert_same(_run(ours, qkv, w, thd=True, packed_seq_params=params), want, 1e-6)  # trainer's path
    _assert_same(_run(ours, qkv, w, mask=mask), want, 1e-6)  # segments read off the mask


def test_packed_segments_bf16_within_rounding(tp1):
    mask, params = _packed(SEGMENTS)
    qkv, w = _qkv(SEGMENTS, torch.float32, seed=1)
    exact = _run(_modules(_config())[1], qkv, w, mask=mask)
    ours, ref = _modules(_config(torch.bfloat16))
    qkv16 = [x.detach().bfloat16() for x in qkv]
    got = _run(ours, qkv16, w, thd=True, packed_seq_params=params)
    meg = _run(ref, qkv16, w, mask=mask)
    assert got[0].dtype == torch.bfloat16
    _assert_same(got, meg, 5e-2)  # a few bf16 ulps of O(1) values
    # and no worse than Megatron's own bf16 rounding against the fp32 result
    for a, b, e in zip([got[0]] + got[1], [meg[0]] + meg[1], [exact[0]] + exact[1]):
        err_ours = (a.float() - e).abs().max()
        err_meg = (b.float() - e).abs().max()
        assert err_ours <= 2 * err_meg + 1e-3, (float(err_ours), float(err_meg))


@pytest.mark.parametrize("groups", [HEADS, 1])
def test_batch_of_causal_rows_matches_megatron(tp1, groups):
    """No packing: [b, T] rows, causal (no mask, and the [1, 1, T, T] causal mask forward_logits passes)."""
    from megatron_rl.train.model import causal_mask

    ours, ref = _modules(_config(groups=groups))
    qkv, w = _qkv([11], torch.float32, batch=3, groups=groups, seed=2)
    want = _run(ref, qkv, w, mask=causal_mask(11, DEVICE))
    _assert_same(_run(ours, qkv, w), want, 1e-6)
    _assert_same(_run(ours, qkv, w, mask=causal_mask(11, DEVICE)), want, 1e-6)


def test_sliding_window_per_segment_matches_megatron(tp1):
    """Window (left=3): Megatron's local module replaces the packing mask with a whole-row window
    mask, so its reference is computed one segment at a time (where that mask is the right one)."""
    config = _config(window=(3, 0), softmax_scale=0.5)
    ours, ref = _modules(config)
    lengths = [9, 2, 6]
    mask, params = _packed(lengths)
    qkv, w = _qkv(lengths, torch.float32, seed=3)
    outs, grads = [], [[], [], []]
    start = 0
    for n in lengths:
        part = [x[start:start + n] for x in qkv]
        o, g = _run(ref, part, w[start:start + n])
        outs.append(o)
        for acc, gi in zip(grads, g):
            acc.append(gi)
        start += n
    want = (torch.cat(outs), [torch.cat(g) for g in grads])
    _assert_same(_run(ours, qkv, w, thd=True, packed_seq_params=params), want, 1e-6)
    _assert_same(_run(ours, qkv, w, mask=mask), want, 1e-6)
    # the window matters here: plain causal attention differs
    causal = _run(_modules(_config(softmax_scale=0.5))[0], qkv, w, thd=True, packed_seq_params=params)
    assert (causal[0] - want[0]).abs().max() > 1e-3


def test_window_skipped_on_layers_by_skip_freq(tp1):
    ours2, _ = _modules(_config(window=(3, 0), skip_freq=2), layer_number=2)  # layer 2: full attention
    ours1, _ = _modules(_config(window=(3, 0), skip_freq=2), layer_number=1)
    assert ours2.window_left is None and ours1.window_left == 3


@pytest.mark.parametrize("kind", ["left_padding", "bidirectional", "float", "per_head"])
def test_uninterpretable_masks_raise(tp1, kind):
    from megatron_rl.train.attention import UnsupportedMaskError

    ours, _ = _modules(_config())
    t = 6
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    if kind == "left_padding":  # HF-style left padding: pad keys 0-1 hidden, pad query rows see nothing
        allowed = causal.clone()
        allowed[:, :2] = False
        mask = ~allowed[None, None]
    elif kind == "bidirectional":
        mask = torch.zeros(1, 1, t, t, dtype=torch.bool)
    elif kind == "float":
        mask = (~causal).float()[None, None]
    else:
        mask = ~causal.expand(1, HEADS, t, t)
    qkv, _ = _qkv([t], torch.float32)
    with pytest.raises(UnsupportedMaskError):
        ours(*qkv, mask)


def test_bad_configs_raise(tp1):
    from megatron_rl.train.attention import SegmentCausalAttention
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match="attention_dropout"):
        SegmentCausalAttention(_config(), 1, AttnMaskType.causal, "self", attention_dropout=0.1)
    _, params = _packed([3, 4])
    ours, _ = _modules(_config())
    qkv, _ = _qkv([8], torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens"):  # boundaries cover 7 of 8 tokens
        ours(*(x.squeeze(1) for x in qkv), None, packed_seq_params=params)


def test_no_parameters_no_state(tp1):
    ours, ref = _modules(_config())
    assert list(ours.state_dict()) == list(ref.state_dict()) == []
    meta = {"dp_cp_group": None}
    assert dict(ours.sharded_state_dict(metadata=meta)) == dict(ref.sharded_state_dict(metadata=meta)) == {}


@pytest.mark.parametrize("family,window", [("llama", None), ("mistral", 4)])
def test_packed_logprobs_equal_one_sequence_at_a_time(tp1, tmp_path, family, window):
    """A packed bin through the step's forward (THD boundaries, RoPE restarting per segment) gives the
    logprobs of each sequence run alone through HF transformers; windows shorter than the sequences."""
    from transformers import AutoModelForCausalLM

    from support.train_models import make_tiny_hf
    from megatron_rl.records import TrainSequence
    from megatron_rl.train.attention import uses_segment_attention
    from megatron_rl.train.hf_weights import load_hf_weights
    from megatron_rl.train.logprobs import token_logprobs
    from megatron_rl.train.model import build_model
    from megatron_rl.train.packing import pack_sequences
    from megatron_rl.train.step import _forward

    if torch.cuda.is_available():
        pytest.skip("CPU check of the local spec (on GPU build_model picks Transformer Engine)")
    model_dir = make_tiny_hf(tmp_path / family, family=family, sliding_window=window)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chunks = build_model(hf.config, tp1, torch.float32, use_te=False)
    load_hf_weights(chunks, model_dir)
    assert uses_segment_attention(chunks[0])
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (9, 3, 12, 6)]
    seqs = [TrainSequence(x, 1, [0.0] * (len(x) - 1), 0.0) for x in ids]
    packed = pack_sequences(seqs, capacity=64, pad_multiple=8)  # one bin, 30 tokens + 2 of padding
    (mb,) = packed.micro_batches
    with torch.no_grad():
        logits = _forward(chunks[0], mb, use_thd=False)
        lp = token_logprobs(logits, mb.labels, None, hf.config.vocab_size)[0]
        start = 0
        for i in mb.seq_indices:
            ids = torch.tensor([seqs[i].token_ids])
            n = ids.shape[1]
            ref = torch.log_softmax(hf(ids).logits.float()[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            torch.testing.assert_close(lp[start:start + n - 1], ref, atol=2e-5, rtol=0)
            start += n
