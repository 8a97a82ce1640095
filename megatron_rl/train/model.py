"""Megatron-Core GPT model built from a Hugging Face config (Llama, Mistral, Qwen2, Qwen3; MoE: Qwen3-MoE,
Mixtral through `moe.py`).

API:
- `model_dims(hf_config, tp=1) -> ModelDims`: the HF shapes plus the padded shapes Megatron uses.
- `build_model(hf_config, layout, dtype=torch.float32, *, use_te=None, recompute=None, router_aux_loss=0.0,
  per_token_loss=False, routing_replay=False) -> list[GPTModel]`:
  this rank's model chunks (`layout.sequence_parallel` and `recompute`, a `Recompute`, set the
  activation-memory options of their TransformerConfig) (one per virtual pipeline stage; one chunk without VPP). Call
  `init_parallel(layout)` first. Each chunk carries `chunk.mrl_dims` (ModelDims) and
  `chunk.mrl_vp_stage`. Weights are random: load them with `hf_weights.load_hf_weights`.
- `forward_logits(chunk, input_ids, position_ids=None, attention_mask=None)`: one forward of a chunk;
  on the last stage returns vocab-parallel logits `[B, T, V_padded / tp]` (feed them to
  `logprobs.token_logprobs`), elsewhere the hidden states. Without an explicit mask it is causal.

Padding for TP (exact: padded parts are zero and stay zero under training, since their gradients
are zero): the vocab is padded to a multiple of `tp` (logprobs mask the padded columns), the KV
groups to a multiple of `tp` (each extra group has `heads // kv_heads` zero query heads, zero K/V
and zero output-projection columns, so it adds exactly 0), and the MLP width to a multiple of `tp`.
This is what lets SmolLM2-135M (9 heads, 3 KV heads) run at TP=2.

RoPE: default, `linear` (Megatron's seq_len_interpolation_factor), `llama3` (Megatron's built-in
llama-3 scaling; only its fixed low/high frequency factors 1/4 and 8192 original context), `yarn`
(Megatron's YaRN embedding; HF's attention scaling is applied by Megatron's attention where it
does so, else folded into the softmax scale as mscale^2). Other types raise `UnsupportedModelError`.

Specs: Transformer Engine layers on GPU when TE imports (use_te=None), the local spec otherwise.
Context parallel (`layout.cp`): TE's THD CP attention (p2p ring) on GPU, `attention.SegmentCausalAttention`'s
all-gather path on the local spec; the step feeds both the same load-balanced chunks (packing.py).

Activation memory (docs/train.md): sequence parallel comes from the layout; `Recompute` maps
trainer.recompute to Megatron's options. Selective recompute checkpoints `self_attention.core_attention`
whatever module that is, so on the local spec it re-runs `attention.SegmentCausalAttention` in the
backward (tests/unit/test_train_recompute.py counts its forwards).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rl.config import ConfigError
from megatron_rl.platform import has_cuda, te_available

from .moe import MOE_MODEL_TYPES, MoeDims, moe_config_kwargs, moe_dims, reduce_expert_grads_over_expert_dp
from .parallel import ParallelLayout
from .unsupported import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3") + MOE_MODEL_TYPES


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0  # yarn attention scaling applied to cos/sin in HF (scores scale by mscale^2)


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    vocab_size: int
    padded_vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    padded_num_kv_heads: int
    ffn_size: int
    padded_ffn_size: int
    qkv_bias: bool
    tie_embeddings: bool
    norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    sliding_window: int | None = None
    # per layer, 1 = sliding window, 0 = full attention (Qwen2's max_window_layers / HF `layer_types`);
    # None: every layer has the window (when there is one)
    window_layers: tuple[int, ...] | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE (Megatron's qk_layernorm)
    moe: MoeDims | None = None  # MoE families: every layer's MLP is routed experts (ffn_size: per expert)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def padded_num_heads(self) -> int:
        return self.padded_num_kv_heads * self.heads_per_group


@dataclass(frozen=True)
class Recompute:
    """Activation recompute of the training forward (trainer.recompute, recompute_method,
    recompute_num_layers). `none` keeps every activation; `selective` recomputes the core attention of
    every layer in the backward; `full` keeps only the input of each group of `num_layers` layers
    (`uniform`: every layer of a stage, group by group) or of the first `num_layers` layers of each
    stage (`block`: the others keep everything) and re-runs the group in the backward."""

    granularity: str = "none"  # none | selective | full
    method: str = "uniform"  # full only: uniform | block
    num_layers: int = 1  # full only

    def __post_init__(self) -> None:
        if self.granularity not in ("none", "selective", "full"):
            raise ValueError(f"recompute {self.granularity!r}: none, selective or full")
        if self.method not in ("uniform", "block") or self.num_layers < 1:
            raise ValueError(f"recompute_method {self.method!r} / recompute_num_layers {self.num_layers}: "
                             "uniform or block, and >= 1 layers")

    @classmethod
    def from_trainer(cls, trainer_config) -> "Recompute":
        t = trainer_config
        return cls(t.recompute, t.recompute_method, t.recompute_num_layers)

    def config_kwargs(self) -> dict:
        """TransformerConfig fields."""
        if self.granularity == "none":
            return {}
        if self.granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _rope_spec(hf_config) -> RopeSpec:
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0) or 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    factor = float(params.get("factor", 1.0) or 1.0)
    if kind == "default":
        return RopeSpec(theta)
    if kind == "linear":
        return RopeSpec(theta, "linear", factor)
    if kind == "llama3":
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in fixed.items():
            if float(params.get(key, want)) != want:
                raise UnsupportedModelError(
                    f"llama3 RoPE scaling with {key}={params.get(key)}: Megatron-Core's implementation "
                    f"hard-codes {key}={want}")
        return RopeSpec(theta, "llama3", factor)
    if kind == "yarn":
        orig = int(params.get("original_max_position_embeddings")
                   or getattr(hf_config, "max_position_embeddings"))
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise UnsupportedModelError("yarn RoPE with mscale/mscale_all_dim (DeepSeek style) is not supported")
        if params.get("truncate", True) is False:
            raise UnsupportedModelError("yarn RoPE with truncate=False is not supported by Megatron-Core")
        default_mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        attention_factor = params.get("attention_factor")
        mscale = float(attention_factor) if attention_factor else default_mscale
        if abs(mscale - default_mscale) > 1e-12:
            raise UnsupportedModelError(f"yarn attention_factor={attention_factor}: Megatron-Core uses "
                                        f"0.1 ln(factor) + 1 = {default_mscale}")
        return RopeSpec(theta, "yarn", factor, orig, float(params.get("beta_fast") or 32.0),
                        float(params.get("beta_slow") or 1.0), mscale)
    raise UnsupportedModelError(f"RoPE type {kind!r} is not supported (default, linear, llama3, yarn)")


def model_dims(hf_config, tp: int = 1) -> ModelDims:
    """Shapes of the HF model and their TP-padded Megatron counterparts; validates the family."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act {act!r}: only SwiGLU (silu) MLPs are supported")
    if getattr(hf_config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads}")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if model_type in ("qwen2", "qwen2_moe"):
        qkv_bias = True  # Qwen2 always has q/k/v biases (and no o_proj bias)
    else:
        qkv_bias = bool(getattr(hf_config, "attention_bias", False))
        if qkv_bias:
            raise UnsupportedModelError(f"attention_bias=True on {model_type} (o_proj bias) is not supported")
    sliding = getattr(hf_config, "sliding_window", None)
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and not getattr(hf_config, "use_sliding_window", False):
        sliding = None
    window_layers = _window_layers(hf_config) if sliding else None
    if window_layers is not None and not any(window_layers):
        sliding, window_layers = None, None
    moe = moe_dims(hf_config)
    ffn = moe.expert_ffn_size if moe else hf_config.intermediate_size
    if getattr(hf_config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    return ModelDims(
        model_type=model_type, vocab_size=hf_config.vocab_size,
        padded_vocab_size=_round_up(hf_config.vocab_size, tp), hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        padded_num_kv_heads=_round_up(kv_heads, tp), ffn_size=ffn,
        padded_ffn_size=ffn if moe else _round_up(ffn, tp), qkv_bias=qkv_bias,  # experts: no TP (moe.py)
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        norm_eps=float(hf_config.rms_norm_eps), rope=_rope_spec(hf_config),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        sliding_window=int(sliding) if sliding else None, window_layers=window_layers,
        qk_norm=model_type in ("qwen3", "qwen3_moe"), moe=moe)


def _window_layers(hf_config) -> tuple[int, ...] | None:
    """Which layers have the sliding window, read off HF's `layer_types` (Qwen2 fills it from
    max_window_layers: layers >= it slide); None when every layer has it or the config says nothing."""
    types = getattr(hf_config, "layer_types", None)
    if not types:
        return None
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != hf_config.num_hidden_layers:
        raise UnsupportedModelError(f"layer_types={list(types)}: only sliding_attention / full_attention, "
                                    "one per layer")
    if all(t == "sliding_attention" for t in types):
        return None
    return tuple(int(t == "sliding_attention") for t in types)


def check_precision(precision: str, use_te: bool | None = None) -> None:
    """ConfigError naming trainer.precision when the layer spec (`use_te`, default: as build_model
    picks it) has no attention for that precision on packed sequences. Transformer Engine's flash and
    fused attention take fp16/bf16 only; its one fp32 backend, the unfused one, pads the packed (THD)
    micro-batch back to one row per sequence with an fp32 [seq, seq] score matrix per head, and has
    no context parallel at all. The local spec (no TE) runs fp32 through SegmentCausalAttention."""
    use_te = te_available() if use_te is None else use_te
    if precision == "fp32" and use_te:
        raise ConfigError("trainer.precision: fp32 with Transformer Engine: TE has no fp32 flash/fused "
                          "attention for packed sequences; use bf16, or for fp32 a GPU install without TE "
                          "(MEGATRON_RL_GPU_TE=0)")


def _megatron_applies_yarn_mscale() -> bool:
    """Whether Megatron's attention scales q/k by the YaRN concentration factor itself (0.16 does,
    from the yarn_* config attributes); otherwise it is folded into the softmax scale."""
    from megatron.core.transformer import attention

    return hasattr(attention, "_yarn_get_concentration_factor_from_config")


def transformer_config(dims: ModelDims, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
                       use_te: bool | None = None, recompute: Recompute | None = None,
                       router_aux_loss: float = 0.0, per_token_loss: bool = False):
    """Megatron's TransformerConfig for `dims` under `layout` (MoE fields from `moe.moe_config_kwargs`,
    `router_aux_loss` its load-balancing loss coefficient; `per_token_loss`: the loss functions return
    token sums, as the trainer's do (optimizer.py sets it too, but MoE routers read it when built). Fusions, batched p2p and CPU init come
    from `platform.megatron_kernel_options` (the machine's facts); `use_te`: the TE layer spec is used
    (default: TE importable on GPU, as `layer_spec`); sequence parallel from the layout, activation
    recompute from `recompute` (default none)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.platform import megatron_kernel_options

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} not supported (float32, bfloat16, float16)")
    stages = layout.pp * layout.n_chunks
    if dims.num_layers % stages:
        raise ValueError(f"{dims.num_layers} layers cannot be split evenly over pp={layout.pp} x "
                         f"vpp={layout.n_chunks} = {stages} stages")
    softmax_scale = None
    if dims.rope.kind == "yarn" and dims.rope.mscale != 1.0 and not _megatron_applies_yarn_mscale():
        softmax_scale = dims.rope.mscale ** 2 / math.sqrt(dims.head_dim)
    use_te = te_available() if use_te is None else use_te
    if use_te and layout.cp > 1 and dims.sliding_window:
        # TE asserts at the first step: its CP attention takes windows only with cp_comm_type a2a or
        # all_gather (no THD), not the p2p ring that packed bins need; refused before launch instead
        raise ValueError(f"trainer.context_parallel={layout.cp} with a sliding-window model "
                         f"(window {dims.sliding_window}) is not supported by Transformer Engine's CP "
                         "attention: use trainer.context_parallel: 1 on GPU")
    kernels = megatron_kernel_options(use_te=use_te, interleaved=layout.interleaved)
    moe_kwargs = moe_config_kwargs(dims.moe, layout, use_te, router_aux_loss) if dims.moe else {}
    if dims.rope.kind == "yarn":  # TE's fused THD RoPE drops YaRN's mscale (Megatron only warns on BSHD)
        kernels["apply_rope_fusion"] = False
    config = TransformerConfig(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, ffn_hidden_size=dims.padded_ffn_size,
        num_attention_heads=dims.padded_num_heads, num_query_groups=dims.padded_num_kv_heads,
        kv_channels=dims.head_dim, normalization="RMSNorm", layernorm_epsilon=dims.norm_eps,
        qk_layernorm=dims.qk_norm,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=dims.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, softmax_scale=softmax_scale,
        attention_softmax_in_fp32=True,
        window_size=(dims.sliding_window - 1, 0) if dims.sliding_window else None,
        window_attn_skip_freq=list(dims.window_layers) if dims.window_layers else None,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        sequence_parallel=layout.sequence_parallel, context_parallel_size=layout.cp,
        # TE's CP attention: K/V chunks passed round the CP ring (the local spec gathers them instead)
        cp_comm_type="p2p" if layout.cp > 1 else None,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.interleaved else None,
        pipeline_dtype=dtype, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        calculate_per_token_loss=per_token_loss,
        **kernels, **(recompute or Recompute()).config_kwargs(), **moe_kwargs,
    )
    if dims.rope.kind == "yarn":  # GPTModel reads these with getattr (they live on MLA configs)
        config.yarn_rotary_scaling_factor = dims.rope.factor
        config.yarn_original_max_position_embeddings = dims.rope.original_max_position_embeddings
        config.yarn_beta_fast = dims.rope.beta_fast
        config.yarn_beta_slow = dims.rope.beta_slow
        config.yarn_mscale = 1.0
        config.yarn_mscale_all_dim = 0.0
        config.yarn_correction_range_round_to_int = True
    return config


def layer_spec(use_te: bool | None = None, segment_attention: bool = True, qk_norm: bool = False,
               num_experts: int | None = None):
    """Transformer Engine spec when `use_te` (default: TE importable on GPU), else the local spec, whose
    core attention is `attention.SegmentCausalAttention` (or Megatron's DotProductAttention with
    `segment_attention=False`, the reference it is tested against). `qk_norm`: q/k RMSNorm per head;
    `num_experts`: MoE MLPs (grouped GEMM experts on TE, SequentialMLP on the local spec)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = te_available()
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=bool(num_experts), qk_layernorm=qk_norm)
    spec = specs.get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm", qk_layernorm=qk_norm)
    if segment_attention:
        from .attention import SegmentCausalAttention

        # per-segment SDPA instead of DotProductAttention's masked [T, T] float32 scores
        spec.submodules.self_attention.submodules.core_attention = SegmentCausalAttention
    return spec


