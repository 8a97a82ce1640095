"""SGLang's torch_native attention backend (the CPU engine's without AMX) decodes a batch one request at
a time: per layer and per request a Python iteration, a KV gather and an SDPA call. On a small model
that loop, not the arithmetic, is much of the decode step's cost.
`batched_decode` does the same attention for the whole batch at once: each request's KV rows are
gathered into one padded [B, L] block (L the longest context of a chunk of requests), positions past a
request's length (and, with a sliding window, before its window) are masked out, one SDPA call per
chunk. The arithmetic per attended position is the original's; masked positions add exp(-inf) = 0.
Chunks keep the padded block under `MAX_BLOCK_BYTES`. Cross-attention and encoder lengths, which the
CPU engine does not serve for our models, keep the original loop. benchmarks/cpu_decode.py measures it
against the loop (MEGATRON_RL_SGLANG_DECODE_LOOP=1 in the server's environment keeps the loop)."""
from __future__ import annotations

import os

import torch
from torch.nn.functional import scaled_dot_product_attention

from ._on_import import patch_on_import

MODULE = "sglang.srt.layers.attention.torch_native_backend"
MAX_BLOCK_BYTES = 64 << 20  # padded K and V of one chunk
LOOP_SWITCH = "MEGATRON_RL_SGLANG_DECODE_LOOP"  # "1" in the server's environment: keep SGLang's loop


def batched_decode(original):
    def run(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens=None,
            scaling=None, enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):
        if encoder_lens is not None or is_cross_attn or causal or query.shape[0] != seq_lens.shape[0]:
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
        lens = seq_lens.tolist()
        row_bytes = 2 * k_cache.shape[1] * k_cache.shape[2] * query.element_size()  # K and V of one position
        start = 0
        while start < len(lens):
            end, longest = start, 0
            while end < len(lens) and (end == start or
                                       (end + 1 - start) * max(longest, lens[end]) * row_bytes <= MAX_BLOCK_BYTES):
                longest = max(longest, lens[end])
                end += 1
            _attend(query[start:end], output[start:end], k_cache, v_cache,
                    req_to_token[req_pool_indices[start:end], :longest], seq_lens[start:end], scaling, enable_gqa,
                    sliding_window_size)
            start = end
        return output

    run.__wrapped__ = original
    return run


def _attend(query, output, k_cache, v_cache, tokens, seq_lens, scaling, enable_gqa, window) -> None:
    """query, output: [B, H, D]; tokens: [B, L] KV rows of each request (valid below its length)."""
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    attend = pos[None, :] < seq_lens[:, None]
    if window is not None and window > -1:  # the original's mask: the query at length-1 sees [length-1-window, length-1]
        attend &= pos[None, :] >= (seq_lens[:, None] - 1 - window)
    rows = torch.where(attend, tokens, torch.zeros((), dtype=tokens.dtype, device=tokens.device)).flatten()
    shape = (*tokens.shape, *k_cache.shape[1:])  # [B, L, Hk, D]
    # index_select, not k_cache[rows]: on CPU advanced indexing of these rows costs ~9x the copy
    key = k_cache.index_select(0, rows).view(shape).transpose(1, 2)  # [B, Hk, L, D]
    value = v_cache.index_select(0, rows).view(shape).transpose(1, 2)
    if key.dtype != query.dtype:  # as the original: SDPA wants one dtype
        key, value = key.to(query.dtype), value.to(query.dtype)
    out = scaled_dot_product_attention(query.unsqueeze(2), key, value, attn_mask=attend[:, None, None, :],
                                       scale=scaling, enable_gqa=enable_gqa)  # [B, H, 1, D]
    output.copy_(out.squeeze(2))


def _patch(module) -> None:
    backend = getattr(module, "TorchNativeAttnBackend", None)
    if backend is None or hasattr(backend._run_sdpa_forward_decode, "__wrapped__"):
        return
    backend._run_sdpa_forward_decode = batched_decode(backend._run_sdpa_forward_decode)


def install() -> None:
    if os.environ.get(LOOP_SWITCH) == "1":  # benchmarks/cpu_decode.py's baseline: SGLang's own loop
        return
    patch_on_import(lambda name: name == MODULE, _patch)
