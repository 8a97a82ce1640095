"""MoE routing replay in the trainer (R3; docs/train.md "Routing replay").

Megatron-Core's `TopKRouter` asks its `router_replay` object for the top-k of every routing
(`RouterReplay.get_replay_topk(scores, topk, ..., default_compute_topk)`, `moe_utils.
topk_routing_with_score_function`); `attach` gives each router of a policy chunk a `TokenReplay`, which
answers with the experts the generator chose where a position has them and with the router's own top-k
where it has none (a row of -1: the last token of each sequence, padding, sequences without routes).
The gates are the router's: its scores gathered at the replayed experts, then what Megatron does with
them (softmax over the k chosen logits for the renormalised families, the full softmax's values
otherwise), so gradients reach the router through the chosen experts' logits.

Per micro-batch, `set_targets` hands each router its layer's rows of `mb.routed_experts` ([layers, topk,
T], already this CP rank's tokens), cut to this TP rank's sequence-parallel slice: the router sees the
tokens of its rank only. Expert parallel needs nothing more: routing runs before dispatch, on every
rank's own tokens, with global expert ids. Each target is also queued (Megatron's FIFO
`replay_backward_list`) for a recompute of the layer in the backward: the chunk's output grad hook
switches its routers to REPLAY_BACKWARD for the backward pass that starts there, so under 1F1B the
recomputed forward takes the routes of its own micro-batch, not of the last one run forward.
`replaying(model)` brackets one schedule pass (actions on, queues and counts cleared); `agreement`
counts how many replayed (position, layer) rows the router's own top-k would have chosen as well.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

FORWARD, BACKWARD = RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD


class TokenReplay(RouterReplay):
    """One router's replay: the generator's experts where a target row has them (ids >= 0), the
    router's own top-k elsewhere; counts the agreement of the two in forward passes."""

    def __init__(self) -> None:
        super().__init__()
        self.agreed = self.replayed = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        action = self.router_replay_action
        if action not in (FORWARD, BACKWARD):
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        target = self.target_topk_idx if action is FORWARD else self.replay_backward_list.pop(0)
        _, own = default_compute_topk(scores, topk, num_groups, group_topk)
        if target is None:  # a micro-batch without routes (an all-pad bin)
            return scores.gather(1, own), own
        target = target.to(device=scores.device, dtype=own.dtype)
        given = target[:, 0] >= 0
        chosen = torch.where(given[:, None], target, own)
        if action is FORWARD:  # a recompute in the backward would count its rows twice
            with torch.no_grad():  # device tensors: no host sync per layer
                same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1)
                self.agreed = self.agreed + (same & given).sum()
                self.replayed = self.replayed + given.sum()
        return scores.gather(1, chosen), chosen


def attach(chunk) -> None:
    """Give every router of `chunk` (a bare GPTModel) a TokenReplay, and the chunk the grad hook that
    switches them to their backward queues while the backward passes through it."""
    from megatron.core.transformer.moe.router import TopKRouter

    replays = []
    for module in chunk.modules():
        if isinstance(module, TopKRouter):
            module.router_replay = TokenReplay()
            replays.append(module.router_replay)
    chunk.register_forward_hook(lambda _module, _args, output: _backward_queues(output, replays))


def _backward_queues(output, replays: list[TokenReplay]) -> None:
    """While the backward pass that starts at `output` runs, the routers read their backward queues."""
    if not (isinstance(output, torch.Tensor) and output.requires_grad):
        return  # forward only: nothing is recomputed

    def switch(grad):
        for r in replays:
            r.set_router_replay_action(BACKWARD)

        def back_to_forward():
            for r in replays:
                r.set_router_replay_action(FORWARD)

        torch.autograd.Variable._execution_engine.queue_callback(back_to_forward)
        return grad

    output.register_hook(switch)


def _routers(model: list) -> list:
    """(global 0-based layer, TokenReplay) of every replaying router of `model`'s chunks."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [(m.layer_number - 1, m.router_replay) for chunk in model for m in chunk.modules()
            if isinstance(m, TopKRouter) and isinstance(m.router_replay, TokenReplay)]


def set_targets(chunk, mb) -> None:
    """Hand `chunk`'s routers the routes of micro-batch `mb` (this rank's slice of its tokens)."""
    routers = _routers([chunk])
    if not routers:
        return
    from megatron.core.utils import get_attr_wrapped_model

    routes = mb.routed_experts
    if routes is not None and get_attr_wrapped_model(chunk, "config").sequence_parallel:
        from megatron.core import parallel_state as ps

        routes = routes.chunk(ps.get_tensor_model_parallel_world_size(), dim=-1)[ps.get_tensor_model_parallel_rank()]
    for layer, replay in routers:
        replay.set_target_indices(None if routes is None else routes[layer].T)


@contextmanager
def replaying(model: list):
    """One schedule pass over `model` with replay on; queues cleared after it (agreement counts kept
    until the next pass starts)."""
    routers = [r for _, r in _routers(model)]
    for r in routers:
        r.agreed = r.replayed = 0
        r.set_router_replay_action(FORWARD)
    try:
        yield
    finally:
        for r in routers:
            r.clear_indices()
            r.clear_router_replay_action()


def agreement(model: list) -> tuple[int, int]:
    """(rows whose own top-k equals the replayed experts, replayed rows) of this rank's last pass."""
    routers = [r for _, r in _routers(model)]
    return int(sum(r.agreed for r in routers)), int(sum(r.replayed for r in routers))


def agreement_metrics(model: list, device: torch.device) -> dict[str, float]:
    """Collective over all trainer ranks: `routing_agreement`, the fraction of replayed (position, MoE
    layer) rows of the last pass whose own top-k would have been the generator's experts (absent when
    none was replayed)."""
    import torch.distributed as dist

    counts = torch.tensor(agreement(model), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)  # every rank routes its own tokens (DP, CP, SP, EP) and layers (PP)
    agreed, replayed = counts.tolist()
    return {"routing_agreement": agreed / replayed} if replayed else {}
