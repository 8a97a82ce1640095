"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) on Megatron-Core's MoE layer.

- `moe_dims(hf_config) -> MoeDims | None`: the router/expert shapes of an MoE HF config (None for
  dense families); unsupported variants raise `UnsupportedModelError`.
- `moe_layout_problems(...)`: why a parallel layout cannot train an MoE model (also for `megatron-rl plan`).
- `moe_config_kwargs(moe, layout, use_te, router_aux_loss)`: the TransformerConfig fields.
- `reduce_expert_grads_over_expert_dp(chunk)`: marks the routed experts so DDP and the optimizer reduce
  their grads over the expert-data-parallel group (build_model calls it before DDP wraps the chunk).
- `router_padding(chunk, mb, forward_kwargs)`: context giving the forward kwargs that keep a packed
  micro-batch's padding out of the router load-balancing loss (Megatron's `padding_mask`).
- `expert_hf_name(moe, layer, expert, part)` / `router_hf_name(moe, layer)`: the HF checkpoint names
  (per-expert tensors, as on disk and as SGLang loads them; transformers >= 5 fuses the experts in
  memory only).

Routing: every family here takes a softmax over all experts and keeps the top k; renormalising the
k kept probabilities (Mixtral always, Qwen3-MoE with `norm_topk_prob`) equals Megatron's softmax over
the top-k logits (`moe_router_pre_softmax=False`), not renormalising is `moe_router_pre_softmax=True`.
Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate . x): Megatron's SharedExpertMLP
with `moe_shared_expert_gate` (TP-split like a dense MLP; its width must divide by TP, no padding).
The router runs in fp32 (`moe_router_dtype`).

Experts: expert tensor parallel is 1 (each expert whole on one rank); expert parallel (`layout.ep`)
splits the experts evenly, rank r holding experts [r * E/ep, (r+1) * E/ep). Their grads are reduced over
the expert-data-parallel group at every layout (`reduce_expert_grads_over_expert_dp`; Megatron does it
only at EP > 1, which left TP > 1 at EP = 1 wrong). Local spec (CPU): `SequentialMLP` and the allgather
token dispatcher (gloo has it; it needs no all_to_all); TE spec (GPU): `TEGroupedMLP` and the alltoall
dispatcher. The router load-balancing loss is `trainer.moe_aux_loss_coef` (0 = off: the loss is then
exactly the policy loss); like Megatron's, it is per micro-batch (f_i, P_i of one packed bin), each TP/CP
rank adding its tokens' part, weighted by the bin's real-token count (over TP x CP) like the policy loss.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from .unsupported import UnsupportedModelError

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
# HF names of an expert's (gate, up, down) projections and of the router, per family
_EXPERT_PARTS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                 "mixtral": ("w1", "w3", "w2")}
_BLOCK = {"qwen3_moe": "mlp", "qwen2_moe": "mlp", "mixtral": "block_sparse_moe"}


@dataclass(frozen=True)
class MoeDims:
    family: str
    num_experts: int
    topk: int
    expert_ffn_size: int
    renormalize_topk: bool
    shared_ffn_size: int = 0  # Qwen2-MoE: the gated shared expert's width (0 = none)


def moe_dims(hf_config) -> MoeDims | None:
    family = getattr(hf_config, "model_type", None)
    if family not in MOE_MODEL_TYPES:
        return None
    if family in ("qwen3_moe", "qwen2_moe"):
        if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
            raise UnsupportedModelError(f"{family} with dense layers (mlp_only_layers / decoder_sparse_step != 1) "
                                        "is not supported")
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
        return MoeDims(family, int(hf_config.num_experts), int(hf_config.num_experts_per_tok),
                       int(hf_config.moe_intermediate_size), bool(hf_config.norm_topk_prob), shared)
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise UnsupportedModelError("mixtral router_jitter_noise != 0 is not supported")
    return MoeDims(family, int(hf_config.num_local_experts), int(hf_config.num_experts_per_tok),
                   int(hf_config.intermediate_size), True)


def moe_layout_problems(experts: int, shared_ffn_size: int, *, tp: int, ep: int,
                        sequence_parallel: bool) -> list[str]:
    """Why an MoE model cannot train in this layout, one line per cause naming its config key (empty: it
    can). Shared by the model build and `megatron-rl plan`, so a refused layout is refused before launch."""
    problems = []
    if experts % ep:
        problems.append(f"{experts} experts cannot be split evenly over trainer.expert_parallel={ep}")
    if shared_ffn_size % tp:
        problems.append(f"shared_expert_intermediate_size={shared_ffn_size} is not divisible by "
                        f"trainer.tensor_parallel={tp}")
    if tp > 1 and not sequence_parallel:
        problems.append("MoE with trainer.tensor_parallel > 1 needs trainer.sequence_parallel: true "
                        "(Megatron's MoE layer refuses to train without it)")
    return problems


def moe_config_kwargs(moe: MoeDims, layout, use_te: bool, router_aux_loss: float = 0.0) -> dict:
    problems = moe_layout_problems(moe.num_experts, moe.shared_ffn_size, tp=layout.tp, ep=layout.ep,
                                   sequence_parallel=layout.sequence_parallel)
    if problems:
        raise ValueError(problems[0])
    return dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.expert_ffn_size,
        moe_router_pre_softmax=not moe.renormalize_topk, moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if router_aux_loss > 0 else "none",
        moe_aux_loss_coeff=float(router_aux_loss),
        moe_token_dispatcher_type="alltoall" if use_te else "allgather",
        moe_grouped_gemm=bool(use_te), expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=1,
        moe_shared_expert_intermediate_size=moe.shared_ffn_size or None, moe_shared_expert_gate=bool(moe.shared_ffn_size))


