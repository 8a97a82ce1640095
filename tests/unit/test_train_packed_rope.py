"""packed_rope's vectorised THD RoPE against Megatron-Core's own `apply_rotary_pos_emb` (unfused, THD,
per sequence): bitwise equal outputs and gradients on packed rows with odd lengths and a 1-token
segment, fp32/bf16, YaRN's mscale, interleaved rotation; the cases it does not handle go to Megatron's
function; positions and cos/sin are built once per micro-batch."""
import pytest
import torch

LENGTHS = [7, 1, 12, 3, 9]
HEADS, DIM = 3, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _config(interleaved=False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                             kv_channels=DIM, rotary_interleaved=interleaved, apply_rope_fusion=False)


def _inputs(dtype, seed=0):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    t = torch.randn(sum(LENGTHS), HEADS, DIM, generator=g).to(DEVICE, dtype)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    rope = RotaryEmbedding(kv_channels=DIM, rotary_percent=1.0, rotary_base=10000.0, use_cpu_initialization=True)
    return t, cu, rope(max(LENGTHS), packed_seq=True).to(DEVICE)


def _apply(fn, t, freqs, config, cu, mscale, cp_group):
    x = t.detach().clone().requires_grad_()
    out = fn(x, freqs, config=config, cu_seqlens=cu, mscale=mscale, cp_group=cp_group)
    out.float().pow(2).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("mscale", [1.0, 1.23])
def test_bitwise_equal_to_megatron_thd(tp1, dtype, interleaved, mscale):
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.train.packed_rope import make_packed_apply

    config = _config(interleaved)
    t, cu, freqs = _inputs(dtype)
    cp = parallel_state.get_context_parallel_group()
    want = _apply(rope_utils.apply_rotary_pos_emb, t, freqs, config, cu, mscale, cp)
    calls = []
    ours = make_packed_apply(lambda *a, **k: calls.append(1) or rope_utils.apply_rotary_pos_emb(*a, **k))
    got = _apply(ours, t, freqs, config, cu, mscale, cp)
    assert not calls, "the packed case must not fall back to Megatron's function"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # positions restart at each segment: the first token of every segment is rotated by angle 0
    starts = cu[:-1].long()
    assert torch.equal(got[0][starts], t[starts] * torch.tensor(mscale).to(dtype))


def test_other_cases_go_to_megatron(tp1):
    from megatron.core import parallel_state

    from megatron_rl.train.packed_rope import make_packed_apply

    calls = []
    ours = make_packed_apply(lambda *a, **k: calls.append(k) or a[0])
    t, cu, freqs = _inputs(torch.float32)
    cp = parallel_state.get_context_parallel_group()
    ours(t, freqs, config=_config(), cu_seqlens=None, cp_group=cp)  # bshd
    fused = _config()
    fused.apply_rope_fusion = True
    ours(t, freqs, config=fused, cu_seqlens=cu, cp_group=cp)
    whole_row = freqs.new_zeros(t.size(0), *freqs.shape[1:])  # freqs at whole-row offsets
    ours(t, whole_row, config=_config(), cu_seqlens=cu, cp_group=cp)
    assert len(calls) == 3


def test_cos_sin_built_once_per_micro_batch(tp1, monkeypatch):
    from megatron_rl.train import packed_rope

    t, cu, freqs = _inputs(torch.float32)
    reads = []
    real = packed_rope._positions
    monkeypatch.setattr(packed_rope, "_positions", lambda *a: reads.append(1) or real(*a))
    first = packed_rope.packed_cos_sin(freqs, cu, t.size(0), 1.0, torch.float32)
    for _ in range(3):  # q and k of every layer
        assert packed_rope.packed_cos_sin(freqs, cu, t.size(0), 1.0, torch.float32)[0] is first[0]
    assert len(reads) == 1
    packed_rope.packed_cos_sin(freqs, cu.clone(), t.size(0), 1.0, torch.float32)  # next micro-batch
    assert len(reads) == 2
    with pytest.raises(ValueError, match="packing of"):
        packed_rope.packed_cos_sin(freqs, cu.clone(), t.size(0) + 1, 1.0, torch.float32)
