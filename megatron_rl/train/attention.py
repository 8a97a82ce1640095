"""Segment-aware causal core attention for Megatron-Core's local (non-Transformer-Engine) layer spec.

`SegmentCausalAttention` takes the place of `megatron.core.transformer.dot_product_attention.
DotProductAttention` as `submodules.core_attention` (same constructor and forward signature). A packed
micro-batch holds several sequences in one row; Megatron's module scores the whole row against
itself (a `[b*np, T, T]` float32 tensor) and masks the cross-segment part away. This module instead
runs `torch.nn.functional.scaled_dot_product_attention` (causal) on each segment, so the cost is
sum(L_i^2) and no `[T, T]` float tensor exists.

Segments come from, in this order:
- `packed_seq_params.cu_seqlens_q` (THD format; q/k/v arrive as `[t, np, hn]`), the trainer's path;
- an explicit boolean mask (Megatron convention, True = masked out) that is block-diagonal causal:
  its segments are read off it and checked (an exact rebuild must equal the mask); any other mask
  raises `UnsupportedMaskError` rather than being computed as something else;
- no mask and a causal layer: one causal segment per row.

Honoured: GQA (enable_gqa), the softmax scale Megatron would use (`config.softmax_scale`, used for
YaRN; `apply_query_key_layer_scaling` cancels out in Megatron, so it is ignored here too), fp32/bf16/
fp16 inputs, TP (heads arrive already split per rank), and sliding windows (`config.window_size` =
(left, 0) with `window_attn_skip_freq`): key j is visible from query i of the same segment iff
i - left <= j <= i (on CPU by `cp_attention.window_causal_attention`'s flash blocks, no [L, L] mask).
Megatron's local module replaces the packing mask with a whole-row window mask (leaking across
segments), so windows are applied here per segment, exactly. Not supported (raise at construction):
attention dropout > 0, non-vanilla softmax types.

One call per packed row on CUDA: with fp16/bf16 inputs, no CP, and torch's
`torch.nn.attention.varlen.varlen_attn` (flash attention over cu_seqlens, torch >= 2.9), all segments of
the micro-batch go through that single kernel instead of one SDPA call per segment (the per-segment
loop launched ~one SDPA per segment per layer and made small-model steps launch bound). What the
installed torch's varlen_attn accepts is read off its signature at import: a sliding window needs its
`window_size`, a non-default softmax scale its `scale`; without `enable_gqa` K/V heads are repeated.
Otherwise (CPU, fp32, CP, head dim not a multiple of 8 or > 256, or the first call raising), the
per-segment SDPA loop runs: same result, more launches. `SegmentCausalAttention.varlen` says which.
Constructing the module also installs `packed_rope` (Megatron's unfused THD RoPE, vectorised).

Shared prompts (`SharedPrefixSeqParams`, built by train.packing): a segment whose `segment_parents`
entry names another segment attends to all of that prefix segment's tokens and causally to its own
(a window counts positions across both), exactly what it would see as one sequence [prefix, segment].
Such rows take the per-segment loop (not varlen_attn, not CP).

Context parallel (config.context_parallel_size > 1): q/k/v hold this CP rank's load-balanced chunks
and `cu_seqlens_q` the whole row's boundaries (or, with no mask, each row is one causal sequence
split the same way); `cp_attention.cp_attention` gathers K/V over the CP group and attends each query
chunk to its key prefix (causal by global positions; no [queries, keys] mask on CPU, sliding window
included). Explicit [T, T] masks are refused under CP.
"""
from __future__ import annotations

import inspect
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from . import packed_rope
from .cp_attention import cp_attention, window_causal_attention


class UnsupportedMaskError(ValueError):
    """An attention mask this module cannot interpret as block-diagonal causal segments."""


@dataclass
class SharedPrefixSeqParams(PackedSeqParams):
    """THD params of a row with shared prompts: segment i of cu_seqlens_q continues segment
    `segment_parents[i]` (-1: none), whose tokens it sees before its own."""

    segment_parents: tuple[int, ...] = ()