@contextmanager
def router_padding(chunk, mb, forward_kwargs: dict):
    """Yields `forward_kwargs` plus what keeps a micro-batch's padding out of the router load-balancing loss.

    Packed bins carry padding (bin tails for SP/PP/EP, segment tails for CP, all-pad bins for EP); without
    a mask Megatron counts those tokens in f_i and P_i. `mb.pad_mask` (`[1, T]`, True = pad) goes to
    Megatron as `padding_mask`; GPTModel splits it for sequence parallel on the first pipeline stage only,
    so later stages get this rank's SP slice here. An all-pad bin runs with the aux loss off (with the mask
    Megatron would divide by its zero token count, without it it would count the padding) in its forward
    and in its backward: full recompute re-runs the forward inside the backward, and that re-run is where
    Megatron attaches the aux loss (the first, checkpointed forward runs without grad), so the coefficient
    stays 0 from the moment the backward reaches this chunk's output until that backward pass ends
    (`_aux_loss_off_in_backward`). Dense chunks and aux-loss-free MoE get `forward_kwargs` unchanged
    (routing itself ignores the mask)."""
    from megatron.core.utils import get_attr_wrapped_model

    config = get_attr_wrapped_model(chunk, "config")
    coeff = config.moe_aux_loss_coeff
    if mb.pad_mask is None or not config.num_moe_experts or not coeff:
        yield forward_kwargs
        return
    if not mb.seq_indices:
        config.moe_aux_loss_coeff = 0.0
        hook = chunk.register_forward_hook(lambda _module, _args, output: _aux_loss_off_in_backward(output, config))
        try:
            yield forward_kwargs
        finally:
            hook.remove()
            config.moe_aux_loss_coeff = coeff
        return
    pad_mask = mb.pad_mask
    if config.sequence_parallel and not get_attr_wrapped_model(chunk, "pre_process"):
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        pad_mask = pad_mask.chunk(tp, dim=1)[rank]
    yield {**forward_kwargs, "padding_mask": pad_mask.contiguous()}


def _aux_loss_off_in_backward(output, config) -> None:
    """Keep `config.moe_aux_loss_coeff` at 0 during the backward pass that starts at `output` (an all-pad
    bin's chunk output), restoring it when that pass ends.

    Why here: the pipeline schedules run one `torch.autograd.backward` per micro-batch (and chunk), after
    other micro-batches' forwards under 1F1B, so no context around the forward can cover a recompute. The
    grad hook of the chunk's output runs before any layer of this chunk is re-run; the engine callback runs
    once the whole pass is done. Forward passes (router_padding) and backward passes never overlap."""
    import torch

    if not (isinstance(output, torch.Tensor) and output.requires_grad):
        return  # forward-only pass: no backward, and Megatron adds no aux loss without grad

    def off_until_pass_ends(grad):
        coeff = config.moe_aux_loss_coeff
        config.moe_aux_loss_coeff = 0.0

        def restore():
            config.moe_aux_loss_coeff = coeff

        torch.autograd.Variable._execution_engine.queue_callback(restore)
        return grad

    output.register_hook(off_until_pass_ends)


def release_dispatch_state(model: list) -> None:
    """Drop the routing probabilities Megatron's token dispatchers keep on themselves (`local_probs`,
    `probs`, ...) once a training pass is over. They still carry the pass's autograd graph: under full
    recompute that holds each MoE layer's re-run input and its gradient (2 hidden vectors per token per
    layer) until the next forward reaches the layer, i.e. through the next minibatch's forward."""
    import torch

    for chunk in model:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            for name in ("local_probs", "probs", "token_probs", "dispatched_probs"):
                if isinstance(getattr(dispatcher, name, None), torch.Tensor):
                    setattr(dispatcher, name, None)


def reduce_expert_grads_over_expert_dp(chunk) -> None:
    """Mark every routed-expert parameter of `chunk` expert-parallel (`allreduce = False`), so that DDP and
    the optimizer reduce (and shard) its gradient over Megatron's expert-data-parallel group.

    Why: the experts are whole on every rank (expert TP 1), and the allgather dispatcher only gathers the
    tokens over the expert TP x EP group, so at TP > 1 and EP = 1 each TP rank's experts see only that
    rank's sequence-parallel tokens. Megatron marks experts expert-parallel only when EP > 1; at EP = 1 it
    syncs them like dense weights, over DP x CP, which leaves the TP ranks' halves unsummed. The
    expert-data-parallel group is TP x CP x DP / EP (world / (expert TP 1 x EP x PP)), the ranks that hold
    the same experts after different tokens: the right one at any EP (at TP = 1, EP = 1 it equals DP x CP)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in chunk.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():
                param.allreduce = False


def router_hf_name(moe: MoeDims, layer: int) -> str:
    return f"model.layers.{layer}.{_BLOCK[moe.family]}.gate.weight"


def expert_hf_name(moe: MoeDims, layer: int, expert: int, part: str) -> str:
    """`part`: gate | up | down."""
    gate, up, down = _EXPERT_PARTS[moe.family]
    name = {"gate": gate, "up": up, "down": down}[part]
    return f"model.layers.{layer}.{_BLOCK[moe.family]}.experts.{expert}.{name}.weight"


def shared_expert_hf_name(moe: MoeDims, layer: int, part: str) -> str:
    """`part`: gate | up | down | gate_weight (the sigmoid gate's [1, hidden] weight)."""
    if part == "gate_weight":
        return f"model.layers.{layer}.mlp.shared_expert_gate.weight"
    return f"model.layers.{layer}.mlp.shared_expert.{part}_proj.weight"


def ep_size_rank() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