def build_model(hf_config, layout: ParallelLayout, dtype: torch.dtype = torch.float32, *,
                use_te: bool | None = None, recompute: Recompute | None = None,
                router_aux_loss: float = 0.0, per_token_loss: bool = False, routing_replay: bool = False,
                lora=None, lora_seed: int = 0) -> list:
    """This rank's GPTModel chunks for `layout` (init_parallel(layout) must have run). `routing_replay`:
    the MoE routers replay the experts micro-batches carry (train.routing_replay; ValueError naming
    algo.routing_replay for a dense model). `lora` (a `lora.LoraSpec`): the base weights are frozen and
    the targeted layers get adapters initialised from `lora_seed` (train/lora.py; `chunk.mrl_lora`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("call megatron_rl.train.parallel.init_parallel(layout) before build_model")
    if ps.get_tensor_model_parallel_world_size() != layout.tp or \
            ps.get_pipeline_model_parallel_world_size() != layout.pp or \
            ps.get_context_parallel_world_size() != layout.cp or \
            ps.get_expert_model_parallel_world_size() != layout.ep:
        raise ValueError("layout does not match the initialised parallel state")
    dims = model_dims(hf_config, layout.tp)
    if routing_replay and not dims.moe:
        raise ValueError(f"algo.routing_replay needs an MoE model; {getattr(hf_config, 'model_type', '?')} is dense")
    if use_te is None:
        use_te = te_available()
    if lora is not None:  # refused before any chunk is built: one line naming the key
        from megatron_rl.train import lora as lora_adapters

        lora_adapters.check_model(lora, dims, use_te, (recompute or Recompute()).granularity)
    config = transformer_config(dims, layout, dtype, use_te=use_te, recompute=recompute,
                                router_aux_loss=router_aux_loss, per_token_loss=per_token_loss)
    spec = layer_spec(use_te, qk_norm=dims.qk_norm, num_experts=dims.moe.num_experts if dims.moe else None)
    rope = dims.rope
    position_type = "yarn" if rope.kind == "yarn" else "rope"
    chunks = []
    for i in range(layout.n_chunks):
        vp_stage = i if layout.interleaved else None
        chunk = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=dims.padded_vocab_size,
            max_sequence_length=dims.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True, share_embeddings_and_output_weights=dims.tie_embeddings,
            position_embedding_type=position_type, rotary_percent=1.0, rotary_base=rope.theta,
            rope_scaling=rope.kind == "llama3", rope_scaling_factor=rope.factor,
            seq_len_interpolation_factor=rope.factor if rope.kind == "linear" else None,
            vp_stage=vp_stage)
        if has_cuda():
            # the local spec's torch norms are built on the CPU (torch_norm.WrappedTorchNorm passes no
            # device); Megatron-LM's get_model moves every chunk the same way. Without it a chunk DDP
            # never re-homes (the KL reference, distributed_optimizer: false) fails at its first forward
            chunk.cuda(torch.cuda.current_device())
        chunk.mrl_dims = dims
        chunk.mrl_vp_stage = vp_stage
        chunk.mrl_lora = None
        if lora is not None:  # before DDP / Float16Module wrap the chunk: they read requires_grad
            lora_adapters.attach(chunk, lora, lora_seed)
        if dims.moe:  # before DDP wraps the chunk: it groups the grads by this mark
            reduce_expert_grads_over_expert_dp(chunk)
        if routing_replay:
            from megatron_rl.train import routing_replay as replay

            replay.attach(chunk)
        chunks.append(chunk)
    return chunks


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """Megatron convention: True = masked out; shape [1, 1, T, T]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(chunk, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Forward one chunk on `[B, T]` ids; last stage -> vocab-parallel logits [B, T, V_pad/tp]."""
    b, t = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
    if attention_mask is None:
        attention_mask = causal_mask(t, input_ids.device)
    return chunk(input_ids, position_ids, attention_mask)


def layer_offset(chunk) -> int:
    """Global index of the chunk's first transformer layer (HF `model.layers.{i}`)."""
    layers = chunk.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0
