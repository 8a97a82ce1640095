"""HF <-> Megatron-Core weights for this rank's TP/PP shard, tensor by tensor.

- `load_hf_weights(model_chunks, hf_tensors)`: copies HF tensors (a Mapping name -> Tensor, e.g.
  `ModelSource.tensors()` or an HF `state_dict()`, or a model name/dir) into this rank's chunks.
- `export_hf_tensors(model_chunks, dtype=None)`: yields `(hf_name, full_tensor)` for the layers this
  pipeline stage owns, TP shards gathered inside the TP group and TP padding removed. Collective
  over the TP group: every TP rank must iterate it to the end, and every TP rank gets the same
  tensors. With tied embeddings only the first stage yields `model.embed_tokens.weight` (no
  `lm_head.weight`).

Megatron layouts (per layer; TP=1 view, after the padding described in `model.py`):
- `linear_qkv`: per KV group g: [q heads of g, k_g, v_g] stacked on dim 0; TP splits whole groups.
- `linear_fc1`: [gate; up]; each TP rank holds [gate_r; up_r].
- `linear_proj` / `linear_fc2`: row-parallel (dim 1); embeddings / output layer: vocab rows (dim 0).
- Transformer Engine specs fold the norms into the next linear (`linear_qkv.layer_norm_weight`,
  `linear_fc1.layer_norm_weight`); both namings are handled.
- MoE (`moe.py`): `mlp.router.weight` is the HF router (`mlp.gate` / `block_sparse_moe.gate`); local
  expert j (`mlp.experts.local_experts.{j}.linear_fc1/2.weight`, or TEGroupedMLP's
  `mlp.experts.linear_fc1/2.weight{j}`) is global expert `ep_rank * E/ep + j`, [gate; up] / down,
  never TP-split. The export all-gathers experts over the EP group (collective over it too: every
  EP rank iterates) and yields all E experts on every rank.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from .lora import is_adapter_param, merged_weight
from .model import ModelDims, layer_offset
from .moe import ep_size_rank, expert_hf_name, router_hf_name, shared_expert_hf_name

Getter = Callable[[str], torch.Tensor]

# Megatron suffix inside a layer -> (kind, TP partition dim or None)
_LAYER_PARAMS = {
    "input_layernorm.weight": ("input_norm", None),
    "self_attention.linear_qkv.layer_norm_weight": ("input_norm", None),
    "self_attention.linear_qkv.weight": ("qkv", 0),
    "self_attention.linear_qkv.bias": ("qkv_bias", 0),
    "self_attention.linear_proj.weight": ("proj", 1),
    "self_attention.q_layernorm.weight": ("q_norm", None),  # Qwen3: per head, shared by all heads
    "self_attention.k_layernorm.weight": ("k_norm", None),
    "pre_mlp_layernorm.weight": ("post_norm", None),
    "mlp.linear_fc1.layer_norm_weight": ("post_norm", None),
    "mlp.linear_fc1.weight": ("fc1", 0),
    "mlp.linear_fc2.weight": ("fc2", 1),
    "mlp.router.weight": ("router", None),
    "mlp.shared_experts.linear_fc1.weight": ("shared_fc1", 0),  # Qwen2-MoE: [gate; up] like fc1
    "mlp.shared_experts.linear_fc2.weight": ("shared_fc2", 1),
    "mlp.shared_experts.gate_weight": ("shared_gate", None),
}
# kind "expert_fc1:<local j>" / "expert_fc2:<local j>"; made global ("...:<e>") before mapping to HF
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_(fc[12])\.weight|linear_(fc[12])\.weight(\d+))$")
_TOP_PARAMS = {
    "embedding.word_embeddings.weight": ("embed", 0),
    "decoder.final_layernorm.weight": ("final_norm", None),
    "output_layer.weight": ("output", 0),
}


def _classify(name: str, offset: int) -> tuple[str, int | None, int | None]:
    """(kind, partition dim, global layer index or None) of a Megatron parameter name."""
    if name in _TOP_PARAMS:
        return (*_TOP_PARAMS[name], None)
    prefix = "decoder.layers."
    if name.startswith(prefix):
        local, _, suffix = name[len(prefix):].partition(".")
        if suffix in _LAYER_PARAMS:
            return (*_LAYER_PARAMS[suffix], offset + int(local))
        m = _EXPERT.match(suffix)
        if m:
            j, fc = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(4), m.group(3))
            return f"expert_{fc}:{j}", None, offset + int(local)
    raise KeyError(f"no HF mapping for Megatron parameter {name!r}")


def _pad_rows(t: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    extra = rows - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


# ------------------------------------------------------------------ HF -> full (TP=1) Megatron

def _hf_layer(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}"


def _expert_kind(kind: str, dims: ModelDims, ep_rank: int, ep: int) -> str:
    """`expert_fcN:<local>` -> `expert_fcN:<global>` for EP rank `ep_rank`; other kinds unchanged."""
    if not kind.startswith("expert_"):
        return kind
    base, _, local = kind.partition(":")
    return f"{base}:{ep_rank * (dims.moe.num_experts // ep) + int(local)}"


def _full_megatron(kind: str, layer: int | None, get: Getter, d: ModelDims) -> torch.Tensor:
    kv, kvp, hpg, hd = d.num_kv_heads, d.padded_num_kv_heads, d.heads_per_group, d.head_dim
    if kind == "embed":
        return _pad_rows(get("model.embed_tokens.weight"), d.padded_vocab_size)
    if kind == "output":
        name = "model.embed_tokens.weight" if d.tie_embeddings else "lm_head.weight"
        return _pad_rows(get(name), d.padded_vocab_size)
    if kind == "final_norm":
        return get("model.norm.weight")
    if kind == "input_norm":
        return get(_hf_layer(layer, "input_layernorm.weight"))
    if kind == "post_norm":
        return get(_hf_layer(layer, "post_attention_layernorm.weight"))
    if kind in ("q_norm", "k_norm"):
        return get(_hf_layer(layer, f"self_attn.{kind}.weight"))
    if kind == "router":
        return get(router_hf_name(d.moe, layer))
    if kind == "shared_fc1":
        return torch.cat([get(shared_expert_hf_name(d.moe, layer, "gate")), get(shared_expert_hf_name(d.moe, layer, "up"))])
    if kind in ("shared_fc2", "shared_gate"):
        return get(shared_expert_hf_name(d.moe, layer, "down" if kind == "shared_fc2" else "gate_weight"))
    if kind.startswith("expert_fc1:"):
        e = int(kind.partition(":")[2])
        return torch.cat([get(expert_hf_name(d.moe, layer, e, "gate")), get(expert_hf_name(d.moe, layer, e, "up"))])
    if kind.startswith("expert_fc2:"):
        return get(expert_hf_name(d.moe, layer, int(kind.partition(":")[2]), "down"))
    if kind in ("qkv", "qkv_bias"):
        suffix = "weight" if kind == "qkv" else "bias"
        q = get(_hf_layer(layer, f"self_attn.q_proj.{suffix}"))
        k = get(_hf_layer(layer, f"self_attn.k_proj.{suffix}"))
        v = get(_hf_layer(layer, f"self_attn.v_proj.{suffix}"))
        tail = q.shape[1:]
        q = _pad_rows(q.reshape(kv, hpg * hd, *tail), kvp)
        k = _pad_rows(k.reshape(kv, hd, *tail), kvp)
        v = _pad_rows(v.reshape(kv, hd, *tail), kvp)
        return torch.cat([q, k, v], dim=1).reshape(kvp * (hpg + 2) * hd, *tail)
    if kind == "proj":
        o = get(_hf_layer(layer, "self_attn.o_proj.weight"))
        o = o.reshape(d.hidden_size, kv, hpg * hd)
        return _pad_rows(o, kvp, dim=1).reshape(d.hidden_size, kvp * hpg * hd)
    if kind == "fc1":  # [gate; up], each padded; TP sharding is handled in _shard
        gate = _pad_rows(get(_hf_layer(layer, "mlp.gate_proj.weight")), d.padded_ffn_size)
        up = _pad_rows(get(_hf_layer(layer, "mlp.up_proj.weight")), d.padded_ffn_size)
        return torch.cat([gate, up], dim=0)
    if kind == "fc2":
        return _pad_rows(get(_hf_layer(layer, "mlp.down_proj.weight")), d.padded_ffn_size, dim=1)
    raise KeyError(kind)


def _shard(kind: str, dim: int | None, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if dim is None or tp == 1:
        return full
    if kind in ("fc1", "shared_fc1"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def _getter(hf_tensors) -> Getter:
    if isinstance(hf_tensors, (str, Path)):
        from .hf_source import resolve_model

        hf_tensors = resolve_model(hf_tensors).tensors()
    if not isinstance(hf_tensors, Mapping):
        raise TypeError("hf_tensors must be a Mapping name -> Tensor, or a model name/dir")

    def get(name: str) -> torch.Tensor:
        try:
            return hf_tensors[name]
        except KeyError:
            raise KeyError(f"HF tensor {name!r} missing from the source") from None

    return get


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


@torch.no_grad()
def load_hf_weights(model_chunks: list, hf_tensors) -> None:
    """Copy HF weights into this rank's chunks (every parameter is written; shapes are checked)."""
    get = _getter(hf_tensors)
    tp, rank = _tp()
    ep, ep_rank = ep_size_rank()
    for chunk in model_chunks:
        dims: ModelDims = chunk.mrl_dims
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            if is_adapter_param(name):  # LoRA adapters are no HF tensors: lora.attach initialised them
                continue
            kind, dim, layer = _classify(name, offset)
            kind = _expert_kind(kind, dims, ep_rank, ep)
            shard = _shard(kind, dim, _full_megatron(kind, layer, get, dims), tp, rank)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: HF shard shape {tuple(shard.shape)} != Megatron "
                                 f"{tuple(param.shape)} (config and weights disagree?)")
            param.copy_(shard.to(dtype=param.dtype, device=param.device))


