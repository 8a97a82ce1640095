"""Memory and throughput estimate of a run, per GPU and per role, printed before launch.

Model shapes come from the HF config of `trainer.model` (only config.json is read: a directory
with the architecture is enough, no weights needed). Hardware and the generator layout come from
`Cluster` (a small YAML next to the run config; defaults: H100 80 GB); the generator TP is the config's
`generator.tp_size`. All numbers are estimates of
the dominant terms; the formulas are written out below and in docs/tools.md.

Trainer GPU (heaviest pipeline stage; TP shards every matrix, PP splits layers, DP replicates):
- weights: bytes(precision) x P_stage / TP
- gradients: 4 B x P_stage / TP (Megatron DDP buffer, grad_reduce_in_fp32 as in train/optimizer.py)
- optimizer: Adam m and v (4 + 4 B) plus fp32 main weights for bf16 (4 B), divided by DP x CP under
  the DistributedOptimizer (ZeRO-1), else not
- context parallel (CP): activations and logits of `micro_batch_tokens / CP` tokens per GPU (each CP
  rank holds its 2 of the 2*CP chunks of every sequence)
- activations: `activation_memory` below (Korthikanti et al. 2022 adapted to GQA, SwiGLU, RMSNorm,
  no dropout and flash attention; sequence parallel and recompute counted), for bins of
  `trainer.micro_batch_tokens` tokens x the micro-batches the 1F1B schedule keeps in flight (up to PP
  on the first stage), plus fp32 logits of one micro-batch and their gradient (tokens x vocab / TP x
  8 B) on the last stage
MoE (Qwen3-MoE, Mixtral; `Shapes.experts` > 0): the expert weights are split over EP
(`trainer.expert_parallel`) and not over TP (expert TP = 1, as train/moe.py builds them), their Adam
state over the expert-data-parallel ranks TP x CP x DP / EP; the dense part (attention, router, norms,
embeddings) as above. Expert activations per token: top-k routed copies of the SwiGLU terms (3 f_e)
and of the permuted input/output (2h), token shards as the rest of the layer (`activation_memory`);
checked against the measured CPU peak of a tiny Mixtral (tests/e2e/test_step_memory_estimate_moe.py).
Training FLOPs count the active parameters (top-k experts).
LoRA (`trainer.lora`, plan/lora_memory.py): the base is frozen, so it has weights only (no gradients,
no Adam state, no fp32 main copy under bf16); the adapters of a stage's layers (A and B, sharded over
TP as train/lora.py shards them) have weights, 4 B gradients and Adam state as above; activations are
the local spec's (LoRA refuses Transformer Engine) with lora_memory's terms; training FLOPs are 4 per
frozen parameter (no weight gradients) and 6 per adapter parameter.
Generator GPU (one SGLang replica over `generator.tp_size` GPUs): bf16 weights / tp_size + KV cache
(`generator.max_total_tokens` x layers x 2 x kv_heads_per_gpu x head_dim x 2 B) + a fixed runtime
overhead. Throughput: decode is memory-bound (each step reads the weight shard and the live KV
cache at `hbm_tbps` x `efficiency`); training is compute-bound at 6 x P FLOPs per token at `mfu`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_rl.config import Config
from megatron_rl.config.file import locate_error, read_yaml
from megatron_rl.config.tree import ConfigError, build
from megatron_rl.plan.lora_memory import LoraShape, adapter_params, adapter_params_per_layer

GB = 1024 ** 3


@dataclass
class Cluster:
    gpu_memory_gb: float = 80.0
    gpu_tflops: float = 989.0  # dense bf16 peak (H100 SXM)
    hbm_tbps: float = 3.35
    gpus_per_node: int = 8
    # GPUs per SGLang replica: generator.tp_size of the run config is the only source; a value here must
    # agree with it (ConfigError otherwise), so an old cluster file cannot silently change the estimate
    generator_tp: int | None = None
    generator_overhead_gb: float = 4.0  # CUDA context, graphs, activations of a decode step
    trainer_overhead_gb: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    mfu: float = 0.35  # model FLOPs utilisation of the trainer
    decode_efficiency: float = 0.5  # fraction of HBM bandwidth a decode step reaches
    mean_completion_fraction: float = 0.5  # mean completion length / rollout.max_new_tokens
    prompt_tokens: int = 512

    @classmethod
    def load(cls, path: str | Path | None) -> "Cluster":
        """The cluster YAML at `path` (defaults when None); ConfigError (one line naming the file, line and
        key) on an unreadable file, a duplicate or unknown key, or a value of the wrong type or not finite."""
        if path is None:
            return cls()
        data, lines = read_yaml(Path(path), "cluster file")
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a cluster file is a mapping of keys ({', '.join(cls.__dataclass_fields__)}), "
                              f"got {'an empty file' if data is None else type(data).__name__}")
        try:
            return build(cls, data, "")
        except ConfigError as e:
            raise locate_error(e, Path(path), lines, []) from None


@dataclass
class Shapes:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP width; per expert for MoE
    tied: bool
    experts: int = 0  # MoE: routed experts per layer (0 = dense)
    topk: int = 0  # MoE: experts per token
    qk_norm: bool = False  # Qwen3: a q and a k RMSNorm (head_dim each) per layer
    shared_ffn: int = 0  # Qwen2-MoE: the gated shared expert's width (split over TP like a dense MLP)
    qkv_bias: bool = False  # Qwen2 families

    @classmethod
    def from_hf(cls, c) -> "Shapes":
        heads = c.num_attention_heads
        experts = int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0)
        ffn = int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size) if experts else c.intermediate_size
        return cls(c.vocab_size, c.hidden_size, c.num_hidden_layers, heads,
                   getattr(c, "num_key_value_heads", None) or heads,
                   getattr(c, "head_dim", None) or c.hidden_size // heads, ffn,
                   bool(getattr(c, "tie_word_embeddings", False)), experts,
                   int(getattr(c, "num_experts_per_tok", 0) or 0) if experts else 0,
                   getattr(c, "model_type", "") in ("qwen3", "qwen3_moe"),
                   int(getattr(c, "shared_expert_intermediate_size", 0) or 0) if experts else 0,
                   getattr(c, "model_type", "") in ("qwen2", "qwen2_moe"))

    @property
    def per_layer_dense(self) -> int:
        """Attention, norms, and the dense MLP or the MoE router: what TP splits."""
        h, hd = self.hidden, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_heads) * hd
        shared = 3 * h * self.shared_ffn + h if self.shared_ffn else 0  # shared expert + its sigmoid gate
        mlp = self.experts * h + shared if self.experts else 3 * h * self.ffn
        bias = (self.heads + 2 * self.kv_heads) * hd if self.qkv_bias else 0
        return qkv + bias + self.heads * hd * h + mlp + 2 * h + (2 * hd if self.qk_norm else 0)

    @property
    def per_layer_experts(self) -> int:
        return self.experts * 3 * self.hidden * self.ffn

    @property
    def per_layer(self) -> int:
        return self.per_layer_dense + self.per_layer_experts

    @property
    def active(self) -> int:
        """Parameters one token uses (all of them for a dense model)."""
        routed = self.layers * (self.experts - self.topk) * 3 * self.hidden * self.ffn if self.experts else 0
        return self.total - routed

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def total(self) -> int:
        return self.embedding * (1 if self.tied else 2) + self.layers * self.per_layer + self.hidden


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def activation_memory(shapes: Shapes, tokens: int, *, tp: int = 1, sequence_parallel: bool = False,
                      recompute: str = "none", recompute_method: str = "uniform", recompute_num_layers: int = 1,
                      stage_layers: int | None = None, in_flight: int = 1, elem_bytes: int = 2,
                      kernels: str = "fused", context_parallel: int = 1, lora=None,
                      mask_bytes: int = 1) -> dict[str, float]:
    """Peak activation bytes of one pipeline stage in a training step (per GPU), logits excluded.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count
    34 sbh + 5 a s^2 b bytes per GPT layer (GeLU, dropout, softmax attention; /t with TP and sequence
    parallel, the s^2 term gone with selective recompute). These models have RMSNorm, SwiGLU, GQA, no
    dropout and flash (TE) or per-segment SDPA attention, so there is no s^2 term, and the count below
    is what Megatron's code keeps alive per token and layer (checked tensor by tensor with autograd's
    saved-tensor hooks on CPU), in elements, with q = heads x head_dim, kv = kv_heads x head_dim (KV
    groups padded to a multiple of TP as model.py does), f = ffn, t = TP, d = t with sequence parallel
    else 1, e = bytes per element:

        fused (GPU: TE norm+linear, fused RoPE, flash attention, fused SwiGLU):
            A = e x [ 4h/d + (3q + 3kv + 3f)/t ]
        local (the CPU local spec, nothing fused):
            A = e x [ 6h/d + (4q + 3kv + 5f)/t + 4 head_dim ]

    - norms: the input and the output (= the next projection's input) of both norms, 4h; the unfused
      torch RMSNorm keeps its normalised input too, 6h; with sequence parallel all are 1/t token shards;
    - attention: the QKV projection output stays alive whole (V is a view of it), plus the rotated
      q and k and the attention output (the output projection's input): 3q + 3kv; the local spec also
      keeps SDPA's own output apart from the projection's reshaped copy (+q) and RoPE's cos/sin
      (4 head_dim);
    - SwiGLU: the FC1 output 2f and the FC2 input f; unfused, silu(gate) and one more f (5f).
    - MoE (`shapes.experts` > 0, f_e = the expert width, k = top-k; experts whole, expert TP 1): the dense
      MLP term goes and each token's k routed copies keep their expert's SwiGLU terms (3 f_e fused,
      5 f_e local) plus the permuted copy (the experts' input) and the expert output that the
      probability-weighted un-permute keeps (2h), token shards like the rest of the layer:
      + k (5 f_e + 2h)/d local, k (3 f_e + 2h)/d fused, - 5f/t or 3f/t. The router's fp32 logits and
      probabilities (a few x E per token) are left out: E is small next to k f_e (2 % of the term at
      Qwen3-30B-A3B's E 128, k 8, f_e 768). Checked on CPU (tests/e2e/test_step_memory_estimate_moe.py):
      +2 % without recompute, -13 % with full recompute. There the MoE term matches the re-run layer
      (74.4 MB re-run vs 75.8 counted); the full-recompute sum below overstates the peak a little (it adds
      the logits and final norm to all layer inputs plus the re-run layer, but the peak is in a layer's
      backward, after those are freed; the dense MLP's uncounted f-wide backward gradients fill that gap,
      the experts' per-expert ones less).
    - context parallel (`tokens` is one CP rank's share, CP = context_parallel): the fused profile is
      TE's ring attention, counted as above. The local spec's CP attention (train/cp_attention.py)
      keeps the K/V it all-gathered, the whole row's (2 kv x CP per local token), and neither the QKV
      output nor the rotated k (only the gathered copy reaches the kernel): its attention term is
      3q + 2 kv CP instead of 4q + 3kv. Selective recompute drops the gathered K/V and the kernel's
      output but keeps the checkpoint's inputs (q, k, and v, a view of the QKV output): 3q + 3kv, as
      without CP. Checked against the saved tensors of the real CP=2 step
      (tests/multiproc/test_estimate_context_parallel.py).

    Stored per micro-batch in flight, L = stage_layers:
    - none: L x A;
    - selective (Megatron's core_attn recompute): the core attention's own saved tensors go. Its inputs
      q/k/v stay (they are the checkpoint's inputs) and its output stays (the output projection keeps
      it), so with flash attention nothing is saved (Megatron warns as much for fused attention); the
      paper's 5as^2b term does not exist here. On the local spec SDPA's separate output copy (q/t) goes;
    - full, uniform, n = recompute_num_layers: ceil(L / n) group inputs of e x h/d, plus once (the
      backward re-runs one group at a time) n x A;
    - full, block: min(n, L) layer inputs + (L - min(n, L)) x A, plus one A once.
    Plus, per micro-batch, the final norm's input and output (2h/d fused, 3h/d local). Returns bytes:
    `per_layer` (A x tokens), `stored` (all micro-batches in flight), `working` (the recompute working
    set), `total`. tests/e2e/test_step_memory_estimate.py checks `local` against the measured peak.

    `lora` (a `plan.lora_memory.LoraShape`, local kernels only: LoRA refuses Transformer Engine) applies
    that module's terms: a frozen base keeps less, the adapters' rank-r products and dropout masks
    (`mask_bytes` per element: 1 on GPU, the compute dtype's size on CPU) more.
    """
    if kernels not in ("fused", "local"):
        raise ValueError(f"kernels {kernels!r}: fused or local")
    t, d = tp, (tp if sequence_parallel else 1)
    layers = shapes.layers if stage_layers is None else stage_layers
    h, local = shapes.hidden, kernels == "local"
    kv_heads = _round_up(shapes.kv_heads, tp)
    q = kv_heads * (shapes.heads // shapes.kv_heads) * shapes.head_dim
    kv = kv_heads * shapes.head_dim
    f = _round_up(shapes.ffn, tp)
    if local and context_parallel > 1:  # the gathered whole-row K/V instead of the QKV output and k
        per_token = 6 * h / d + (3 * q + 2 * kv * context_parallel + 5 * f) / t + 4 * shapes.head_dim
        attn_core = (2 * context_parallel - 3) * kv / t  # selective keeps q, k, v (3q + 3kv)
    elif local:
        per_token = 6 * h / d + (4 * q + 3 * kv + 5 * f) / t + 4 * shapes.head_dim
        attn_core = q / t  # SDPA's own output, apart from the output projection's input
    else:
        per_token, attn_core = 4 * h / d + (3 * q + 3 * kv + 3 * f) / t, 0.0
    if shapes.experts:  # MoE: experts whole (no TP), top-k routed copies of each token shard
        per_token += shapes.topk * ((5 if local else 3) * shapes.ffn + 2 * h) / d - (5 if local else 3) * f / t
    fixed, head_width = 0.0, (3 if local else 2) * h / d
    if lora is not None:
        from megatron_rl.plan.lora_memory import activation_terms

        if not local:
            raise ValueError("LoRA runs on the local layer spec (Transformer Engine is refused): kernels='local'")
        terms = activation_terms(shapes, lora, tp=tp, sequence_parallel=sequence_parallel)
        per_token += terms.per_token
        fixed = terms.mask_per_token * tokens * mask_bytes + terms.per_layer * elem_bytes
        head_width = terms.head_per_token
    layer = tokens * elem_bytes * per_token + fixed
    layer_input = tokens * elem_bytes * h / d
    working = 0.0
    if recompute == "none":
        stored = layers * layer
    elif recompute == "selective":
        stored = layers * (layer - tokens * elem_bytes * attn_core)
    elif recompute == "full" and recompute_method == "uniform":
        n = min(recompute_num_layers, layers)
        stored, working = -(-layers // n) * layer_input, n * layer
    elif recompute == "full" and recompute_method == "block":
        n = min(recompute_num_layers, layers)
        stored, working = n * layer_input + (layers - n) * layer, layer
    else:
        raise ValueError(f"recompute {recompute!r} / recompute_method {recompute_method!r}")
    head = tokens * elem_bytes * head_width
    stored = in_flight * (stored + head)
    return {"per_layer": layer, "stored": stored, "working": working, "total": stored + working}


@dataclass
class Estimate:
    params: int
    trainer_gpus: int
    generator_gpus: int
    trainer_gb: dict[str, float] = field(default_factory=dict)
    generator_gb: dict[str, float] = field(default_factory=dict)
    throughput: dict[str, float] = field(default_factory=dict)
    gpu_memory_gb: float = 0.0
    adapter_params: int = 0  # trainer.lora: adapter parameters of the whole model (0: full training)

    @property
    def fits(self) -> bool:
        return self.trainer_gb["total"] <= self.gpu_memory_gb and self.generator_gb["total"] <= self.gpu_memory_gb

    def to_dict(self) -> dict:
        return asdict(self) | {"fits": self.fits}


def estimate(cfg: Config, cluster: Cluster, shapes: Shapes) -> Estimate:
    t, r, g = cfg.trainer, cfg.rollout, cfg.generator
    tp, pp, dp, cp = t.tensor_parallel, t.pipeline_parallel, t.data_parallel, t.context_parallel
    if shapes.layers % pp:
        raise ValueError(f"{shapes.layers} layers do not split over pipeline_parallel={pp}")
    ep = t.expert_parallel
    if shapes.experts % ep:
        raise ValueError(f"{shapes.experts} experts do not split over expert_parallel={ep}")
    if not shapes.experts and ep > 1:
        raise ValueError(f"expert_parallel={ep} needs an MoE model ({cfg.trainer.model} is dense)")
    stage_layers = shapes.layers // pp
    first = shapes.embedding + stage_layers * shapes.per_layer_dense
    last = (0 if shapes.tied and pp == 1 else shapes.embedding) + stage_layers * shapes.per_layer_dense + shapes.hidden
    p_stage = max(first, last) if pp > 1 else shapes.total - shapes.layers * shapes.per_layer_experts
    e_stage = stage_layers * shapes.per_layer_experts  # expert parameters of a stage, split over EP only
    wbytes = 2 if t.precision == "bf16" else 4
    opt_bytes = 8 + (4 if t.precision == "bf16" else 0)
    shard = p_stage / tp + e_stage / ep  # parameters per GPU
    expert_dp = tp * cp * dp // ep
    opt_params = (p_stage / tp / (dp * cp) + e_stage / ep / expert_dp) if t.distributed_optimizer else shard
    lora = LoraShape.from_config(t.lora)
    if lora is None:
        tr = {"weights": wbytes * shard / GB, "gradients": 4 * shard / GB, "optimizer": opt_bytes * opt_params / GB}
    else:  # frozen base: weights only; the adapters (whole layers per stage, TP-sharded) train
        adapters = stage_layers * adapter_params_per_layer(shapes, lora, tp)
        opt_adapters = adapters / (dp * cp) if t.distributed_optimizer else adapters
        tr = {"weights": wbytes * (shard + adapters) / GB, "gradients": 4 * adapters / GB,
              "optimizer": opt_bytes * opt_adapters / GB}
    hd = shapes.head_dim
    micro_batches = max(1, r.n_batch // r.n_mini // dp)  # sequences per DP rank per step >= bins
    in_flight = min(pp, micro_batches)
    tokens = t.micro_batch_tokens // cp  # context parallel: each CP rank holds 1/CP of every bin
    act = activation_memory(shapes, tokens, tp=tp, sequence_parallel=t.sequence_parallel,
                            recompute=t.recompute, recompute_method=t.recompute_method,
                            recompute_num_layers=t.recompute_num_layers, stage_layers=stage_layers,
                            in_flight=in_flight, elem_bytes=wbytes, context_parallel=cp, lora=lora,
                            kernels="local" if lora else "fused")
    tr["activations"] = act["total"] / GB
    tr["logits"] = tokens * shapes.vocab / tp * 4 * 2 / GB  # logits + their gradient, fp32
    tr["overhead"] = cluster.trainer_overhead_gb
    tr["total"] = sum(tr.values())
    gtp = g.tp_size
    if cluster.generator_tp is not None and cluster.generator_tp != gtp:
        raise ConfigError(f"the cluster's generator_tp={cluster.generator_tp} disagrees with generator.tp_size={gtp} "
                          "of the config, which is the single source of the generator layout: drop generator_tp")
    kv_per_gpu = max(1, shapes.kv_heads // gtp) if shapes.kv_heads >= gtp else 1
    kv_token = shapes.layers * 2 * kv_per_gpu * hd * 2
    ge = {"weights": 2 * shapes.total / gtp / GB, "kv_cache": g.max_total_tokens * kv_token / GB,
          "overhead": cluster.generator_overhead_gb}
    ge["total"] = sum(ge.values())
    # throughput
    seq_len = cluster.prompt_tokens + cluster.mean_completion_fraction * r.max_new_tokens
    live = min(r.n_async / g.num_generators, g.max_total_tokens / seq_len)  # sequences per replica
    step_bytes = 2 * shapes.total / gtp + live * seq_len * kv_token
    step_s = step_bytes / (cluster.hbm_tbps * 1e12 * cluster.decode_efficiency)
    gen_tok_s = g.num_generators * live / step_s
    trainer_gpus = tp * cp * pp * dp
    # 6 FLOPs per parameter and token (forward 2, input gradients 2, weight gradients 2); a frozen base
    # skips its weight gradients: 4 per base parameter, 6 per adapter parameter
    flops_per_token = 6 * shapes.active if lora is None else 4 * shapes.active + 6 * adapter_params(shapes, lora)
    train_tok_s = trainer_gpus * cluster.gpu_tflops * 1e12 * cluster.mfu / flops_per_token
    batch_tokens = r.n_batch * seq_len
    gen_s = r.n_batch * cluster.mean_completion_fraction * r.max_new_tokens / gen_tok_s
    train_s = batch_tokens / train_tok_s
    thr = {"generator_tokens_per_s": gen_tok_s, "trainer_tokens_per_s": train_tok_s,
           "live_sequences_per_replica": live, "generation_s_per_update": gen_s, "train_s_per_update": train_s,
           "update_s": max(gen_s, train_s), "bottleneck": 0.0 if gen_s >= train_s else 1.0}
    return Estimate(shapes.total, trainer_gpus, g.num_generators * gtp, tr, ge, thr, cluster.gpu_memory_gb,
                    adapter_params(shapes, lora) if lora else 0)


def shapes_of(cfg: Config) -> Shapes:
    from megatron_rl.train.hf_source import resolve_model

    return Shapes.from_hf(resolve_model(cfg.trainer.model).config())


def render(e: Estimate, cfg: Config) -> str:
    t, g = cfg.trainer, cfg.generator
    lines = [f"model: {e.params / 1e9:.2f} B parameters"
             + (f"; LoRA rank {t.lora.rank} on {', '.join(t.lora.target_modules)}: {e.adapter_params / 1e6:.1f} M "
                f"trained ({100 * e.adapter_params / e.params:.2f} %), base frozen" if e.adapter_params else ""),
             f"trainer: {e.trainer_gpus} GPUs (TP={t.tensor_parallel} CP={t.context_parallel} PP={t.pipeline_parallel} "
             f"DP={t.data_parallel} EP={t.expert_parallel}, sequence_parallel={t.sequence_parallel}, recompute={t.recompute}, "
             f"{t.precision}, distributed_optimizer={t.distributed_optimizer})",
             "  per GPU: " + ", ".join(f"{k} {v:.1f} GB" for k, v in e.trainer_gb.items()),
             f"generators: {g.num_generators} x {e.generator_gpus // max(1, g.num_generators)} GPUs "
             f"(KV cache {g.max_total_tokens} tokens)",
             "  per GPU: " + ", ".join(f"{k} {v:.1f} GB" for k, v in e.generator_gb.items()),
             f"GPU memory: {e.gpu_memory_gb:.0f} GB -> " + ("fits" if e.fits else "DOES NOT FIT"),
             f"throughput: generate {e.throughput['generator_tokens_per_s']:.0f} tok/s, train "
             f"{e.throughput['trainer_tokens_per_s']:.0f} tok/s; per update: generation "
             f"{e.throughput['generation_s_per_update']:.1f} s, training {e.throughput['train_s_per_update']:.1f} s "
             f"({'generators' if e.throughput['bottleneck'] == 0 else 'trainers'} bound)"]
    return "\n".join(lines)