def prefix_bounds(params, total: int) -> dict[tuple[int, int], tuple[int, int]]:
    """{(start, end) of a segment: (start, end) of the prefix segment it continues}; {} without any."""
    parents = getattr(params, "segment_parents", ())
    if not parents:
        return {}
    cu = [int(x) for x in params.cu_seqlens_q.tolist()]
    if len(parents) != len(cu) - 1 or cu[-1] != total:
        raise ValueError(f"{len(parents)} segment parents for {len(cu) - 1} segments over {cu[-1]} of {total} tokens")
    out = {}
    for i, parent in enumerate(parents):
        if parent >= 0:
            if not (parent < i and parents[parent] < 0):
                raise ValueError(f"segment {i} continues segment {parent}: a prefix comes first and has none")
            out[(cu[i], cu[i + 1])] = (cu[parent], cu[parent + 1])
    return out


# One mask object serves every layer of a forward: remember the segments read off the last one.
_MASK_CACHE: dict = {"ref": None, "version": -1, "segments": None}
# Likewise one PackedSeqParams object per micro-batch forward: its boundaries are read to the host
# (a device sync) once, not once per layer.
_PACKED_CACHE: dict = {"ref": None, "key": None, "segments": None, "prefixes": {}, "cu": {}}


def _load_varlen():
    """torch's varlen_attn and the names of its parameters; (None, empty) on a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)
    except (ImportError, TypeError, ValueError):
        return None, frozenset()


_VARLEN_ATTN, _VARLEN_PARAMS = _load_varlen()
# (device type, dtype, head dim, window, gqa) whose first varlen call raised: the loop serves them
_VARLEN_FAILED: set = set()


def segments_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """[(start, end)] of a THD packing; the boundaries must cover exactly `total` tokens."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens {cu} do not describe a packing of {total} tokens")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def segments_from_mask(mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of a `[b or 1, 1, T, T]` block-diagonal causal mask (True = masked), its segments.

    Raises UnsupportedMaskError for anything else (padding masks, non-causal, per-head masks)."""
    if mask.dtype != torch.bool:
        raise UnsupportedMaskError(f"attention mask must be boolean (True = masked), got {mask.dtype}")
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        raise UnsupportedMaskError(f"attention mask must be [b, 1, T, T], got {tuple(mask.shape)}")
    t = mask.shape[-1]
    allowed = ~mask[:, 0]
    # a block-diagonal causal row i allows exactly keys start(i)..i, start(i) = its segment's start
    starts = allowed.to(torch.uint8).argmax(dim=-1)  # first allowed key per query
    idx = torch.arange(t, device=mask.device)
    seg_start = starts == idx  # query i opens a segment
    # every query continues the segment of the previous one or opens one
    ok_first = bool((starts[:, 0] == 0).all())
    ok_cont = bool((seg_start[:, 1:] | (starts[:, 1:] == starts[:, :-1])).all())
    if not (ok_first and ok_cont):
        raise UnsupportedMaskError("attention mask is not block-diagonal causal (packed segments)")
    rebuilt = (idx[None, None, :] >= starts[:, :, None]) & (idx[None, None, :] <= idx[None, :, None])
    if not torch.equal(rebuilt, allowed):
        raise UnsupportedMaskError("attention mask is not block-diagonal causal (packed segments)")
    rows = []
    for r in range(mask.shape[0]):
        bounds = seg_start[r].nonzero().flatten().tolist() + [t]
        rows.append(list(zip(bounds[:-1], bounds[1:])))
    return rows


def _cached_mask_segments(mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    ref = _MASK_CACHE["ref"]
    if ref is not None and ref() is mask and _MASK_CACHE["version"] == mask._version:
        return _MASK_CACHE["segments"]
    segments = segments_from_mask(mask)
    _MASK_CACHE.update(ref=weakref.ref(mask), version=mask._version, segments=segments)
    return segments


def _packed_segments(params, total: int, device: torch.device) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """Segments of THD `params` over `total` tokens and their int32 boundaries on `device`, checked
    and read to the host once per params object (every layer of a forward gets the same one)."""
    if params.qkv_format != "thd":
        raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r}: only 'thd'")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        if getattr(params, name, None) is not None:
            raise ValueError(f"packed_seq_params.{name} is not supported")
    q, kv = params.cu_seqlens_q, params.cu_seqlens_kv
    key = (id(q), q._version, id(kv), None if kv is None else kv._version, total)
    ref = _PACKED_CACHE["ref"]
    if ref is None or ref() is not params or _PACKED_CACHE["key"] != key:
        if kv is not None and kv is not q and not torch.equal(q.cpu(), kv.cpu()):
            raise ValueError("self-attention needs cu_seqlens_q == cu_seqlens_kv")
        segments = segments_from_cu_seqlens(q, total)
        _PACKED_CACHE.update(ref=weakref.ref(params), key=key, segments=segments, cu={},
                             prefixes=prefix_bounds(params, total))
    segments, by_device = _PACKED_CACHE["segments"], _PACKED_CACHE["cu"]
    if device not in by_device:  # empty segments dropped: the kernel sees exactly the checked ones
        bounds = [0] + [e for _, e in segments]
        by_device[device] = torch.tensor(bounds, dtype=torch.int32).to(device)
    return segments, by_device[device]


def _row_bounds(rows: list[list[tuple[int, int]]], b: int, s: int, device) -> torch.Tensor:
    """int32 boundaries of every row's segments over the b*s tokens taken row after row."""
    bounds = [0]
    for r in range(b):
        bounds += [r * s + e for a, e in rows[r if len(rows) > 1 else 0] if e > a]
    return torch.tensor(bounds, dtype=torch.int32).to(device)


def _window_mask(length: int, left: int | None, device, prefix: int = 0) -> torch.Tensor:
    """SDPA boolean mask (True = attend) [length, prefix + length]: query i, at position prefix + i, sees
    the keys at positions up to its own, at most `left` back (None: all)."""
    d = (torch.arange(length, device=device)[:, None] + prefix) - torch.arange(prefix + length, device=device)[None, :]
    return (d >= 0) if left is None else (d >= 0) & (d <= left)


class SegmentCausalAttention(MegatronModule):
    """Core attention computed per packed segment with SDPA (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"SegmentCausalAttention needs attention_dropout=0, got {dropout}")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SegmentCausalAttention supports softmax_type='vanilla' only, "
                             f"got {config.softmax_type!r}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        self.cp_group = getattr(pg_collection, "cp", None) if config.context_parallel_size > 1 else None
        if config.context_parallel_size > 1 and self.cp_group is None:
            from megatron.core import parallel_state as ps

            self.cp_group = ps.get_context_parallel_group()
        self.cp_size = config.context_parallel_size
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.head_dim = config.kv_channels
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"heads ({config.num_attention_heads}) and query groups "
                             f"({config.num_query_groups}) must divide by TP={tp}")
        self.heads_per_rank = config.num_attention_heads // tp
        self.groups_per_rank = config.num_query_groups // tp
        # Megatron divides by layer_number for apply_query_key_layer_scaling and multiplies it back
        # inside the softmax: the net scale is this one.
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
        window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(f"window_size={config.window_size}: only causal windows (left, 0)")
            window = None if left < 0 else int(left)
        self.window_left = window
        # the packed rows this module attends per segment get their RoPE in one apply per call too
        packed_rope.install()
        reason = self._varlen_unusable()
        self.varlen = reason is None  # one varlen_attn call per micro-batch on CUDA fp16/bf16
        self.varlen_unusable_reason = reason

    def _varlen_unusable(self) -> Optional[str]:
        """Why this layer can never use varlen_attn (None: it can, on CUDA with fp16/bf16 inputs)."""
        if _VARLEN_ATTN is None:
            return "torch has no torch.nn.attention.varlen.varlen_attn"
        if self.cp_size > 1:
            return "context parallel attention gathers K/V itself"
        if self.head_dim % 8 or self.head_dim > 256:
            return f"head dim {self.head_dim}: flash attention needs a multiple of 8, at most 256"
        if "window_size" not in _VARLEN_PARAMS:
            if self.window_left is not None:
                return "this torch's varlen_attn has no window_size (sliding window)"
            if "is_causal" not in _VARLEN_PARAMS:
                return "this torch's varlen_attn has neither window_size nor is_causal"
        if "scale" not in _VARLEN_PARAMS and not math.isclose(self.softmax_scale, self.head_dim ** -0.5):
            return "this torch's varlen_attn has no scale and the softmax scale is not 1/sqrt(head dim)"
        return None

    def _segments(self, s: int, b: int, attention_mask, attn_mask_type, packed_seq_params, device):
        if packed_seq_params is not None:  # whole-row boundaries under CP
            return [_packed_segments(packed_seq_params, s * self.cp_size, device)[0]]
        if attention_mask is not None:
            if self.cp_size > 1:
                raise UnsupportedMaskError("context parallelism needs packed_seq_params (THD) or no mask")
            rows = _cached_mask_segments(attention_mask)
            if attention_mask.shape[-1] != s:
                raise UnsupportedMaskError(f"mask is for {attention_mask.shape[-1]} tokens, input has {s}")
            if len(rows) not in (1, b):
                raise UnsupportedMaskError(f"mask batch {len(rows)} vs input batch {b}")
            return rows
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type != AttnMaskType.causal:
            raise UnsupportedMaskError(f"no attention mask with attn_mask_type={mask_type}: only causal "
                                       "attention is supported")
        return [[(0, s * self.cp_size)]]

    def _attend_after_prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
        """q [n, np, L, hn], k/v [n, ng, prefix + L, hn] (the prefix's keys first) -> [n, np, L, hn]:
        query i sits at position prefix + i and sees keys 0 .. prefix + i (within the window)."""
        allowed = _window_mask(q.shape[2], self.window_left, q.device, prefix)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale,
                                              enable_gqa=self.heads_per_rank != self.groups_per_rank)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, np, L, hn], k/v [n, ng, L, hn] -> [n, np, L, hn], causal (+ window) per row."""
        length = q.shape[2]
        gqa = self.heads_per_rank != self.groups_per_rank
        if self.window_left is not None and length > self.window_left + 1:
            if q.device.type == "cpu" and self.window_left >= 1:  # flash blocks, no [L, L] float mask saved
                return window_causal_attention(q, k, v, 0, self.window_left, self.softmax_scale)
            mask = _window_mask(length, self.window_left, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                              enable_gqa=gqa)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """[s, b, np, hn] (or THD [t, np, hn]) q and [s, b, ng, hn] k/v -> context [s, b, np * hn]."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SegmentCausalAttention")
        thd = query.dim() == 3
        if thd:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        s, b, nq, hn = query.shape
        if key.shape[0] != s:
            raise ValueError(f"query has {s} tokens, key {key.shape[0]}: only self-attention is supported")
        if nq != self.heads_per_rank or key.shape[2] != self.groups_per_rank:
            raise ValueError(f"expected {self.heads_per_rank} query heads and {self.groups_per_rank} groups "
                             f"per rank, got {nq} and {key.shape[2]}")
        rows = self._segments(s, b, attention_mask, attn_mask_type, packed_seq_params, query.device)
        multi_segment = len(rows) > 1 or len(rows[0]) > 1
        prefixes = _PACKED_CACHE["prefixes"] if packed_seq_params is not None else {}
        if prefixes and (self.cp_size > 1 or b != 1):
            raise ValueError("shared prompts need one packed row without context parallelism")
        if multi_segment and not prefixes and self._varlen_applies(query):
            if packed_seq_params is not None and b == 1:  # THD: the trainer's path, no copy
                cu = _packed_segments(packed_seq_params, s, query.device)[1]
            else:
                cu = _row_bounds(rows, b, s, query.device)
            max_len = max(e - a for segs in rows for a, e in segs)
            out = self._varlen_rows(query, key, value, cu, max_len)
            if out is not None:
                return out
        # [s, b, h, hn] -> [b, h, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if self.cp_size > 1:
            out = torch.cat([cp_attention(q[r:r + 1], k[r:r + 1], v[r:r + 1], rows[r if len(rows) > 1 else 0],
                                          self.cp_group, self.softmax_scale, self.window_left,
                                          self.heads_per_rank != self.groups_per_rank) for r in range(b)])
        elif len(rows) == 1 and len(rows[0]) == 1:  # one segment per row: one call for the batch
            out = self._attend(q, k, v)
        else:
            outs = []
            for r in range(b):
                segs = rows[r if len(rows) > 1 else 0]
                outs.append(torch.cat([self._attend_segment(q[r:r + 1], k[r:r + 1], v[r:r + 1], a, e,
                                                            prefixes.get((a, e))) for a, e in segs], dim=2))
            out = torch.cat(outs, dim=0) if b > 1 else outs[0]
        out = out.permute(2, 0, 1, 3).reshape(s, b, nq * hn)  # [s, b, np * hn]
        return out

    def _attend_segment(self, q, k, v, a: int, e: int, prefix: tuple[int, int] | None) -> torch.Tensor:
        """Tokens a..e of the row [1, h, T, hn], after the prefix segment they continue, if any."""
        if prefix is None:
            return self._attend(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e])
        pa, pe = prefix
        keys = torch.cat([k[:, :, pa:pe], k[:, :, a:e]], dim=2)
        values = torch.cat([v[:, :, pa:pe], v[:, :, a:e]], dim=2)
        return self._attend_after_prefix(q[:, :, a:e], keys, values, pe - pa)

    def _varlen_key(self, query: torch.Tensor) -> tuple:
        return (query.device.type, query.dtype, self.head_dim, self.window_left,
                self.heads_per_rank != self.groups_per_rank)

    def _varlen_applies(self, query: torch.Tensor) -> bool:
        return (self.varlen and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
                and self._varlen_key(query) not in _VARLEN_FAILED)

    def _varlen_rows(self, query, key, value, cu: torch.Tensor, max_len: int) -> Optional[torch.Tensor]:
        """[s, b, np, hn] q and [s, b, ng, hn] k/v, segments `cu` over the b*s tokens taken row after
        row -> context [s, b, np * hn]; None when this torch's kernel refused (the loop takes over)."""
        s, b, nq, hn = query.shape
        q, k, v = (x.transpose(0, 1).reshape(b * s, x.shape[2], hn) for x in (query, key, value))
        kw = {}
        if "scale" in _VARLEN_PARAMS:
            kw["scale"] = self.softmax_scale
        if "window_size" in _VARLEN_PARAMS:  # (-1, 0): causal; (left, 0): causal sliding window
            kw["window_size"] = (-1 if self.window_left is None else self.window_left, 0)
        else:
            kw["is_causal"] = True
        if nq != k.shape[1]:
            if "enable_gqa" in _VARLEN_PARAMS:
                kw["enable_gqa"] = True
            else:  # SDPA's GQA: query head h reads K/V group h // (np / ng)
                k, v = (x.repeat_interleave(nq // x.shape[1], dim=1) for x in (k, v))
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        key_ = self._varlen_key(query)
        try:
            out = _VARLEN_ATTN(q, k, v, cu, cu, max_len, max_len, **kw)
        except torch.cuda.OutOfMemoryError:
            raise
        except (NotImplementedError, RuntimeError) as err:
            _VARLEN_FAILED.add(key_)
            warnings.warn(f"SegmentCausalAttention: torch varlen_attn failed for {key_} ({err}); "
                          "computing attention per segment with SDPA instead", RuntimeWarning)
            return None
        return out.reshape(b, s, nq * hn).transpose(0, 1).contiguous()  # [s, b, np * hn]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters nor buffers (vanilla softmax only)


def uses_segment_attention(model) -> bool:
    """Whether `model` (any wrapper) computes core attention with SegmentCausalAttention."""
    return any(isinstance(m, SegmentCausalAttention) for m in model.modules())