# ------------------------------------------------------------------ Megatron -> HF

def _gather(kind: str, dim: int | None, local: torch.Tensor, tp: int) -> torch.Tensor:
    if dim is None or tp == 1:
        return local
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    if kind in ("fc1", "shared_fc1"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def _to_hf(kind: str, layer: int | None, full: torch.Tensor, d: ModelDims) -> list[tuple[str, torch.Tensor]]:
    kv, kvp, hpg, hd = d.num_kv_heads, d.padded_num_kv_heads, d.heads_per_group, d.head_dim
    if kind == "embed":
        return [("model.embed_tokens.weight", full[: d.vocab_size])]
    if kind == "output":
        return [] if d.tie_embeddings else [("lm_head.weight", full[: d.vocab_size])]
    if kind == "final_norm":
        return [("model.norm.weight", full)]
    if kind == "input_norm":
        return [(_hf_layer(layer, "input_layernorm.weight"), full)]
    if kind == "post_norm":
        return [(_hf_layer(layer, "post_attention_layernorm.weight"), full)]
    if kind in ("q_norm", "k_norm"):
        return [(_hf_layer(layer, f"self_attn.{kind}.weight"), full)]
    if kind == "router":
        return [(router_hf_name(d.moe, layer), full)]
    if kind == "shared_fc1":
        gate, up = full.chunk(2, dim=0)
        return [(shared_expert_hf_name(d.moe, layer, "gate"), gate), (shared_expert_hf_name(d.moe, layer, "up"), up)]
    if kind in ("shared_fc2", "shared_gate"):
        return [(shared_expert_hf_name(d.moe, layer, "down" if kind == "shared_fc2" else "gate_weight"), full)]
    if kind.startswith("expert_fc1:"):
        e = int(kind.partition(":")[2])
        gate, up = full.chunk(2, dim=0)
        return [(expert_hf_name(d.moe, layer, e, "gate"), gate), (expert_hf_name(d.moe, layer, e, "up"), up)]
    if kind.startswith("expert_fc2:"):
        return [(expert_hf_name(d.moe, layer, int(kind.partition(":")[2]), "down"), full)]
    if kind in ("qkv", "qkv_bias"):
        suffix = "weight" if kind == "qkv" else "bias"
        tail = full.shape[1:]
        groups = full.reshape(kvp, (hpg + 2) * hd, *tail)[:kv]
        q, k, v = groups.split([hpg * hd, hd, hd], dim=1)
        return [(_hf_layer(layer, f"self_attn.{n}_proj.{suffix}"), t.reshape(kv * t.shape[1], *tail))
                for n, t in (("q", q), ("k", k), ("v", v))]
    if kind == "proj":
        o = full.reshape(d.hidden_size, kvp, hpg * hd)[:, :kv]
        return [(_hf_layer(layer, "self_attn.o_proj.weight"), o.reshape(d.hidden_size, kv * hpg * hd))]
    if kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return [(_hf_layer(layer, "mlp.gate_proj.weight"), gate[: d.ffn_size]),
                (_hf_layer(layer, "mlp.up_proj.weight"), up[: d.ffn_size])]
    if kind == "fc2":
        return [(_hf_layer(layer, "mlp.down_proj.weight"), full[:, : d.ffn_size])]
    raise KeyError(kind)


@torch.no_grad()
def export_hf_tensors(model_chunks: list, dtype: torch.dtype | None = None,
                      grads: bool = False, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for this stage's parameters, TP-gathered, padding removed.

    `grads=True` exports the parameters' `.grad` (or DDP `main_grad`) in the same layout instead
    (zeros where a parameter has none), for gradient checks against HF. With LoRA adapters
    (train/lora.py) an adapted weight is exported merged, W + scale * B A (each TP shard merges its own
    rows / columns: exact), unless `merge_lora=False`; the adapters themselves are never yielded
    (`lora_weights.export_adapter_tensors` does that, in PEFT's names)."""
    tp, _ = _tp()
    ep, _ = ep_size_rank()
    for chunk in model_chunks:
        dims: ModelDims = chunk.mrl_dims
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            if is_adapter_param(name):
                continue
            kind, dim, layer = _classify(name, offset)
            if kind == "output" and dims.tie_embeddings:
                continue  # the last stage's copy of the tied embedding: the first stage exports it
            local = param.detach()
            if merge_lora and not grads and getattr(chunk, "mrl_lora", None) and name.endswith(".weight"):
                local = merged_weight(chunk.get_submodule(name.rsplit(".", 1)[0]), local)
            if grads:
                g = getattr(param, "main_grad", None)
                g = param.grad if g is None else g
                local = torch.zeros_like(local) if g is None else g.detach()
            for part_kind, full in _gathered_parts(kind, dim, local, tp, ep, dims):
                for hf_name, tensor in _to_hf(part_kind, layer, full, dims):
                    tensor = tensor.contiguous()
                    yield hf_name, tensor if dtype is None else tensor.to(dtype)


def _gathered_parts(kind: str, dim: int | None, local: torch.Tensor, tp: int, ep: int, dims: ModelDims):
    """[(kind, full tensor)]: one TP-gathered tensor, or for an expert its copies on every EP rank."""
    if not kind.startswith("expert_"):
        return [(kind, _gather(kind, dim, local, tp))]
    if ep == 1:
        return [(_expert_kind(kind, dims, 0, 1), local)]
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_expert_model_parallel_group())
    return [(_expert_kind(kind, dims, r, ep), part) for r, part in enumerate(parts)]


def hf_names_of_stage(model_chunks: list) -> list[str]:
    """HF names `export_hf_tensors` yields on this rank, without communication or copies."""
    names = []
    ep, _ = ep_size_rank()
    for chunk in model_chunks:
        dims: ModelDims = chunk.mrl_dims
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            if is_adapter_param(name):
                continue
            kind, _, layer = _classify(name, offset)
            if kind == "output" and dims.tie_embeddings:
                continue
            kinds = [_expert_kind(kind, dims, r, ep) for r in range(ep)] if kind.startswith("expert_") else [kind]
            for k in kinds:
                names.extend(n for n, _ in _to_hf(k, layer, _meta_full(k, dims), dims))
    return names


def _meta_full(kind: str, d: ModelDims) -> torch.Tensor:
    """A meta tensor with the full padded shape of `kind` (for name listing only)."""
    hpg, hd, kvp = d.heads_per_group, d.head_dim, d.padded_num_kv_heads
    shapes = {
        "embed": (d.padded_vocab_size, d.hidden_size), "output": (d.padded_vocab_size, d.hidden_size),
        "final_norm": (d.hidden_size,), "input_norm": (d.hidden_size,), "post_norm": (d.hidden_size,),
        "q_norm": (hd,), "k_norm": (hd,),
        "qkv": (kvp * (hpg + 2) * hd, d.hidden_size), "qkv_bias": (kvp * (hpg + 2) * hd,),
        "proj": (d.hidden_size, kvp * hpg * hd), "fc1": (2 * d.padded_ffn_size, d.hidden_size),
        "fc2": (d.hidden_size, d.padded_ffn_size),
    }
    if d.moe is not None:
        shapes["router"] = (d.moe.num_experts, d.hidden_size)
        shapes["shared_fc1"] = (2 * d.moe.shared_ffn_size, d.hidden_size)
        shapes["shared_fc2"] = (d.hidden_size, d.moe.shared_ffn_size)
        shapes["shared_gate"] = (1, d.hidden_size)
    if kind.startswith("expert_"):
        fc1 = kind.startswith("expert_fc1")
        shape = (2 * d.ffn_size, d.hidden_size) if fc1 else (d.hidden_size, d.ffn_size)
        return torch.empty(shape, device="meta")
    return torch.empty(shapes[kind], device="meta")
