"""Memory and throughput estimate of a run, per GPU and per role, printed before launch.

Model shapes come from the HF config of `trainer.model` (only config.json is read: a directory
with the architecture is enough, no weights needed). Hardware and the generator layout come from
`Cluster` (a small YAML next to the run config; defaults: H100 80 GB). All numbers are estimates of
the dominant terms; the formulas are written out below and in docs/tools.md.

Trainer GPU (heaviest pipeline stage; TP shards every matrix, PP splits layers, DP replicates):
- weights: bytes(precision) x P_stage / TP
- gradients: 4 B x P_stage / TP (Megatron DDP buffer, grad_reduce_in_fp32 as in train/optimizer.py)
- optimizer: Adam m and v (4 + 4 B) plus fp32 main weights for bf16 (4 B), divided by DP under the
  DistributedOptimizer (ZeRO-1), else not
- activations: the tokens of one micro-batch (the packing bin, `trainer.micro_batch_tokens`) x
  bytes per token per layer (2 B x (4h + 2(q+k+v) + 4 ffn): norm/attention inputs and outputs,
  SwiGLU intermediates; flash attention, no s^2 term; sequence parallel divides by TP) x layers of
  the stage x micro-batches the 1F1B schedule keeps in flight (up to PP on the first stage), plus
  fp32 logits of one micro-batch (tokens x vocab / TP x 4 B) on the last stage
Generator GPU (one SGLang replica over `generator_tp` GPUs): bf16 weights / generator_tp + KV cache
(`generator.max_total_tokens` x layers x 2 x kv_heads_per_gpu x head_dim x 2 B) + a fixed runtime
overhead. Throughput: decode is memory-bound (each step reads the weight shard and the live KV
cache at `hbm_tbps` x `efficiency`); training is compute-bound at 6 x P FLOPs per token at `mfu`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_rl.config import Config
from megatron_rl.config_file import locate_error, read_yaml
from megatron_rl.config_tree import ConfigError, build

GB = 1024 ** 3


@dataclass
class Cluster:
    gpu_memory_gb: float = 80.0
    gpu_tflops: float = 989.0  # dense bf16 peak (H100 SXM)
    hbm_tbps: float = 3.35
    gpus_per_node: int = 8
    generator_tp: int = 1  # GPUs per SGLang replica (tensor parallel inside SGLang)
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
    ffn: int
    tied: bool

    @classmethod
    def from_hf(cls, c) -> "Shapes":
        heads = c.num_attention_heads
        return cls(c.vocab_size, c.hidden_size, c.num_hidden_layers, heads,
                   getattr(c, "num_key_value_heads", None) or heads,
                   getattr(c, "head_dim", None) or c.hidden_size // heads, c.intermediate_size,
                   bool(getattr(c, "tie_word_embeddings", False)))

    @property
    def per_layer(self) -> int:
        h, hd = self.hidden, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_heads) * hd
        return qkv + self.heads * hd * h + 3 * h * self.ffn + 2 * h

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def total(self) -> int:
        return self.embedding * (1 if self.tied else 2) + self.layers * self.per_layer + self.hidden


@dataclass
class Estimate:
    params: int
    trainer_gpus: int
    generator_gpus: int
    trainer_gb: dict[str, float] = field(default_factory=dict)
    generator_gb: dict[str, float] = field(default_factory=dict)
    throughput: dict[str, float] = field(default_factory=dict)
    gpu_memory_gb: float = 0.0

    @property
    def fits(self) -> bool:
        return self.trainer_gb["total"] <= self.gpu_memory_gb and self.generator_gb["total"] <= self.gpu_memory_gb

    def to_dict(self) -> dict:
        return asdict(self) | {"fits": self.fits}


def estimate(cfg: Config, cluster: Cluster, shapes: Shapes) -> Estimate:
    t, r, g = cfg.trainer, cfg.rollout, cfg.generator
    tp, pp, dp = t.tensor_parallel, t.pipeline_parallel, t.data_parallel
    if shapes.layers % pp:
        raise ValueError(f"{shapes.layers} layers do not split over pipeline_parallel={pp}")
    stage_layers = shapes.layers // pp
    first = shapes.embedding + stage_layers * shapes.per_layer
    last = (0 if shapes.tied and pp == 1 else shapes.embedding) + stage_layers * shapes.per_layer + shapes.hidden
    p_stage = max(first, last) if pp > 1 else shapes.total
    wbytes = 2 if t.precision == "bf16" else 4
    opt_bytes = 8 + (4 if t.precision == "bf16" else 0)
    tr = {"weights": wbytes * p_stage / tp / GB, "gradients": 4 * p_stage / tp / GB,
          "optimizer": opt_bytes * p_stage / tp / (dp if t.distributed_optimizer else 1) / GB}
    h, hd = shapes.hidden, shapes.head_dim
    per_token_layer = 2 * (4 * h + 2 * (shapes.heads + 2 * shapes.kv_heads) * hd + 4 * shapes.ffn) / tp
    micro_batches = max(1, r.n_batch // r.n_mini // dp)  # sequences per DP rank per step >= bins
    in_flight = min(pp, micro_batches)
    tokens = t.micro_batch_tokens
    tr["activations"] = tokens * per_token_layer * stage_layers * in_flight / GB
    tr["logits"] = tokens * shapes.vocab / tp * 4 * 2 / GB  # logits + their gradient, fp32
    tr["overhead"] = cluster.trainer_overhead_gb
    tr["total"] = sum(tr.values())
    gtp = cluster.generator_tp
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
    trainer_gpus = tp * pp * dp
    train_tok_s = trainer_gpus * cluster.gpu_tflops * 1e12 * cluster.mfu / (6 * shapes.total)
    batch_tokens = r.n_batch * seq_len
    gen_s = r.n_batch * cluster.mean_completion_fraction * r.max_new_tokens / gen_tok_s
    train_s = batch_tokens / train_tok_s
    thr = {"generator_tokens_per_s": gen_tok_s, "trainer_tokens_per_s": train_tok_s,
           "live_sequences_per_replica": live, "generation_s_per_update": gen_s, "train_s_per_update": train_s,
           "update_s": max(gen_s, train_s), "bottleneck": 0.0 if gen_s >= train_s else 1.0}
    return Estimate(shapes.total, trainer_gpus, g.num_generators * gtp, tr, ge, thr, cluster.gpu_memory_gb)


def shapes_of(cfg: Config) -> Shapes:
    from megatron_rl.train.hf_source import resolve_model

    return Shapes.from_hf(resolve_model(cfg.trainer.model).config())


def render(e: Estimate, cfg: Config) -> str:
    t, g = cfg.trainer, cfg.generator
    lines = [f"model: {e.params / 1e9:.2f} B parameters",
             f"trainer: {e.trainer_gpus} GPUs (TP={t.tensor_parallel} PP={t.pipeline_parallel} "
             f"DP={t.data_parallel}, {t.precision}, distributed_optimizer={t.distributed_optimizer})",
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
