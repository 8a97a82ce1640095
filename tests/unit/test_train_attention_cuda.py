"""SegmentCausalAttention on CUDA: the one-call `varlen_attn` path against the per-segment SDPA loop
(the path CPU, fp32 and CP take, itself checked against Megatron in test_train_attention.py), forward
and q/k/v gradients, on packed rows with odd lengths and a 1-token segment, GQA, sliding windows, a
softmax scale, the THD (trainer) and the explicit-mask entries; and both against the fp32 loop, so
the fast path is no less accurate than the slow one."""
import pytest
import torch

pytestmark = pytest.mark.gpu

SEGMENTS = [37, 1, 130, 5, 77, 256, 3, 2]  # odd lengths, a 1-token segment, one longer than any window
HEADS = 6


def _config(dtype, head_dim, groups, window=None, softmax_scale=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=HEADS * head_dim, num_attention_heads=HEADS, num_query_groups=groups,
        kv_channels=head_dim, attention_dropout=0.0, hidden_dropout=0.0, softmax_scale=softmax_scale,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_cpu_initialization=True, window_size=window)


def _module(config, varlen: bool):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.train.attention import SegmentCausalAttention

    m = SegmentCausalAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self", softmax_scale=config.softmax_scale)
    if varlen and not m.varlen:
        pytest.skip(f"varlen_attn unusable here: {m.varlen_unusable_reason}")
    m.varlen = varlen
    return m


def _params(lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def _inputs(t, head_dim, groups, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, batch, HEADS, head_dim, generator=g)
    k = torch.randn(t, batch, groups, head_dim, generator=g)
    v = torch.randn(t, batch, groups, head_dim, generator=g)
    w = torch.randn(t, batch, HEADS * head_dim, generator=g)
    return [x.cuda() for x in (q, k, v)], w.cuda()


def _run(module, qkv, w, dtype, thd, **kw):
    leaves = [x.detach().to(dtype).requires_grad_() for x in qkv]
    q, k, v = (x.squeeze(1) for x in leaves) if thd else leaves
    out = module(q, k, v, kw.pop("mask", None), **kw).reshape(w.shape)
    (out.float() * w).sum().backward()
    return [out.detach().float()] + [x.grad.float() for x in leaves]


@pytest.fixture
def varlen_calls(monkeypatch):
    """Counts the varlen_attn calls the module makes (and fails the test if a first call fell back)."""
    from megatron_rl.train import attention

    if attention._VARLEN_ATTN is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    calls = []
    real = attention._VARLEN_ATTN

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_VARLEN_ATTN", counting)
    yield calls
    assert not attention._VARLEN_FAILED, f"varlen_attn raised and fell back: {attention._VARLEN_FAILED}"


def _compare(fast, slow, exact, bf16_atol):
    for name, a, b, e in zip(["output", "dq", "dk", "dv"], fast, slow, exact):
        scale = max(1.0, float(e.abs().max()))
        err = float((a - b).abs().max())
        assert err <= bf16_atol * scale, f"{name}: varlen vs loop max abs difference {err}"
        err_fast, err_slow = float((a - e).abs().max()), float((b - e).abs().max())
        assert err_fast <= 2 * err_slow + 1e-3 * scale, (name, err_fast, err_slow)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [HEADS, 2, 1])
@pytest.mark.parametrize("window", [None, (17, 0)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_equals_per_segment_loop_thd(tp1, varlen_calls, dtype, groups, window, head_dim):
    config = _config(dtype, head_dim, groups, window=window)
    qkv, w = _inputs(sum(SEGMENTS), head_dim, groups)
    params = _params(SEGMENTS)
    fast = _run(_module(config, True), qkv, w, dtype, thd=True, packed_seq_params=params)
    assert len(varlen_calls) == 1, "one varlen_attn call for the whole packed row"
    slow = _run(_module(config, False), qkv, w, dtype, thd=True, packed_seq_params=params)
    exact = _run(_module(_config(torch.float32, head_dim, groups, window=window), False), qkv, w,
                 torch.float32, thd=True, packed_seq_params=params)
    assert len(varlen_calls) == 1
    _compare(fast, slow, exact, 3e-2 if dtype == torch.bfloat16 else 5e-3)


def test_varlen_softmax_scale(tp1, varlen_calls):
    config = _config(torch.bfloat16, 64, 2, softmax_scale=0.37)
    qkv, w = _inputs(sum(SEGMENTS), 64, 2, seed=3)
    params = _params(SEGMENTS)
    fast = _run(_module(config, True), qkv, w, torch.bfloat16, thd=True, packed_seq_params=params)
    slow = _run(_module(config, False), qkv, w, torch.bfloat16, thd=True, packed_seq_params=params)
    exact = _run(_module(_config(torch.float32, 64, 2, softmax_scale=0.37), False), qkv, w,
                 torch.float32, thd=True, packed_seq_params=params)
    assert len(varlen_calls) == 1
    _compare(fast, slow, exact, 3e-2)


def test_varlen_rows_of_an_explicit_mask(tp1, varlen_calls):
    """[b=2, T] rows with different packings given as a block-diagonal causal mask: one call, b*T tokens."""
    rows = [[11, 1, 52], [30, 34]]
    t = sum(rows[0])
    seg = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
    allowed = (seg[:, :, None] == seg[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    mask = (~allowed)[:, None].cuda()
    config = _config(torch.bfloat16, 64, 2, window=(9, 0))
    qkv, w = _inputs(t, 64, 2, batch=2, seed=5)
    fast = _run(_module(config, True), qkv, w, torch.bfloat16, thd=False, mask=mask)
    slow = _run(_module(config, False), qkv, w, torch.bfloat16, thd=False, mask=mask)
    exact = _run(_module(_config(torch.float32, 64, 2, window=(9, 0)), False), qkv, w, torch.float32,
                 thd=False, mask=mask)
    assert len(varlen_calls) == 1
    _compare(fast, slow, exact, 3e-2)


def test_packed_boundaries_read_once_per_params(tp1, varlen_calls, monkeypatch):
    """Every layer of a forward gets the same PackedSeqParams: the boundaries go to the host once."""
    from megatron_rl.train import attention

    reads = []
    real = attention.segments_from_cu_seqlens
    monkeypatch.setattr(attention, "segments_from_cu_seqlens", lambda *a: reads.append(1) or real(*a))
    config = _config(torch.bfloat16, 64, 2)
    module = _module(config, True)
    qkv, w = _inputs(sum(SEGMENTS), 64, 2)
    params = _params(SEGMENTS)
    for _ in range(3):
        _run(module, qkv, w, torch.bfloat16, thd=True, packed_seq_params=params)
    assert len(reads) == 1 and len(varlen_calls) == 3
    _run(module, qkv, w, torch.bfloat16, thd=True, packed_seq_params=_params(SEGMENTS))  # a new micro-batch
    assert len(reads) == 2


def test_fp32_inputs_take_the_loop(tp1, varlen_calls):
    config = _config(torch.float32, 64, 2)
    module = _module(config, True)
    qkv, w = _inputs(sum(SEGMENTS), 64, 2)
    _run(module, qkv, w, torch.float32, thd=True, packed_seq_params=_params(SEGMENTS))
    assert not varlen_calls
