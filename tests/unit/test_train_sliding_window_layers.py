"""Qwen2's `use_sliding_window` with `max_window_layers`: HF slides only layers >= max_window_layers
(its `layer_types`). The trainer reads the same per-layer pattern (`ModelDims.window_layers` ->
Megatron's `window_attn_skip_freq` list) instead of windowing every layer, and a packed bin through the
step's forward gives each sequence's logprobs as HF transformers does, run alone."""
import pytest
import torch

WINDOW = 4  # sliding_window: a token sees itself and 3 keys back; the sequences are longer


def _qwen2_config(max_window_layers: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=301, hidden_size=48, intermediate_size=97, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
                       rms_norm_eps=1e-5, use_sliding_window=True, sliding_window=WINDOW,
                       max_window_layers=max_window_layers)


@pytest.mark.parametrize("max_window_layers,expected", [(0, (WINDOW, None)), (1, (WINDOW, (0, 1))), (2, (None, None))])
def test_window_layers_follow_hf_layer_types(max_window_layers, expected):
    from megatron_rl.train.model import model_dims

    dims = model_dims(_qwen2_config(max_window_layers))
    assert (dims.sliding_window, dims.window_layers) == expected


def test_te_context_parallel_with_a_window_is_refused_at_build():
    """TE's CP attention asserts on windows with the p2p ring at the first step; the build says so first,
    naming the key, and leaves the local spec (CPU CP path) and window-free models alone."""
    from megatron_rl.train.model import model_dims, transformer_config
    from megatron_rl.train.parallel import ParallelLayout

    windowed, full = model_dims(_qwen2_config(0)), model_dims(_qwen2_config(2))
    with pytest.raises(ValueError, match="trainer.context_parallel=2 with a sliding-window model"):
        transformer_config(windowed, ParallelLayout(cp=2), use_te=True)
    assert transformer_config(windowed, ParallelLayout(cp=2), use_te=False).window_size == (WINDOW - 1, 0)
    assert transformer_config(full, ParallelLayout(cp=2), use_te=True).context_parallel_size == 2


def test_unknown_layer_type_is_refused():
    from megatron_rl.train.model import UnsupportedModelError, model_dims

    config = _qwen2_config(1)
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        model_dims(config)


@pytest.mark.parametrize("max_window_layers", [1, 2])
def test_packed_logprobs_equal_hf_with_some_layers_windowed(tp1, tmp_path, max_window_layers):
    """Layer 1 full, layer 2 windowed (max_window_layers=1), or no layer windowed (2 of 2)."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    from megatron_rl.records import TrainSequence
    from megatron_rl.train.hf_weights import load_hf_weights
    from megatron_rl.train.logprobs import token_logprobs
    from megatron_rl.train.model import build_model
    from megatron_rl.train.packing import pack_sequences
    from megatron_rl.train.step import _forward

    if torch.cuda.is_available():
        pytest.skip("CPU check of the local spec (on GPU build_model picks Transformer Engine)")
    torch.manual_seed(0)
    Qwen2ForCausalLM(_qwen2_config(max_window_layers)).float().save_pretrained(tmp_path, safe_serialization=True)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    chunks = build_model(hf.config, tp1, torch.float32, use_te=False)
    load_hf_weights(chunks, tmp_path)
    windows = [layer.self_attention.core_attention.window_left for layer in chunks[0].decoder.layers]
    assert windows == ([None, WINDOW - 1] if max_window_layers == 1 else [None, None])
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, 301, (n,), generator=g).tolist() for n in (9, 3, 12, 6)]
    seqs = [TrainSequence(x, 1, [0.0] * (len(x) - 1), 0.0) for x in ids]
    (mb,) = pack_sequences(seqs, capacity=64, pad_multiple=8).micro_batches
    with torch.no_grad():
        lp = token_logprobs(_forward(chunks[0], mb, use_thd=False), mb.labels, None, 301)[0]
        start = 0
        for i in mb.seq_indices:
            x = torch.tensor([seqs[i].token_ids])
            ref = torch.log_softmax(hf(x).logits.float()[0, :-1], -1).gather(-1, x[0, 1:, None]).squeeze(-1)
            torch.testing.assert_close(lp[start:start + x.shape[1] - 1], ref, atol=2e-5, rtol=0)
            start += x.shape[1]
