"""RoPE on packed (THD) micro-batches without Transformer Engine, one vectorised apply per call.

Without TE's fused THD RoPE, Megatron-Core's `rope_utils._apply_rotary_pos_emb_thd` reads the
boundaries to the host (`cu_seqlens.tolist()`, a device sync) on every call, i.e. for q and k of every
layer, and (megatron-core >= 0.19) applies RoPE one sequence at a time: ~a dozen small kernels per
packed sequence per call, thousands of launches per step on a GPU. Positions restart at each segment,
so the rotation each token gets depends only on its offset in its own segment.

`install()` wraps the `apply_rotary_pos_emb` that `megatron.core.transformer.attention` calls: for
the unfused THD case without CP it gathers `freqs` at per-token positions (restarting at each segment)
and applies Megatron's own formula ((t * cos) + (rotate_half(t) * sin), cos/sin = f(freqs) * mscale
cast to t's dtype) to the whole row at once. RoPE is elementwise per token, so the result is bitwise
the one Megatron computes per sequence. The positions and cos/sin are built once per (freqs,
cu_seqlens) pair, i.e. once per micro-batch forward (every layer gets the same two tensors), with one
host read of the boundaries. Every other case (TE fusion, CP > 1, MLA, no cu_seqlens, freqs holding
whole-row positions) goes to Megatron's function unchanged.

A row with shared prompts (train.packing) gives its tokens' positions itself (`with_positions`): a
branch continues its prefix's positions instead of restarting at its segment's start. Such a row
outside the handled case raises (Megatron's function would restart them).
"""
from __future__ import annotations

import weakref

import torch

# the last (freqs, cu_seqlens) pair seen and the cos/sin per dtype built for it
_CACHE: dict = {"key": None, "refs": None, "positions": None, "cos_sin": {}}
# the attribute of a cu_seqlens tensor holding its row's positions (`with_positions`): the tensor is
# what Megatron's attention hands to apply_rotary_pos_emb, so the positions travel with it
_POSITIONS_ATTR = "mrl_rope_positions"


def with_positions(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`cu_seqlens`, carrying every token's RoPE position ([total] long) for the packed apply."""
    setattr(cu_seqlens, _POSITIONS_ATTR, positions)
    return cu_seqlens


def given_positions(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    return getattr(cu_seqlens, _POSITIONS_ATTR, None)


def _positions(cu_seqlens: torch.Tensor, total: int, max_positions: int) -> torch.Tensor:
    """Per-token offset in its segment (long, on the CPU), boundaries checked."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens {cu} do not describe a packing of {total} tokens")
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if longest > max_positions:
        raise ValueError(f"a packed segment of {longest} tokens exceeds the {max_positions} RoPE positions")
    starts = torch.tensor(cu[:-1]).repeat_interleave(torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    return torch.arange(total) - starts


def packed_cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor, total: int, mscale: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [total, 1, 1, dim] of every token's in-segment position, cached per micro-batch."""
    key = (id(freqs), freqs._version, id(cu_seqlens), cu_seqlens._version, total)
    refs = _CACHE["refs"]
    if _CACHE["key"] != key or refs is None or refs[0]() is not freqs or refs[1]() is not cu_seqlens:
        positions = given_positions(cu_seqlens)
        if positions is None:
            positions = _positions(cu_seqlens, total, freqs.size(0))
        elif positions.numel() != total or int(positions.max()) >= freqs.size(0):
            raise ValueError(f"{positions.numel()} given RoPE positions up to {int(positions.max())} for "
                             f"{total} tokens and {freqs.size(0)} frequencies")
        positions = positions.to(freqs.device)
        _CACHE.update(key=key, refs=(weakref.ref(freqs), weakref.ref(cu_seqlens)), positions=positions,
                      cos_sin={})
    cos_sin = _CACHE["cos_sin"]
    if (mscale, dtype) not in cos_sin:
        packed = freqs[_CACHE["positions"]]
        cos_sin[(mscale, dtype)] = ((torch.cos(packed) * mscale).to(dtype), (torch.sin(packed) * mscale).to(dtype))
    return cos_sin[(mscale, dtype)]


def _handles(t, freqs, config, cu_seqlens, cp_group, kwargs) -> bool:
    """The unfused THD, no-CP, plain (non-MLA) case with freqs indexed by in-segment position."""
    return (cu_seqlens is not None and not config.apply_rope_fusion and not config.multi_latent_attention
            and not kwargs.get("mla_rotary_interleaved") and set(kwargs) <= {"mla_rotary_interleaved"}
            and cp_group is not None and cp_group.size() == 1 and t.dim() == 3 and freqs.dim() == 4
            and freqs.size(0) != t.size(0))  # == total: Megatron reads freqs at whole-row offsets


def make_packed_apply(original):
    """`apply_rotary_pos_emb` with the packed THD case vectorised, everything else `original`."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, **kwargs):
        if not _handles(t, freqs, config, cu_seqlens, cp_group, kwargs):
            if given_positions(cu_seqlens) is not None:
                raise ValueError("a packed row with shared prompts needs the unfused THD RoPE without CP, MLA "
                                 "or fusion (set trainer.share_prompts: false)")
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **kwargs)
        cos_, sin_ = packed_cos_sin(freqs, cu_seqlens, t.size(0), mscale, t.dtype)
        x = t.unsqueeze(1)  # [t, 1, h, d], as Megatron's bshd apply sees each sequence
        rot_dim = freqs.shape[-1]
        x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        x = (x * cos_) + (_rotate_half(x, config.rotary_interleaved) * sin_)
        return torch.cat((x, x_pass), dim=-1).squeeze(1)

    apply_rotary_pos_emb.mrl_packed_original = original
    return apply_rotary_pos_emb


def install() -> None:
    """Route Megatron's self-attention RoPE through `make_packed_apply` (idempotent)."""
    import megatron.core.transformer.attention as attention

    if not hasattr(attention.apply_rotary_pos_emb, "mrl_packed_original"):
        attention.apply_rotary_pos_emb = make_packed_apply(attention.apply_rotary_pos_emb)
